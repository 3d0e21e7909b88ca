//! A cluster (SPEC §10.2): several instances with the same routes, lease store and
//! PostgreSQL database. S3 gate leases — §2's protocol under
//! `{prefix}.gate/{shard:04}/` — decide which instance serves each shard of
//! leases; PostgreSQL keeps what was delivered. No consensus of our own.
//!
//! One keeper task per instance ([`Cluster::run`]), every third of `gate_ttl`:
//! - records a heartbeat in the database (membership is advisory: it only says
//!   how many instances share the shards; ownership is the gate lease alone);
//! - renews every gate lease it holds (read-back of uncertain creates included)
//!   and looks at the others;
//! - balances: takes free shards (no gate, a `release`, or an acquire expired by
//!   more than `grace_ms` on the store's clock) while it holds fewer than its
//!   share, and hands shards over (drain, then a `release` gate object) while it
//!   holds more.
//!
//! A tenure of shard *s* begins when this instance creates a gate epoch *g* for it
//! from a free shard (renewals keep the tenure; every successor's epoch is
//! greater): *g* is the owner generation of every state write. A takeover claims
//! the shard in the database (older generations' writes fail from then on), turns
//! older generations' `in_flight` records into `in_doubt`, and starts the fences
//! of the shard's leases at max(stored mark, latest listed epoch), settling for
//! the drain timeout as after a restart (SPEC §5).
//!
//! Self-fencing: forwards on *s* are allowed until `gate_ttl − self_fence_margin`
//! after the latest gate create was *sent* (this instance's monotonic clock; the
//! send, not the confirmation, so the window only errs short). A watcher stops
//! the shard there: no new forward, and the fences' in-flight requests get the
//! remaining `self_fence_margin` before they are aborted — at `gate_ttl`.

pub mod guard;
mod keeper;
#[cfg(test)]
mod keeper_tests;
pub mod peer;
mod set_up;
mod shard;
mod tenure;
pub(crate) mod window;

pub use set_up::Conflict;
use set_up::Verdict;
use shard::{Seen, ShardLease};
pub use shard::{ShardLeaseView, ShardView};

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::dedup::Dedup;
use crate::epoch::LeaseName;
use crate::fence::Fences;

use crate::lease::{Epochs, LeaseStore, StoreError};
use crate::setup::GateKey;
use crate::state::{Owner, StateError, StateStore};

