//! The one value built at start-up ([`crate::server::build`]) and handed to the
//! request path, the admin API and the metrics collector: the state store, the
//! lease store, the running fences and the dedup records. Each of them is given
//! this; none reaches through another to get at these.

use std::sync::Arc;

use crate::dedup::Dedup;
use crate::epoch::LeaseName;
use crate::fence::Fences;
use crate::guard::Guard;
use crate::lease::LeaseStore;
use crate::live::LiveConfig;
use crate::state::{Owner, StateStore};

pub struct Shared {
    /// Marks and dedup records, durable.
    pub state: Arc<dyn StateStore>,
    /// The lease store (epoch objects).
    pub store: Arc<dyn LeaseStore>,
    pub fences: Arc<Fences>,
    pub dedup: Arc<Dedup>,
    /// The instance guard: forwarding only while it is held (SPEC §10.1).
    pub guard: Arc<Guard>,
    /// What a reload may change: the routes (dedup records are scoped by route),
    /// the admin token, TLS, the access-log switch.
    pub live: Arc<LiveConfig>,
}

impl Shared {
    pub fn has_route(&self, name: &str) -> bool {
        self.live.current().routes.get(name).is_some()
    }

    /// The owner generation under which this instance writes the records of
    /// `route`; `None` when its lease's fence is not running here.
    pub fn owner_of_route(&self, name: &str) -> Option<Owner> {
        let lease: LeaseName = self.live.current().routes.get(name)?.fence.lease().clone();
        self.fences.get(&lease).map(|f| f.owner())
    }
}
