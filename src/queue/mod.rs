//! Queued delivery (SPEC §11): a queued route's request is admitted (§4),
//! written durably and answered `202`; each lease's messages are then
//! delivered one at a time in acceptance order, with retries.
//!
//! Why the order is the lease's epoch order: a message's sequence number is
//! taken while its request holds its gate pass, under the lock that orders
//! acceptances ([`store::QueueStore::accept`]). Raising the mark to e+1 waits
//! for every pass of an older epoch (the drain, §5), and an aborted pass takes
//! no number. So every message of e+1 is numbered after every message of e;
//! the deliverer ([`deliver`]) sends a lease's lowest unsettled number and the
//! next only once it is settled (delivered, failed for good, or dropped). A
//! lease's routes are all queued or all direct (config), so no direct request
//! overtakes the queue either.

mod bulk;
mod deliver;
mod edits;
mod follow;
pub mod job;
pub mod message;
pub(crate) mod metrics;
pub mod pause;
pub mod postgres;
mod restore;
mod rules;
pub mod sled;
pub mod store;
pub mod timed;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::live::LiveConfig;
use crate::metrics::Metrics;
use crate::state::{Owner, StateError};
pub(crate) use edits::By;
pub(crate) use follow::FollowTenures;
pub use message::{Accepted, Answer, Edit, Envelope, ListedBy, Listing, Message, Requeued, Status};
pub(crate) use restore::fence_restored;
pub use restore::Fenced;
pub(crate) use rules::conflict;
pub use store::QueueStore;

/// Milliseconds since the Unix epoch.
pub(crate) fn ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Where a lease's messages may be sent from now, as this instance sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sender {
    /// From here, written under this owner.
    Here(Owner),
    /// From here once it may send again (its guard or its shard's window
    /// lapsed, the state is another set-up's for now): its deliverer waits.
    Later,
    /// Not from here: the lease's shard is served by another instance (a
    /// cluster); its deliverer stops until a tenure here starts it again.
    Elsewhere,
}

impl Sender {
    /// The owner to write under, if the messages may be sent from here now.
    pub(crate) fn owner(self) -> Option<Owner> {
        match self {
            Sender::Here(o) => Some(o),
            _ => None,
        }
    }
}

/// Where a lease's messages may be sent from now ([`Sender`]).
pub(crate) type OwnerOf = Box<dyn Fn(&str) -> Sender + Send + Sync>;

/// What the deliverers need of the rest of fencegate.
pub(crate) struct Context {
    pub live: Arc<LiveConfig>,
    /// SPEC §10 applied to the queue: whether this instance may write and
    /// send a lease's messages now, and under which owner — it holds its
    /// instance guard (a single instance) or serves the lease's shard (a
    /// cluster), and its state is its set-up's.
    pub owner_of: OwnerOf,
    /// SPEC §11, a route removed by a reload keeps its messages "until it is
    /// back (or an operator drops them)": the owner under which an operator
    /// may drop a message whose lease no route names now ([`OwnerOf`] under
    /// the same conditions as `owner_of`, by the lease's shard in a cluster).
    /// Never used to send.
    pub drop_owner_of: OwnerOf,
    pub clock: Arc<dyn Clock>,
    /// Shutdown: no new attempt starts.
    pub stop: CancellationToken,
    /// Shutdown's last resort: an attempt still out is cut (its outcome unknown).
    pub abandon: CancellationToken,
    /// Written before a lease's first message of a newer epoch is sent (a
    /// single instance's guard, a cluster's anchor;
    /// [`crate::state::identity::Checkpoint`]).
    pub checkpoint: Option<Arc<dyn crate::state::identity::Checkpoint>>,
    /// The generation at which the state was last found restored or copied
    /// (0: never): each lease's queue is fenced once for it before any of its
    /// messages is sent ([`Queue::fence_if_restored`]).
    pub restored: u64,
    /// The leases' epochs, for a restored state's fence.
    pub epochs: crate::lease::Epochs,
    /// Trace export (`[telemetry]`): a span per attempt.
    pub telemetry: Option<Arc<crate::telemetry::Telemetry>>,
}

