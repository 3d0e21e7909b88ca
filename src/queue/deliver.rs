//! A lease's deliverer (SPEC §11): sends the head of its queue, and the next
//! only once the head is settled. Each attempt is written as started, durably,
//! before it is sent; a crash while it is out leaves it `delivering`, which
//! the next run counts as an unknown outcome and sends again, with the same
//! `webhook-id`.
//!
//! On sled a settlement is made durable with the next attempt's start — one
//! flush per message instead of two — and counted once it is ([`Owed`]): the
//! next message is still sent only after the one before it is settled on
//! disk, and a deliverer that waits or stops first makes it durable.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Request, StatusCode};
use tokio::sync::Notify;
use tokio::task::JoinSet;

use super::store::Written;
use super::{ms, Answer, Message, Queue, Sender, Status};
use crate::forward::{self, UpstreamError};
use crate::routes::Route;
use crate::state::Owner;
use crate::streaming::UpBody;
use crate::telemetry::{Kind, Spans};

/// How long a deliverer waits before looking again when it cannot go on
/// (the route is gone, the instance may not forward, the state cannot be read).
const PAUSE: Duration = Duration::from_millis(250);

/// Statuses that are not a final refusal though they are 4xx (SPEC §11).
fn retryable_4xx(s: StatusCode) -> bool {
    matches!(s.as_u16(), 408 | 409 | 425 | 429)
}

/// What an attempt came to.
enum Came {
    /// 2xx: delivered.
    Delivered(Answer),
    /// A final refusal (4xx other than 408, 409, 425, 429).
    Refused(u16),
    /// Its request could not be built from what was kept (nothing sent).
    Unbuildable(String),
    /// Try again: the status (if it answered), why, whether anything may have
    /// been sent, and a `Retry-After` the destination asked for.
    Again {
        status: Option<u16>,
        why: String,
        maybe_sent: bool,
        retry_after: Option<Duration>,
    },
}

