//! Time, injected. Expiry is judged on the *store's* clock (SPEC §2, §4), which
//! fencegate estimates from the `Date` header of store responses; tests swap the
//! local clock for a manual one instead of sleeping through TTLs.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

/// The local wall clock.
pub trait Clock: Send + Sync + 'static {
    fn now(&self) -> SystemTime;
}

/// The operating system's clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> SystemTime {
        SystemTime::now()
    }
}

/// A clock that only moves when told to (tests).
#[derive(Debug)]
pub struct ManualClock(Mutex<SystemTime>);

impl ManualClock {
    pub fn new(at: SystemTime) -> Arc<ManualClock> {
        Arc::new(ManualClock(Mutex::new(at)))
    }

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
/// `Date` has one-second resolution and is truncated, so when a response arrives the
/// store's clock reads somewhere in `[Date, Date + 1 s + transit)`. We keep the
/// *upper* end: fencegate then believes an epoch expired slightly early, never late,
/// which is the safe side for a fence (contenders wait a further `grace_ms`).
/// A contender asks the opposite question ("has someone else's tenure expired?"),
/// whose safe side is the lower end: [`StoreClock::earliest`].
pub struct StoreClock {
    local: Arc<dyn Clock>,
    offset_ms: AtomicI64,
    /// Whether the offset came from a `Date` header (and so carries its 1 s
    /// uncertainty); a store that is the local clock (`dir`) never sets it.
    from_date: AtomicBool,
}

impl StoreClock {
    pub fn new(local: Arc<dyn Clock>) -> StoreClock {
        StoreClock {
            local,
            offset_ms: AtomicI64::new(0),
            from_date: AtomicBool::new(false),
        }
    }

    /// The earliest the store's clock may read: [`StoreClock::now`] less the `Date`
    /// header's one-second resolution. For deciding that *another* holder's tenure
    /// has expired (SPEC §2 step 2), so that contenders take over late, never early.
    pub fn earliest(&self) -> SystemTime {
        let now = self.now();
        if self.from_date.load(Ordering::Relaxed) {
            now - Duration::from_secs(1)
        } else {
            now
        }
    }

    /// The store's clock, estimated.
    pub fn now(&self) -> SystemTime {
        let local = self.local.now();
        let off = self.offset_ms.load(Ordering::Relaxed);
        if off >= 0 {
            local + Duration::from_millis(off as u64)
        } else {
            local - Duration::from_millis(off.unsigned_abs())
        }
    }

    /// The local clock (for callers that need both).
    pub fn local_now(&self) -> SystemTime {
        self.local.now()
    }

    /// Records a `Date` header seen on a store response that arrived at `received`
    /// (local time).
    pub fn observe_date(&self, date: SystemTime, received: SystemTime) {
        let upper = date + Duration::from_secs(1);
        let off = match upper.duration_since(received) {
            Ok(d) => i64::try_from(d.as_millis()).unwrap_or(i64::MAX),
            Err(e) => -i64::try_from(e.duration().as_millis()).unwrap_or(i64::MAX),
        };
        self.offset_ms.store(off, Ordering::Relaxed);
        self.from_date.store(true, Ordering::Relaxed);
    }

    /// Records a `Date` header value (RFC 9110 IMF-fixdate); unparsable values are ignored.
    pub fn observe_date_header(&self, value: &str) {
        if let Ok(date) = httpdate::parse_http_date(value) {
            self.observe_date(date, self.local.now());
        }
    }

    /// The current offset estimate in milliseconds (store minus local).
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
    fn offset_takes_the_upper_end_of_the_date_second() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(10_000);
        let local = ManualClock::new(t0 + Duration::from_millis(300));
        let sc = StoreClock::new(local.clone());
        // No Date seen (the dir store): the local clock, exactly.
        assert_eq!(sc.earliest(), sc.now());
        // The store says 10_000 s (truncated); we received it locally at 10_000.3 s.
        sc.observe_date(t0, t0 + Duration::from_millis(300));
        assert_eq!(sc.offset_ms(), 700);
        assert_eq!(sc.now(), t0 + Duration::from_secs(1));
        // A contender's view: the lower end of the Date second.
        assert_eq!(sc.earliest(), t0);
        // A store clock behind ours gives a negative offset.
        sc.observe_date(t0 - Duration::from_secs(5), t0);
        assert_eq!(sc.offset_ms(), -4000);
    }
}