/// SPEC §10.2: the first 8 bytes of SHA-256(lease name), big-endian, modulo `shards`.
pub fn shard_of(lease: &LeaseName, shards: u32) -> u32 {
    let digest = Sha256::digest(lease.as_str().as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    let s = u64::from_be_bytes(first) % u64::from(shards.max(1));
    u32::try_from(s).unwrap_or(0)
}

pub use crate::setup::shard_name;

/// Why a cluster member could not start (SPEC §10.2).
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// Another set-up (a single instance, or a cluster sealed differently) uses this
    /// store and prefix.
    #[error("{0}")]
    OtherSetUp(Conflict),
    /// The lease store failed.
    #[error("cluster start-up: {0}")]
    Store(#[from] StoreError),
    /// The state backend failed.
    #[error("cluster start-up: {0}")]
    State(#[from] StateError),
}

/// Where a request for a shard is served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// Here, under this tenure.
    Local(Owner),
    /// By the instance holding the shard's gate lease.
    Peer {
        /// The owner's instance id.
        owner: String,
        /// The owner's advertised proxy URL, where the request is relayed.
        url: String,
    },
    /// Nobody serves it right now (no owner, or a takeover or handover under way).
    Unavailable,
}

/// This instance's membership of a cluster (SPEC §10.2): the shards' gate leases it
/// holds and sees, where each request is served, and the keeper that balances and takes
/// over shards.
pub struct Cluster {
    id: String,
    advertise: String,
    shards: u32,
    peer_token: String,
    /// Seals and checks this cluster's gate objects.
    key: GateKey,
    /// Where deliveries are kept ([`crate::setup::state_of`]).
    state_id: String,
    /// A live gate object of another set-up seen in the last round, if any.
    conflict: Mutex<Option<Conflict>>,
    epochs: Epochs,
    ttl: Duration,
    margin: Duration,
    grace: Duration,
    gates: Vec<ShardLease>,
    fences: Arc<Fences>,
    state: Arc<dyn StateStore>,
    dedup: Arc<Dedup>,
    members: Mutex<Vec<String>>,
    /// Shards whose store call failed in the current keeper round.
    store_failures: AtomicUsize,
    /// Wakes the keeper for an early round (a request found no owner).
    nudged: tokio::sync::Notify,
    stopping: CancellationToken,
    /// Shards taken over from a dead owner.
    pub takeovers: AtomicU64,
    /// Shards handed over on a graceful leave.
    pub(crate) handovers: AtomicU64,
    /// Requests relayed to the shard's owner.
    pub(crate) peer_forwards: AtomicU64,
    /// Relays that failed to reach the owner.
    pub(crate) peer_failures: AtomicU64,
    /// Store calls made for gate leases (renewals, looks, takeovers, releases).
    pub gate_calls: Arc<AtomicU64>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Cluster {
    /// Checks that no other kind of set-up uses the prefix; nothing is taken yet.
    pub async fn new(
        cfg: &Config,
        store: Arc<dyn LeaseStore>,
        fences: Arc<Fences>,
        state: Arc<dyn StateStore>,
        dedup: Arc<Dedup>,
    ) -> Result<Arc<Cluster>, ClusterError> {
        let Some(cc) = &cfg.cluster else {
            unreachable!("Cluster::new without [cluster]: checked by the caller")
        };
        let shards = cc.shards;
        let mut settle: BTreeMap<LeaseName, Duration> = BTreeMap::new();
        for r in &cfg.routes {
            let s = settle.entry(r.lease.clone()).or_default();
            *s = (*s).max(r.drain_timeout());
        }
        let gates = (0..shards)
            .map(|s| ShardLease {
                name: shard_name(s),
                leases: settle
                    .iter()
                    .filter(|(l, _)| shard_of(l, shards) == s)
                    .map(|(l, d)| (l.clone(), *d))
                    .collect(),
                serving: AtomicU64::new(0),
                window: window::Window::new(),
                holding: Mutex::new(None),
                op: tokio::sync::Mutex::new(()),
                busy: AtomicBool::new(false),
                seen: Mutex::new(Seen::default()),
            })
            .collect();
        let gate_calls = Arc::new(AtomicU64::new(0));
        let counted: Arc<dyn LeaseStore> = Arc::new(Counted {
            inner: store,
            calls: gate_calls.clone(),
        });
        let cluster = Arc::new(Cluster {
            id: cc.instance_id.clone(),
            advertise: cc.advertise.trim_end_matches('/').to_owned(),
            shards,
            peer_token: cc.resolved_peer_token().unwrap_or_default(),
            key: GateKey::from_peer_token(
                &cc.resolved_peer_token().unwrap_or_default(),
                &format!("{}.gate/", cfg.store.prefix),
            ),
            state_id: crate::setup::state_of(&cfg.state, &cc.instance_id),
            conflict: Mutex::new(None),
            epochs: Epochs::new(counted, format!("{}.gate/", cfg.store.prefix)),
            ttl: cfg.store.gate_ttl,
            margin: cfg.store.self_fence_margin,
            grace: Duration::from_millis(cfg.store.grace_ms),
            gates,
            fences,
            state,
            dedup,
            members: Mutex::new(vec![cc.instance_id.clone()]),
            store_failures: AtomicUsize::new(0),
            nudged: tokio::sync::Notify::new(),
            stopping: CancellationToken::new(),
            takeovers: AtomicU64::new(0),
            handovers: AtomicU64::new(0),
            peer_forwards: AtomicU64::new(0),
            peer_failures: AtomicU64::new(0),
            gate_calls,
        });
        cluster.check_set_up().await?;
        Ok(cluster)
    }

    /// The live gate object of another set-up seen in the last keeper round.
    pub fn conflict(&self) -> Option<Conflict> {
        lock(&self.conflict).clone()
    }

    /// This instance's id (`[cluster] instance_id`).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The number of shards (`[cluster] shards`).
    pub fn shards(&self) -> u32 {
        self.shards
    }

    /// The shared peer token (never logged).
    pub fn peer_token(&self) -> &str {
        &self.peer_token
    }

    /// Where a request for `shard` is served now.
    pub fn place(&self, shard: u32) -> Placement {
        let Some(g) = self.gates.get(shard as usize) else {
            return Placement::Unavailable;
        };
        if lock(&self.conflict).is_some() {
            return Placement::Unavailable;
        }
        let generation = g.serving.load(Ordering::SeqCst);
        if generation != 0 && (g.window.is_open() || weakened::no_self_fence()) {
            return Placement::Local(Owner { shard, generation });
        }
        let seen = lock(&g.seen).clone();
        match (seen.owner, seen.advertise) {
            (Some(owner), Some(url)) if owner != self.id => Placement::Peer { owner, url },
            _ => Placement::Unavailable,
        }
    }

    /// A request found its shard without an owner it could reach (a handover or a
    /// takeover under way): look at the gate leases now rather than at the next
    /// tick, so a released shard is taken — and its new owner known — sooner.
    pub fn nudge(&self) {
        self.nudged.notify_one();
    }

    /// Whether a forward under `owner` may start now (SPEC §10.2 self-fencing).
    pub fn may_forward(&self, owner: Owner) -> bool {
        self.gates.get(owner.shard as usize).is_some_and(|g| {
            g.serving.load(Ordering::SeqCst) == owner.generation
                && (g.window.is_open() || weakened::no_self_fence())
        })
    }

    /// Shards served here now.
    pub fn owned(&self) -> usize {
        self.gates
            .iter()
            .filter(|g| g.serving.load(Ordering::SeqCst) != 0)
            .count()
    }

    /// Instances seen alive at the last heartbeat.
    pub fn members(&self) -> Vec<String> {
        lock(&self.members).clone()
    }

    /// Whether this instance can serve or route: it has looked at the shards at
    /// least once and every shard has an owner it can name.
    pub fn is_ready(&self) -> bool {
        lock(&self.conflict).is_none()
            && self
                .gates
                .iter()
                .all(|g| g.serving.load(Ordering::SeqCst) != 0 || lock(&g.seen).owner.is_some())
    }

    /// Every shard's gate lease as last seen, for `/v1/cluster` and the page.
    pub fn shard_leases(&self) -> Vec<ShardLeaseView> {
        (0..self.shards)
            .zip(&self.gates)
            .map(|(shard, g)| {
                let seen = lock(&g.seen).clone();
                ShardLeaseView {
                    shard,
                    owner: seen.owner,
                    advertise: seen.advertise,
                    gate_epoch: seen.epoch.get(),
                    expires_at: seen.expires_at,
                    served_here: g.serving.load(Ordering::SeqCst) != 0,
                    leases: g.leases.iter().map(|(l, _)| l.to_string()).collect(),
                    untrusted: match seen.verdict {
                        Some(Verdict::Untrusted(why)) => Some(why),
                        _ => None,
                    },
                }
            })
            .collect()
    }

    /// [`Cluster::shard_leases`] as JSON rows (times in RFC 3339).
    pub fn view(&self) -> Vec<ShardView> {
        self.shard_leases()
            .into_iter()
            .map(|g| ShardView {
                shard: g.shard,
                owner: g.owner,
                advertise: g.advertise,
                gate_epoch: g.gate_epoch,
                expires_at: g.expires_at.map(crate::clock::rfc3339),
                served_here: g.served_here,
                leases: g.leases,
                untrusted: g.untrusted,
            })
            .collect()
    }
}

/// A deliberately weakened build, to show the fault campaign's checker failing
/// (tests/it/campaign/cluster.rs): only with the `failpoints` feature, and only
/// when `FENCEGATE_WEAKEN=no_self_fence` is set, an owner whose gate lease was not
/// renewed keeps forwarding past `gate_ttl − self_fence_margin` and never aborts
/// its in-flight requests at `gate_ttl`.
mod weakened {
    #[cfg(feature = "failpoints")]
    pub fn no_self_fence() -> bool {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| std::env::var("FENCEGATE_WEAKEN").is_ok_and(|v| v == "no_self_fence"))
    }

    #[cfg(not(feature = "failpoints"))]
    pub(super) fn no_self_fence() -> bool {
        false
    }
}

/// The lease store as the keeper uses it, counting its calls: what gate leases
/// cost at rest (`fencegate_cluster_gate_store_calls_total`).
struct Counted {
    inner: Arc<dyn LeaseStore>,
    calls: Arc<AtomicU64>,
}

#[async_trait::async_trait]
impl LeaseStore for Counted {
    async fn list(
        &self,
        prefix: &str,
        start_after: Option<&str>,
    ) -> Result<Vec<String>, StoreError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.inner.list(prefix, start_after).await
    }
    async fn list_folders(&self, prefix: &str) -> Result<Vec<String>, StoreError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.inner.list_folders(prefix).await
    }
    async fn get(&self, key: &str) -> Result<Option<crate::lease::StoredObject>, StoreError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.inner.get(key).await
    }
    async fn create_if_absent(
        &self,
        key: &str,
        body: bytes::Bytes,
    ) -> Result<crate::lease::CreateOutcome, StoreError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.inner.create_if_absent(key, body).await
    }
    async fn delete(&self, key: &str) -> Result<(), StoreError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.inner.delete(key).await
    }
    fn clock(&self) -> &crate::clock::StoreClock {
        self.inner.clock()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
}

/// A stable number of an instance id, to spread first picks of free shards.
fn shard_of_id(id: &str) -> u64 {
    let digest = Sha256::digest(id.as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SPEC §10.2's shard function, pinned: other-language tools compute it too.
    #[test]
    fn shard_of_is_the_first_eight_bytes_of_sha256_mod_shards() {
        let lease = LeaseName::parse("billing").unwrap();
        let d = Sha256::digest(b"billing");
        let want = u64::from_be_bytes(d[..8].try_into().unwrap()) % 16;
        assert_eq!(u64::from(shard_of(&lease, 16)), want);
        assert_eq!(shard_of(&lease, 1), 0);
        assert_eq!(shard_name(7).as_str(), "0007");
    }
}
