//! A route's circuit breaker (SPEC §9 `breaker`), as a pure state machine over
//! instants the caller passes in: closed → `failures` consecutive upstream
//! failures within `window` → open for `cool_down` → half-open, where exactly one
//! request (the probe) is let through → closed on its success, open again on its
//! failure. Results of requests let through while closed that end after the
//! breaker opened (or was reset by a reload) are ignored, even once it has closed
//! again: only the probe decides, and a closed run counts only its own requests.

use std::collections::VecDeque;

use tokio::time::Instant;

use crate::config::BreakerConfig;

/// Where the breaker stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Forwarding.
    Closed,
    /// Refusing until the cool-down ends.
    Open,
    /// Cool-down over: one probe at a time decides.
    HalfOpen,
}

impl BreakerState {
    /// The name the metrics, the admin API and the page use.
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }
}

/// What a request may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    /// Forward it; its result counts while the breaker is still in the closed
    /// run (numbered so) that let it through.
    Normal(u64),
    /// Forward it as the probe numbered so (its result closes or reopens).
    Probe(u64),
    /// Refuse it; the breaker is open until then (`None`: a probe is out).
    Refused(Option<Instant>),
}

/// The breaker's state and its recent failures.
#[derive(Debug)]
pub struct Breaker {
    state: Inner,
    /// Probes handed out so far: a result from an older one is ignored.
    probes: u64,
    /// Closed runs so far (each open or reset ends one): a result of a request
    /// let through by an earlier run is ignored.
    run: u64,
}

#[derive(Debug)]
enum Inner {
    /// The instants of the current run of consecutive failures (at most `failures`).
    Closed(VecDeque<Instant>),
    Open {
        until: Instant,
    },
    HalfOpen {
        probe_out: bool,
    },
}

impl Default for Breaker {
    fn default() -> Breaker {
        Breaker {
            state: Inner::Closed(VecDeque::new()),
            probes: 0,
            run: 0,
        }
    }
}

impl Breaker {
    /// The state now (an open breaker whose cool-down is over reads half-open).
    pub fn state(&self, now: Instant) -> BreakerState {
        match self.state {
            Inner::Closed(_) => BreakerState::Closed,
            Inner::Open { until } if now < until => BreakerState::Open,
            Inner::Open { .. } | Inner::HalfOpen { .. } => BreakerState::HalfOpen,
        }
    }

    /// Until when it stays open, if it is open now.
    pub fn open_until(&self, now: Instant) -> Option<Instant> {
        match self.state {
            Inner::Open { until } if now < until => Some(until),
            _ => None,
        }
    }

    /// Consecutive failures counted toward opening it.
    pub fn failures(&self) -> usize {
        match &self.state {
            Inner::Closed(run) => run.len(),
            _ => 0,
        }
    }

    /// Whether a request may go now; a half-open breaker hands out one probe.
    pub fn enter(&mut self, now: Instant) -> Entry {
        match &mut self.state {
            Inner::Closed(_) => Entry::Normal(self.run),
            Inner::Open { until } if now < *until => Entry::Refused(Some(*until)),
            Inner::HalfOpen { probe_out: true } => Entry::Refused(None),
            Inner::Open { .. } | Inner::HalfOpen { probe_out: false } => {
                self.state = Inner::HalfOpen { probe_out: true };
                self.probes += 1;
                Entry::Probe(self.probes)
            }
        }
    }

    /// A request's result: `ok` is false for an upstream failure. Says whether
    /// it opened the breaker (for the `opened` counter, kept by the caller).
    #[must_use]
    pub fn record(&mut self, entry: Entry, ok: bool, now: Instant, cfg: &BreakerConfig) -> bool {
        match (entry, &mut self.state) {
            (Entry::Normal(r), Inner::Closed(run)) if r == self.run => {
                if ok {
                    run.clear();
                    return false;
                }
                run.push_back(now);
                while run.len() > cfg.failures as usize {
                    run.pop_front();
                }
                // Only failures within `window` of the latest count.
                while run
                    .front()
                    .is_some_and(|first| now.duration_since(*first) > cfg.window)
                {
                    run.pop_front();
                }
                if run.len() >= cfg.failures as usize {
                    self.open(now, cfg);
                    return true;
                }
                false
            }
            (Entry::Probe(n), Inner::HalfOpen { .. }) if n == self.probes => {
                if ok {
                    self.state = Inner::Closed(VecDeque::new());
                    false
                } else {
                    self.open(now, cfg);
                    true
                }
            }
            _ => false,
        }
    }

    /// Its settings changed (a reload): closed, as new, but results of requests
    /// let through before are ignored and probe numbers go on.
    pub fn reset(&mut self) {
        self.state = Inner::Closed(VecDeque::new());
        self.run += 1;
    }

