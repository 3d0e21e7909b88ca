//! Slowing down admin token guesses (SPEC §8): per client address, ten wrong
//! tokens at once, then one a second. Past that, a presented token is not even
//! looked at: `429 too_many_attempts` with `Retry-After`, so guessing costs
//! time whatever the answers would have said. A right token spends nothing.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// Wrong tokens an address may present at once.
const BURST: f64 = 10.0;
/// And then per second.
const PER_SECOND: f64 = 1.0;
/// Addresses remembered; past it, those with every guess back are forgotten.
const MAX_TRACKED: usize = 10_000;

/// Each client address's guesses left.
#[derive(Default)]
pub(crate) struct Guesses {
    by_address: Mutex<HashMap<IpAddr, Left>>,
}

#[derive(Clone, Copy)]
struct Left {
    guesses: f64,
    at: Instant,
}

impl Left {
    fn now(self, now: Instant) -> f64 {
        let back = now.saturating_duration_since(self.at).as_secs_f64() * PER_SECOND;
        (self.guesses + back).min(BURST)
    }
}

impl Guesses {
    /// `Err(seconds)` while `ip` has no guess left: when to try again.
    pub(crate) fn allow(&self, ip: IpAddr) -> Result<(), u64> {
        let g = self.by_address.lock().unwrap_or_else(|p| p.into_inner());
        match g.get(&ip) {
            Some(l) if l.now(Instant::now()) < 1.0 => {
                let wait = (1.0 - l.now(Instant::now())) / PER_SECOND;
                Err(Duration::from_secs_f64(wait).as_secs().max(1))
            }
            _ => Ok(()),
        }
    }

    /// `ip` presented a wrong token.
    pub(crate) fn failed(&self, ip: IpAddr) {
        let now = Instant::now();
        let mut g = self.by_address.lock().unwrap_or_else(|p| p.into_inner());
        if g.len() >= MAX_TRACKED && !g.contains_key(&ip) {
            g.retain(|_, l| l.now(now) < BURST);
        }
        let left = g.get(&ip).map_or(BURST, |l| l.now(now));
        g.insert(
            ip,
            Left {
                guesses: (left - 1.0).max(0.0),
                at: now,
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ten_wrong_guesses_then_one_a_second_per_address() {
        let g = Guesses::default();
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        for _ in 0..10 {
            assert_eq!(g.allow(a), Ok(()));
            g.failed(a);
        }
        assert!(g.allow(a).is_err(), "the eleventh waits");
        assert_eq!(g.allow(b), Ok(()), "another address is not slowed");
    }
}
