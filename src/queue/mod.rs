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

mod deliver;
pub mod store;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::live::LiveConfig;
use crate::metrics::{emit, Metrics};
use crate::state::StateError;
pub use store::{Accepted, Answer, Envelope, Message, QueueStore, Status};

/// Why `routes` cannot serve beside the messages this queue holds (start-up
/// and reload, SPEC §11), if they cannot: a direct route on a lease whose
/// queue holds messages that may still be sent would overtake them, and a
/// queued route moved to another lease would answer that lease's workers from
/// them (and deliver them in the old lease's order).
pub(crate) fn conflict(
    store: &QueueStore,
    routes: &[crate::config::RouteConfig],
) -> Result<Option<String>, StateError> {
    let holding = store.holding()?;
    for r in routes {
        let queued = r.delivery == crate::config::Delivery::Queued;
        for (route, lease) in &holding {
            if !queued && lease == r.lease.as_str() {
                return Ok(Some(format!(
                    "route {:?} would forward lease {lease}'s requests directly, but its queue still holds messages that may be sent (pending, or failed and retriable): a direct request could reach the destination before an older one. Keep the lease's routes queued until those are delivered or dropped (GET /v1/deliveries?lease={lease} on the admin listener)",
                    r.name
                )));
            }
            if queued && *route == r.name && lease != r.lease.as_str() {
                return Ok(Some(format!(
                    "route {route:?} holds messages of lease {lease} that may still be sent, and would move to lease {}: deliver or drop them first (GET /v1/deliveries?route={route} on the admin listener), or give the route a new name",
                    r.lease
                )));
            }
        }
    }
    Ok(None)
}

/// Milliseconds since the Unix epoch.
pub(crate) fn ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Why an operator's retry or drop was refused.
#[derive(Debug, thiserror::Error)]
pub enum Edit {
    #[error("no queued message has this route and key")]
    /// No such message.
    NotFound,
    #[error("the message is {}: retry takes a pending or failed one, drop a pending or failed one", .0.as_str())]
    /// Its status allows neither.
    Conflict(Status),
    #[error("a message of epoch {0} of its lease was sent or waits: retrying this older one would deliver it after that one")]
    /// A newer epoch's message of its lease was sent, or waits.
    Superseded(u64),
    #[error("the state store: {0}")]
    /// The state could not be read or written.
    State(#[from] StateError),
}

/// What the deliverers need of the rest of fencegate.
pub(crate) struct Context {
    pub live: Arc<LiveConfig>,
    /// SPEC §10 applied to the queue: whether this instance may send now (it
    /// holds its instance guard, and its state is its set-up's).
    pub may_send: Box<dyn Fn() -> bool + Send + Sync>,
    pub clock: Arc<dyn Clock>,
    /// Shutdown: no new attempt starts.
    pub stop: CancellationToken,
    /// Shutdown's last resort: an attempt still out is cut (its outcome unknown).
    pub abandon: CancellationToken,
}

/// Attempts by outcome, per route.
#[derive(Default)]
struct Counts {
    attempts: HashMap<(String, &'static str), u64>,
}

/// The queue: its records, a deliverer task per lease with messages, and its
/// figures.
pub struct Queue {
    /// The messages, on sled.
    pub store: QueueStore,
    /// Per lease whose deliverer runs, what wakes it (a new message, an
    /// operator's action).
    running: Mutex<HashMap<String, Arc<Notify>>>,
    counts: Mutex<Counts>,
    unknown: AtomicU64,
    /// Held while a message is read and changed by the deliverer (its attempt
    /// started) or by an operator (retry, drop), so neither overwrites the other.
    edits: tokio::sync::Mutex<()>,
    /// Attempts out now, and what wakes [`Queue::stop`] when one ends.
    out: AtomicU64,
    idle: Notify,
    /// Cancelled to cut every attempt out now (the instance guard lapsed or
    /// was taken, SPEC §10.1), then replaced for the attempts after.
    cut: Mutex<CancellationToken>,
    /// Trace export (`[telemetry]`): a span per attempt.
    telemetry: std::sync::OnceLock<Arc<crate::telemetry::Telemetry>>,
    ctx: Context,
}

impl Queue {
    pub(crate) fn new(store: QueueStore, ctx: Context) -> Arc<Queue> {
        Arc::new(Queue {
            store,
            running: Mutex::new(HashMap::new()),
            counts: Mutex::new(Counts::default()),
            unknown: AtomicU64::new(0),
            edits: tokio::sync::Mutex::new(()),
            out: AtomicU64::new(0),
            idle: Notify::new(),
            telemetry: std::sync::OnceLock::new(),
            cut: Mutex::new(CancellationToken::new()),
            ctx,
        })
    }

    /// Cuts every attempt out now: this instance may no longer send (its
    /// guard was not renewed in time, or was taken). Their outcomes are
    /// unknown; each is sent again once the instance may send.
    pub(crate) fn cut_attempts(&self) {
        let mut cut = self.cut.lock().unwrap_or_else(|p| p.into_inner());
        cut.cancel();
        *cut = CancellationToken::new();
    }

