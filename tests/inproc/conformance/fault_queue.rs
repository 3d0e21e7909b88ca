//! A [`QueueStore`] in front of a real one whose writes a test can fault —
//! the queue's counterpart of [`super::fault_state`]: [`Fault::Fail`] (refused
//! before the store sees it: nothing applied) and [`Fault::Unknown`] (applied,
//! then its answer lost), once each, per operation.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use fencegate::queue::message::{Held, Listing, QueueBound};
use fencegate::queue::store::{Admitted, Depth, Written};
use fencegate::queue::{Accepted, Envelope, Message, QueueStore, Requeued};
use fencegate::state::{Owner, StateError};

use super::Fault;

/// The queue's writes a test may fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QOp {
    Accept,
    Attempt,
    Settle,
    Put,
    Requeue,
}

/// See the module docs.
pub struct FaultQueue {
    inner: Arc<dyn QueueStore>,
    next: Mutex<Vec<(QOp, Fault)>>,
}

impl FaultQueue {
    pub fn new(inner: Arc<dyn QueueStore>) -> Arc<FaultQueue> {
        Arc::new(FaultQueue {
            inner,
            next: Mutex::default(),
        })
    }

    /// The next call of `op` meets `fault`.
    pub fn once(&self, op: QOp, fault: Fault) {
        self.next.lock().unwrap().push((op, fault));
    }

    async fn faulted<T>(
        &self,
        op: QOp,
        call: impl std::future::Future<Output = Result<T, StateError>>,
    ) -> Result<T, StateError> {
        let fault = {
            let mut next = self.next.lock().unwrap();
            let at = next.iter().position(|(o, _)| *o == op);
            at.map(|i| next.remove(i).1)
        };
        match fault {
            Some(Fault::Fail) => Err(StateError::Write(format!("{op:?}: refused (fault)"))),
            Some(Fault::Unknown) => {
                let _ = call.await;
                Err(StateError::Write(format!("{op:?}: answer lost (fault)")))
            }
            _ => call.await,
        }
    }
}

#[async_trait]
impl QueueStore for FaultQueue {
    async fn accept(
        &self,
        owner: Owner,
        msg: Message,
        envelope: &Envelope,
        bound: &QueueBound,
        admitted: Admitted,
    ) -> Result<Accepted, StateError> {
        self.faulted(
            QOp::Accept,
            self.inner.accept(owner, msg, envelope, bound, admitted),
        )
        .await
    }

    async fn get(&self, route: &str, key: &str) -> Result<Option<Message>, StateError> {
        self.inner.get(route, key).await
    }

    async fn envelope(&self, route: &str, key: &str) -> Result<Option<Envelope>, StateError> {
        self.inner.envelope(route, key).await
    }

    async fn head(&self, lease: &str) -> Result<Option<Message>, StateError> {
        self.inner.head(lease).await
    }

    async fn front(&self, lease: &str, max: usize) -> Result<Vec<Message>, StateError> {
        self.inner.front(lease, max).await
    }

    async fn leases_with_work(&self) -> Result<Vec<String>, StateError> {
        self.inner.leases_with_work().await
    }

    async fn holding_for(
        &self,
        routes: &[(&str, &str, bool)],
    ) -> Result<std::collections::BTreeSet<(String, String)>, StateError> {
        self.inner.holding_for(routes).await
    }

    async fn other_kind(
        &self,
        routes: &[(&str, bool)],
    ) -> Result<Option<(String, bool)>, StateError> {
        self.inner.other_kind(routes).await
    }

    async fn depth(&self) -> Result<Depth, StateError> {
        self.inner.depth().await
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
        self.faulted(QOp::Attempt, self.inner.start_attempt_unflushed(owner, msg))
            .await
    }

    async fn durable(&self) -> Result<(), StateError> {
        self.inner.durable().await
    }

    async fn put(&self, owner: Owner, msg: &Message) -> Result<(), StateError> {
        self.faulted(QOp::Put, self.inner.put(owner, msg)).await
    }

    async fn settle(&self, owner: Owner, msg: &Message) -> Result<(), StateError> {
        self.faulted(QOp::Settle, self.inner.settle(owner, msg))
            .await
    }

    async fn settle_unflushed(&self, owner: Owner, msg: &Message) -> Result<Written, StateError> {
        self.faulted(QOp::Settle, self.inner.settle_unflushed(owner, msg))
            .await
    }

    async fn requeue(
        &self,
        owner: Owner,
        route: &str,
        key: &str,
        now_ms: u64,
    ) -> Result<Requeued, StateError> {
        self.faulted(QOp::Requeue, self.inner.requeue(owner, route, key, now_ms))
            .await
    }

    async fn raise_sent(&self, owner: Owner, lease: &str, epoch: u64) -> Result<(), StateError> {
        self.inner.raise_sent(owner, lease, epoch).await
    }

    async fn restore_fenced(&self, lease: &str) -> Result<u64, StateError> {
        self.inner.restore_fenced(lease).await
    }

    async fn mark_restore_fenced(
        &self,
        owner: Owner,
        lease: &str,
        r: u64,
    ) -> Result<(), StateError> {
        self.inner.mark_restore_fenced(owner, lease, r).await
    }

    async fn put_job(&self, job: &fencegate::queue::job::Job) -> Result<(), StateError> {
        self.inner.put_job(job).await
    }

    async fn jobs(&self) -> Result<Vec<fencegate::queue::job::Job>, StateError> {
        self.inner.jobs().await
    }

    async fn job_progress(
        &self,
        id: &str,
        delta: &fencegate::queue::job::JobDelta,
    ) -> Result<Option<fencegate::queue::job::Job>, StateError> {
        self.inner.job_progress(id, delta).await
    }

    async fn paused(&self) -> Result<fencegate::queue::pause::Paused, StateError> {
        self.inner.paused().await
    }

    async fn set_paused(
        &self,
        what: &fencegate::queue::pause::Pausable,
        since_ms: Option<u64>,
    ) -> Result<(), StateError> {
        self.inner.set_paused(what, since_ms).await
    }

    async fn sent_epoch(&self, lease: &str) -> Result<u64, StateError> {
        self.inner.sent_epoch(lease).await
    }

    async fn list(&self, listing: &Listing) -> Result<(Vec<Message>, u64), StateError> {
        self.inner.list(listing).await
    }

    async fn sweep(&self, before_ms: u64) -> Result<usize, StateError> {
        self.inner.sweep(before_ms).await
    }
}
