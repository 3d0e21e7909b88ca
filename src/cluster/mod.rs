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
use crate::state::{Owner, StateError, StateStore};

/// SPEC §10.2: the first 8 bytes of SHA-256(lease name), big-endian, modulo `shards`.
pub fn shard_of(lease: &LeaseName, shards: u32) -> u32 {
    let digest = Sha256::digest(lease.as_str().as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    let s = u64::from_be_bytes(first) % u64::from(shards.max(1));
    u32::try_from(s).unwrap_or(0)
}

/// The gate lease's name of a shard: `0007`.
pub fn shard_name(shard: u32) -> LeaseName {
    // Four digits always make a valid lease name.
    LeaseName::parse(&format!("{shard:04}")).unwrap_or_else(|_| unreachable!())
}

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("the lease store's prefix is used by a fencegate set-up of mode {mode:?} with {shards} shards (instance {holder:?}); this cluster has {ours} shards. A single instance and a cluster never share a prefix, and changing [cluster] shards needs every instance stopped")]
    OtherSetUp {
        mode: String,
        shards: u32,
        holder: String,
        ours: u32,
    },
    #[error("cluster start-up: {0}")]
    Store(#[from] StoreError),
    #[error("cluster start-up: {0}")]
    State(#[from] StateError),
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
    /// The latest gate object as read (objects are immutable: read once per epoch).
    object: Option<(EpochObject, Option<String>)>,
}

struct ShardGate {
    name: LeaseName,
    /// The configured leases of this shard, with their longest drain timeout.
    leases: Vec<(LeaseName, Duration)>,
    /// The generation of the tenure being served here; 0 when not served.
    serving: AtomicU64,
    /// Milliseconds after [`Cluster::origin`] until which forwards may start.
    forward_until_ms: AtomicU64,
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
}

pub struct Cluster {
    id: String,
    advertise: String,
    shards: u32,
    peer_token: String,
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

    /// SPEC §10.2: a live gate object of the other mode or another shard count
    /// under the prefix refuses start-up.
    async fn check_set_up(&self) -> Result<(), ClusterError> {
        let name = shard_name(0);
        let st = acquire::status(&self.epochs, &name).await?;
        if st.latest == Epoch::NONE || st.is_free(self.grace) {
            return Ok(());
        }
        let key = crate::epoch::object_key(self.epochs.prefix(), &name, st.latest);
        let rec: Option<EpochRecord> = self
            .epochs
            .store()
            .get(&key)
            .await?
            .and_then(|o| serde_json::from_slice(&o.body).ok());
        if let Some(rec) = rec {
            let mode = rec.mode.clone().unwrap_or_else(|| "single".into());
            let shards = rec.shards.unwrap_or(1);
            if mode != "cluster" || shards != self.shards {
                return Err(ClusterError::OtherSetUp {
                    mode,
                    shards,
                    holder: rec.holder,
                    ours: self.shards,
                });
            }
        }
        Ok(())
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
        self.gates
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
            })
            .collect()
    }

    /// Extends the shard's forwarding window after a gate create sent at `sent`.
    fn extend(&self, g: &ShardGate, sent: Instant) {
        let until =
            (sent + self.ttl.saturating_sub(self.margin)).saturating_duration_since(self.origin);
        g.forward_until_ms.fetch_max(
            u64::try_from(until.as_millis()).unwrap_or(u64::MAX),
            Ordering::SeqCst,
        );
    }

    fn decorate(&self) -> impl Fn(&mut EpochRecord) + Sync + '_ {
        move |r: &mut EpochRecord| {
            r.advertise = Some(self.advertise.clone());
            r.mode = Some("cluster".into());
            r.shards = Some(self.shards);
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
                match &seen.object {
                    Some((EpochObject::Acquire { expires_at, .. }, _)) if !seen.free => {
                        // Already past (the look came just before): look again.
                        let at = acquire::free_at(*expires_at, self.grace);
                        Some(at.duration_since(earliest).unwrap_or_default())
                    }
                    _ => None,
                }
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
        while looks.join_next().await.is_some() {}
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
        if !self.stopping.is_cancelled() {
            self.balance();
        }
    }

    /// Renews the shard's gate lease if held here, and records its latest gate.
    async fn renew_and_look(self: &Arc<Self>, shard: u32) {
        let g = &self.gates[shard as usize];
        let held = lock(&g.holding).clone();
        if let Some(h) = held {
            let _op = g.op.lock().await;
            // A handover may have released it while we waited.
            if lock(&g.holding).as_ref() != Some(&h) {
                return;
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
                    self.stop_serving(shard, Duration::ZERO, "gate lease lost");
                }
                Err(e) => {
                    self.store_failures.fetch_add(1, Ordering::SeqCst);
                    tracing::warn!(shard, error = %e, "could not renew a shard's gate lease; retrying next round")
                }
            }
            return;
        }
        match self.look(g).await {
            Ok(seen) => *lock(&g.seen) = seen,
            Err(e) => {
                self.store_failures.fetch_add(1, Ordering::SeqCst);
                tracing::warn!(shard, error = %e, "could not look at a shard's gate lease")
            }
        }
    }

    /// The latest gate object of a shard held elsewhere: one LIST a round (of the
    /// epochs after the last one seen), and a GET only when the epoch changed
    /// (gate objects are immutable).
    async fn look(&self, g: &ShardGate) -> Result<Seen, StoreError> {
        // Listed after the epoch last seen (objects are never deleted): the cost
        // of a look does not grow with the shard's history.
        let known = lock(&g.seen).epoch;
        let latest = self.epochs.latest_after(&g.name, known).await?;
        let cached = {
            let seen = lock(&g.seen);
            (seen.epoch == latest && seen.object.is_some()).then(|| seen.object.clone())
        };
        let object = match cached {
            Some(o) => o,
            None if latest == Epoch::NONE => None,
            None => {
                let key = crate::epoch::object_key(self.epochs.prefix(), &g.name, latest);
                self.epochs.store().get(&key).await?.map(|o| {
                    let advertise = serde_json::from_slice::<EpochRecord>(&o.body)
                        .ok()
                        .and_then(|r| r.advertise);
                    (
                        EpochObject::from_stored(&g.name, latest, &o.body, o.last_modified),
                        advertise,
                    )
                })
            }
        };
        let st = acquire::LeaseStatus {
            latest,
            object: object.as_ref().map(|(o, _)| o.clone()),
            store_now: self.epochs.store_now(),
            store_earliest: self.epochs.store().clock().earliest(),
        };
        let mut seen = Seen {
            epoch: latest,
            free: st.is_free(self.grace),
            object: object.clone(),
            ..Seen::default()
        };
        if let Some((
            EpochObject::Acquire {
                holder, expires_at, ..
            },
            advertise,
        )) = &object
        {
            seen.holder = Some(holder.clone());
            if st.store_earliest <= *expires_at {
                seen.owner = Some(holder.clone());
                seen.expires_at = Some(*expires_at);
                seen.advertise = advertise.clone();
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
            object: None,
        };
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
        for shard in free.into_iter().take(want) {
            self.clone().spawn_takeover(shard, None);
        }
    }

    /// Takes `shard` (or starts a new tenure on a gate epoch already held) in the
    /// background.
    fn spawn_takeover(self: Arc<Self>, shard: u32, held: Option<(Holding, Instant)>) {
        let g = &self.gates[shard as usize];
        if g.busy.swap(true, Ordering::SeqCst) {
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
                match acquire::acquire_with(
                    &self.epochs,
                    &g.name,
                    &self.id,
                    self.ttl,
                    self.grace,
                    None,
                    None,
                    &decorate,
                )
                .await
                {
                    Ok(h) => {
                        self.extend(g, sent);
                        self.saw_ours(g, &h);
                        *lock(&g.holding) = Some(h.clone());
                        h
                    }
                    Err(AcquireError::Held { .. }) => return,
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
                self.stop_serving(shard, self.margin, "self-fenced");
                return;
            }
            tokio::time::sleep(Duration::from_millis(until - now)).await;
        }
    }

    /// Stops serving `shard` now: no new admissions or forwards; its requests in
    /// flight get `drain` to finish, then are aborted.
    fn stop_serving(&self, shard: u32, drain: Duration, why: &'static str) {
        let g = &self.gates[shard as usize];
        let generation = g.serving.swap(0, Ordering::SeqCst);
        if generation == 0 {
            return;
        }
        let owner = Owner { shard, generation };
        let fences = self.fences.clone();
        let leases: Vec<LeaseName> = g.leases.iter().map(|(l, _)| l.clone()).collect();
        tokio::spawn(async move {
            for lease in &leases {
                fences.stop_owned(lease, owner, drain).await;
            }
            tracing::info!(shard, why, "stopped serving a shard");
        });
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
        let generation = g.serving.swap(0, Ordering::SeqCst);
        let owner = Owner { shard, generation };
        for (lease, drain) in &g.leases {
            self.fences.stop_owned(lease, owner, *drain).await;
        }
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
        *lock(&g.seen) = Seen {
            epoch: h.epoch,
            free: true,
            ..Seen::default()
        };
        match acquire::release(&self.epochs, &g.name, &self.id, h.epoch, &h.token).await {
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
    pub fn no_self_fence() -> bool {
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