/// One lease's deliverer (SPEC §11): the head of its queue, one attempt at a
/// time (or several, `ordering = "none"`), while this instance may send
/// it. One loop on purpose: each `continue` is a decision of §11 (not here,
/// not now, nothing left, wait for the schedule), and the repeated steps are
/// functions of their own ([`wind_down`], [`pause`]).
pub(super) async fn run(q: Arc<Queue>, lease: String, notify: Arc<Notify>) {
    // `ordering = "none"`: the attempts out, by key.
    let mut running: JoinSet<(String, String)> = JoinSet::new();
    let mut out: HashSet<(String, String)> = HashSet::new();
    let mut owed = Owed::default();
    loop {
        if q.ctx.stop.is_cancelled() {
            // Attempts out finish (shutdown waits for them, then cuts them).
            while running.join_next().await.is_some() {}
            owed.pay(&q).await;
            return;
        }
        let wakes = q.wakes(&lease);
        let owner = match (q.ctx.owner_of)(&lease) {
            Sender::Here(owner) => owner,
            Sender::Later => {
                pause(&q, &notify, &mut owed, PAUSE).await;
                continue;
            }
            Sender::Elsewhere => {
                // Served by another instance (a cluster): the shard's next
                // tenure here starts this deliverer again.
                if wind_down(
                    &q,
                    &lease,
                    wakes,
                    &notify,
                    &mut running,
                    &mut out,
                    &mut owed,
                )
                .await
                {
                    return;
                }
                continue;
            }
        };
        if let Err(e) = q.fence_if_restored(&lease, owner).await {
            tracing::warn!(lease, error = %e, "cannot fence the queue of a restored state; nothing is sent until it is");
            pause(&q, &notify, &mut owed, PAUSE).await;
            continue;
        }
        let head = match q.store.head(&lease).await {
            Ok(Some(m)) => m,
            Ok(None) => {
                if wind_down(
                    &q,
                    &lease,
                    wakes,
                    &notify,
                    &mut running,
                    &mut out,
                    &mut owed,
                )
                .await
                {
                    return;
                }
                continue;
            }
            Err(e) => {
                tracing::warn!(lease, error = %e, "cannot read the queue; trying again");
                pause(&q, &notify, &mut owed, PAUSE).await;
                continue;
            }
        };
        let parallel = q
            .ctx
            .live
            .current()
            .routes
            .get(&head.route)
            .filter(|r| r.queued)
            .and_then(|r| r.parallel);
        if let Some(width) = parallel {
            owed.pay(&q).await;
            let wait = launch(&q, &lease, owner, width, &mut running, &mut out).await;
            tokio::select! {
                _ = q.ctx.stop.cancelled() => {}
                _ = notify.notified() => {}
                Some(done) = running.join_next(), if !running.is_empty() => {
                    if let Ok(key) = done {
                        out.remove(&key);
                    }
                }
                _ = tokio::time::sleep(wait) => {}
            }
            continue;
        }
        // One at a time: what a change to `ordering` left out ends first.
        while let Some(done) = running.join_next().await {
            if let Ok(key) = done {
                out.remove(&key);
            }
        }
        if q.holds(&lease, &head.route) {
            // Paused (SPEC §11): no attempt starts, and nothing behind the
            // head goes before it. A resume wakes the deliverer.
            pause(&q, &notify, &mut owed, PAUSE).await;
            continue;
        }
        let now = ms(q.ctx.clock.now());
        if head.status == Status::Pending && head.next_attempt_ms > now {
            pause(
                &q,
                &notify,
                &mut owed,
                Duration::from_millis(head.next_attempt_ms - now),
            )
            .await;
            continue;
        }
        let live = q.ctx.live.current();
        let Some(route) = live.routes.get(&head.route).filter(|r| r.queued) else {
            // Removed by a reload: kept, not delivered, until it is back or an
            // operator drops the message.
            pause(&q, &notify, &mut owed, PAUSE * 4).await;
            continue;
        };
        let ticket = match route.protect.enter(&route.protect_cfg) {
            Ok(t) => t,
            Err(refused) => {
                // A held route delays the attempt; it spends none.
                pause(&q, &notify, &mut owed, refused.wait).await;
                continue;
            }
        };
        if let Err(e) = attempt(&q, route, owner, head, ticket, Some(&mut owed)).await {
            if let crate::state::StateError::OwnerLost { .. } = e {
                // A newer owner holds the shard: this instance sends nothing
                // more of it (and soon sees it is not served here).
                tracing::info!(lease, error = %e, "the lease's queue is delivered by the shard's new owner");
                pause(&q, &notify, &mut owed, PAUSE).await;
                continue;
            }
            tracing::warn!(lease, error = %e, "a delivery attempt could not be written; trying again");
            // Nothing after it goes before what it wrote is durable: a settle
            // that is in sled's memory but not on disk would otherwise let the
            // next message go first, and come back after a crash.
            while !q.ctx.stop.is_cancelled() {
                if q.store.durable().await.is_ok() {
                    owed.paid(&q);
                    break;
                }
                pause(&q, &notify, &mut owed, PAUSE).await;
            }
        }
    }
}

/// `ordering = "none"`: starts an attempt for each message at the front of
/// the lease's queue with its head's epoch — due, not out already, up to
/// `width` out at once, while the route lets them through. A message of the
/// next epoch is at the front only once none of this epoch is left, so epoch
/// order holds; within an epoch there is none. How long to wait at most
/// before looking again.
async fn launch(
    q: &Arc<Queue>,
    lease: &str,
    owner: Owner,
    width: usize,
    running: &mut JoinSet<(String, String)>,
    out: &mut HashSet<(String, String)>,
) -> Duration {
    let front = match q.store.front(lease, width.saturating_mul(4).max(64)).await {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!(lease, error = %e, "cannot read the queue; trying again");
            return PAUSE;
        }
    };
    let now = ms(q.ctx.clock.now());
    let mut wait = PAUSE * 4;
    let live = q.ctx.live.current();
    for m in front {
        if out.len() >= width {
            break;
        }
        let key = (m.route.clone(), m.key.clone());
        if out.contains(&key) {
            continue;
        }
        if m.status == Status::Pending && m.next_attempt_ms > now {
            wait = wait.min(Duration::from_millis(m.next_attempt_ms - now));
            continue;
        }
        if q.holds(lease, &m.route) {
            // Paused (SPEC §11): `ordering = "none"` keeps no order, so the
            // messages of routes not paused go on.
            continue;
        }
        let Some(route) = live.routes.get(&m.route).filter(|r| r.queued) else {
            continue;
        };
        let ticket = match route.protect.enter(&route.protect_cfg) {
            Ok(t) => t,
            Err(refused) => {
                wait = wait.min(refused.wait);
                break;
            }
        };
        out.insert(key.clone());
        let q = q.clone();
        running.spawn(async move {
            let live = q.ctx.live.current();
            if let Some(route) = live.routes.get(&m.route).filter(|r| r.queued) {
                if let Err(e) = attempt(&q, route, owner, m, ticket, None).await {
                    tracing::warn!(error = %e, "a delivery attempt could not be written; trying again");
                    while q.store.durable().await.is_err() && !q.ctx.stop.is_cancelled() {
                        tokio::time::sleep(PAUSE).await;
                    }
                }
            }
            key
        });
    }
    wait
}

