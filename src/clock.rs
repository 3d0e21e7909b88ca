//! Time, injected. Expiry is judged on the *store's* clock (SPEC §2, §4), which
//! fencegate estimates from the `Date` header of store responses; tests swap the
//! local clock for a manual one instead of sleeping through TTLs.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

/// The monotonic side of time is tokio's clock: every deadline, window, idle
/// limit and sleep in fencegate runs on `tokio::time::Instant` and
/// `tokio::time::sleep`, which a test pauses and advances
/// (`#[tokio::test(start_paused = true)]`, `tokio::time::advance`) — and
/// [`TokioClock`] makes the wall clock follow it, so one advance moves both.
/// `std::time::Instant::now` is for measurements that decide nothing (latency
/// metrics, log fields), through [`stopwatch`] only (clippy.toml).
pub fn stopwatch() -> std::time::Instant {
    // The one place a measurement's start is read (clippy.toml).
    #[allow(clippy::disallowed_methods)]
    std::time::Instant::now()
}

/// The local wall clock.
pub trait Clock: Send + Sync + 'static {
    /// The current wall-clock time.
    fn now(&self) -> SystemTime;
}

/// The operating system's clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    // The one place the wall clock is read (clippy.toml).
    #[allow(clippy::disallowed_methods)]
    fn now(&self) -> SystemTime {
        SystemTime::now()
    }
}

/// A wall clock that follows tokio's: `start` plus the time tokio says has
/// passed since it was made. Under a paused runtime it moves only with
/// `tokio::time::advance` (or auto-advance), together with every deadline.
#[derive(Debug)]
pub struct TokioClock {
    start: SystemTime,
    origin: tokio::time::Instant,
}

impl TokioClock {
    /// A clock that reads `start` now and advances with tokio's (possibly paused) time.
    pub fn new(start: SystemTime) -> Arc<TokioClock> {
        Arc::new(TokioClock {
            start,
            origin: tokio::time::Instant::now(),
        })
    }
}

impl Clock for TokioClock {
    fn now(&self) -> SystemTime {
        self.start + self.origin.elapsed()
    }
}

/// A clock that only moves when told to (tests).
#[derive(Debug)]
pub struct ManualClock(Mutex<SystemTime>);

