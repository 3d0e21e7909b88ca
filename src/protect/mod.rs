//! Protecting the destination (SPEC §7 `upstream_held`, §9): per route, a limit
//! on requests at the upstream at once (`max_in_flight`), a hold while a 429 or
//! 503's `Retry-After` runs (`honor_retry_after`, capped by `max_retry_after`),
//! a circuit breaker (`breaker`, [`breaker`]) and a rate (`rate`, [`rate`]).
//!
//! Each is a refusal *before* forwarding, decided after admission and before the
//! dedup claim (`proxy`): a refused request forwards nothing and records nothing,
//! so a worker's key stays as it was and no rule of SPEC §4–§6 changes. A request
//! let through holds a [`Ticket`]; its answer (or failure) is reported back under
//! the route's keys at that time, and its [`Slot`] counts it in flight until its
//! exchange with the upstream is over at both ends (the same span a drain waits
//! for, SPEC §5; an unknown outcome lingers for the drain timeout).
//!
//! The state ([`Guard`]) is per route and kept across a reload while the route's
//! name and upstream stay the same (`RouteTable::carry_over`): a reload does not
//! forget a destination that asked for quiet, nor release requests it has. It is
//! this instance's: in a cluster each shard's owner keeps its own.
//!
//! Durations are bounded by config validation and every instant computed here
//! saturates: no key makes the request path panic.

pub mod breaker;
pub mod rate;
pub mod retry_after;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use http::header::RETRY_AFTER;
use http::{HeaderMap, StatusCode};
use tokio::time::Instant;

use crate::config::{BreakerConfig, RouteConfig};
use breaker::{Breaker, BreakerState, Entry};

/// A route's protection keys (SPEC §9), as one snapshot of the config holds them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// `max_in_flight`: none is no limit.
    pub max_in_flight: Option<usize>,
    /// `honor_retry_after`.
    pub honor_retry_after: bool,
    /// `max_retry_after`: the longest hold one answer sets.
    pub max_retry_after: Duration,
    /// `breaker`: none is no breaker.
    pub breaker: Option<BreakerConfig>,
    /// `rate` and its burst: none is no rate.
    pub rate: Option<(rate::Rate, u32)>,
}

impl Settings {
    /// The keys of route `cfg`.
    pub fn of(cfg: &RouteConfig) -> Settings {
        Settings {
            max_in_flight: cfg.max_in_flight,
            honor_retry_after: cfg.honor_retry_after,
            max_retry_after: cfg.max_retry_after,
            breaker: cfg.breaker,
            rate: cfg
                .rate
                .map(|r| (r, cfg.rate_burst.unwrap_or_else(|| r.default_burst()))),
        }
    }
}

/// Why a request was refused (SPEC §7 `upstream_held`, its `detail`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// `max_in_flight` requests are at the upstream already.
    InFlightLimit {
        /// The limit.
        limit: usize,
    },
    /// The upstream's `Retry-After` has not passed.
    RetryAfter,
    /// The breaker is open, or half-open with its probe out.
    BreakerOpen,
    /// Every upstream request the instance's descriptor budget allows is out
    /// (SPEC §9 "Limits", [`crate::budget`]): not the route's doing.
    ConnectionBudget,
    /// The route's `rate` is used up for now.
    Rate,
}

impl Reason {
    /// `detail` in the error's body: stable, for programs.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::InFlightLimit { .. } => "in_flight_limit",
            Reason::RetryAfter => "retry_after",
            Reason::BreakerOpen => "breaker_open",
            Reason::ConnectionBudget => "connection_budget",
            Reason::Rate => "rate",
        }
    }

    fn index(self) -> usize {
        match self {
            Reason::InFlightLimit { .. } => 0,
            Reason::RetryAfter => 1,
            Reason::BreakerOpen => 2,
            Reason::ConnectionBudget => 3,
            Reason::Rate => 4,
        }
    }

    /// Every reason, for the metrics.
    pub const ALL: [&'static str; 5] = [
        "in_flight_limit",
        "retry_after",
        "breaker_open",
        "connection_budget",
        "rate",
    ];
}