/// SPEC §10 applied to the queue: this instance sends `lease`'s messages only
/// while it holds its place under `owner` (the instance guard, the shard's
/// tenure) and the state is its set-up's.
fn may_send(q: &Queue, lease: &str, owner: Owner) -> bool {
    (q.ctx.owner_of)(lease) == Sender::Here(owner)
}

/// Settlements written but not yet durable, and what is said of each once it
/// is (its count, which a scrape may rely on; the `queue_delivered`
/// failpoint). Paid by the next attempt's start, whose flush covers them, or
/// by [`Owed::pay`] before the deliverer waits or stops.
#[derive(Default)]
pub(super) struct Owed(Vec<(String, &'static str)>);

impl Owed {
    /// Says what was settled: everything written is durable now.
    fn paid(&mut self, q: &Queue) {
        for (route, outcome) in self.0.drain(..) {
            said(q, &route, outcome);
        }
    }

    /// Makes what is owed durable; false (logged) if the store cannot.
    async fn pay(&mut self, q: &Queue) -> bool {
        if self.0.is_empty() {
            return true;
        }
        match q.store.durable().await {
            Ok(()) => {
                self.paid(q);
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "a settled message could not be made durable; trying again");
                false
            }
        }
    }
}

/// Counts a settlement once it is durable.
fn said(q: &Queue, route: &str, outcome: &'static str) {
    q.count(route, outcome);
    if outcome == "delivered" {
        crate::failpoint::hit("queue_delivered");
    }
}

/// Nothing more to send from here (the lease is served elsewhere, or its
/// queue is empty): the attempts out end first, what is owed is paid, then
/// the deliverer retires unless it was woken meanwhile (`wakes` moved on).
/// `true`: retired, the caller returns; `false`: look again.
async fn wind_down(
    q: &Queue,
    lease: &str,
    wakes: u64,
    notify: &Notify,
    running: &mut JoinSet<(String, String)>,
    out: &mut HashSet<(String, String)>,
    owed: &mut Owed,
) -> bool {
    while running.join_next().await.is_some() {}
    out.clear();
    if !owed.pay(q).await {
        pause(q, notify, owed, PAUSE).await;
        return false;
    }
    q.retire(lease, wakes)
}

/// Waits for `d`, a wake-up or shutdown — what is owed made durable first.
async fn pause(q: &Queue, notify: &Notify, owed: &mut Owed, d: Duration) {
    owed.pay(q).await;
    tokio::select! {
        _ = q.ctx.stop.cancelled() => {}
        _ = notify.notified() => {}
        _ = tokio::time::sleep(d) => {}
    }
}

/// One attempt of the lease's head (SPEC §11): a place in the upstream
/// budget, the attempt written as started before anything is sent, sent,
/// and what it came to written. One sequence on purpose: its order is what
/// makes an attempt's outcome known or counted unknown, never lost.
async fn attempt(
    q: &Queue,
    route: &Route,
    owner: Owner,
    mut m: Message,
    mut ticket: crate::protect::Ticket,
    mut owed: Option<&mut Owed>,
) -> Result<(), crate::state::StateError> {
    // The instance's upstream budget (SPEC §9 "Limits"): an attempt waits its
    // turn behind workers' requests and other leases' attempts; order holds.
    let slot = tokio::select! {
        s = route.upstreams.slot() => s,
        _ = q.ctx.stop.cancelled() => return Ok(()),
    };
    if let Some(s) = slot {
        ticket.hold(s);
    }
    if let Some(c) = &q.ctx.checkpoint {
        // SPEC §10, identity and generations: a copy of the state taken
        // before this send must find itself older than the gate objects.
        // Looked up in the store once per lease and newer epoch: the epoch
        // known sent here only rises (a restored state is a new process).
        if m.epoch > q.known_sent(&m.lease) {
            if m.epoch > q.store.sent_epoch(&m.lease).await? && !c.checkpoint().await {
                tracing::warn!(lease = %m.lease, epoch = m.epoch, "the gate object before a newer epoch's first message could not be written; not sent yet");
                tokio::select! {
                    _ = q.ctx.stop.cancelled() => {}
                    _ = tokio::time::sleep(PAUSE) => {}
                }
                return Ok(());
            }
            q.note_sent(&m.lease, m.epoch);
        }
    }
    // Counted out before shutdown is looked at: shutdown cancels `stop`, then
    // waits for what is out (SeqCst both sides), so an attempt either sees
    // the stop or is waited for.
    let Some(_out) = Out::enter(q, owner.shard) else {
        return Ok(());
    };
    let edit = q.edits.lock().await;
    // Paused since the deliverer looked (it may have waited for its place
    // in the upstream budget, or a checkpoint): not started. Checked under
    // `edits`, which a pause holds while it takes effect (`Queue::set_paused`):
    // a pause answered before this point holds the message; one answered
    // after finds it written as started — out when the pause landed.
    if q.holds(&m.lease, &m.route) {
        return Ok(());
    }
    // An operator may have changed it since it was read as the head.
    match q.store.get(&m.route, &m.key).await? {
        Some(now)
            if now.status == m.status
                && now.seq == m.seq
                && now.next_attempt_ms == m.next_attempt_ms => {}
        _ => return Ok(()),
    }
    // Read once the message is known unchanged: an operator's drop since the
    // head was read removed it (and the attempt ended above).
    let Some(envelope) = q.store.envelope(&m.route, &m.key).await? else {
        return Err(crate::state::StateError::Write(format!(
            "the request of queued message {}/{} is gone",
            m.route, m.key
        )));
    };
    if m.status == Status::Delivering {
        // Out when the last run stopped: it may have arrived.
        m.unknown_outcomes += 1;
        q.unknown.fetch_add(1, Ordering::Relaxed);
    }
    let now = ms(q.ctx.clock.now());
    m.status = Status::Delivering;
    m.attempts += 1;
    m.updated_ms = now;
    // Refused once a newer owner holds the shard: the attempt is not sent.
    let written = q.store.start_attempt_unflushed(owner, &m).await?;
    drop(edit);
    if written == Written::Unflushed {
        // Outside the edits lock: other leases' deliverers' starts share
        // this flush. Nothing is sent before it.
        q.store.durable().await?;
    }
    // Its flush made the settlements before it durable.
    if let Some(o) = owed.as_deref_mut() {
        o.paid(q);
    }
    crate::failpoint::hit("queue_attempt_started");
    let request = match build(q, route, &m, envelope) {
        Ok(r) => r,
        Err(why) => {
            drop(ticket);
            return finish(q, route, owner, m, Came::Unbuildable(why), owed).await;
        }
    };
    // What cuts this attempt, taken before the last check: a cut after the
    // check reaches it (one before it, the check sees).
    let cut = q.cut_token(owner.shard);
    // The last check, right before the send (nothing awaited between them).
    if !may_send(q, &m.lease, owner) {
        drop(ticket);
        m.status = Status::Pending;
        m.attempts -= 1;
        q.store.put(owner, &m).await?;
        q.count(&m.route, "not_sent");
        return Ok(());
    }
    // A span per attempt (`[telemetry]`): a child of the worker's trace when
    // its request carried a `traceparent`, with the upstream call under it.
    let mut spans = q
        .ctx
        .telemetry
        .as_ref()
        .map_or_else(Spans::off, |t| t.request(request.headers()));
    let mut request = request;
    let calling = spans.onward(request.headers_mut());
    let result = send(q, route, request, ticket, cut).await;
    calling.end(&mut spans, "upstream", Kind::Client, &result, |c, a| {
        if let Some(s) = c.status() {
            a.int("http.response.status_code", i64::from(s));
        }
        c.is_failure().then_some("the attempt failed")
    });
    let attempt = i64::from(m.attempts);
    let (epoch, outcome) = (m.epoch as i64, result.name());
    spans.finish_as(
        Kind::Internal,
        || format!("attempt {}", route.target.prefix),
        |a| {
            a.str("fencegate.route", m.route.clone())
                .str("fencegate.lease", m.lease.clone())
                .int("fencegate.epoch", epoch)
                .int("fencegate.attempt", attempt)
                .str("fencegate.delivery.outcome", outcome);
        },
        result.is_failure().then_some("the attempt failed"),
    );
    crate::failpoint::hit("queue_attempt_answered");
    finish(q, route, owner, m, result, owed).await
}

impl Came {
    /// The destination's status, if it answered.
    fn status(&self) -> Option<u16> {
        match self {
            Came::Delivered(a) => Some(a.status),
            Came::Refused(s) => Some(*s),
            Came::Unbuildable(_) => None,
            Came::Again { status, .. } => *status,
        }
    }

    fn is_failure(&self) -> bool {
        !matches!(self, Came::Delivered(_))
    }

    /// Its name on the attempt's span.
    fn name(&self) -> &'static str {
        match self {
            Came::Delivered(_) => "delivered",
            Came::Refused(_) => "refused",
            Came::Unbuildable(_) => "unbuildable",
            Came::Again { .. } => "again",
        }
    }
}

