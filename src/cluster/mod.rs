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

pub mod peer;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::dedup::Dedup;
use crate::epoch::{Epoch, EpochObject, EpochRecord, LeaseName};
use crate::fence::Fences;
use crate::lease::acquire::{self, AcquireError, Holding};
use crate::lease::{Epochs, LeaseStore, StoreError};
use crate::setup::{GateKey, SetUp};
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

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("{0}")]
    OtherSetUp(Conflict),
    #[error("cluster start-up: {0}")]
    Store(#[from] StoreError),
    #[error("cluster start-up: {0}")]
    State(#[from] StateError),
}

/// A live gate object of another set-up under this cluster's prefix (SPEC
/// §10.2): a single instance, or a cluster of another shard count. While one is
/// seen, this instance forwards nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflict {
    pub shard: u32,
    pub theirs: SetUp,
    pub ours: SetUp,
    pub holder: String,
}

impl std::fmt::Display for Conflict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (instance {:?}, gate lease {:04}) uses this lease store and prefix; this is {}. Two set-ups on one prefix void the fence: stop one (a single instance and a cluster never share a prefix; changing [cluster] shards needs every instance stopped first)",
            self.theirs, self.holder, self.shard, self.ours
        )
    }
}

/// What a gate object read from the store is to this cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Verdict {
    /// Sealed by a member (this peer token) of this set-up.
    Ours,
    /// Another set-up's: a single instance (which seals nothing), or a cluster
    /// of another shard count with this peer token.
    Foreign(SetUp),
    /// Neither: unparsable, or claiming to be a cluster's without a valid MAC
    /// (forged, or a member with another peer token). Nothing is taken from it.
    Untrusted(String),
}

/// Why a shard just taken is not served.
enum AnchorError {
    Conflict(Conflict),
    NotAnchored,
    Store(StoreError),
}

/// Where a request for a shard is served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// Here, under this tenure.
    Local(Owner),
    /// By the instance holding the shard's gate lease.
    Peer { owner: String, url: String },
    /// Nobody serves it right now (no owner, or a takeover or handover under way).
    Unavailable,
}

/// The latest gate object seen for a shard.
#[derive(Debug, Clone, Default)]
struct Seen {
    epoch: Epoch,
    /// The holder of a live acquire (not expired on the store's clock).
    owner: Option<String>,
    /// The holder named by the latest acquire, live or not (for logs).
    holder: Option<String>,
    advertise: Option<String>,
    expires_at: Option<SystemTime>,
    /// A contender may take it now (SPEC §2 step 2, with `grace_ms`).
    free: bool,
    /// The latest gate object as read (objects are immutable: read once per
    /// epoch; judged again at every look).
    status: Option<acquire::LeaseStatus>,
    /// What the latest gate object is to this cluster (`None`: no object).
    verdict: Option<Verdict>,
}

impl Seen {
    /// Whether the latest gate object is one of this set-up's (shard 0: the
    /// prefix's anchor, [`crate::setup`]).
    fn ours(&self) -> bool {
        self.verdict == Some(Verdict::Ours)
    }
}

struct ShardGate {
    name: LeaseName,
    /// The configured leases of this shard, with their longest drain timeout.
    leases: Vec<(LeaseName, Duration)>,
    /// The generation of the tenure being served here; 0 when not served.
    serving: AtomicU64,
    /// Milliseconds after [`Cluster::origin`] until which forwards may start:
    /// `gate_ttl − self_fence_margin` after the latest gate create was sent.
    forward_until_ms: AtomicU64,
    /// Milliseconds after [`Cluster::origin`] at which whatever is still in
    /// flight on the shard is aborted, every lease alike: `gate_ttl` after the
    /// latest gate create was sent.
    abort_at_ms: AtomicU64,
    /// The gate epoch held (renewals, takeover and release go through `op`).
    holding: Mutex<Option<Holding>>,
    /// Serializes the gate's store operations: a renewal never races a release.
    op: tokio::sync::Mutex<()>,
    /// A takeover or a handover task is running.
    busy: AtomicBool,
    seen: Mutex<Seen>,
}

/// A shard's gate lease as this instance last saw it.
#[derive(Debug, Clone)]
pub struct ShardGateView {
    pub shard: u32,
    pub owner: Option<String>,
    pub advertise: Option<String>,
    pub gate_epoch: u64,
    /// On the store's clock.
    pub expires_at: Option<SystemTime>,
    pub served_here: bool,
    pub leases: Vec<String>,
    /// Why the latest gate object was not trusted, if it was not.
    pub untrusted: Option<String>,
}