/// A refusal: why, and when a retry may go (the answer's `Retry-After`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused {
    /// Why.
    pub reason: Reason,
    /// Whole seconds, at least 1: when the hold or the cool-down ends, rounded
    /// up; 1 when nothing says (a full route, a probe out).
    pub retry_after_secs: u64,
    /// How long a queued attempt waits before it tries again: the next
    /// token's time for a rate, else `retry_after_secs`.
    pub wait: Duration,
}

impl Refused {
    fn after(reason: Reason, retry_after_secs: u64) -> Refused {
        Refused {
            reason,
            retry_after_secs,
            wait: Duration::from_secs(retry_after_secs),
        }
    }
}

/// Whole seconds until `until`, rounded up, at least 1.
fn secs_until(until: Instant, now: Instant) -> u64 {
    let d = until.saturating_duration_since(now);
    (d.as_millis().div_ceil(1000) as u64).max(1)
}

/// One route's protection state (see the module docs).
#[derive(Debug)]
pub struct Guard {
    in_flight: AtomicUsize,
    /// Held until `base` plus this many ms (0: not held). An atomic: a route
    /// without a breaker takes no lock per request.
    held_until_ms: AtomicU64,
    /// The longest hold an answer sets now, in ms (0: `honor_retry_after` is
    /// off). The route's current keys, not its requests' admission-time ones:
    /// a request in flight across a reload holds no longer than the new keys say.
    hold_cap_ms: AtomicU64,
    base: Instant,
    breaker: Mutex<BreakerCell>,
    /// The `rate`'s bucket (only a route with a rate takes this lock).
    bucket: Mutex<Option<rate::Bucket>>,
    counts: Arc<Counts>,
}

/// The breaker and the settings it runs with now (a reload changes them).
#[derive(Debug, Default)]
struct BreakerCell {
    breaker: Breaker,
    cfg: Option<BreakerConfig>,
}

/// Counters since start-up: shared by the route's successive guards, so that a
/// reload (even one changing the upstream) never makes one go down.
#[derive(Debug, Default)]
struct Counts {
    refused: [AtomicU64; 5],
    opened: AtomicU64,
}

/// "For ever" for a hold: a century (a longer one cannot be an `Instant`).
const FAR: Duration = Duration::from_secs(100 * 365 * 86_400);

fn cap_ms(s: &Settings) -> u64 {
    if s.honor_retry_after {
        u64::try_from(s.max_retry_after.as_millis())
            .unwrap_or(u64::MAX)
            .max(1)
    } else {
        0
    }
}

impl Guard {
    /// A fresh state for a route with keys `s`.
    pub fn new(s: &Settings) -> Guard {
        Guard {
            in_flight: AtomicUsize::new(0),
            held_until_ms: AtomicU64::new(0),
            hold_cap_ms: AtomicU64::new(cap_ms(s)),
            base: Instant::now(),
            breaker: Mutex::new(BreakerCell {
                breaker: Breaker::default(),
                cfg: s.breaker,
            }),
            bucket: Mutex::new(None),
            counts: Arc::default(),
        }
    }

    /// A fresh state (a route whose upstream changed) that goes on counting
    /// where `old` is.
    pub fn continuing(old: &Guard, s: &Settings) -> Guard {
        Guard {
            counts: old.counts.clone(),
            ..Guard::new(s)
        }
    }

    /// Lets a request through, or says why not. A request let through counts in
    /// flight until its [`Slot`] drops. A route neither held nor with a breaker
    /// pays two atomic operations and no clock read.
    pub fn enter(self: &Arc<Self>, s: &Settings) -> Result<Ticket, Refused> {
        self.try_enter(s).inspect_err(|r| {
            self.counts.refused[r.reason.index()].fetch_add(1, Ordering::Relaxed);
        })
    }