    /// A probe that ended without a result (not forwarded after all, or stopped
    /// by fencegate): the next request probes instead.
    pub fn probe_unused(&mut self, entry: Entry) {
        if let (Entry::Probe(n), Inner::HalfOpen { probe_out }) = (entry, &mut self.state) {
            if n == self.probes {
                *probe_out = false;
            }
        }
    }

    /// Opens it for `cool_down`: a cool-down past what an `Instant` can hold
    /// (config validation bounds it; this never panics) is open "for ever".
    fn open(&mut self, now: Instant, cfg: &BreakerConfig) {
        let until = now
            .checked_add(cfg.cool_down)
            .or_else(|| now.checked_add(FAR))
            .unwrap_or(now);
        self.state = Inner::Open { until };
        self.run += 1;
    }
}

/// "For ever" for an instant: a century.
const FAR: std::time::Duration = std::time::Duration::from_secs(100 * 365 * 86_400);

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn cfg() -> BreakerConfig {
        BreakerConfig {
            failures: 3,
            window: Duration::from_secs(10),
            cool_down: Duration::from_secs(5),
        }
    }

    fn fail(b: &mut Breaker, now: Instant) {
        let e = b.enter(now);
        assert!(matches!(e, Entry::Normal(_)));
        let _ = b.record(e, false, now, &cfg());
    }

    #[test]
    fn opens_after_consecutive_failures_within_the_window_only() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut b = Breaker::default();
        fail(&mut b, t0);
        fail(&mut b, t0 + s);
        // A success ends the run.
        let _ = b.record(Entry::Normal(0), true, t0 + 2 * s, &cfg());
        fail(&mut b, t0 + 3 * s);
        fail(&mut b, t0 + 4 * s);
        // Too far apart: the first falls out of the window.
        fail(&mut b, t0 + 15 * s);
        assert_eq!(b.state(t0 + 15 * s), BreakerState::Closed);
        assert_eq!(b.failures(), 1);
        fail(&mut b, t0 + 16 * s);
        fail(&mut b, t0 + 17 * s);
        assert_eq!(b.state(t0 + 17 * s), BreakerState::Open);
        assert_eq!(b.enter(t0 + 18 * s), Entry::Refused(Some(t0 + 22 * s)));
    }

    #[test]
    fn one_probe_at_a_time_closes_or_reopens() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut b = Breaker::default();
        for i in 0..3 {
            fail(&mut b, t0 + i * s);
        }
        let after = t0 + 8 * s;
        assert_eq!(b.state(after), BreakerState::HalfOpen);
        let probe = b.enter(after);
        assert!(matches!(probe, Entry::Probe(_)));
        assert_eq!(b.enter(after), Entry::Refused(None), "one probe at a time");
        // A late result of a request let through before it opened: ignored.
        assert!(!b.record(Entry::Normal(0), true, after, &cfg()));
        assert_eq!(b.state(after), BreakerState::HalfOpen);
        // The probe fails: open again for a cool-down.
        assert!(b.record(probe, false, after, &cfg()));
        assert_eq!(b.state(after), BreakerState::Open);
        let later = after + 5 * s;
        let probe = b.enter(later);
        // Not forwarded after all: the next request probes.
        b.probe_unused(probe);
        let probe2 = b.enter(later);
        assert!(matches!(probe2, Entry::Probe(_)) && probe2 != probe);
        // The stale probe's result is ignored; the live one closes it.
        assert!(!b.record(probe, false, later, &cfg()));
        assert_eq!(b.state(later), BreakerState::HalfOpen);
        assert!(!b.record(probe2, true, later, &cfg()));
        assert_eq!(b.state(later), BreakerState::Closed);
        let normal = b.enter(later);
        assert!(matches!(normal, Entry::Normal(_)));
        // A failure of a request let through before the breaker opened, ending
        // after the probe closed it: not counted against the new run.
        let mut one = cfg();
        one.failures = 1;
        assert!(!b.record(Entry::Normal(0), false, later, &one));
        assert_eq!(b.state(later), BreakerState::Closed);
        // A reset (a reload) ignores earlier requests too; probe numbers go on.
        b.reset();
        assert!(!b.record(normal, false, later, &one));
        assert_eq!(b.state(later), BreakerState::Closed);
    }

    #[test]
    fn a_cool_down_past_what_an_instant_holds_opens_without_panicking() {
        let now = Instant::now();
        let huge = BreakerConfig {
            failures: 1,
            window: Duration::from_secs(10),
            cool_down: Duration::MAX,
        };
        let mut b = Breaker::default();
        let e = b.enter(now);
        assert!(b.record(e, false, now, &huge));
        assert_eq!(b.state(now), BreakerState::Open);
    }
}
