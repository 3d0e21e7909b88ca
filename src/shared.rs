//! The one value built at start-up ([`crate::server::build`]) and handed to the
//! request path, the admin API and the metrics collector: the state store, the
//! lease store, the running fences and the dedup records. Each of them is given
//! this; none reaches through another to get at these.

use std::sync::Arc;

use crate::dedup::Dedup;
use crate::durable::Durable;
use crate::fence::Fences;
use crate::lease::LeaseStore;

pub struct Shared {
    /// Marks and dedup records, durable.
    pub state: Arc<Durable>,
    /// The lease store (epoch objects).
    pub store: Arc<dyn LeaseStore>,
    pub fences: Arc<Fences>,
    pub dedup: Arc<Dedup>,
    /// The configured route names (dedup records are scoped by route).
    pub routes: Vec<String>,
}

impl Shared {
    pub fn has_route(&self, name: &str) -> bool {
        self.routes.iter().any(|r| r == name)
    }
}