    fn try_enter(self: &Arc<Self>, s: &Settings) -> Result<Ticket, Refused> {
        // One read of the hold: a route not held, without a breaker or a rate,
        // reads no clock.
        let held_ms = self.held_until_ms.load(Ordering::Acquire);
        let timed = s.breaker.is_some() || s.rate.is_some() || held_ms != 0;
        let now = if timed { Instant::now() } else { self.base };
        let until = self.at(held_ms);
        if held_ms != 0 && now < until && s.honor_retry_after {
            return Err(Refused::after(Reason::RetryAfter, secs_until(until, now)));
        }
        let full = || {
            Refused::after(
                Reason::InFlightLimit {
                    limit: s.max_in_flight.unwrap_or_default(),
                },
                1,
            )
        };
        let open = |until: Option<Instant>| {
            Refused::after(Reason::BreakerOpen, until.map_or(1, |u| secs_until(u, now)))
        };
        let (slot, entry) = match s.breaker {
            None => {
                let slot = self.take_slot(s.max_in_flight).ok_or_else(full)?;
                self.take_token(s, now)?;
                (slot, None)
            }
            Some(_) => {
                let mut cell = self.lock_breaker();
                // An open breaker says so (with its cool-down) even on a full route.
                if let Some(until) = cell.breaker.open_until(now) {
                    return Err(open(Some(until)));
                }
                let slot = self.take_slot(s.max_in_flight).ok_or_else(full)?;
                // A token before the breaker's probe: a rate refusal spends no probe.
                self.take_token(s, now)?;
                match cell.breaker.enter(now) {
                    Entry::Refused(until) => {
                        self.give_token(s);
                        return Err(open(until));
                    }
                    e => (slot, Some(e)),
                }
            }
        };
        Ok(Ticket {
            guard: self.clone(),
            slot: Some(slot),
            entry,
        })
    }

    /// Takes a token of the route's `rate`, if it has one.
    fn take_token(&self, s: &Settings, now: Instant) -> Result<(), Refused> {
        let Some((rate, burst)) = s.rate else {
            return Ok(());
        };
        let mut bucket = self.bucket.lock().unwrap_or_else(|p| p.into_inner());
        let b = bucket.get_or_insert_with(|| rate::Bucket::new(burst, now));
        b.take(rate, burst, now).map_err(|wait| Refused {
            reason: Reason::Rate,
            retry_after_secs: (wait.as_millis().div_ceil(1000) as u64).max(1),
            wait,
        })
    }

    fn give_token(&self, s: &Settings) {
        if let Some((_, burst)) = s.rate {
            if let Some(b) = self
                .bucket
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_mut()
            {
                b.give_back(burst);
            }
        }
    }

    /// Counts a refusal for the instance's upstream budget and says so: taken
    /// before the route's own checks, nothing of the route's state is touched.
    pub fn refuse_for_budget(&self) -> Refused {
        self.counts.refused[Reason::ConnectionBudget.index()].fetch_add(1, Ordering::Relaxed);
        Refused::after(Reason::ConnectionBudget, 1)
    }

    fn take_slot(self: &Arc<Self>, limit: Option<usize>) -> Option<Slot> {
        let Some(max) = limit else {
            return Some(self.counted());
        };
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()?;
        Some(Slot {
            guard: self.clone(),
            budget: None,
        })
    }

    /// A slot counted now, whatever the limit.
    fn counted(self: &Arc<Self>) -> Slot {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        Slot {
            guard: self.clone(),
            budget: None,
        }
    }