/// An attempt counted as out ([`Queue::stop`] waits for it).
/// An attempt counted as out ([`Queue::stop`] and [`Queue::stop_shard`] wait
/// for it).
struct Out<'q>(&'q Queue, u32);

impl<'q> Out<'q> {
    fn enter(q: &'q Queue, shard: u32) -> Option<Out<'q>> {
        q.out.fetch_add(1, Ordering::SeqCst);
        *q.out_by_shard
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(shard)
            .or_default() += 1;
        let out = Out(q, shard);
        (!q.ctx.stop.is_cancelled()).then_some(out)
    }
}

impl Drop for Out<'_> {
    fn drop(&mut self) {
        if let Some(n) = self
            .0
            .out_by_shard
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&self.1)
        {
            *n = n.saturating_sub(1);
        }
        self.0.out.fetch_sub(1, Ordering::SeqCst);
        self.0.idle.notify_waiters();
    }
}

/// The request of attempt `m.attempts`: as accepted, signed now.
fn build(
    q: &Queue,
    route: &Route,
    m: &Message,
    e: super::Envelope,
) -> Result<Request<UpBody>, String> {
    let mut req = Request::new(UpBody::from(e.body.clone()));
    *req.method_mut() = e.method.parse().map_err(|_| "a stored method".to_owned())?;
    *req.uri_mut() = route.target.upstream_uri_of(&e.rest, e.query.as_deref())?;
    let h = req.headers_mut();
    for (n, v) in &e.headers {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(n.as_bytes()),
            HeaderValue::from_bytes(v),
        ) {
            h.append(n, v);
        }
    }
    // The route as it is now: a reload's new upstream or credentials apply.
    forward::route_headers(&route.target, h, &m.key)?;
    if let Some(signer) = &route.signer {
        // The same webhook-id on every attempt; timestamp and signature per attempt.
        let id = format!("{}:{}", m.route, m.key);
        signer.sign(h, &id, q.ctx.clock.now(), &e.body)?;
    }
    Ok(req)
}

