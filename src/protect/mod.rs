//! Protecting the destination (SPEC §7 `upstream_held`, §9): per route, a limit
//! on requests at the upstream at once (`max_in_flight`), a hold while a 429 or
//! 503's `Retry-After` runs (`honor_retry_after`, capped by `max_retry_after`),
//! and a circuit breaker (`breaker`, [`breaker`]).
//!
//! Each is a refusal *before* forwarding, decided after admission and before the
//! dedup claim (`proxy`): a refused request forwards nothing and records nothing,
//! so a worker's key stays free and no rule of SPEC §4–§6 changes. A request let
//! through holds a [`Ticket`]; its answer (or failure) is reported back, and its
//! [`Slot`] counts it in flight until its exchange with the upstream is over at
//! both ends (the same span a drain waits for, SPEC §5).
//!
//! The state ([`Guard`]) is per route and kept across a reload while the route's
//! name and upstream stay the same (`RouteTable::carry_over`): a reload does not
//! forget a destination that asked for quiet, nor release requests it has. It is
//! this instance's: in a cluster each shard's owner keeps its own.

pub mod breaker;
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
}

impl Settings {
    /// The keys of route `cfg`.
    pub fn of(cfg: &RouteConfig) -> Settings {
        Settings {
            max_in_flight: cfg.max_in_flight,
            honor_retry_after: cfg.honor_retry_after,
            max_retry_after: cfg.max_retry_after,
            breaker: cfg.breaker,
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
}

impl Reason {
    /// `detail` in the error's body: stable, for programs.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::InFlightLimit { .. } => "in_flight_limit",
            Reason::RetryAfter => "retry_after",
            Reason::BreakerOpen => "breaker_open",
        }
    }

    fn index(self) -> usize {
        match self {
            Reason::InFlightLimit { .. } => 0,
            Reason::RetryAfter => 1,
            Reason::BreakerOpen => 2,
        }
    }

    /// Every reason, for the metrics.
    pub const ALL: [&'static str; 3] = ["in_flight_limit", "retry_after", "breaker_open"];
}

/// A refusal: why, and when a retry may go (the answer's `Retry-After`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused {
    /// Why.
    pub reason: Reason,
    /// Whole seconds, at least 1: when the hold or the cool-down ends, rounded
    /// up; 1 when nothing says (a full route, a probe out).
    pub retry_after_secs: u64,
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
    base: Instant,
    breaker: Mutex<Breaker>,
    refused: [AtomicU64; 3],
}

impl Default for Guard {
    fn default() -> Guard {
        Guard {
            in_flight: AtomicUsize::new(0),
            held_until_ms: AtomicU64::new(0),
            base: Instant::now(),
            breaker: Mutex::new(Breaker::default()),
            refused: Default::default(),
        }
    }
}

impl Guard {
    /// Lets a request through, or says why not. A request let through counts in
    /// flight until its [`Slot`] drops. A route neither held nor with a breaker
    /// pays two atomic operations and no clock read.
    pub fn enter(self: &Arc<Self>, s: &Settings) -> Result<Ticket, Refused> {
        self.try_enter(s).inspect_err(|r| {
            self.refused[r.reason.index()].fetch_add(1, Ordering::Relaxed);
        })
    }

    fn try_enter(self: &Arc<Self>, s: &Settings) -> Result<Ticket, Refused> {
        // One read of the hold: a route not held and without a breaker reads no clock.
        let held_ms = self.held_until_ms.load(Ordering::Acquire);
        let timed = s.breaker.is_some() || held_ms != 0;
        let now = if timed { Instant::now() } else { self.base };
        let until = self.base + Duration::from_millis(held_ms);
        if held_ms != 0 && now < until && s.honor_retry_after {
            return Err(Refused {
                reason: Reason::RetryAfter,
                retry_after_secs: secs_until(until, now),
            });
        }
        let slot = self.take_slot(s.max_in_flight).ok_or(Refused {
            reason: Reason::InFlightLimit {
                limit: s.max_in_flight.unwrap_or_default(),
            },
            retry_after_secs: 1,
        })?;
        let entry = match s.breaker {
            None => None,
            Some(_) => match self.lock_breaker().enter(now) {
                Entry::Refused(until) => {
                    return Err(Refused {
                        reason: Reason::BreakerOpen,
                        retry_after_secs: until.map_or(1, |u| secs_until(u, now)),
                    })
                }
                e => Some(e),
            },
        };
        Ok(Ticket {
            guard: self.clone(),
            slot: Some(slot),
            entry,
            settings: *s,
        })
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
        Some(Slot(self.clone()))
    }