/// Attempts by outcome, per route.
#[derive(Default)]
struct Counts {
    attempts: HashMap<(String, &'static str), u64>,
}

/// A running deliverer: what wakes it, and how many times it was woken (it
/// stops only if none came since it last looked at its queue).
struct Running {
    notify: Arc<Notify>,
    wakes: u64,
}

/// The queue: its records, a deliverer task per lease with messages, and its
/// figures.
pub struct Queue {
    /// The messages, on sled or in PostgreSQL.
    pub store: Arc<dyn QueueStore>,
    /// Per lease whose deliverer runs, what wakes it (a new message, an
    /// operator's action, a takeover).
    running: Mutex<HashMap<String, Running>>,
    counts: Mutex<Counts>,
    unknown: AtomicU64,
    /// Held while a message is read and changed by the deliverer (its attempt
    /// started) or by an operator (retry, drop), so neither overwrites the other.
    edits: tokio::sync::Mutex<()>,
    /// Held shared by each acceptance from its look at the running routes to
    /// its write's end, and exclusively by a reload from its look at the
    /// queue's messages to its new routes' swap (SPEC §11, the rule of kinds):
    /// a message is never written under a route that a reload made direct or
    /// moved since it looked, however long its write waited.
    pub(crate) kinds: tokio::sync::RwLock<()>,
    /// Attempts out now, and what wakes [`Queue::stop`] when one ends.
    out: AtomicU64,
    /// Attempts out now per shard (a cluster's tenure waits for its own).
    out_by_shard: Mutex<HashMap<u32, u64>>,
    idle: Notify,
    /// Per shard, cancelled to cut every attempt out now on it (the instance
    /// guard lapsed or was taken, SPEC §10.1; the shard's tenure ended,
    /// §10.2), then replaced for the attempts after.
    cut: Mutex<HashMap<u32, CancellationToken>>,
    /// The PostgreSQL queue's figures, read in the background (a scrape
    /// does not wait for the database).
    depth: Mutex<HashMap<String, (u64, u64)>>,
    /// Leases whose queue was found fenced for [`Context::restored`].
    fenced: Mutex<std::collections::HashSet<String>>,
    /// Per lease, an epoch known to be at most its newest sent one: no
    /// checkpoint is needed to send a message of it or below.
    sent: Mutex<HashMap<String, u64>>,
    /// The pauses in force (SPEC §11): read at start, written through by
    /// this instance's admin API, and read again each second on PostgreSQL
    /// (another member's admin API may have written them).
    paused: std::sync::RwLock<pause::Paused>,
    /// Held from a read of the pauses to its write into `paused`: a
    /// background read that began before a pause's write cannot put back
    /// what it read after the pause took effect.
    pauses_read: tokio::sync::Mutex<()>,
    /// Wakes the bulk jobs' runner (a job was made).
    jobs_wake: Notify,
    /// When this process started (ms): a message it accepted was sent by
    /// no copy, so a restored state's fence need not count it unknown.
    started_ms: u64,
    ctx: Context,
}

impl Queue {
    pub(crate) fn new(store: Arc<dyn QueueStore>, ctx: Context) -> Arc<Queue> {
        Arc::new(Queue {
            store,
            running: Mutex::new(HashMap::new()),
            counts: Mutex::new(Counts::default()),
            unknown: AtomicU64::new(0),
            edits: tokio::sync::Mutex::new(()),
            kinds: tokio::sync::RwLock::new(()),
            out: AtomicU64::new(0),
            out_by_shard: Mutex::new(HashMap::new()),
            idle: Notify::new(),
            cut: Mutex::new(HashMap::new()),
            depth: Mutex::new(HashMap::new()),
            fenced: Mutex::new(Default::default()),
            sent: Mutex::new(HashMap::new()),
            paused: std::sync::RwLock::new(pause::Paused::default()),
            pauses_read: tokio::sync::Mutex::new(()),
            jobs_wake: Notify::new(),
            started_ms: ms(ctx.clock.now()),
            ctx,
        })
    }

    /// The epoch known here to be at most `lease`'s newest sent one (0).
    pub(crate) fn known_sent(&self, lease: &str) -> u64 {
        self.sent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(lease)
            .copied()
            .unwrap_or(0)
    }

    /// A message of `lease` at `epoch` is cleared to be sent.
    pub(crate) fn note_sent(&self, lease: &str, epoch: u64) {
        let mut sent = self.sent.lock().unwrap_or_else(|p| p.into_inner());
        let e = sent.entry(lease.to_owned()).or_default();
        *e = (*e).max(epoch);
    }

    /// SPEC §10, identity and generations: before `lease`'s messages are
    /// sent from a state found restored or copied, its queue is fenced
    /// ([`fence_restored`]) — once per restore, whoever sends them (the
    /// lease's mark of it is written under `owner`, after the fence).
    pub(crate) async fn fence_if_restored(
        &self,
        lease: &str,
        owner: Owner,
    ) -> Result<(), StateError> {
        let r = self.ctx.restored;
        if r == 0
            || self
                .fenced
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(lease)
        {
            return Ok(());
        }
        // Beside attempts and operators' edits, never across them.
        let _edit = self.edits.lock().await;
        if self.store.restore_fenced(lease).await? < r {
            let done = fence_restored(
                self.store.as_ref(),
                &self.ctx.epochs,
                owner,
                lease,
                ms(self.ctx.clock.now()),
                self.started_ms,
            )
            .await?;
            self.store.mark_restore_fenced(owner, lease, r).await?;
            tracing::error!(
                lease,
                failed_unsent = done.failed,
                resent_as_unknown = done.unknown,
                "restored or copied state fenced: queued messages of an epoch below the lease's latest are failed unsent (a retry is refused as superseded), those of the latest epoch are sent again as unknown outcomes"
            );
        }
        self.fenced
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(lease.to_owned());
        Ok(())
    }