async fn send(
    q: &Queue,
    route: &Route,
    req: Request<UpBody>,
    ticket: crate::protect::Ticket,
    cut: tokio_util::sync::CancellationToken,
) -> Came {
    let abandon = q.ctx.abandon.clone();
    let stop = async move {
        tokio::select! {
            _ = abandon.cancelled() => "shutdown gave up on it",
            _ = cut.cancelled() => "this instance may no longer send (its guard lapsed, or the shard's tenure ended)",
        }
    };
    tokio::pin!(stop);
    let started = tokio::time::Instant::now();
    let head = forward::send(&route.client, req, route.timeout, stop.as_mut()).await;
    let mut head = match head {
        Ok(h) => h,
        Err(UpstreamError::Unreachable(why)) => {
            ticket.failed(true, None);
            return Came::Again {
                status: None,
                why,
                maybe_sent: false,
                retry_after: None,
            };
        }
        Err(UpstreamError::Uncertain(why)) => {
            ticket.failed(true, None);
            return Came::Again {
                status: None,
                why,
                maybe_sent: true,
                retry_after: None,
            };
        }
    };
    let status = head.status;
    let read = forward::read_up_to(
        &mut head,
        route.max_replay_bytes,
        started + route.timeout,
        stop.as_mut(),
    )
    .await;
    let wall = q.ctx.clock.now();
    let retry_after = crate::protect::retry_after::delay(&head.headers, wall);
    drop(ticket.answered(status, &head.headers, || wall));
    match read {
        Err(UpstreamError::Unreachable(why) | UpstreamError::Uncertain(why))
            if status.is_success() =>
        {
            // A 2xx whose body broke off: it was received; keep no body.
            tracing::debug!(why, "a delivered message's answer broke off");
            Came::Delivered(Answer::new(status.as_u16(), &head.headers, None))
        }
        _ if status.is_success() => {
            let body = read.ok().filter(|(_, whole)| *whole).map(|(b, _)| b);
            Came::Delivered(Answer::new(
                status.as_u16(),
                &head.headers,
                body.as_ref().map(Bytes::as_ref),
            ))
        }
        _ if status.is_client_error() && !retryable_4xx(status) => Came::Refused(status.as_u16()),
        _ => Came::Again {
            status: Some(status.as_u16()),
            why: format!("the destination answered {status}"),
            maybe_sent: true,
            retry_after,
        },
    }
}