/// A shard as `/v1/cluster` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ShardView {
    pub shard: u32,
    pub owner: Option<String>,
    pub advertise: Option<String>,
    pub gate_epoch: u64,
    /// On the store's clock, RFC 3339.
    pub expires_at: Option<String>,
    pub served_here: bool,
    pub leases: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub untrusted: Option<String>,
}

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
    origin: Instant,
    gates: Vec<ShardGate>,
    fences: Arc<Fences>,
    state: Arc<dyn StateStore>,
    dedup: Arc<Dedup>,
    members: Mutex<Vec<String>>,
    /// Shards whose store call failed in the current keeper round.
    store_failures: AtomicUsize,
    /// Wakes the keeper for an early round (a request found no owner).
    nudged: tokio::sync::Notify,
    stopping: CancellationToken,
    pub takeovers: AtomicU64,
    pub handovers: AtomicU64,
    pub peer_forwards: AtomicU64,
    pub peer_failures: AtomicU64,
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
            .map(|s| ShardGate {
                name: shard_name(s),
                leases: settle
                    .iter()
                    .filter(|(l, _)| shard_of(l, shards) == s)
                    .map(|(l, d)| (l.clone(), *d))
                    .collect(),
                serving: AtomicU64::new(0),
                forward_until_ms: AtomicU64::new(0),
                abort_at_ms: AtomicU64::new(0),
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
            key: GateKey::from_peer_token(&cc.resolved_peer_token().unwrap_or_default()),
            state_id: crate::setup::state_of(&cfg.state, &cc.instance_id),
            conflict: Mutex::new(None),
            epochs: Epochs::new(counted, format!("{}.gate/", cfg.store.prefix)),
            ttl: cfg.store.gate_ttl,
            margin: cfg.store.self_fence_margin,
            grace: Duration::from_millis(cfg.store.grace_ms),
            origin: Instant::now(),
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

    /// SPEC §10.2: a live gate object of another set-up under the prefix — on any
    /// shard this cluster uses, or any the set-up named by shard 0 uses —
    /// refuses start-up. Running, the keeper looks again every round.
    async fn check_set_up(&self) -> Result<(), ClusterError> {
        let anchor = self.read_latest(0).await?;
        // Every shard gate lease ever used under the prefix, whatever shard 0's
        // latest object claims (it may be garbage).
        let shards = self
            .shards
            .max(crate::setup::shards_in_use(&self.epochs).await?);
        for shard in 0..shards {
            let read = if shard == 0 {
                anchor.clone()
            } else {
                self.read_latest(shard).await?
            };
            if let Some(c) = self.live_conflict(shard, read.as_ref()) {
                return Err(ClusterError::OtherSetUp(c));
            }
        }
        Ok(())
    }

    /// The latest gate object of `shard` (any shard name, ours or another
    /// set-up's): its epoch, its record if it parses, and whether it is free.
    async fn read_latest(
        &self,
        shard: u32,
    ) -> Result<Option<(Epoch, Option<EpochRecord>, bool)>, StoreError> {
        let name = shard_name(shard);
        let latest = self.epochs.latest_after(&name, Epoch::NONE).await?;
        self.read_at(shard, latest).await
    }

    /// The gate object of `shard` at `epoch` ([`Cluster::read_latest`]); whether
    /// it is free is judged as of now.
    async fn read_at(
        &self,
        shard: u32,
        epoch: Epoch,
    ) -> Result<Option<(Epoch, Option<EpochRecord>, bool)>, StoreError> {
        if epoch == Epoch::NONE {
            return Ok(None);
        }
        let st = acquire::status_at(&self.epochs, &shard_name(shard), epoch).await?;
        if st.object.is_none() {
            return Ok(None);
        }
        let free = self.is_free(&self.verdict(shard, st.record.as_ref()), &st);
        Ok(Some((epoch, st.record, free)))
    }

    /// What a gate object of `shard` is to this cluster.
    fn verdict(&self, shard: u32, rec: Option<&EpochRecord>) -> Verdict {
        let Some(rec) = rec else {
            return Verdict::Untrusted("the gate object does not parse".into());
        };
        let theirs = SetUp::of(rec);
        let ours = SetUp::Cluster {
            shards: self.shards,
        };
        if self.key.verifies(rec) {
            return if theirs == ours {
                Verdict::Ours
            } else {
                Verdict::Foreign(theirs)
            };
        }
        match theirs {
            SetUp::Single if shard == 0 => Verdict::Foreign(theirs),
            // A single instance holds shard 0 only.
            SetUp::Single => Verdict::Untrusted(format!(
                "the gate object of epoch {} claims a single instance ({:?}) on shard {shard}, which a single instance never uses: forged",
                rec.epoch, rec.holder
            )),
            SetUp::Cluster { .. } => Verdict::Untrusted(format!(
                "the gate object of epoch {} names holder {:?} but its MAC does not verify: not written by a member with this peer_token (forged, or a member configured with another token)",
                rec.epoch, rec.holder
            )),
        }
    }

    /// Whether a contender may take a shard whose latest gate object is read in
    /// `st` (SPEC §2 step 2, with `grace_ms`): a member's object is believed;
    /// anything else — another set-up's, forged, garbage — ends the tenure it
    /// follows no sooner than that tenure would end itself
    /// ([`crate::setup::gate_free`]).
    fn is_free(&self, verdict: &Verdict, st: &acquire::LeaseStatus) -> bool {
        crate::setup::gate_free(st, *verdict == Verdict::Ours, self.ttl, self.grace)
    }

    /// A conflict if `read` (a shard's latest gate object) is a live one of
    /// another set-up.
    fn live_conflict(
        &self,
        shard: u32,
        read: Option<&(Epoch, Option<EpochRecord>, bool)>,
    ) -> Option<Conflict> {
        let (_, rec, free) = read?;
        match self.verdict(shard, rec.as_ref()) {
            Verdict::Foreign(theirs) if !free => Some(Conflict {
                shard,
                theirs,
                ours: SetUp::Cluster {
                    shards: self.shards,
                },
                holder: rec.as_ref().map(|r| r.holder.clone()).unwrap_or_default(),
            }),
            _ => None,
        }
    }

    /// The live gate object of another set-up seen in the last keeper round.
    pub fn conflict(&self) -> Option<Conflict> {
        lock(&self.conflict).clone()
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn shards(&self) -> u32 {
        self.shards
    }

    /// The shared peer token (never logged).
    pub fn peer_token(&self) -> &str {
        &self.peer_token
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX)
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
        if generation != 0
            && (self.now_ms() < g.forward_until_ms.load(Ordering::SeqCst)
                || weakened::no_self_fence())
        {
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
                && (self.now_ms() < g.forward_until_ms.load(Ordering::SeqCst)
                    || weakened::no_self_fence())
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
    pub fn shard_gates(&self) -> Vec<ShardGateView> {
        (0..self.shards)
            .zip(&self.gates)
            .map(|(shard, g)| {
                let seen = lock(&g.seen).clone();
                ShardGateView {
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

    /// [`Cluster::shard_gates`] as JSON rows (times in RFC 3339).
    pub fn view(&self) -> Vec<ShardView> {
        self.shard_gates()
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

    /// Extends the shard's forwarding window and its abort deadline after a gate
    /// create sent at `sent`.
    fn extend(&self, g: &ShardGate, sent: Instant) {
        let ms = |at: Instant| {
            u64::try_from(at.saturating_duration_since(self.origin).as_millis()).unwrap_or(u64::MAX)
        };
        g.forward_until_ms.fetch_max(
            ms(sent + self.ttl.saturating_sub(self.margin)),
            Ordering::SeqCst,
        );
        g.abort_at_ms
            .fetch_max(ms(sent + self.ttl), Ordering::SeqCst);
    }

    /// The shard's one abort deadline (SPEC §10.2): `gate_ttl` after its latest
    /// gate create was sent. Every lease of the shard is held to it, however
    /// the shard is left.
    fn abort_deadline(&self, g: &ShardGate) -> tokio::time::Instant {
        let at = self.origin + Duration::from_millis(g.abort_at_ms.load(Ordering::SeqCst));
        tokio::time::Instant::from_std(at)
    }

    fn decorate(&self) -> impl Fn(&mut EpochRecord) + Sync + '_ {
        move |r: &mut EpochRecord| {
            r.advertise = Some(self.advertise.clone());
            SetUp::Cluster {
                shards: self.shards,
            }
            .stamp(r);
            r.state = Some(self.state_id.clone());
            self.key.seal(r);
        }
    }

    /// Keeps this instance's shards until `stop`, then hands them all over.
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        // Rounds start every third of gate_ttl, however long the last one took:
        // a slow store must not stretch the renewal period.
        let mut ticks = tokio::time::interval(self.ttl / 3);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let free_in = self.next_free_in();
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = ticks.tick() => {}
                _ = self.nudged.notified() => {
                    // At most a few early rounds a second, whatever the traffic.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                // A shard held elsewhere becomes free before the next tick: look
                // then, not up to a renew period later (a takeover after a
                // crash is that much sooner).
                _ = tokio::time::sleep(free_in.unwrap_or(self.ttl)), if free_in.is_some() => {}
            }
            self.round().await;
        }
    }

    /// How long until the earliest shard held elsewhere may be taken — its gate
    /// epoch's expiry plus `LastModified`'s resolution and `grace_ms`, on the
    /// earliest reading of the store's clock (what [`acquire::LeaseStatus::is_free`]
    /// decides on) — plus a little. A live owner's renewals keep pushing this
    /// beyond the next tick; only a dead or stalled owner's shard comes sooner.
    /// Not while the store fails: the last round's looks are stale, and rounds
    /// would follow one another as fast as they fail.
    fn next_free_in(&self) -> Option<Duration> {
        if self.store_failures.load(Ordering::SeqCst) > 0 {
            return None;
        }
        let earliest = self.epochs.store().clock().earliest();
        self.gates
            .iter()
            .filter(|g| !g.busy.load(Ordering::SeqCst) && lock(&g.holding).is_none())
            .filter_map(|g| {
                let seen = lock(&g.seen);
                let (Some(st), Some(v), false) = (&seen.status, &seen.verdict, seen.free) else {
                    return None;
                };
                // Already past (the look came just before): look again.
                crate::setup::gate_free_at(st, *v == Verdict::Ours, self.ttl, self.grace)
                    .map(|at| at.duration_since(earliest).unwrap_or_default())
            })
            .min()
            .map(|d| d + Duration::from_millis(50))
    }

    /// One keeper round: renew and look, heartbeat, balance.
    async fn round(self: &Arc<Self>) {
        self.store_failures.store(0, Ordering::SeqCst);
        let mut looks = tokio::task::JoinSet::new();
        for shard in 0..self.shards {
            let me = self.clone();
            looks.spawn(async move { me.renew_and_look(shard).await });
        }
        let mut conflict = None;
        while let Some(found) = looks.join_next().await {
            if let Ok(Some(c)) = found {
                conflict = Some(c);
            }
        }
        self.set_conflict(conflict);
        // An instance that reached the lease store for no shard this round can
        // neither renew nor take one: it stops announcing itself, so that the
        // others stop reserving its share and take its shards once their gate
        // leases expire. (It announced itself before: cut from S3 but not from
        // PostgreSQL, its shards stayed unserved for as long as the cut lasted —
        // found by the cluster fault campaign.)
        if self.store_failures.load(Ordering::SeqCst) >= self.shards as usize {
            tracing::warn!("the lease store answered no shard's call this round; not announcing this instance to the cluster");
        } else {
            match self.state.heartbeat(&self.id, self.ttl).await {
                Ok(m) => *lock(&self.members) = m,
                Err(e) => {
                    tracing::warn!(error = %e, "cluster heartbeat failed; balancing on the last membership seen")
                }
            }
        }
        if !self.stopping.is_cancelled() && lock(&self.conflict).is_none() {
            self.balance();
        }
    }

    /// Records the last round's conflict. On a new one, every shard stops at
    /// once (another set-up may be forwarding the same leases right now); when
    /// it is gone, shards are taken again as after any takeover (settling).
    fn set_conflict(&self, now: Option<Conflict>) {
        let before = std::mem::replace(&mut *lock(&self.conflict), now.clone());
        match (&before, &now) {
            (None, Some(c)) => {
                tracing::error!(conflict = %c, "another fencegate set-up holds a gate lease under this prefix: this instance forwards nothing until it is gone");
            }
            (Some(_), None) => {
                tracing::warn!(
                    "the other fencegate set-up's gate leases have ended: serving again"
                );
            }
            _ => {}
        }
        if now.is_some() {
            for shard in 0..self.shards {
                self.stop_serving(
                    shard,
                    tokio::time::Instant::now(),
                    "another set-up shares the prefix",
                );
            }
        }
    }

    /// Renews the shard's gate lease if held here, and records its latest gate;
    /// returns a conflict if that is a live gate object of another set-up.
    async fn renew_and_look(self: &Arc<Self>, shard: u32) -> Option<Conflict> {
        let g = &self.gates[shard as usize];
        let held = lock(&g.holding).clone();
        if let Some(h) = held {
            let _op = g.op.lock().await;
            // A handover may have released it while we waited.
            if lock(&g.holding).as_ref() != Some(&h) {
                return None;
            }
            let sent = Instant::now();
            let decorate = self.decorate();
            let renewed = acquire::renew_direct(&self.epochs, &h, self.ttl, &decorate).await;
            match renewed {
                Ok(new) => {
                    self.extend(g, sent);
                    self.saw_ours(g, &new);
                    *lock(&g.holding) = Some(new.clone());
                    if g.serving.load(Ordering::SeqCst) == 0 && !g.busy.load(Ordering::SeqCst) {
                        // Self-fenced while renewals failed; held again: a new tenure.
                        drop(_op);
                        self.clone().spawn_takeover(shard, Some((new, sent)));
                    }
                }
                Err(AcquireError::NotHolder { why, .. }) => {
                    // Someone else created the next gate epoch: the tenure is over.
                    *lock(&g.holding) = None;
                    tracing::warn!(shard, gate_epoch = %h.epoch, why, "lost the gate lease of a shard");
                    self.stop_serving(shard, tokio::time::Instant::now(), "gate lease lost");
                }
                Err(e) => {
                    self.store_failures.fetch_add(1, Ordering::SeqCst);
                    tracing::warn!(shard, error = %e, "could not renew a shard's gate lease; retrying next round")
                }
            }
            return None;
        }
        match self.look(shard, g).await {
            Ok(seen) => {
                let conflict = match &seen.verdict {
                    Some(Verdict::Foreign(theirs)) if !seen.free => Some(Conflict {
                        shard,
                        theirs: *theirs,
                        ours: SetUp::Cluster {
                            shards: self.shards,
                        },
                        holder: seen.holder.clone().unwrap_or_default(),
                    }),
                    _ => None,
                };
                if let Some(Verdict::Untrusted(why)) = &seen.verdict {
                    if lock(&g.seen).epoch != seen.epoch {
                        tracing::error!(shard, gate_epoch = %seen.epoch, why, "an untrusted gate object: no owner is taken from it, nothing is relayed by it, and the shard is unavailable until gate_ttl after it was written");
                    }
                }
                *lock(&g.seen) = seen;
                conflict
            }
            Err(e) => {
                self.store_failures.fetch_add(1, Ordering::SeqCst);
                tracing::warn!(shard, error = %e, "could not look at a shard's gate lease");
                None
            }
        }
    }

    /// The latest gate object of a shard held elsewhere: one LIST a round (of the
    /// epochs after the last one seen), and a GET only when the epoch changed
    /// (gate objects are immutable). An owner and its `advertise` are taken
    /// only from an object a member of this set-up sealed ([`Verdict::Ours`]).
    async fn look(&self, shard: u32, g: &ShardGate) -> Result<Seen, StoreError> {
        // Listed after the epoch last seen (objects are never deleted): the cost
        // of a look does not grow with the shard's history.
        let known = lock(&g.seen).epoch;
        let latest = self.epochs.latest_after(&g.name, known).await?;
        let cached = {
            let seen = lock(&g.seen);
            seen.status
                .clone()
                .filter(|st| st.latest == latest && seen.epoch == latest)
        };
        let mut st = match cached {
            Some(st) => st,
            None => acquire::status_at(&self.epochs, &g.name, latest).await?,
        };
        // Judged as of now, on the object read once.
        st.store_now = self.epochs.store_now();
        st.store_earliest = self.epochs.store().clock().earliest();
        let verdict = st
            .object
            .as_ref()
            .map(|_| self.verdict(shard, st.record.as_ref()));
        let free = match &verdict {
            Some(v) => self.is_free(v, &st),
            None => true,
        };
        let mut seen = Seen {
            epoch: latest,
            free,
            verdict: verdict.clone(),
            status: Some(st.clone()),
            ..Seen::default()
        };
        if let Some(EpochObject::Acquire {
            holder, expires_at, ..
        }) = &st.object
        {
            seen.holder = Some(holder.clone());
            if verdict == Some(Verdict::Ours) && st.store_earliest <= *expires_at {
                seen.owner = Some(holder.clone());
                seen.expires_at = Some(*expires_at);
                seen.advertise = st.record.as_ref().and_then(|r| r.advertise.clone());
            }
        }
        Ok(seen)
    }

    fn saw_ours(&self, g: &ShardGate, h: &Holding) {
        *lock(&g.seen) = Seen {
            epoch: h.epoch,
            owner: Some(self.id.clone()),
            holder: Some(self.id.clone()),
            advertise: Some(self.advertise.clone()),
            expires_at: Some(h.expires_at),
            free: false,
            status: None,
            verdict: Some(Verdict::Ours),
        };
    }

    /// Whether shard 0's latest gate object is this set-up's (held here, or
    /// sealed by a member, released or not): only then are other shards served.
    fn anchored(&self) -> bool {
        let g = &self.gates[0];
        lock(&g.holding).is_some() || lock(&g.seen).ours()
    }

    /// Takes free shards while holding fewer than this instance's share, hands
    /// shards over while holding more (SPEC §10.2 balance). Shares: with `n`
    /// shards and `l` live instances each holds ⌊n/l⌋ or ⌈n/l⌉. Only an instance
    /// below ⌊n/l⌋ makes another one give up a shard, and then only the one holding
    /// the most (lowest id first) gives one per round: no flapping.
    fn balance(self: &Arc<Self>) {
        let mut counts: HashMap<String, usize> = HashMap::new();
        let mut live: BTreeSet<String> = self.members().into_iter().collect();
        live.insert(self.id.clone());
        let mut free = Vec::new();
        let mut mine = Vec::new();
        for (shard, g) in (0..self.shards).zip(&self.gates) {
            if g.busy.load(Ordering::SeqCst) {
                if lock(&g.holding).is_some() {
                    *counts.entry(self.id.clone()).or_default() += 1;
                }
                continue;
            }
            if lock(&g.holding).is_some() {
                *counts.entry(self.id.clone()).or_default() += 1;
                mine.push(shard);
                continue;
            }
            let seen = lock(&g.seen).clone();
            match seen.owner {
                Some(o) => {
                    live.insert(o.clone());
                    *counts.entry(o).or_default() += 1;
                }
                None if seen.free => free.push(shard),
                None => {}
            }
        }
        let n = self.shards as usize;
        let l = live.len().max(1);
        let (lo, hi) = (n / l, n.div_ceil(l));
        let held = counts.get(&self.id).copied().unwrap_or(0);
        let count = |id: &String| counts.get(id).copied().unwrap_or(0);
        let starving = live.iter().any(|id| *id != self.id && count(id) < lo);
        if held > hi {
            for shard in mine.iter().rev().take(held - hi) {
                self.clone()
                    .spawn_handover(*shard, "balancing: more than this instance's share");
            }
            return;
        }
        if held == hi && hi > lo && starving {
            let most = live
                .iter()
                .map(|id| (std::cmp::Reverse(count(id)), id))
                .min();
            if most.map(|(_, id)| id) == Some(&self.id) {
                if let Some(shard) = mine.last() {
                    self.clone()
                        .spawn_handover(*shard, "balancing: an instance holds less than its share");
                }
            }
            return;
        }
        let want = if held < lo {
            lo - held
        } else if held < hi && !starving {
            hi - held
        } else {
            0
        };
        // Start at a place of our own so that instances do not all race for the
        // same free shard.
        let offset = usize::try_from(shard_of_id(&self.id) % n.max(1) as u64).unwrap_or(0);
        free.sort_by_key(|s| (*s as usize + n - offset) % n);
        // Shard 0 first while it is not this set-up's: until it is, no other
        // shard is served ([`crate::setup`]'s anchor).
        let (free, want) = if self.anchored() {
            (free, want)
        } else if free.contains(&0) {
            (vec![0], 1)
        } else {
            (Vec::new(), 0)
        };
        for shard in free.into_iter().take(want) {
            self.clone().spawn_takeover(shard, None);
        }
    }

    /// Takes `shard` (or starts a new tenure on a gate epoch already held) in the
    /// background.
    fn spawn_takeover(self: Arc<Self>, shard: u32, held: Option<(Holding, Instant)>) {
        let g = &self.gates[shard as usize];
        if lock(&self.conflict).is_some() || g.busy.swap(true, Ordering::SeqCst) {
            return;
        }
        tokio::spawn(async move {
            self.take_over(shard, held).await;
            self.gates[shard as usize]
                .busy
                .store(false, Ordering::SeqCst);
        });
    }

    async fn take_over(self: &Arc<Self>, shard: u32, held: Option<(Holding, Instant)>) {
        let g = &self.gates[shard as usize];
        let previous = lock(&g.seen).clone();
        let holding = match held {
            Some((h, _)) => h,
            None => {
                let _op = g.op.lock().await;
                let sent = Instant::now();
                let decorate = self.decorate();
                // Judged again as the create's read sees it, by this cluster's
                // rule: a forged object's own word frees nothing early.
                let free = |st: &acquire::LeaseStatus| {
                    self.is_free(&self.verdict(shard, st.record.as_ref()), st)
                };
                let rules = acquire::GateRules {
                    free: &free,
                    reclaim: None,
                };
                let taken = acquire::acquire_with(
                    &self.epochs,
                    &g.name,
                    &self.id,
                    self.ttl,
                    self.grace,
                    None,
                    Some(&rules),
                    &decorate,
                )
                .await;
                match taken {
                    Ok(h) => {
                        self.extend(g, sent);
                        self.saw_ours(g, &h);
                        *lock(&g.holding) = Some(h.clone());
                        h
                    }
                    Err(AcquireError::Held { .. } | AcquireError::NotHolder { .. }) => return,
                    Err(e) => {
                        tracing::warn!(shard, error = %e, "could not take a free shard");
                        return;
                    }
                }
            }
        };
        let owner = Owner {
            shard,
            generation: holding.epoch.get(),
        };
        if let Err(why) = self.check_anchor(shard, holding.epoch).await {
            match why {
                AnchorError::Conflict(c) => {
                    self.set_conflict(Some(c));
                }
                AnchorError::NotAnchored => tracing::info!(
                    shard,
                    "shard 0's latest gate object is not this set-up's yet: handing the shard back until it is"
                ),
                AnchorError::Store(e) => {
                    tracing::warn!(shard, error = %e, "could not check the prefix's set-up after taking a shard; handing it back")
                }
            }
            self.hand_back(shard).await;
            return;
        }
        if lock(&self.conflict).is_some() {
            self.hand_back(shard).await;
            return;
        }
        if let Err(e) = self.start_tenure(g, owner).await {
            tracing::warn!(shard, error = %e, "could not start serving a shard; handing it back");
            self.hand_back(shard).await;
            return;
        }
        if self.stopping.is_cancelled() {
            return;
        }
        g.serving.store(owner.generation, Ordering::SeqCst);
        self.takeovers.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            shard,
            gate_epoch = owner.generation,
            previous = previous.holder.as_deref().unwrap_or("none"),
            leases = g.leases.len(),
            "took over a shard"
        );
        let me = self.clone();
        tokio::spawn(async move { me.watch_deadline(shard, owner.generation).await });
    }

    /// After creating gate epoch `epoch` of `shard` and before serving it: shard
    /// 0 (the anchor) must be this set-up's, and a set-up that took shard 0 over
    /// from another one looks at every shard that one used — after its own
    /// create, so of two set-ups starting side by side one sees the other.
    async fn check_anchor(&self, shard: u32, epoch: Epoch) -> Result<(), AnchorError> {
        if shard != 0 {
            let anchor = self.read_latest(0).await.map_err(AnchorError::Store)?;
            if let Some(c) = self.live_conflict(0, anchor.as_ref()) {
                return Err(AnchorError::Conflict(c));
            }
            return match anchor {
                Some((_, rec, _)) if self.verdict(0, rec.as_ref()) == Verdict::Ours => Ok(()),
                _ => Err(AnchorError::NotAnchored),
            };
        }
        if epoch.get() <= 1 {
            return Ok(());
        }
        let before = self
            .read_at(0, Epoch::new(epoch.get() - 1))
            .await
            .map_err(AnchorError::Store)?;
        let shards = match &before {
            None => return Ok(()),
            // Whatever the object before ours claims (it may be garbage),
            // every shard gate lease ever used under the prefix is looked at.
            Some((_, rec, _)) => match self.verdict(0, rec.as_ref()) {
                Verdict::Ours => return Ok(()),
                _ => crate::setup::shards_in_use(&self.epochs)
                    .await
                    .map_err(AnchorError::Store)?
                    .max(self.shards),
            },
        };
        for s in 1..shards {
            let read = self.read_latest(s).await.map_err(AnchorError::Store)?;
            if let Some(c) = self.live_conflict(s, read.as_ref()) {
                return Err(AnchorError::Conflict(c));
            }
        }
        Ok(())
    }

    /// SPEC §10.2 takeover: claim the shard's state, turn older generations'
    /// in-flight records in doubt, start its fences at max(stored, listed).
    async fn start_tenure(&self, g: &ShardGate, owner: Owner) -> Result<(), String> {
        self.state
            .claim_shard(owner)
            .await
            .map_err(|e| e.to_string())?;
        let in_doubt = self.dedup.recover(owner).await.map_err(|e| e.to_string())?;
        if in_doubt > 0 {
            tracing::warn!(
                shard = owner.shard,
                records = in_doubt,
                "dedup records left in flight by the shard's previous owner are now in doubt"
            );
        }
        for (lease, settle) in &g.leases {
            self.fences
                .take_over(lease, *settle, owner)
                .await
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// Stops the shard at its forwarding deadline unless a renewal moved it.
    async fn watch_deadline(&self, shard: u32, generation: u64) {
        let g = &self.gates[shard as usize];
        loop {
            if g.serving.load(Ordering::SeqCst) != generation {
                return;
            }
            let until = g.forward_until_ms.load(Ordering::SeqCst);
            let now = self.now_ms();
            if now >= until && weakened::no_self_fence() {
                return;
            }
            if now >= until {
                tracing::warn!(
                    shard,
                    gate_epoch = generation,
                    "the shard's gate lease was not renewed in time: no new forwards; requests in flight are aborted at gate_ttl"
                );
                self.stop_serving(shard, self.abort_deadline(g), "self-fenced");
                return;
            }
            tokio::time::sleep(Duration::from_millis(until - now)).await;
        }
    }

    /// Stops serving `shard` now: no new admissions or forwards; its requests in
    /// flight may finish until `deadline`, then are aborted.
    fn stop_serving(&self, shard: u32, deadline: tokio::time::Instant, why: &'static str) {
        let g = &self.gates[shard as usize];
        let generation = g.serving.swap(0, Ordering::SeqCst);
        if generation == 0 {
            return;
        }
        let owner = Owner { shard, generation };
        let stops = self.stop_leases(g, owner, |_| deadline);
        tokio::spawn(async move {
            stops.join_all().await;
            tracing::info!(shard, why, "stopped serving a shard");
        });
    }

    /// Closes the fence of every lease of the shard at once (the leases of one
    /// shard never wait for one another: closed one after another, each with
    /// a timeout of its own, the last would be aborted long after `gate_ttl`)
    /// and returns the drains, each aborting what is in flight at its deadline.
    fn stop_leases(
        &self,
        g: &ShardGate,
        owner: Owner,
        deadline: impl Fn(Duration) -> tokio::time::Instant,
    ) -> tokio::task::JoinSet<bool> {
        let mut stops = tokio::task::JoinSet::new();
        for (lease, drain) in &g.leases {
            let (fences, lease, at) = (self.fences.clone(), lease.clone(), deadline(*drain));
            stops.spawn(async move { fences.stop_owned(&lease, owner, at).await });
        }
        stops
    }

    fn spawn_handover(self: Arc<Self>, shard: u32, why: &'static str) {
        let g = &self.gates[shard as usize];
        if g.busy.swap(true, Ordering::SeqCst) {
            return;
        }
        tokio::spawn(async move {
            tracing::info!(shard, why, "handing a shard over");
            self.hand_over(shard).await;
            self.gates[shard as usize]
                .busy
                .store(false, Ordering::SeqCst);
        });
    }

    /// A graceful handover: no new requests, the in-flight ones finish (or are
    /// aborted after their drain timeout), then a `release` gate object lets a
    /// successor take the shard at once.
    async fn hand_over(&self, shard: u32) {
        let g = &self.gates[shard as usize];
        // A renewal may still move the shard's deadline while the drains run, but
        // a store lost partway must not: what is in flight is aborted by the
        // deadline of the latest create sent before the handover began at the
        // latest, whatever the leases' own drain timeouts.
        let latest = self.abort_deadline(g);
        let generation = g.serving.swap(0, Ordering::SeqCst);
        let owner = Owner { shard, generation };
        let now = tokio::time::Instant::now();
        self.stop_leases(g, owner, |drain| (now + drain).min(latest))
            .join_all()
            .await;
        if self.hand_back(shard).await {
            self.handovers.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Writes the `release` gate object of a held shard; true if released.
    async fn hand_back(&self, shard: u32) -> bool {
        let g = &self.gates[shard as usize];
        g.serving.store(0, Ordering::SeqCst);
        let _op = g.op.lock().await;
        let Some(h) = lock(&g.holding).take() else {
            return false;
        };
        g.forward_until_ms.store(0, Ordering::SeqCst);
        g.abort_at_ms.store(0, Ordering::SeqCst);
        *lock(&g.seen) = Seen {
            epoch: h.epoch,
            free: true,
            verdict: Some(Verdict::Ours),
            ..Seen::default()
        };
        let decorate = self.decorate();
        match acquire::release_with(
            &self.epochs,
            &g.name,
            &self.id,
            h.epoch,
            &h.token,
            &decorate,
        )
        .await
        {
            Ok(e) => {
                tracing::info!(shard, gate_epoch = %e, "released a shard");
                true
            }
            Err(e) => {
                tracing::warn!(shard, error = %e, "could not release a shard; a successor waits for its expiry");
                false
            }
        }
    }

    /// Graceful stop (SIGTERM, after the in-flight requests finished or were
    /// abandoned): every shard is handed over, and this instance leaves.
    pub async fn leave(self: &Arc<Self>) {
        self.stopping.cancel();
        // A takeover under way finishes (or gives up) first: then nothing is
        // taken behind our back. Bounded: a store call has its own timeout.
        for _ in 0..250 {
            if !self.gates.iter().any(|g| g.busy.load(Ordering::SeqCst)) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut held = Vec::new();
        for (shard, g) in (0..self.shards).zip(&self.gates) {
            if lock(&g.holding).is_some() {
                held.push(shard);
            }
        }
        // Side by side: with the store slow or away each release waits out its
        // own timeouts, and one after another they could outlast the stop.
        let mut releases = tokio::task::JoinSet::new();
        for shard in held {
            let me = self.clone();
            releases.spawn(async move { me.hand_over(shard).await });
        }
        while releases.join_next().await.is_some() {}
        if let Err(e) = self.state.leave(&self.id).await {
            tracing::warn!(error = %e, "could not record leaving the cluster");
        }
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
