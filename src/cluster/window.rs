//! An owner's forwarding window (SPEC §10): a tenure's holder — a shard's
//! owner in a cluster (its owner row; and the prefix's anchor), or a single
//! instance's guard (a gate lease) — starts no forward later than
//! `gate_ttl − self_fence_margin` after it *sent* its latest renewal or take,
//! and aborts what is still in flight at `gate_ttl` after it. Both deadlines run
//! on this process's monotonic clock from the send, not the confirmation, so the
//! window only errs short; neither the store's clock nor the local wall clock
//! matters. One type for both holders, so the rule is written once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

pub(crate) struct Window {
    origin: Instant,
    /// Milliseconds after `origin` until which forwards may start; 0: closed.
    forward_until_ms: AtomicU64,
    /// Milliseconds after `origin` at which what is in flight is aborted.
    abort_at_ms: AtomicU64,
}

impl Window {
    pub(crate) fn new() -> Window {
        Window {
            origin: Instant::now(),
            forward_until_ms: AtomicU64::new(0),
            abort_at_ms: AtomicU64::new(0),
        }
    }

    fn ms(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.origin).as_millis()).unwrap_or(u64::MAX)
    }

    /// Milliseconds since this window's origin.
    pub(crate) fn now_ms(&self) -> u64 {
        self.ms(Instant::now())
    }

    /// A gate create sent at `sent` succeeded: forwards may start until
    /// `ttl − margin` after it, and are aborted at `ttl` after it. Never moves a
    /// deadline back (renewals confirmed out of order).
    pub(crate) fn extend(&self, sent: Instant, ttl: Duration, margin: Duration) {
        self.forward_until_ms
            .fetch_max(self.ms(sent + ttl.saturating_sub(margin)), Ordering::SeqCst);
        self.abort_at_ms
            .fetch_max(self.ms(sent + ttl), Ordering::SeqCst);
    }

    /// Whether a forward may start now.
    pub(crate) fn is_open(&self) -> bool {
        self.now_ms() < self.forward_until_ms.load(Ordering::SeqCst)
    }

    /// The forwarding deadline, in milliseconds after the origin (0: closed).
    pub(crate) fn forward_until_ms(&self) -> u64 {
        self.forward_until_ms.load(Ordering::SeqCst)
    }

    /// The abort deadline, in milliseconds after the origin (0: none).
    pub(crate) fn abort_at_ms(&self) -> u64 {
        self.abort_at_ms.load(Ordering::SeqCst)
    }

    /// When what is in flight is aborted: `gate_ttl` after the latest create
    /// was sent.
    pub(crate) fn abort_deadline(&self) -> tokio::time::Instant {
        self.origin + Duration::from_millis(self.abort_at_ms())
    }

    /// When forwards stop (the origin itself when closed).
    pub(crate) fn forward_deadline(&self) -> Instant {
        self.origin + Duration::from_millis(self.forward_until_ms())
    }

    /// The tenure is over (released, or taken): no forward from now on.
    pub(crate) fn close(&self) {
        self.forward_until_ms.store(0, Ordering::SeqCst);
        self.abort_at_ms.store(0, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The window counts from the send; a late confirmation of an older
    /// create never shortens it; closing ends it.
    #[test]
    fn a_window_runs_from_the_send_and_never_moves_back() {
        let w = Window::new();
        assert!(!w.is_open(), "closed until a create succeeded");
        let (ttl, margin) = (Duration::from_secs(10), Duration::from_secs(2));
        let now = Instant::now();
        w.extend(now, ttl, margin);
        assert!(w.is_open());
        let until = w.forward_until_ms();
        let abort = w.abort_at_ms();
        assert_eq!(abort - until, 2_000);
        w.extend(now - Duration::from_secs(5), ttl, margin);
        assert_eq!((w.forward_until_ms(), w.abort_at_ms()), (until, abort));
        // Sent so long ago that the window has passed: closed.
        let old = Window::new();
        old.extend(Instant::now() - Duration::from_secs(9), ttl, margin);
        assert!(!old.is_open());
        w.close();
        assert!(!w.is_open());
    }
}
