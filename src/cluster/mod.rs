//! A cluster (SPEC §10.2): several instances with the same routes, lease store and
//! PostgreSQL database. Rows of `fencegate_owners` decide which instance serves
//! each shard of leases (issue 28: coordination costs nothing in the lease
//! store per shard); one gate lease in the store, the prefix's anchor under
//! `{prefix}.gate/0000/` ([`anchor`]), keeps other set-ups out; PostgreSQL
//! keeps what was delivered. No consensus of our own.
//!
//! The keeper ([`Cluster::run`], `keeper`) renews every row this instance owns
//! in one `UPDATE` every third of `gate_ttl`, reads every row every tenth of it
//! (at most 1 s), records a beat (membership is advisory: it only says how many
//! instances share the shards), and balances: takes free shards while it holds
//! fewer than its share, hands shards over (drain, then release the row) while
//! it holds more.
//!
//! A row is free when released, or when this instance has seen its
//! `(generation, renewals)` unchanged for `gate_ttl + grace_ms` on its own
//! monotonic clock — never judged on the database's clock, which may jump. A
//! take is an `UPDATE` conditioned on exactly that pair, raising the
//! generation: the owner generation of every state write. The take waits for
//! the old generation's writes in progress (the owner row's lock), turns older
//! generations' `in_flight` records into `in_doubt`, and starts the fences of
//! the shard's leases at max(stored mark, latest listed epoch), settling for
//! the drain timeout as after a restart (SPEC §5).
//!
//! Self-fencing: forwards on *s* are allowed until `gate_ttl − self_fence_margin`
//! after the latest successful renewal (or take) was *sent* (this instance's
//! monotonic clock; the send, not the confirmation, so the window only errs
//! short), and while the anchor's window is open. A watcher stops the shard
//! there: no new forward, and the fences' in-flight requests are aborted at
//! `gate_ttl` after that send. A renewal whose outcome is unknown extends
//! nothing; if it committed, successors only wait longer.

mod anchor;
mod exclusion;
pub mod guard;
mod keeper;
#[cfg(test)]
mod keeper_tests;
pub mod peer;
mod shard;
mod tenure;
#[cfg(test)]
mod tenure_tests;
pub(crate) mod window;

pub use exclusion::Conflict;
use exclusion::Verdict;
use shard::Shard;
pub use shard::{ShardStatus, ShardView};
use tokio::time::Instant;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::dedup::Dedup;
use crate::epoch::LeaseName;
use crate::fence::Fences;

use crate::lease::{Epochs, LeaseStore, StoreError};
use crate::set_up::GateKey;
use crate::state::identity::Stamp;
use crate::state::{Generation, Owner, OwnerRow, OwnershipStore, StateError, StateStore};

/// SPEC §10.2: the first 8 bytes of SHA-256(lease name), big-endian, modulo `shards`.
pub fn shard_of(lease: &LeaseName, shards: u32) -> u32 {
    let digest = Sha256::digest(lease.as_str().as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    let s = u64::from_be_bytes(first) % u64::from(shards.max(1));
    u32::try_from(s).unwrap_or(0)
}

pub use crate::set_up::shard_name;

/// Why a cluster member could not start (SPEC §10.2).
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// Another set-up (a single instance, or a cluster sealed differently) uses this
    /// store and prefix.
    #[error("{0}")]
    OtherSetUp(Conflict),
    /// A member of an older build (one gate lease per shard in the store, before
    /// ownership rows) still holds a shard: the two would own it at once.
    #[error("instance {holder:?} holds gate lease {shard:04} under this prefix: it runs a fencegate older than this one, which kept a gate lease per shard in the lease store instead of rows in the database. Both would own the shard at once: stop every instance of the older version, then start this one (a cluster is upgraded across this change by stopping it, not one instance at a time)")]
    OlderBuild {
        /// The shard whose live gate object was read.
        shard: u32,
        /// The instance named by that object.
        holder: String,
    },
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
    /// By the instance owning the shard's row.
    Peer {
        /// The owner's instance id.
        owner: String,
        /// The owner's advertised proxy URL, where the request is relayed.
        url: String,
    },
    /// Nobody serves it right now (no owner, or a takeover or handover under way).
    Unavailable,
}