impl ManualClock {
    /// A clock stopped at `at`.
    pub fn new(at: SystemTime) -> Arc<ManualClock> {
        Arc::new(ManualClock(Mutex::new(at)))
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let mut t = self.0.lock().unwrap_or_else(|p| p.into_inner());
        *t += by;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> SystemTime {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// An estimate of the store's clock: local time plus an offset learned from the
/// `Date` header of store responses.
///
/// `Date` has one-second resolution and is truncated, and the store stamped it
/// somewhere between the request leaving and the response arriving. So when a
/// response arrives after a round trip `rtt`, the store's clock reads somewhere in
/// `[Date, Date + 1 s + rtt)`. fencegate judges its own admissions on the *upper*
/// end: it then believes an epoch expired slightly early, never late, which is the
/// safe side for a fence (contenders wait a further `grace_ms`). A contender asks
/// the opposite question ("has someone else's tenure expired?"), whose safe side is
/// the lower end: [`StoreClock::earliest`]. Each end is the most cautious over the
/// last [`SAMPLES`] responses, so one quick response cannot move the estimate to
/// the unsafe side of an earlier, slower one.
pub struct StoreClock {
    local: Arc<dyn Clock>,
    /// Upper end of the offset (store minus local), ms: read on every admission.
    offset_ms: AtomicI64,
    /// Lower end of the offset, ms.
    lower_ms: AtomicI64,
    /// Whether the offset came from a `Date` header (and so carries its
    /// uncertainty); a store that is the local clock (`dir`) never sets it.
    from_date: AtomicBool,
    /// The recent samples' (lower, upper) offsets, newest last.
    samples: Mutex<VecDeque<(i64, i64)>>,
}

/// How many recent `Date` samples the estimate takes its bounds over.
pub const SAMPLES: usize = 8;

fn signed_ms(later: SystemTime, earlier: SystemTime) -> i64 {
    match later.duration_since(earlier) {
        Ok(d) => i64::try_from(d.as_millis()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_millis()).unwrap_or(i64::MAX),
    }
}

fn plus_ms(t: SystemTime, ms: i64) -> SystemTime {
    if ms >= 0 {
        t + Duration::from_millis(ms as u64)
    } else {
        t - Duration::from_millis(ms.unsigned_abs())
    }
}

impl StoreClock {
    /// An estimate of the store's clock, at zero offset until the first `Date` header
    /// is seen.
    pub fn new(local: Arc<dyn Clock>) -> StoreClock {
        StoreClock {
            local,
            offset_ms: AtomicI64::new(0),
            lower_ms: AtomicI64::new(0),
            from_date: AtomicBool::new(false),
            samples: Mutex::new(VecDeque::with_capacity(SAMPLES)),
        }
    }

    /// The earliest the store's clock may read: the lower end of the estimate. For
    /// deciding that *another* holder's tenure has expired (SPEC §2 step 2), so
    /// that contenders take over late, never early.
    pub fn earliest(&self) -> SystemTime {
        if self.from_date.load(Ordering::Relaxed) {
            plus_ms(self.local.now(), self.lower_ms.load(Ordering::Relaxed))
        } else {
            self.now()
        }
    }

    /// The store's clock, estimated on the late side (the upper end).
    pub fn now(&self) -> SystemTime {
        plus_ms(self.local.now(), self.offset_ms.load(Ordering::Relaxed))
    }

    /// Records a `Date` header seen on a store response to a request sent at
    /// `sent` that arrived at `received` (local times).
    pub fn observe_date(&self, date: SystemTime, sent: SystemTime, received: SystemTime) {
        let rtt = received.duration_since(sent).unwrap_or_default();
        let lower = signed_ms(date, received);
        let upper = signed_ms(date + Duration::from_secs(1) + rtt, received);
        // Rounded outwards to whole milliseconds.
        let upper = upper.saturating_add(1);
        let mut samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        if samples.len() == SAMPLES {
            samples.pop_front();
        }
        samples.push_back((lower, upper));
        let lo = samples.iter().map(|s| s.0).min().unwrap_or(lower);
        let hi = samples.iter().map(|s| s.1).max().unwrap_or(upper);
        self.lower_ms.store(lo, Ordering::Relaxed);
        self.offset_ms.store(hi, Ordering::Relaxed);
        self.from_date.store(true, Ordering::Relaxed);
    }

    /// Records a `Date` header value (RFC 9110 IMF-fixdate) of a response to a
    /// request sent at `sent`; unparsable values are ignored.
    pub fn observe_date_header(&self, value: &str, sent: SystemTime) {
        if let Ok(date) = httpdate::parse_http_date(value) {
            self.observe_date(date, sent, self.local.now());
        }
    }

    /// The local clock, to time a store request with.
    pub fn local_now(&self) -> SystemTime {
        self.local.now()
    }

    /// The current offset estimate in milliseconds (store minus local, upper end).
    pub fn offset_ms(&self) -> i64 {
        self.offset_ms.load(Ordering::Relaxed)
    }
}

/// Milliseconds since the Unix epoch, saturating (for logs and JSON).
pub fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// RFC 3339 with milliseconds, UTC (for `expires_at` and admin output).
pub fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offset_takes_the_upper_end_of_the_date_second_and_the_round_trip() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(10_000);
        let local = ManualClock::new(t0 + Duration::from_millis(300));
        let sc = StoreClock::new(local.clone());
        // No Date seen (the dir store): the local clock, exactly.
        assert_eq!(sc.earliest(), sc.now());
        // The store says 10_000 s (truncated); the request left at 10_000.1 s and
        // the answer arrived at 10_000.3 s: the store's clock then read at most
        // 10_000 s + 1 s + 200 ms (+1 ms rounding).
        sc.observe_date(
            t0,
            t0 + Duration::from_millis(100),
            t0 + Duration::from_millis(300),
        );
        assert_eq!(sc.offset_ms(), 901);
        assert_eq!(sc.now(), t0 + Duration::from_millis(1201));
        // A contender's view: the lower end, the Date itself.
        assert_eq!(sc.earliest(), t0);
    }

    #[test]
    fn the_most_cautious_bound_of_recent_samples_wins() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(10_000);
        let local = ManualClock::new(t0);
        let sc = StoreClock::new(local.clone());
        // A slow answer (rtt 500 ms), then a quick one: the later sample would pull
        // the upper end back by the round trip; the estimate keeps the slow one's.
        sc.observe_date(t0, t0 - Duration::from_millis(500), t0);
        assert_eq!(sc.offset_ms(), 1501);
        sc.observe_date(t0, t0, t0);
        assert_eq!(sc.offset_ms(), 1501);
        // Once it has aged out of the window, the quick samples' bound holds.
        for _ in 0..SAMPLES {
            sc.observe_date(t0, t0, t0);
        }
        assert_eq!(sc.offset_ms(), 1001);
        // A store clock behind ours gives a negative offset.
        for _ in 0..SAMPLES {
            sc.observe_date(t0 - Duration::from_secs(5), t0, t0);
        }
        assert_eq!(sc.offset_ms(), -3999);
        assert_eq!(sc.earliest(), t0 - Duration::from_secs(5));
    }
}
