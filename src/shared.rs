//! The one value built at start-up ([`crate::server::build`]) and handed to the
//! request path, the admin API and the metrics collector: the state store, the
//! lease store, the running fences and the dedup records. Each of them is given
//! this; none reaches through another to get at these.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::cluster::guard::InstanceGuard;
use crate::cluster::Cluster;
use crate::dedup::Dedup;
use crate::epoch::LeaseName;
use crate::fence::Fences;
use crate::lease::LeaseStore;
use crate::live::LiveConfig;
use crate::state::timed::StateMetrics;
use crate::state::{Owner, StateStore};

pub struct Shared {
    /// Marks and dedup records, durable.
    pub state: Arc<dyn StateStore>,
    /// Latency and errors of `state`'s calls (it is wrapped in [`crate::state::timed::Timed`]).
    pub state_metrics: StateMetrics,
    /// The lease store (epoch objects).
    pub store: Arc<dyn LeaseStore>,
    pub fences: Arc<Fences>,
    pub dedup: Arc<Dedup>,
    /// Who serves which lease: one instance, or a cluster (SPEC §10).
    pub mode: Mode,
    /// What a reload may change: the routes (dedup records are scoped by route),
    /// the admin token, TLS, the access-log switch.
    pub live: Arc<LiveConfig>,
    /// Queued routes' messages and their deliverers (SPEC §11); `None` unless
    /// the state is on sled.
    pub queue: Option<Arc<crate::queue::Queue>>,
    /// Set by the first SIGTERM: `/readyz` fails from then on, while the
    /// listeners still serve for `shutdown_delay_ms` (SPEC §8).
    pub stopping: AtomicBool,
    /// The upstream share of the descriptor budget (SPEC §9 "Limits"): every
    /// route's, and a reload's new routes'.
    pub upstreams: Arc<crate::budget::Upstreams>,
}

/// SPEC §10: a single instance behind its instance guard, or one of a cluster.
#[derive(Clone)]
pub enum Mode {
    /// Forwarding only while the instance guard is held (§10.1).
    Single(Arc<InstanceGuard>),
    /// Forwarding only on the shards whose owner rows this instance holds, while
    /// the prefix's anchor is its set-up's (§10.2).
    Cluster(Arc<Cluster>),
}

impl Mode {
    /// Whether a forward under `owner` may start now (self-fencing, §10).
    pub fn may_forward(&self, owner: Owner) -> bool {
        match self {
            Mode::Single(g) => g.may_forward(),
            Mode::Cluster(c) => c.may_forward(owner),
        }
    }

    /// Why this instance forwards nothing, or cannot trust a shard's gate
    /// lease, in one line each (`/readyz`, the operator's page).
    pub fn fence_problems(&self) -> Vec<String> {
        match self {
            Mode::Single(g) => g.conflict().into_iter().collect(),
            Mode::Cluster(c) => c
                .conflict()
                .map(|c| format!("forwarding stopped: {c}"))
                .into_iter()
                .chain(c.shard_statuses().into_iter().filter_map(|s| {
                    s.untrusted
                        .map(|why| format!("shard {} unavailable: {why}", s.shard))
                }))
                .collect(),
        }
    }

    pub fn cluster(&self) -> Option<&Arc<Cluster>> {
        match self {
            Mode::Single(_) => None,
            Mode::Cluster(c) => Some(c),
        }
    }
}

impl Shared {
    /// Why this instance forwards nothing, or cannot serve a shard, in one
    /// line each (`/readyz`, the operator's page): another set-up on the
    /// prefix or its database (SPEC §10), an untrusted gate object.
    pub fn fence_problems(&self) -> Vec<String> {
        let mut problems = self.mode.fence_problems();
        problems.extend(
            self.state
                .set_up_conflict()
                .map(|p| format!("forwarding stopped: {p}")),
        );
        problems
    }

    /// Shutdown has begun: readiness fails from now on.
    pub fn begin_stopping(&self) {
        self.stopping.store(true, Ordering::SeqCst);
    }

    /// Whether shutdown has begun (`/readyz` answers 503).
    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    pub fn has_route(&self, name: &str) -> bool {
        self.live.current().routes.get(name).is_some()
    }

    /// The owner generation under which this instance writes the records of
    /// `route`; `None` when its lease's fence is not running here, or when
    /// the database belongs to another set-up now (an operator's action is
    /// not written into another set-up's records, SPEC §10).
    pub fn owner_of_route(&self, name: &str) -> Option<Owner> {
        if self.state.set_up_conflict().is_some() {
            return None;
        }
        let lease: LeaseName = self.live.current().routes.get(name)?.lease.clone();
        self.fences.get(&lease).map(|f| f.owner())
    }
}