    /// Cuts every attempt out now: this instance may no longer send (its
    /// guard was not renewed in time, or was taken). Their outcomes are
    /// unknown; each is sent again once the instance may send.
    pub(crate) fn cut_attempts(&self) {
        let mut cut = self.cut.lock().unwrap_or_else(|p| p.into_inner());
        for (_, t) in cut.drain() {
            t.cancel();
        }
    }

    /// Cuts the attempts out now on `shard` (its tenure here ended).
    fn cut_shard(&self, shard: u32) {
        if let Some(t) = self
            .cut
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&shard)
        {
            t.cancel();
        }
    }

    /// What cuts an attempt on `shard` starting now ([`Queue::cut_attempts`],
    /// [`Queue::cut_shard`]).
    fn cut_token(&self, shard: u32) -> CancellationToken {
        self.cut
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(shard)
            .or_default()
            .clone()
    }

    /// A cluster's tenure of `owner.shard` began here: the deliverers of its
    /// leases with messages start (a `delivering` message among them was cut
    /// mid-attempt by the previous owner: its outcome is unknown, and it is
    /// sent again first).
    pub(crate) fn serve_shard(self: &Arc<Self>, leases: &[crate::epoch::LeaseName]) {
        for l in leases {
            self.wake(l.as_str());
        }
    }

    /// A cluster's tenure of `shard` ended here: no attempt starts on it (its
    /// deliverers find their lease not served), and those out may end until
    /// `deadline`, then are cut — the bound a forwarded request of the shard
    /// has (SPEC §10.2).
    pub(crate) async fn stop_shard(&self, shard: u32, deadline: tokio::time::Instant) {
        let ended = async {
            loop {
                let idle = self.idle.notified();
                let out = self
                    .out_by_shard
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get(&shard)
                    .copied()
                    .unwrap_or(0);
                if out == 0 {
                    return;
                }
                idle.await;
            }
        };
        if tokio::time::timeout_at(deadline, ended).await.is_err() {
            tracing::warn!(
                shard,
                "delivery attempts still out when the shard's tenure ended are cut; their outcome is unknown and the shard's next owner sends them again"
            );
            self.cut_shard(shard);
        }
    }

    /// Starts a deliverer for every lease with messages left by an earlier run
    /// (a `delivering` one among them was cut mid-attempt: its outcome is
    /// unknown, and it is sent again first).
    /// Whether a message of `route` on `lease` may not start an attempt now
    /// (SPEC §11, pause and resume).
    pub(crate) fn holds(&self, lease: &str, route: &str) -> bool {
        self.paused
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .holds(lease, route)
    }