    /// What cuts an attempt starting now ([`Queue::cut_attempts`]).
    fn cut_token(&self) -> CancellationToken {
        self.cut.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Traces each attempt from now on (`[telemetry]`).
    pub(crate) fn trace_with(&self, t: Arc<crate::telemetry::Telemetry>) {
        let _ = self.telemetry.set(t);
    }

    /// Starts a deliverer for every lease with messages left by an earlier run
    /// (a `delivering` one among them was cut mid-attempt: its outcome is
    /// unknown, and it is sent again first).
    pub(crate) fn start(self: &Arc<Self>) -> Result<usize, StateError> {
        let leases = self.store.leases_with_work()?;
        for l in &leases {
            self.wake(l);
        }
        Ok(leases.len())
    }

    /// Wakes `lease`'s deliverer, starting it if it is not running.
    pub(crate) fn wake(self: &Arc<Self>, lease: &str) {
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = running.get(lease) {
            n.notify_one();
            return;
        }
        let notify = Arc::new(Notify::new());
        running.insert(lease.to_owned(), notify.clone());
        tokio::spawn(deliver::run(self.clone(), lease.to_owned(), notify));
    }

    /// `lease`'s deliverer found nothing to do: it stops, unless a message
    /// came meanwhile (checked under the same lock [`Queue::wake`] takes, so a
    /// message accepted now either is seen here or starts a new deliverer).
    fn retire(&self, lease: &str) -> bool {
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        match self.store.head(lease) {
            Ok(None) => {
                running.remove(lease);
                true
            }
            _ => false,
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

    /// An operator's retry (SPEC §11): a pending message is due now; a failed
    /// one goes back to the end of its lease's queue — unless a message of a
    /// newer epoch of its lease was sent or waits, which it would then follow
    /// (the order rule has no exemption, not even an operator's).
    pub(crate) async fn retry(self: &Arc<Self>, route: &str, key: &str) -> Result<Message, Edit> {
        let _edit = self.edits.lock().await;
        let mut m = self.store.get(route, key)?.ok_or(Edit::NotFound)?;
        let now = ms(self.ctx.clock.now());
        let m = match m.status {
            Status::Pending => {
                m.next_attempt_ms = now;
                m.updated_ms = now;
                self.store.put(&m).await?;
                m
            }
            Status::Failed => match self.store.requeue(route, key, now).await? {
                store::Requeued::Done(m) => *m,
                store::Requeued::Gone => return Err(Edit::NotFound),
                store::Requeued::NotFailed(s) => return Err(Edit::Conflict(s)),
                store::Requeued::Superseded(e) => return Err(Edit::Superseded(e)),
            },
            other => return Err(Edit::Conflict(other)),
        };
        self.wake(&m.lease);
        Ok(m)
    }

    /// An operator's drop (SPEC §11): a pending or failed message is settled
    /// `dropped`; the messages behind it go on.
    pub(crate) async fn drop_message(
        self: &Arc<Self>,
        route: &str,
        key: &str,
    ) -> Result<Message, Edit> {
        let _edit = self.edits.lock().await;
        let mut m = self.store.get(route, key)?.ok_or(Edit::NotFound)?;
        if !matches!(m.status, Status::Pending | Status::Failed) {
            return Err(Edit::Conflict(m.status));
        }
        m.status = Status::Dropped;
        m.updated_ms = ms(self.ctx.clock.now());
        self.store.settle(&m).await?;
        self.wake(&m.lease);
        Ok(m)
    }

    fn count(&self, route: &str, outcome: &'static str) {
        let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        *c.attempts.entry((route.to_owned(), outcome)).or_default() += 1;
    }

    /// Registers the queue's metrics (SPEC §11).
    pub(crate) fn register(self: &Arc<Self>, metrics: &Metrics) {
        metrics.with_registry(|r| r.register_collector(Box::new(QueueCollector(self.clone()))));
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

struct QueueCollector(Arc<Queue>);

impl std::fmt::Debug for QueueCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("QueueCollector")
    }
}

impl Collector for QueueCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let q = &self.0;
        let now = ms(q.ctx.clock.now());
        let mut depth: HashMap<String, (i64, u64)> = HashMap::new();
        for r in q.ctx.live.current().routes.iter().filter(|r| r.queued) {
            depth.insert(r.name.clone(), (0, now));
        }
        for (route, (n, oldest)) in q.store.depth().unwrap_or_default() {
            depth.insert(route, (n as i64, oldest.min(now)));
        }
        let mut rows: Vec<_> = depth.into_iter().collect();
        rows.sort();
        emit(
            &mut enc,
            "fencegate_queue_depth",
            "Queued messages not settled (pending or being delivered), per route",
            MetricType::Gauge,
            rows.iter()
                .map(|(r, (n, _))| (vec![("route", r.clone())], ConstGauge::new(*n)))
                .collect(),
        )?;
        emit(
            &mut enc,
            "fencegate_queue_oldest_pending_seconds",
            "Age of the oldest message not settled, per route (0: none)",
            MetricType::Gauge,
            rows.iter()
                .map(|(r, (_, oldest))| {
                    (
                        vec![("route", r.clone())],
                        ConstGauge::new(now.saturating_sub(*oldest) as f64 / 1000.0),
                    )
                })
                .collect(),
        )?;
        let mut attempts: Vec<_> = q
            .counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .attempts
            .iter()
            .map(|((r, o), n)| ((r.clone(), *o), *n))
            .collect();
        attempts.sort();
        emit(
            &mut enc,
            "fencegate_queue_attempts",
            "Delivery attempts by route and outcome (delivered, retry, failed, not_sent)",
            MetricType::Counter,
            attempts
                .into_iter()
                .map(|((r, o), n)| {
                    (
                        vec![("route", r), ("outcome", o.to_owned())],
                        ConstCounter::new(n),
                    )
                })
                .collect(),
        )?;
        emit(
            &mut enc,
            "fencegate_queue_unknown_outcomes",
            "Attempts whose outcome was unknown (timed out, reset, or out at a crash): the message is sent again with the same webhook-id",
            MetricType::Counter,
            vec![(vec![], ConstCounter::new(q.unknown.load(Ordering::Relaxed)))],
        )
    }
}
