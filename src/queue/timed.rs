//! The queue's store calls measured like every other state call
//! ([`crate::state::timed`]): `fencegate_state_duration_seconds` and
//! `fencegate_state_errors` with `op` `queue_accept`, `queue_read`,
//! `queue_attempt`, `queue_write`, `queue_settle`, `queue_durable`,
//! `queue_sweep` — a slow or failing queue shows on the same dashboard.

use std::sync::Arc;

use async_trait::async_trait;

use super::message::{Accepted, Envelope, Held, Listing, Message, QueueBound, Requeued};
use super::store::{Admitted, Depth, QueueStore, Written};
use crate::state::timed::{Op, StateMetrics};
use crate::state::{Owner, StateError};

/// A [`QueueStore`] that measures the one it wraps.
pub struct TimedQueue {
    inner: Arc<dyn QueueStore>,
    metrics: StateMetrics,
}

impl TimedQueue {
    /// Wraps `inner`, recording into the state store's series.
    pub fn wrap(inner: Arc<dyn QueueStore>, metrics: StateMetrics) -> Arc<dyn QueueStore> {
        Arc::new(TimedQueue { inner, metrics })
    }

    async fn timed<T>(
        &self,
        op: Op,
        f: impl std::future::Future<Output = Result<T, StateError>>,
    ) -> Result<T, StateError> {
        self.metrics.measure(op, f).await
    }
}

#[async_trait]
impl QueueStore for TimedQueue {
    async fn accept(
        &self,
        owner: Owner,
        msg: Message,
        envelope: &Envelope,
        bound: &QueueBound,
        admitted: Admitted,
    ) -> Result<Accepted, StateError> {
        self.timed(
            Op::QueueAccept,
            self.inner.accept(owner, msg, envelope, bound, admitted),
        )
        .await
    }

    async fn get(&self, route: &str, key: &str) -> Result<Option<Message>, StateError> {
        self.timed(Op::QueueRead, self.inner.get(route, key)).await
    }

    async fn envelope(&self, route: &str, key: &str) -> Result<Option<Envelope>, StateError> {
        self.timed(Op::QueueRead, self.inner.envelope(route, key))
            .await
    }

    async fn head(&self, lease: &str) -> Result<Option<Message>, StateError> {
        self.timed(Op::QueueRead, self.inner.head(lease)).await
    }

    async fn front(&self, lease: &str, max: usize) -> Result<Vec<Message>, StateError> {
        self.timed(Op::QueueRead, self.inner.front(lease, max))
            .await
    }

    async fn leases_with_work(&self) -> Result<Vec<String>, StateError> {
        self.timed(Op::QueueRead, self.inner.leases_with_work())
            .await
    }

    async fn holding_for(
        &self,
        routes: &[(&str, &str, bool)],
    ) -> Result<std::collections::BTreeSet<(String, String)>, StateError> {
        self.timed(Op::QueueRead, self.inner.holding_for(routes))
            .await
    }

    async fn other_kind(
        &self,
        routes: &[(&str, bool)],
    ) -> Result<Option<(String, bool)>, StateError> {
        self.timed(Op::QueueRead, self.inner.other_kind(routes))
            .await
    }

    async fn depth(&self) -> Result<Depth, StateError> {
        self.timed(Op::QueueRead, self.inner.depth()).await
    }

    fn depth_now(&self) -> Option<Result<Depth, StateError>> {
        self.inner.depth_now()
    }

    fn held_by_route(&self) -> Option<Vec<(String, Held)>> {
        self.inner.held_by_route()
    }

    async fn start_attempt_unflushed(
        &self,
        owner: Owner,
        msg: &Message,
    ) -> Result<Written, StateError> {
        self.timed(
            Op::QueueAttempt,
            self.inner.start_attempt_unflushed(owner, msg),
        )
        .await
    }

    async fn durable(&self) -> Result<(), StateError> {
        self.timed(Op::QueueDurable, self.inner.durable()).await
    }

    async fn put(&self, owner: Owner, msg: &Message) -> Result<(), StateError> {
        self.timed(Op::QueueWrite, self.inner.put(owner, msg)).await
    }

    async fn settle(&self, owner: Owner, msg: &Message) -> Result<(), StateError> {
        self.timed(Op::QueueSettle, self.inner.settle(owner, msg))
            .await
    }

    async fn settle_unflushed(&self, owner: Owner, msg: &Message) -> Result<Written, StateError> {
        self.timed(Op::QueueSettle, self.inner.settle_unflushed(owner, msg))
            .await
    }

    async fn requeue(
        &self,
        owner: Owner,
        route: &str,
        key: &str,
        now_ms: u64,
    ) -> Result<Requeued, StateError> {
        self.timed(
            Op::QueueWrite,
            self.inner.requeue(owner, route, key, now_ms),
        )
        .await
    }

    async fn raise_sent(&self, owner: Owner, lease: &str, epoch: u64) -> Result<(), StateError> {
        self.timed(Op::QueueWrite, self.inner.raise_sent(owner, lease, epoch))
            .await
    }

    async fn restore_fenced(&self, lease: &str) -> Result<u64, StateError> {
        self.timed(Op::QueueRead, self.inner.restore_fenced(lease))
            .await
    }

    async fn mark_restore_fenced(
        &self,
        owner: Owner,
        lease: &str,
        r: u64,
    ) -> Result<(), StateError> {
        self.timed(
            Op::QueueWrite,
            self.inner.mark_restore_fenced(owner, lease, r),
        )
        .await
    }

    async fn put_job(&self, job: &super::job::Job) -> Result<(), StateError> {
        self.timed(Op::QueueWrite, self.inner.put_job(job)).await
    }

    async fn jobs(&self) -> Result<Vec<super::job::Job>, StateError> {
        self.timed(Op::QueueRead, self.inner.jobs()).await
    }

    async fn job_progress(
        &self,
        id: &str,
        delta: &super::job::JobDelta,
    ) -> Result<Option<super::job::Job>, StateError> {
        self.timed(Op::QueueWrite, self.inner.job_progress(id, delta))
            .await
    }

    async fn paused(&self) -> Result<super::pause::Paused, StateError> {
        self.timed(Op::QueueRead, self.inner.paused()).await
    }

    async fn set_paused(
        &self,
        what: &super::pause::Pausable,
        since_ms: Option<u64>,
    ) -> Result<(), StateError> {
        self.timed(Op::QueueWrite, self.inner.set_paused(what, since_ms))
            .await
    }

    async fn sent_epoch(&self, lease: &str) -> Result<u64, StateError> {
        self.timed(Op::QueueRead, self.inner.sent_epoch(lease))
            .await
    }

    async fn list(&self, listing: &Listing) -> Result<(Vec<Message>, u64), StateError> {
        self.timed(Op::QueueRead, self.inner.list(listing)).await
    }

    async fn sweep(&self, before_ms: u64) -> Result<usize, StateError> {
        self.timed(Op::QueueSweep, self.inner.sweep(before_ms))
            .await
    }
}
