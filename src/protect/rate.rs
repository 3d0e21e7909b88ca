//! A rate per destination (SPEC §9 `rate`, `rate_burst`): a token bucket per
//! route. A request takes a token when it is let through; none left, it is
//! refused (503 `upstream_held`, detail `rate`) with the time the next token
//! comes, and a queued attempt waits that long (SPEC §11: the order holds).
//!
//! Per instance: a route's bucket is this process's, as every other protection
//! state is. In a cluster each member sends at most the rate for the leases it
//! owns, so a route whose leases are spread over N members reaches up to N
//! times it: set a route's rate divided by the members that may own its
//! leases. Coordination on every request would cost a database round trip.

use std::time::Duration;

use serde::de::{Deserializer, Error};
use tokio::time::Instant;

/// `rate = "50/s"`: so many requests per second, minute or hour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    /// So many requests…
    pub count: u32,
    /// …per this.
    pub per: Per,
}

/// The period of a [`Rate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Per {
    /// `/s`
    Second,
    /// `/m`
    Minute,
    /// `/h`
    Hour,
}

impl std::fmt::Display for Rate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let per = match self.per {
            Per::Second => "s",
            Per::Minute => "m",
            Per::Hour => "h",
        };
        write!(f, "{}/{per}", self.count)
    }
}

impl Rate {
    /// Requests a second.
    pub fn per_sec(&self) -> f64 {
        let secs = match self.per {
            Per::Second => 1.0,
            Per::Minute => 60.0,
            Per::Hour => 3600.0,
        };
        f64::from(self.count) / secs
    }

    /// Reads `"N/s"`, `"N/m"` or `"N/h"` (N ≥ 1).
    pub fn parse(s: &str) -> Result<Rate, String> {
        let bad = || {
            format!("{s:?} is not a rate: write requests per second, minute or hour, e.g. \"50/s\", \"600/m\"")
        };
        let (n, per) = s.trim().split_once('/').ok_or_else(bad)?;
        let count: u32 = n.trim().parse().map_err(|_| bad())?;
        let per = match per.trim() {
            "s" | "sec" | "second" => Per::Second,
            "m" | "min" | "minute" => Per::Minute,
            "h" | "hour" => Per::Hour,
            _ => return Err(bad()),
        };
        if count == 0 {
            return Err(format!(
                "{s:?}: a rate must be at least 1 (leave it out for none)"
            ));
        }
        Ok(Rate { count, per })
    }

    /// The burst when `rate_burst` is not set: a second's worth, at least 1.
    pub fn default_burst(&self) -> u32 {
        (self.per_sec().ceil() as u32).max(1)
    }
}

/// serde: `rate = "50/s"`.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Rate>, D::Error> {
    let s: String = serde::Deserialize::deserialize(d)?;
    Rate::parse(&s).map(Some).map_err(D::Error::custom)
}

/// A token bucket: up to `burst` tokens, refilled at the rate.
#[derive(Debug)]
pub struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    /// Full.
    pub fn new(burst: u32, now: Instant) -> Bucket {
        Bucket {
            tokens: f64::from(burst),
            at: now,
        }
    }

    /// Takes a token, or says how long until one comes.
    pub fn take(&mut self, rate: Rate, burst: u32, now: Instant) -> Result<(), Duration> {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * rate.per_sec()).min(f64::from(burst.max(1)));
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            return Ok(());
        }
        let wait = (1.0 - self.tokens) / rate.per_sec();
        Err(Duration::from_secs_f64(wait.clamp(0.001, 86_400.0)))
    }

    /// Gives back a token taken for a request that was not let through after
    /// all (another check refused it).
    pub fn give_back(&mut self, burst: u32) {
        self.tokens = (self.tokens + 1.0).min(f64::from(burst.max(1)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_read_and_bad_ones_say_how_to_write_them() {
        assert_eq!(Rate::parse("50/s").unwrap().per_sec(), 50.0);
        assert_eq!(Rate::parse("600/m").unwrap().per_sec(), 10.0);
        assert_eq!(Rate::parse(" 36 / h ").unwrap().per_sec(), 0.01);
        assert_eq!(Rate::parse("50/s").unwrap().to_string(), "50/s");
        for bad in ["50", "fast", "50/d", "-1/s", "0/s", "1.5/s"] {
            let e = Rate::parse(bad).unwrap_err();
            assert!(e.contains("rate"), "{bad}: {e}");
        }
        assert_eq!(Rate::parse("50/s").unwrap().default_burst(), 50);
        assert_eq!(Rate::parse("6/m").unwrap().default_burst(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_bucket_lets_a_burst_through_then_the_rate() {
        let rate = Rate::parse("2/s").unwrap();
        let t0 = Instant::now();
        let mut b = Bucket::new(2, t0);
        assert!(b.take(rate, 2, t0).is_ok());
        assert!(b.take(rate, 2, t0).is_ok());
        let wait = b.take(rate, 2, t0).unwrap_err();
        assert_eq!(wait, Duration::from_millis(500));
        let t1 = t0 + Duration::from_millis(500);
        assert!(b.take(rate, 2, t1).is_ok());
        assert!(b.take(rate, 2, t1).is_err());
        // An idle second refills no more than the burst.
        let t2 = t1 + Duration::from_secs(10);
        assert!(b.take(rate, 2, t2).is_ok());
        assert!(b.take(rate, 2, t2).is_ok());
        assert!(b.take(rate, 2, t2).is_err());
        b.give_back(2);
        assert!(b.take(rate, 2, t2).is_ok());
    }
}