/// The database a cluster keeps its state in, by what it is (SPEC §10): the
/// schema its tables are in, the id written into it, and its generations.
pub struct Database<'a> {
    /// The schema in use.
    pub schema: &'a str,
    /// The database's id (`fencegate_identity`).
    pub id: Option<&'a str>,
    /// Its generation, carried by each anchor create and raised past it.
    pub generations: Arc<dyn crate::state::identity::Generations>,
}

/// This instance's membership of a cluster (SPEC §10.2): where each request
/// is served, and what wires the parts together — the shards it owns and
/// sees owned ([`shard`]), the prefix's anchor ([`anchor`]), the keeper's
/// cadence and membership ([`keeper`]), what a tenure starts and stops
/// ([`tenure`]) — through the rounds and takeovers that move a shard from
/// one to the next. Its counters are the cluster's metrics.
pub struct Cluster {
    id: String,
    advertise: String,
    /// `advertise` as a header value, for the owner hint on each answer.
    advertise_header: Option<http::HeaderValue>,
    shards: u32,
    peer_token: String,
    /// Seals and checks this cluster's gate objects.
    key: GateKey,
    /// Where deliveries are kept ([`crate::set_up::state_of`]).
    state_id: String,
    /// A live gate object of another set-up on the anchor, if any.
    conflict: Mutex<Option<Conflict>>,
    /// The prefix's anchor gate lease ([`anchor`]).
    anchor: anchor::Anchor,
    epochs: Epochs,
    ttl: Duration,
    margin: Duration,
    grace: Duration,
    by_shard: Vec<Shard>,
    /// What a tenure starts and stops besides its row ([`tenure`]).
    tenures: tenure::Tenures,
    /// The state: whether the database is this set-up's.
    state: Arc<dyn StateStore>,
    /// The shards' owner rows and membership (the same database as `state`).
    owners: Arc<dyn OwnershipStore>,
    /// The keeper's cadence and membership ([`keeper`]).
    keeper: keeper::Keeper,
    /// Cancelled by a graceful leave: nothing is taken from then on.
    stopping: CancellationToken,
    /// Shards taken over from a dead owner.
    pub takeovers: AtomicU64,
    /// Shards handed over on a graceful leave.
    pub(crate) handovers: AtomicU64,
    /// Shards this instance stopped serving at their forwarding deadline
    /// (renewals, or the anchor's, not confirmed in time).
    pub(crate) self_fences: AtomicU64,
    /// Requests relayed to the shard's owner.
    pub(crate) peer_forwards: AtomicU64,
    /// Relays that failed to reach the owner.
    pub(crate) peer_failures: AtomicU64,
    /// Store calls made for the anchor, by operation: list, get, put, delete.
    pub gate_calls: Arc<[AtomicU64; 4]>,
    /// Database calls made by coordination (renewals, looks, takes, releases,
    /// beats).
    pub db_calls: AtomicU64,
    /// Anchor epochs created by this instance.
    pub anchor_creates: AtomicU64,
    /// The database's generation ([`crate::state::identity`]): carried by
    /// each anchor create, raised past it once the object is written.
    pub(super) stamp: Stamp,
}