    /// A slot counted now, whatever the limit.
    fn counted(self: &Arc<Self>) -> Slot {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        Slot(self.clone())
    }

    fn lock_breaker(&self) -> crate::lock_order::Ordered<'_, Breaker> {
        crate::lock_order::lock("route breaker", &self.breaker)
    }

    fn held_until(&self, now: Instant) -> Option<Instant> {
        let ms = self.held_until_ms.load(Ordering::Acquire);
        let until = self.base + Duration::from_millis(ms);
        (ms != 0 && now < until).then_some(until)
    }

    /// Holds the route for `d` from `now`, unless it is held longer already.
    fn hold(&self, now: Instant, d: Duration) {
        let until = now.saturating_duration_since(self.base) + d;
        let ms = u64::try_from(until.as_millis()).unwrap_or(u64::MAX).max(1);
        self.held_until_ms.fetch_max(ms, Ordering::AcqRel);
    }

    /// A reload changed the route's keys (same name, same upstream): the state
    /// stays, except what a key turned off — no hold without
    /// `honor_retry_after`, a hold no longer than the new `max_retry_after`, a
    /// fresh breaker when its settings changed.
    pub fn reconfigured(&self, old: &Settings, new: &Settings) {
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
        if new.breaker != old.breaker {
            *self.lock_breaker() = Breaker::default();
        }
    }

    /// What the admin API, the page and the metrics show.
    pub fn view(&self, s: &Settings, now: Instant) -> View {
        let b = s.breaker.map(|_| {
            let b = self.lock_breaker();
            BreakerView {
                state: b.state(now),
                failures: b.failures(),
                open_for: b.open_until(now).map(|u| u.duration_since(now)),
                opened: b.opened,
            }
        });
        View {
            in_flight: self.in_flight.load(Ordering::Acquire),
            held_for: self.held_until(now).map(|u| u.duration_since(now)),
            breaker: b,
            refused: std::array::from_fn(|i| self.refused[i].load(Ordering::Relaxed)),
        }
    }
}

/// A request's place in flight at the upstream: released when dropped.
#[derive(Debug)]
pub struct Slot(Arc<Guard>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A request let through: report how it ended ([`Ticket::answered`],
/// [`Ticket::failed`]). Dropped without a report (a replay, a drain abort before
/// sending), it counts for nothing and a probe goes back.
#[derive(Debug)]
pub struct Ticket {
    guard: Arc<Guard>,
    slot: Option<Slot>,
    entry: Option<Entry>,
    settings: Settings,
}

impl Ticket {
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
        if self.entry.is_some() {
            self.report(!status.is_server_error(), Instant::now());
        }
        let asks = matches!(
            status,
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
        );
        if asks && self.settings.honor_retry_after && headers.contains_key(RETRY_AFTER) {
            if let Some(d) = retry_after::delay(headers, wall()) {
                let cap = self.settings.max_retry_after;
                self.guard.hold(Instant::now(), d.min(cap));
            }
        }
        self.slot.take().unwrap_or_else(|| self.guard.counted())
    }

    /// The exchange failed. `upstream` is whether the upstream is to blame (no
    /// connection, a timeout, a reset): a failure for the breaker. A drain abort,
    /// shutdown or the worker's own body failing is not.
    pub fn failed(mut self, upstream: bool) {
        if upstream {
            self.report(false, Instant::now());
        }
    }

    fn report(&mut self, ok: bool, now: Instant) {
        if let (Some(entry), Some(cfg)) = (self.entry.take(), &self.settings.breaker) {
            self.guard.lock_breaker().record(entry, ok, now, cfg);
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(entry) = self.entry.take() {
            self.guard.lock_breaker().probe_unused(entry);
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
    pub refused: [u64; 3],
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
        }
    }

    #[test]
    fn the_limit_counts_slots_until_they_drop() {
        let g = Arc::new(Guard::default());
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
        assert_eq!(g.view(&settings(), now).refused, [2, 0, 0]);
    }

    #[test]
    fn a_retry_after_holds_up_to_the_cap_and_only_when_honoured() {
        let g = Arc::new(Guard::default());
        let mut s = settings();
        s.max_retry_after = Duration::from_secs(10);
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
}
