//! How fences are kept current (SPEC §4.3): store calls follow traffic. The
//! [`Refresh`] schedule books each lease's next listing; one task,
//! [`refresh_all`], lists the fences in use as their listings fall due; and
//! [`fresh`] says whether what a fence knows is recent enough to admit on.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::time::Instant;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::Fence;
use crate::epoch::LeaseName;
use crate::lease::StoreError;
use crate::lock_order::Ordered;

/// When each lease must next be listed. Store calls follow traffic (SPEC §4.3):
/// a lease is listed at most once per `interval` while it is in use and not at all
/// while idle; a request arriving when the latest listing is older than the
/// interval reads the store itself before it is decided (coalesced with any other
/// such request), so it is decided on knowledge no older than a refresher listing
/// every lease each interval would give.
///
/// One task ([`refresh_all`]) runs the schedule: each listing, when it completes,
/// books the next one an interval after it started; when that falls due the lease
/// is listed again only if it was used meanwhile. A timer per lease cost 30% of a
/// core for 10,000 idle leases; a sorted map of due times costs nothing while idle.
pub struct Refresh {
    interval_ms: u64,
    base: Instant,
    due: Mutex<BTreeMap<(u64, LeaseName), Weak<Fence>>>,
    wake: Notify,
}

impl Refresh {
    pub fn new(interval: Duration) -> Arc<Refresh> {
        Arc::new(Refresh {
            interval_ms: u64::try_from(interval.as_millis())
                .unwrap_or(u64::MAX)
                .max(1),
            base: Instant::now(),
            due: Mutex::new(BTreeMap::new()),
            wake: Notify::new(),
        })
    }

    pub fn interval(&self) -> Duration {
        Duration::from_millis(self.interval_ms)
    }

    /// The interval in milliseconds, as [`Refresh::now`] counts.
    pub(super) fn interval_ms(&self) -> u64 {
        self.interval_ms
    }

    /// Milliseconds since the schedule began, plus one: 0 stands for "never".
    pub(super) fn now(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .saturating_add(1)
    }

    fn due(&self) -> Ordered<'_, BTreeMap<(u64, LeaseName), Weak<Fence>>> {
        crate::lock_order::lock("refresh schedule", &self.due)
    }

    /// Books the listing after one that started at `started`.
    pub(super) fn schedule(&self, started: u64, lease: &LeaseName, fence: Weak<Fence>) {
        let at = started.saturating_add(self.interval_ms);
        let first = {
            let mut due = self.due();
            due.insert((at, lease.clone()), fence);
            due.keys().next().is_some_and(|(t, _)| *t == at)
        };
        if first {
            self.wake.notify_one();
        }
    }

    /// The fences due by `now`, and when the next one falls due.
    pub(super) fn take_due(&self, now: u64) -> (Vec<Arc<Fence>>, Option<u64>) {
        let mut due = self.due();
        let mut ready = Vec::new();
        while let Some(first) = due.first_entry() {
            if first.key().0 > now {
                return (ready, Some(first.key().0));
            }
            ready.extend(first.remove().upgrade());
        }
        (ready, None)
    }
}

/// Whether knowledge is fresh enough to admit on (SPEC §4.3, "known"): the latest
/// completed listing started less than `interval` ago, or one is in progress that
/// the schedule started on time (within [`LATE_MS`] of it falling due) — the same
/// age a refresher listing every lease each interval gives, where a request never
/// waits for the listing in progress either. Times in [`Refresh::now`] units.
pub(super) fn fresh(now: u64, listed_at: u64, listing_since: u64, interval: u64) -> bool {
    listed_at != 0
        && (now < listed_at.saturating_add(interval)
            || (listing_since != 0
                && listing_since <= listed_at.saturating_add(interval + LATE_MS)))
}

/// How late after falling due a listing may start and still count as on time: the
/// timer's resolution and a busy runtime's delay, not the store's latency.
const LATE_MS: u64 = 20;

/// Most store calls the background refresh has in flight at once.
const REFRESH_CONCURRENCY: usize = 32;

/// The background refresh of every fence ([`Refresh`]): lists each fence in use
/// when its listing falls due, from one task with a bounded number of calls in
/// flight. A store outage is logged at most once per interval, not once per lease.
pub(crate) async fn refresh_all(refresh: Arc<Refresh>, stop: CancellationToken) {
    let mut calls = tokio::task::JoinSet::new();
    let mut queue: std::collections::VecDeque<Arc<Fence>> = Default::default();
    let mut failed = 0usize;
    let mut first_error: Option<(LeaseName, StoreError)> = None;
    let mut logged: Option<Instant> = None;
    loop {
        let now = refresh.now();
        let (ready, next) = refresh.take_due(now);
        queue.extend(ready.into_iter().filter(|f| f.wants_listing(now)));
        while calls.len() < REFRESH_CONCURRENCY {
            let Some(f) = queue.pop_front() else { break };
            calls.spawn(async move { (f.lease().clone(), f.refresh_due().await) });
        }
        while let Some(r) = calls.try_join_next() {
            if let Ok((lease, Err(e))) = r {
                failed += 1;
                first_error.get_or_insert((lease, e));
            }
        }
        if failed > 0 && logged.is_none_or(|t| t.elapsed() >= refresh.interval()) {
            if let Some((lease, e)) = first_error.take() {
                tracing::warn!(failed, %lease, error = %e, "epoch refresh failed");
            }
            failed = 0;
            logged = Some(Instant::now());
        }
        let sleep = match next {
            // Queued listings wait for a call to finish, not for a due time.
            _ if !queue.is_empty() => Duration::from_secs(3600),
            Some(at) => Duration::from_millis(at.saturating_sub(refresh.now())),
            None => refresh.interval(),
        };
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = refresh.wake.notified() => {}
            Some(r) = calls.join_next(), if !calls.is_empty() => {
                if let Ok((lease, Err(e))) = r {
                    failed += 1;
                    first_error.get_or_insert((lease, e));
                }
            }
            _ = tokio::time::sleep(sleep) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn knowledge_is_fresh_for_an_interval_or_while_an_on_time_listing_runs() {
        // Never listed: a request must read.
        assert!(!fresh(5, 0, 0, 1000));
        assert!(fresh(1000, 1, 0, 1000));
        assert!(!fresh(1001, 1, 0, 1000));
        // The due listing started on time and is still running.
        assert!(fresh(1050, 1, 1001 + LATE_MS, 1000));
        // It started late (the lease was idle; a request started it).
        assert!(!fresh(5000, 1, 4990, 1000));
    }
}