/// Work that follows a shard's tenure here besides its fences: the queue's
/// deliverers (SPEC §11), which send a shard's messages only while it is
/// served here, and whose attempts out are held to the tenure's abort deadline
/// as forwarded requests are.
pub trait TenureWork: Send + Sync {
    /// Whether a tenure of a shard whose leases are `leases` may begin here
    /// (checked before its fences start; `Err` says why not, and the shard is
    /// handed back).
    fn check(
        &self,
        leases: &[LeaseName],
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), String>> + Send + '_>>;
    /// A tenure of a shard whose leases are `leases` began here.
    fn started(&self, leases: &[LeaseName]);
    /// The tenure of `shard` ended here: nothing new starts on it, and what is
    /// out may end until `deadline`, then is cut.
    fn stop(
        &self,
        shard: u32,
        deadline: Instant,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>>;
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Cluster {
    /// Checks that no other kind of set-up uses the prefix; nothing is taken yet.
    /// `schema`: the PostgreSQL schema the state is in.
    pub async fn new(
        cfg: &Config,
        store: Arc<dyn LeaseStore>,
        fences: Arc<Fences>,
        state: Arc<dyn StateStore>,
        owners: Arc<dyn OwnershipStore>,
        dedup: Arc<Dedup>,
        db: Database<'_>,
    ) -> Result<Arc<Cluster>, ClusterError> {
        let Database {
            schema,
            id: database_id,
            generations: gens,
        } = db;
        let Some(cc) = &cfg.cluster else {
            unreachable!("Cluster::new without [cluster]: checked by the caller")
        };
        let shards = cc.shards;
        let mut settle: BTreeMap<LeaseName, Duration> = BTreeMap::new();
        for r in &cfg.routes {
            let s = settle.entry(r.lease.clone()).or_default();
            *s = (*s).max(r.drain_timeout());
        }
        let by_shard = (0..shards)
            .map(|s| {
                Shard::new(
                    settle
                        .iter()
                        .filter(|(l, _)| shard_of(l, shards) == s)
                        .map(|(l, d)| (l.clone(), *d))
                        .collect(),
                )
            })
            .collect();
        let gate_calls: Arc<[AtomicU64; 4]> = Arc::new(Default::default());
        let counted: Arc<dyn LeaseStore> = Arc::new(Counted {
            inner: store,
            calls: gate_calls.clone(),
        });
        let key = GateKey::from_peer_token(
            &cc.resolved_peer_token().unwrap_or_default(),
            &format!("{}.gate/", cfg.store.prefix),
        );
        let state_id =
            crate::set_up::state_of(&cfg.state, &cc.instance_id, Some(schema), database_id);
        let epochs = Epochs::new(counted, format!("{}.gate/", cfg.store.prefix));
        // SPEC §10, identity and generations: the anchor's objects carry the
        // database's generation, as a single instance's guard objects do.
        // Another member may be between its anchor create and the raise
        // after it: a finding is confirmed after two database timeouts.
        let shard0 = shard_name(0);
        let latest = epochs
            .latest_after(&shard0, crate::epoch::Epoch::NONE)
            .await?;
        let before = gens.recorded().await?;
        // A database never raised has sent nothing a fence would hold back.
        let seen = match before.generation {
            0 => None,
            _ => crate::set_up::generation_seen(&epochs, &shard0, latest, &state_id).await?,
        };
        let stamp = Stamp::new(gens.clone());
        stamp
            .find(&state_id, before, seen, Some(cfg.state.timeout() * 2))
            .await?;
        let cluster = Arc::new(Cluster {
            id: cc.instance_id.clone(),
            advertise: cc.advertise.trim_end_matches('/').to_owned(),
            advertise_header: http::HeaderValue::from_str(cc.advertise.trim_end_matches('/')).ok(),
            shards,
            peer_token: cc.resolved_peer_token().unwrap_or_default(),
            key,
            state_id,
            conflict: Mutex::new(None),
            anchor: anchor::Anchor::new(),
            epochs,
            ttl: cfg.store.gate_ttl,
            margin: cfg.store.self_fence_margin,
            grace: Duration::from_millis(cfg.store.grace_ms),
            by_shard,
            tenures: tenure::Tenures::new(fences, state.clone(), dedup),
            state,
            owners,
            keeper: keeper::Keeper::new(&cc.instance_id, cfg.store.gate_ttl),
            stopping: CancellationToken::new(),
            takeovers: AtomicU64::new(0),
            handovers: AtomicU64::new(0),
            self_fences: AtomicU64::new(0),
            peer_forwards: AtomicU64::new(0),
            peer_failures: AtomicU64::new(0),
            gate_calls,
            db_calls: AtomicU64::new(0),
            anchor_creates: AtomicU64::new(0),
            stamp,
        });
        cluster.check_set_up().await?;
        Ok(cluster)
    }

    /// The generation at which the database was found restored or copied,
    /// as read at start-up (0: never): each lease's queue is fenced for it
    /// before its messages are sent.
    pub fn restored(&self) -> u64 {
        self.stamp.restored()
    }

    /// Makes `work` follow every tenure here from now on (set once, before
    /// the keeper runs).
    pub fn follow(&self, work: Arc<dyn TenureWork>) {
        self.tenures.follow(work);
    }

    /// The live gate object of another set-up seen in the last keeper round.
    pub fn conflict(&self) -> Option<Conflict> {
        lock(&self.conflict).clone()
    }

    /// Whether another set-up holds the prefix (a live gate object) or the
    /// database (its set-up record): nothing is served, taken or balanced.
    fn stopped_by_another_set_up(&self) -> bool {
        lock(&self.conflict).is_some() || self.state.set_up_conflict().is_some()
    }

    /// This instance's `advertise` URL as a header value (SPEC §10.2, the
    /// owner hint on an answer it served as the shard's owner).
    pub fn advertise_header(&self) -> Option<&http::HeaderValue> {
        self.advertise_header.as_ref()
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
        let Some(g) = self.by_shard.get(shard as usize) else {
            return Placement::Unavailable;
        };
        if self.stopped_by_another_set_up() {
            return Placement::Unavailable;
        }
        if let Some(generation) = g.serving() {
            if self.window_open(g) || weakened::no_self_fence() {
                return Placement::Local(Owner { shard, generation });
            }
        }
        let seen = lock(&g.seen).clone();
        match seen.owner(self.ttl, self.grace) {
            Some(OwnerRow {
                owner: Some(owner),
                advertise: Some(url),
                ..
            }) if *owner != self.id => Placement::Peer {
                owner: owner.clone(),
                url: url.clone(),
            },
            _ => Placement::Unavailable,
        }
    }

    /// A request found its shard without an owner it could reach (a handover or a
    /// takeover under way): look at the owner rows now rather than at the next
    /// tick, so a released shard is taken — and its new owner known — sooner.
    pub fn nudge(&self) {
        self.keeper.nudge();
    }

    /// Whether a forward under `owner` may start now (SPEC §10.2 self-fencing).
    pub fn may_forward(&self, owner: Owner) -> bool {
        self.by_shard.get(owner.shard as usize).is_some_and(|g| {
            g.serving() == Some(owner.generation)
                && (self.window_open(g) || weakened::no_self_fence())
        })
    }

    /// Shards served here now.
    pub fn owned(&self) -> usize {
        self.by_shard
            .iter()
            .filter(|g| g.serving().is_some())
            .count()
    }

    /// Instances seen alive at the last heartbeat.
    pub fn members(&self) -> Vec<String> {
        self.keeper.members()
    }

    /// Whether this instance can serve or route: it has looked at the shards at
    /// least once and every shard has an owner it can name.
    pub fn is_ready(&self) -> bool {
        !self.stopped_by_another_set_up()
            && self.by_shard.iter().all(|g| {
                g.serving().is_some() || lock(&g.seen).owner(self.ttl, self.grace).is_some()
            })
    }

    /// Every shard as last seen, for `/v1/cluster` and the page.
    pub fn shard_statuses(&self) -> Vec<ShardStatus> {
        let anchor = lock(&self.anchor.seen).clone();
        (0..self.shards)
            .zip(&self.by_shard)
            .map(|(shard, g)| {
                let seen = lock(&g.seen).clone();
                let owner = seen.owner(self.ttl, self.grace).cloned();
                // A shard never taken shows generation 0 (no take's).
                let row = seen.row.clone().unwrap_or(OwnerRow {
                    shard,
                    generation: Generation::new(0),
                    owner: None,
                    advertise: None,
                    renewals: 0,
                    expires_at: None,
                    ttl: None,
                    released: false,
                });
                ShardStatus {
                    shard,
                    owner: owner.as_ref().and_then(|r| r.owner.clone()),
                    advertise: owner.as_ref().and_then(|r| r.advertise.clone()),
                    generation: row.generation.get(),
                    renewals: row.renewals,
                    anchor_epoch: (shard == 0).then(|| anchor.epoch.get()),
                    expires_at: row.expires_at,
                    served_here: g.serving().is_some(),
                    leases: g.leases.iter().map(|(l, _)| l.to_string()).collect(),
                    untrusted: match (&anchor.verdict, shard) {
                        (Some(Verdict::Untrusted(why)), 0) => Some(why.clone()),
                        _ => None,
                    },
                }
            })
            .collect()
    }

    /// The anchor as last seen, for `/v1/cluster`: its latest epoch, who
    /// created it, whether it is this set-up's and whether this instance's
    /// window of it is open.
    pub fn anchor_view(&self) -> serde_json::Value {
        let seen = lock(&self.anchor.seen).clone();
        serde_json::json!({
            "epoch": seen.epoch.get(),
            "holder": seen.holder,
            "ours": seen.verdict == Some(Verdict::Ours),
            "window_open": self.anchor.window.is_open(),
            "ttl_ms": u64::try_from(self.anchor_ttl().as_millis()).unwrap_or(u64::MAX),
        })
    }

    /// [`Cluster::shard_statuses`] as JSON rows (times in RFC 3339).
    pub fn view(&self) -> Vec<ShardView> {
        self.shard_statuses()
            .into_iter()
            .map(|g| ShardView {
                shard: g.shard,
                owner: g.owner,
                advertise: g.advertise,
                generation: g.generation,
                renewals: g.renewals,
                anchor_epoch: g.anchor_epoch,
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
/// when `FENCEGATE_WEAKEN=no_self_fence` is set, an owner whose row was not
/// renewed keeps forwarding past `gate_ttl − self_fence_margin` and never aborts
/// its in-flight requests at `gate_ttl`.
mod weakened {
    #[cfg(feature = "failpoints")]
    pub(super) fn no_self_fence() -> bool {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| std::env::var("FENCEGATE_WEAKEN").is_ok_and(|v| v == "no_self_fence"))
    }

    #[cfg(not(feature = "failpoints"))]
    pub(super) fn no_self_fence() -> bool {
        false
    }
}

/// The lease store as the keeper uses it, counting its calls by operation (list,
/// get, put, delete): what coordination costs at rest
/// (`fencegate_cluster_gate_store_calls_total`).
struct Counted {
    inner: Arc<dyn LeaseStore>,
    calls: Arc<[AtomicU64; 4]>,
}

/// The operations [`Counted`] counts, in its order.
pub const GATE_CALL_OPS: [&str; 4] = ["list", "get", "put", "delete"];

#[async_trait::async_trait]
impl LeaseStore for Counted {
    async fn list(
        &self,
        prefix: &str,
        start_after: Option<&str>,
    ) -> Result<Vec<String>, StoreError> {
        self.calls[0].fetch_add(1, Ordering::Relaxed);
        self.inner.list(prefix, start_after).await
    }
    async fn list_folders(&self, prefix: &str) -> Result<Vec<String>, StoreError> {
        self.calls[0].fetch_add(1, Ordering::Relaxed);
        self.inner.list_folders(prefix).await
    }
    async fn list_first(
        &self,
        prefix: &str,
        start_after: Option<&str>,
        max: usize,
    ) -> Result<Vec<String>, StoreError> {
        self.calls[0].fetch_add(1, Ordering::Relaxed);
        self.inner.list_first(prefix, start_after, max).await
    }
    async fn get(&self, key: &str) -> Result<Option<crate::lease::StoredObject>, StoreError> {
        self.calls[1].fetch_add(1, Ordering::Relaxed);
        self.inner.get(key).await
    }
    async fn create_if_absent(
        &self,
        key: &str,
        body: bytes::Bytes,
    ) -> Result<crate::lease::CreateOutcome, StoreError> {
        self.calls[2].fetch_add(1, Ordering::Relaxed);
        self.inner.create_if_absent(key, body).await
    }
    async fn delete(&self, key: &str) -> Result<(), StoreError> {
        self.calls[3].fetch_add(1, Ordering::Relaxed);
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