    /// The pauses in force, as this instance last read them.
    pub(crate) fn pauses(&self) -> pause::Paused {
        self.paused
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Reads the pauses from the state (another member may have written them).
    async fn read_pauses(&self) -> Result<(), StateError> {
        let _one = self.pauses_read.lock().await;
        let p = self.store.paused().await?;
        *self.paused.write().unwrap_or_else(|e| e.into_inner()) = p;
        Ok(())
    }

    /// An operator's pause (`on`) or resume of `what`, durable on return;
    /// since when it is paused (`None`: not paused). A resume wakes the
    /// deliverers it held.
    pub(crate) async fn set_paused(
        self: &Arc<Self>,
        what: &pause::Pausable,
        on: bool,
    ) -> Result<Option<u64>, StateError> {
        let since = on.then(|| ms(self.ctx.clock.now()));
        self.store.set_paused(what, since).await?;
        {
            // Takes effect under `edits`: an attempt is written as started
            // either before (it was out when the pause landed) or after,
            // and then it sees the pause (`deliver::attempt`).
            let _one = self.pauses_read.lock().await;
            let _edit = self.edits.lock().await;
            let p = self.store.paused().await?;
            *self.paused.write().unwrap_or_else(|e| e.into_inner()) = p;
        }
        if !on {
            match what {
                pause::Pausable::Lease(l) => self.wake(l),
                pause::Pausable::Route(_) => {
                    for l in self.store.leases_with_work().await? {
                        self.wake(&l);
                    }
                }
            }
        }
        Ok(self.pauses().0.get(what).copied())
    }

    pub(crate) async fn start(self: &Arc<Self>) -> Result<usize, StateError> {
        self.read_pauses().await?;
        let leases = self.store.leases_with_work().await?;
        for l in &leases {
            self.wake(l);
        }
        if self.store.depth_now().is_none() {
            tokio::spawn(self.clone().read_depth(Duration::from_secs(1)));
        }
        // Bulk jobs left unfinished by a previous run go on (SPEC §11).
        tokio::spawn(self.clone().run_jobs());
        Ok(leases.len())
    }

    /// Wakes `lease`'s deliverer, starting it if it is not running.
    pub(crate) fn wake(self: &Arc<Self>, lease: &str) {
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = running.get_mut(lease) {
            r.wakes += 1;
            r.notify.notify_one();
            return;
        }
        let notify = Arc::new(Notify::new());
        running.insert(
            lease.to_owned(),
            Running {
                notify: notify.clone(),
                wakes: 0,
            },
        );
        tokio::spawn(deliver::run(self.clone(), lease.to_owned(), notify));
    }

    /// How many times `lease`'s deliverer was woken: read before it looks at
    /// its queue, and given back to [`Queue::retire`].
    fn wakes(&self, lease: &str) -> u64 {
        self.running
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(lease)
            .map_or(0, |r| r.wakes)
    }

    /// `lease`'s deliverer found nothing to do (or its lease is not served
    /// here): it stops, unless it was woken since it looked (`wakes`, under
    /// the lock [`Queue::wake`] takes: a message accepted meanwhile either
    /// was seen or starts a new deliverer).
    fn retire(&self, lease: &str, wakes: u64) -> bool {
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        if running.get(lease).is_some_and(|r| r.wakes == wakes) {
            running.remove(lease);
            true
        } else {
            false
        }
    }

    /// Reads the PostgreSQL queue's figures every `every` (metrics).
    /// And wakes the deliverer of every lease served here whose queue holds
    /// messages but whose deliverer is not running: a message committed
    /// after its request was answered 503 (a COMMIT that outlasted `[state]
    /// timeout_ms`, for as long as it took) is found within `every`.
    ///
    /// Once no route is queued and nothing was left at the last read, the reads
    /// stop until a reload queues a route again: a set-up that does not queue
    /// pays no statement a second for it (and holds no pooled connection).
    async fn read_depth(self: Arc<Self>, every: Duration) {
        let mut first = true;
        loop {
            let idle = !first
                && self
                    .depth
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .is_empty()
                && !self.ctx.live.current().routes.iter().any(|r| r.queued);
            first = false;
            if idle {
                tokio::select! {
                    _ = self.ctx.stop.cancelled() => return,
                    _ = tokio::time::sleep(every) => {}
                }
                continue;
            }
            if let Ok(d) = self.store.depth().await {
                *self.depth.lock().unwrap_or_else(|p| p.into_inner()) = d;
            }
            if let Err(e) = self.read_pauses().await {
                tracing::debug!(error = %e, "cannot read the queue's pauses; trying again");
            }
            if let Ok(leases) = self.store.leases_with_work().await {
                for lease in leases {
                    let idle = !self
                        .running
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .contains_key(&lease);
                    if idle && matches!((self.ctx.owner_of)(&lease), Sender::Here(_)) {
                        self.wake(&lease);
                    }
                }
            }
            tokio::select! {
                _ = self.ctx.stop.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
        }
    }

    /// Shutdown (after `stop` was cancelled: no attempt starts): waits up to
    /// `timeout` for the attempts out to end, then cuts them.
    pub(crate) async fn stop(&self, timeout: Duration) {
        let ended = async {
            loop {
                let idle = self.idle.notified();
                if self.out.load(Ordering::SeqCst) == 0 {
                    return;
                }
                idle.await;
            }
        };
        if tokio::time::timeout(timeout, ended).await.is_err() {
            tracing::warn!("delivery attempts still out at shutdown are cut; their outcome is unknown and they are sent again at the next start");
            self.ctx.abandon.cancel();
        }
    }

    fn count(&self, route: &str, outcome: &'static str) {
        let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        *c.attempts.entry((route.to_owned(), outcome)).or_default() += 1;
    }

    /// Registers the queue's metrics (SPEC §11).
    pub(crate) fn register(self: &Arc<Self>, metrics: &Metrics) {
        metrics.with_registry(|r| {
            r.register_collector(Box::new(metrics::QueueCollector(self.clone())))
        });
    }

    /// Removes settled messages older than `ttl`, every `every`.
    pub(crate) async fn run_sweeper(self: Arc<Self>, ttl: Duration, every: Duration) {
        let stop = self.ctx.stop.clone();
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            let before = ms(self.ctx.clock.now()).saturating_sub(ttl.as_millis() as u64);
            // Each removal is a transaction that checks the message unchanged,
            // as a requeue's is: no lock held across the pass.
            match self.store.sweep(before).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(removed = n, "queue sweep removed settled messages"),
                Err(e) => tracing::warn!(error = %e, "queue sweep failed"),
            }
        }
    }
}