/// Writes what the attempt came to: settled (delivered, failed), or pending
/// with its next attempt.
async fn finish(
    q: &Queue,
    route: &Route,
    owner: Owner,
    mut m: Message,
    result: Came,
    owed: Option<&mut Owed>,
) -> Result<(), crate::state::StateError> {
    let now = ms(q.ctx.clock.now());
    m.updated_ms = now;
    match result {
        Came::Delivered(answer) => {
            m.status = Status::Delivered;
            m.last_status = Some(answer.status);
            m.last_error = None;
            m.answer = Some(answer);
            settle(q, owner, &m, "delivered", owed).await?;
        }
        Came::Unbuildable(why) => {
            m.status = Status::Failed;
            m.last_error = Some(format!("could not be built: {why}"));
            settle(q, owner, &m, "failed", owed).await?;
            tracing::warn!(
                route = m.route,
                key = m.key,
                why,
                "a queued message could not be built"
            );
        }
        Came::Refused(status) => {
            m.status = Status::Failed;
            m.last_status = Some(status);
            m.last_error = Some(format!(
                "the destination refused it ({status}): not retried"
            ));
            settle(q, owner, &m, "failed", owed).await?;
            tracing::warn!(
                route = m.route,
                key = m.key,
                status,
                "a queued message failed for good"
            );
        }
        Came::Again {
            status,
            why,
            maybe_sent,
            retry_after,
        } => {
            m.last_status = status;
            m.last_error = Some(why);
            if maybe_sent && status.is_none() {
                // Timed out or reset after it may have been sent.
                m.unknown_outcomes += 1;
                q.unknown.fetch_add(1, Ordering::Relaxed);
            }
            let schedule = &route.retry;
            match schedule.get(m.attempts as usize - 1) {
                Some(wait) => {
                    let mut wait = jitter(*wait);
                    if let Some(ra) = retry_after {
                        let cap = schedule.last().copied().unwrap_or(wait);
                        wait = wait.max(ra.min(cap));
                    }
                    m.status = Status::Pending;
                    m.next_attempt_ms = now + wait.as_millis() as u64;
                    q.store.put(owner, &m).await?;
                    q.count(&m.route, "retry");
                }
                None => {
                    m.status = Status::Failed;
                    settle(q, owner, &m, "failed", owed).await?;
                    tracing::warn!(
                        route = m.route,
                        key = m.key,
                        attempts = m.attempts,
                        "a queued message failed after its last attempt"
                    );
                }
            }
        }
    }
    Ok(())
}

/// Writes a settled message: counted once durable — at once, or (a lease's
/// deliverer passing `owed`) with the next durable write.
async fn settle(
    q: &Queue,
    owner: Owner,
    m: &Message,
    outcome: &'static str,
    owed: Option<&mut Owed>,
) -> Result<(), crate::state::StateError> {
    match owed {
        Some(o) => {
            if q.store.settle_unflushed(owner, m).await? == Written::Unflushed {
                o.0.push((m.route.clone(), outcome));
                return Ok(());
            }
        }
        None => q.store.settle(owner, m).await?,
    }
    said(q, &m.route, outcome);
    Ok(())
}

/// ±20% of `d`.
fn jitter(d: Duration) -> Duration {
    // A uniform fraction in [0, 1] from 53 random bits.
    let unit = (crate::entropy::u64() >> 11) as f64 / (1u64 << 53) as f64;
    d.mul_f64(0.8 + 0.4 * unit)
}