    fn lock_breaker(&self) -> crate::lock_order::Ordered<'_, BreakerCell> {
        crate::lock_order::lock("route breaker", &self.breaker)
    }

    /// `base` plus `ms` (never past what an `Instant` holds).
    fn at(&self, ms: u64) -> Instant {
        let d = Duration::from_millis(ms);
        self.base
            .checked_add(d)
            .or_else(|| self.base.checked_add(FAR))
            .unwrap_or(self.base)
    }

    fn held_until(&self, now: Instant) -> Option<Instant> {
        let ms = self.held_until_ms.load(Ordering::Acquire);
        let until = self.at(ms);
        (ms != 0 && now < until).then_some(until)
    }

    /// Holds the route for `d` from `now` (at most [`FAR`]), unless it is held
    /// longer already.
    fn hold(&self, now: Instant, d: Duration) {
        let until = now.saturating_duration_since(self.base) + d.min(FAR);
        let ms = u64::try_from(until.as_millis()).unwrap_or(u64::MAX).max(1);
        self.held_until_ms.fetch_max(ms, Ordering::AcqRel);
    }

    /// A result for the breaker, under the settings it runs with now.
    fn record(&self, entry: Entry, ok: bool, now: Instant) {
        let mut cell = self.lock_breaker();
        if let Some(cfg) = cell.cfg {
            if cell.breaker.record(entry, ok, now, &cfg) {
                self.counts.opened.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// A reload changed the route's keys (same name, same upstream): the state
    /// stays, except what a key turned off — no hold without
    /// `honor_retry_after`, a hold no longer than the new `max_retry_after`, a
    /// breaker closed afresh when its settings changed (its counters go on). A
    /// request in flight reports under the new keys.
    pub fn reconfigured(&self, old: &Settings, new: &Settings) {
        self.hold_cap_ms.store(cap_ms(new), Ordering::Release);
        if !new.honor_retry_after {
            self.held_until_ms.store(0, Ordering::Release);
        } else if new.max_retry_after < old.max_retry_after {
            let now = Instant::now();
            if let Some(until) = self.held_until(now) {
                if until.duration_since(now) > new.max_retry_after {
                    self.held_until_ms.store(0, Ordering::Release);
                    self.hold(now, new.max_retry_after);
                }
            }
        }
        let mut cell = self.lock_breaker();
        if new.breaker != old.breaker {
            cell.breaker.reset();
        }
        cell.cfg = new.breaker;
        if new.rate != old.rate {
            // A new rate starts with a full bucket of its own burst.
            *self.bucket.lock().unwrap_or_else(|p| p.into_inner()) = None;
        }
    }

    /// What the admin API, the page and the metrics show.
    pub fn view(&self, s: &Settings, now: Instant) -> View {
        let b = s.breaker.map(|_| {
            let cell = self.lock_breaker();
            let b = &cell.breaker;
            BreakerView {
                state: b.state(now),
                failures: b.failures(),
                open_for: b.open_until(now).map(|u| u.duration_since(now)),
                opened: self.counts.opened.load(Ordering::Relaxed),
            }
        });
        View {
            in_flight: self.in_flight.load(Ordering::Acquire),
            held_for: self.held_until(now).map(|u| u.duration_since(now)),
            breaker: b,
            refused: std::array::from_fn(|i| self.counts.refused[i].load(Ordering::Relaxed)),
        }
    }
}

/// A request's place in flight at the upstream, and its share of the
/// instance's upstream budget: both released when dropped.
#[derive(Debug)]
pub struct Slot {
    guard: Arc<Guard>,
    budget: Option<crate::budget::UpstreamSlot>,
}

impl Slot {
    /// Keeps counting for `d` (the route's drain timeout), then is released: a
    /// request whose outcome is unknown may still be running at the destination
    /// (SPEC §5). Released at once outside a runtime. Its share of the
    /// instance's upstream budget is given back now: an unknown outcome's
    /// connection was cut, and the budget counts sockets, not the
    /// destination's work.
    fn linger(mut self, d: Duration) {
        self.budget = None;
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                tokio::time::sleep(d).await;
                drop(self);
            });
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.guard.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A request let through: report how it ended ([`Ticket::answered`],
/// [`Ticket::failed`]) — under the route's keys at that time, not at its
/// admission. Dropped without a report (a replay, a drain abort before sending),
/// it counts for nothing and a probe goes back.
#[derive(Debug)]
pub struct Ticket {
    guard: Arc<Guard>,
    slot: Option<Slot>,
    entry: Option<Entry>,
}

impl Ticket {
    /// Holds `budget` (the instance's upstream share) with this request's slot,
    /// for as long as the slot is held.
    pub fn hold(&mut self, budget: crate::budget::UpstreamSlot) {
        if let Some(slot) = self.slot.as_mut() {
            slot.budget = Some(budget);
        }
    }

    /// The upstream answered `status`: a 5xx is a failure for the breaker, a
    /// 429 or 503 with `Retry-After` holds the route (when honoured; `wall` is
    /// read only for a date). The slot is returned: in flight until the
    /// exchange is over.
    pub fn answered(
        mut self,
        status: StatusCode,
        headers: &HeaderMap,
        wall: impl FnOnce() -> SystemTime,
    ) -> Slot {
        if let Some(entry) = self.entry.take() {
            self.guard
                .record(entry, !status.is_server_error(), Instant::now());
        }
        let asks = matches!(
            status,
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
        );
        let cap = self.guard.hold_cap_ms.load(Ordering::Acquire);
        if asks && cap != 0 && headers.contains_key(RETRY_AFTER) {
            if let Some(d) = retry_after::delay(headers, wall()) {
                self.guard
                    .hold(Instant::now(), d.min(Duration::from_millis(cap)));
            }
        }
        self.slot.take().unwrap_or_else(|| self.guard.counted())
    }

    /// The exchange failed. `upstream` is whether the upstream is to blame (no
    /// connection, a timeout, a reset): a failure for the breaker. A drain abort,
    /// shutdown or the worker's own body failing or stalling is not. `linger`:
    /// the outcome is unknown, so the request keeps its slot that long (the
    /// drain timeout, as its pass keeps counting for a drain, SPEC §5).
    pub fn failed(mut self, upstream: bool, linger: Option<Duration>) {
        if upstream {
            if let Some(entry) = self.entry.take() {
                self.guard.record(entry, false, Instant::now());
            }
        }
        if let (Some(d), Some(slot)) = (linger, self.slot.take()) {
            slot.linger(d);
        }
    }

    /// Stopped by fencegate (a drain abort) after it may have been sent: not a
    /// result, but a probe may still be running at the destination, so it stays
    /// out for `d` (the drain timeout) before the next request may probe. Outside
    /// a runtime it goes back at once.
    pub fn cut_off(mut self, d: Duration) {
        let Some(entry @ Entry::Probe(_)) = self.entry else {
            return;
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        self.entry = None;
        let guard = self.guard.clone();
        rt.spawn(async move {
            tokio::time::sleep(d).await;
            guard.lock_breaker().breaker.probe_unused(entry);
        });
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(entry) = self.entry.take() {
            self.guard.lock_breaker().breaker.probe_unused(entry);
        }
    }
}

/// A route's protection as shown.
#[derive(Debug, Clone)]
pub struct View {
    /// Requests at the upstream now.
    pub in_flight: usize,
    /// How long the route stays held by a `Retry-After`, if it is.
    pub held_for: Option<Duration>,
    /// The breaker, if the route has one.
    pub breaker: Option<BreakerView>,
    /// Refusals since start-up, by [`Reason::ALL`].
    pub refused: [u64; 5],
}

/// A breaker as shown.
#[derive(Debug, Clone)]
pub struct BreakerView {
    /// Closed, open or half-open.
    pub state: BreakerState,
    /// Consecutive failures counted toward opening (while closed).
    pub failures: usize,
    /// How long it stays open, if it is.
    pub open_for: Option<Duration>,
    /// Times it opened.
    pub opened: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> Settings {
        Settings {
            max_in_flight: Some(2),
            honor_retry_after: true,
            max_retry_after: Duration::from_secs(60),
            breaker: None,
            rate: None,
        }
    }

    /// A rate refuses past its burst with the next token's time, and a
    /// refusal by another check (the in-flight limit) spends no token.
    #[tokio::test(start_paused = true)]
    async fn a_rate_refuses_past_its_burst_and_other_refusals_spend_no_token() {
        let s = Settings {
            max_in_flight: Some(1),
            rate: Some((rate::Rate::parse("2/s").unwrap(), 2)),
            ..settings()
        };
        let g = Arc::new(Guard::new(&s));
        let a = g.enter(&s).unwrap();
        // Full: refused by the limit, not the rate; no token spent.
        let r = g.enter(&s).unwrap_err();
        assert_eq!(r.reason, Reason::InFlightLimit { limit: 1 });
        drop(a);
        let b = g.enter(&s).unwrap();
        drop(b);
        let r = g.enter(&s).unwrap_err();
        assert_eq!(r.reason, Reason::Rate);
        assert_eq!(
            (r.retry_after_secs, r.wait),
            (1, Duration::from_millis(500))
        );
        tokio::time::advance(Duration::from_millis(500)).await;
        assert!(g.enter(&s).is_ok());
        assert_eq!(g.view(&s, Instant::now()).refused[Reason::Rate.index()], 1);
    }

    #[test]
    fn the_limit_counts_slots_until_they_drop() {
        let g = Arc::new(Guard::new(&settings()));
        let now = Instant::now();
        let a = g.enter(&settings()).unwrap();
        let b = g.enter(&settings()).unwrap();
        let r = g.enter(&settings()).unwrap_err();
        assert_eq!(r.reason, Reason::InFlightLimit { limit: 2 });
        assert_eq!(r.retry_after_secs, 1);
        // An answered request stays in flight until its slot drops.
        let slot = a.answered(StatusCode::OK, &HeaderMap::new(), || SystemTime::UNIX_EPOCH);
        assert!(g.enter(&settings()).is_err());
        drop(slot);
        drop(b);
        assert_eq!(g.view(&settings(), now).in_flight, 0);
        assert_eq!(g.view(&settings(), now).refused, [2, 0, 0, 0, 0]);
    }

    #[test]
    fn a_retry_after_holds_up_to_the_cap_and_only_when_honoured() {
        let mut s = settings();
        s.max_retry_after = Duration::from_secs(10);
        let g = Arc::new(Guard::new(&s));
        let mut h = HeaderMap::new();
        h.insert(http::header::RETRY_AFTER, "3600".parse().unwrap());
        let t = g.enter(&s).unwrap();
        drop(t.answered(StatusCode::TOO_MANY_REQUESTS, &h, || SystemTime::UNIX_EPOCH));
        let r = g.enter(&s).unwrap_err();
        assert_eq!(r.reason, Reason::RetryAfter);
        assert!((9..=10).contains(&r.retry_after_secs), "{r:?}");
        // A 200 with Retry-After holds nothing; turning honouring off lifts it.
        let off = Settings {
            honor_retry_after: false,
            ..s
        };
        assert!(g.enter(&off).is_ok());
        g.reconfigured(&s, &off);
        assert!(g.enter(&s).is_ok());
    }

    #[test]
    fn a_ticket_reports_under_the_keys_of_a_reload_since_its_admission() {
        let s = settings();
        let g = Arc::new(Guard::new(&s));
        let mut h = HeaderMap::new();
        h.insert(http::header::RETRY_AFTER, "300".parse().unwrap());
        let t = g.enter(&s).unwrap();
        let short = Settings {
            max_retry_after: Duration::from_secs(2),
            ..s
        };
        g.reconfigured(&s, &short);
        drop(t.answered(StatusCode::SERVICE_UNAVAILABLE, &h, || {
            SystemTime::UNIX_EPOCH
        }));
        let r = g.enter(&short).unwrap_err();
        assert!(r.retry_after_secs <= 2, "{r:?}");
        // Not honoured any more: an answer in flight across the reload holds nothing.
        let off = Settings {
            honor_retry_after: false,
            ..short
        };
        g.reconfigured(&short, &off);
        let t = g.enter(&off).unwrap();
        drop(t.answered(StatusCode::SERVICE_UNAVAILABLE, &h, || {
            SystemTime::UNIX_EPOCH
        }));
        assert_eq!(g.view(&off, Instant::now()).held_for, None);
    }

    #[tokio::test(start_paused = true)]
    async fn an_unknown_outcome_keeps_its_slot_for_the_drain_timeout() {
        let mut s = settings();
        s.max_in_flight = Some(1);
        let g = Arc::new(Guard::new(&s));
        g.enter(&s)
            .unwrap()
            .failed(true, Some(Duration::from_secs(5)));
        let r = g.enter(&s).unwrap_err();
        assert_eq!(r.reason, Reason::InFlightLimit { limit: 1 });
        tokio::time::sleep(Duration::from_secs(6)).await;
        // A failure known to have left nothing running gives its slot back at once.
        g.enter(&s).unwrap().failed(true, None);
        assert!(g.enter(&s).is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn an_unknown_outcome_gives_its_budget_place_back_at_once() {
        let mut s = settings();
        s.max_in_flight = Some(1);
        let g = Arc::new(Guard::new(&s));
        let budget = crate::budget::Upstreams::new(&crate::budget::Budget {
            limit: 1024,
            reserved: 0,
            admin_connections: 8,
            client_connections: 8,
            upstream_requests: 1,
            idle_per_host: 1,
            clients_lowered: false,
        });
        let mut t = g.enter(&s).unwrap();
        t.hold(budget.try_slot().unwrap());
        assert!(budget.try_slot().is_none());
        t.failed(true, Some(Duration::from_secs(5)));
        // The route's slot lingers (the destination may still run it); the
        // socket was cut, so the instance's place does not.
        assert!(g.enter(&s).is_err());
        assert!(budget.try_slot().is_some());
    }

    #[test]
    fn counters_go_on_across_a_fresh_guard_and_a_breaker_reset() {
        let cfg = BreakerConfig {
            failures: 1,
            window: Duration::from_secs(10),
            cool_down: Duration::from_secs(60),
        };
        let s = Settings {
            breaker: Some(cfg),
            ..settings()
        };
        let g = Arc::new(Guard::new(&s));
        g.enter(&s).unwrap().failed(true, None);
        assert_eq!(g.enter(&s).unwrap_err().reason, Reason::BreakerOpen);
        let longer = Settings {
            breaker: Some(BreakerConfig {
                cool_down: Duration::from_secs(120),
                ..cfg
            }),
            ..s
        };
        g.reconfigured(&s, &longer);
        let v = g.view(&longer, Instant::now());
        let b = v.breaker.unwrap();
        assert_eq!(
            (b.state, b.opened, v.refused),
            (BreakerState::Closed, 1, [0, 0, 1, 0, 0])
        );
        let fresh = Guard::continuing(&g, &longer);
        let v = fresh.view(&longer, Instant::now());
        assert_eq!((v.breaker.unwrap().opened, v.refused), (1, [0, 0, 1, 0, 0]));
    }

    #[test]
    fn a_huge_hold_saturates() {
        let g = Arc::new(Guard::new(&settings()));
        g.hold(Instant::now(), Duration::MAX);
        let r = g.enter(&settings()).unwrap_err();
        assert_eq!(r.reason, Reason::RetryAfter);
    }

    #[tokio::test(start_paused = true)]
    async fn a_probe_cut_off_by_a_drain_abort_stays_out_for_the_drain_timeout() {
        let s = Settings {
            breaker: Some(BreakerConfig {
                failures: 1,
                window: Duration::from_secs(10),
                cool_down: Duration::from_secs(1),
            }),
            ..settings()
        };
        let g = Arc::new(Guard::new(&s));
        g.enter(&s).unwrap().failed(true, None);
        tokio::time::sleep(Duration::from_secs(2)).await;
        g.enter(&s).unwrap().cut_off(Duration::from_secs(5));
        let r = g.enter(&s).unwrap_err();
        assert_eq!((r.reason, r.retry_after_secs), (Reason::BreakerOpen, 1));
        tokio::time::sleep(Duration::from_secs(6)).await;
        let probe = g.enter(&s).unwrap();
        drop(probe.answered(StatusCode::OK, &HeaderMap::new(), || SystemTime::UNIX_EPOCH));
        let b = g.view(&s, Instant::now()).breaker.unwrap();
        assert_eq!(b.state, BreakerState::Closed);
    }

    #[test]
    fn a_full_route_with_an_open_breaker_says_breaker_open_with_the_cool_down() {
        let s = Settings {
            breaker: Some(BreakerConfig {
                failures: 1,
                window: Duration::from_secs(10),
                cool_down: Duration::from_secs(60),
            }),
            ..settings()
        };
        let g = Arc::new(Guard::new(&s));
        let _a = g.enter(&s).unwrap();
        let b = g.enter(&s).unwrap();
        let _b = b.answered(StatusCode::INTERNAL_SERVER_ERROR, &HeaderMap::new(), || {
            SystemTime::UNIX_EPOCH
        });
        let r = g.enter(&s).unwrap_err();
        assert_eq!(r.reason, Reason::BreakerOpen);
        assert!((59..=60).contains(&r.retry_after_secs), "{r:?}");
    }
}
