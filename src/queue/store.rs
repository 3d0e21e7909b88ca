//! Where the queue is kept (SPEC §11): on sled beside the marks (a single
//! instance, [`super::sled`]) or in PostgreSQL, every write under the shard
//! owner's generation (a cluster, or a single instance on PostgreSQL,
//! [`super::postgres`]).

use std::sync::Arc;

use async_trait::async_trait;

use super::message::{Accepted, Envelope, Held, Listing, Message, QueueBound, Requeued};
use super::postgres::PgQueue;
use super::sled::SledQueue;
use crate::state::{Owner, StateError};

/// Whether a write is on disk already or waits for the next durable one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    /// Durable.
    Durable,
    /// Durable with the store's next durable write.
    Unflushed,
}

/// What a pass being admitted still looks like when its place is taken.
pub type Admitted = Arc<dyn Fn() -> bool + Send + Sync>;

/// Per route: messages not settled, and when the oldest lease head among
/// them was accepted (ms).
pub type Depth = std::collections::HashMap<String, (u64, u64)>;

/// Where the queue is kept: sled (a single instance, [`SledQueue`]) or
/// PostgreSQL (a cluster, or a single instance on PostgreSQL, [`PgQueue`]),
/// and the wrappers over either ([`super::timed::TimedQueue`]; a test's fault
/// injector). Writes name the [`Owner`] they are made under; sled has one
/// owner and ignores it.
#[async_trait]
pub trait QueueStore: Send + Sync + 'static {
    /// Accepts `msg` (its `seq` is assigned here) with its request, unless its
    /// key has a message already; `admitted` is asked once the lease's next
    /// place is held and before it is taken (SPEC §11: a pass aborted by a
    /// newer epoch's drain takes no place after it). Durable on return.
    async fn accept(
        &self,
        owner: Owner,
        msg: Message,
        envelope: &Envelope,
        bound: &QueueBound,
        admitted: Admitted,
    ) -> Result<Accepted, StateError>;

    /// The message of `route`, `key`, if there is one.
    async fn get(&self, route: &str, key: &str) -> Result<Option<Message>, StateError>;

    /// The request of `route`, `key`.
    async fn envelope(&self, route: &str, key: &str) -> Result<Option<Envelope>, StateError>;

    /// The first message of `lease` not settled, if any.
    async fn head(&self, lease: &str) -> Result<Option<Message>, StateError>;

    /// Up to `max` messages at the front of `lease`'s queue that have the
    /// epoch of its head (in place order): what `ordering = "none"` may send
    /// at once.
    async fn front(&self, lease: &str, max: usize) -> Result<Vec<Message>, StateError>;

    /// Leases with messages not settled (start-up, a takeover).
    async fn leases_with_work(&self) -> Result<Vec<String>, StateError>;

    /// (route, lease) of messages that may still be sent, at least those
    /// [`super::conflict`] looks for among `routes` (name, lease, queued):
    /// on sled every one (one pass), on PostgreSQL only those (index reads).
    async fn holding_for(
        &self,
        routes: &[(&str, &str, bool)],
    ) -> Result<std::collections::BTreeSet<(String, String)>, StateError>;

    /// The first of `routes` (name, queued) whose name keeps state of the
    /// other kind ([`super::history_conflict`]): a direct route's name with
    /// messages kept, a queued route's name with dedup records. Index probes
    /// by route on either store.
    async fn other_kind(
        &self,
        routes: &[(&str, bool)],
    ) -> Result<Option<(String, bool)>, StateError>;

    /// Per route, how many messages are not settled and when the oldest
    /// lease head among them was accepted (metrics).
    async fn depth(&self) -> Result<Depth, StateError>;

    /// [`QueueStore::depth`] without waiting, where the store can answer so
    /// (sled); `None` for PostgreSQL, whose figures are read in the
    /// background.
    fn depth_now(&self) -> Option<Result<Depth, StateError>>;

    /// Every route's requests kept (metrics), where fencegate's memory holds
    /// them (sled); `None` elsewhere.
    fn held_by_route(&self) -> Option<Vec<(String, Held)>> {
        None
    }

    /// Writes a message's attempt as started (`delivering`), with its epoch
    /// as the newest of its lease that may have been sent: from here on an
    /// operator's retry of an older message is superseded. On sled durable
    /// only with the next [`QueueStore::durable`], so that the deliverer
    /// waits for the disk outside the lock that orders edits and other
    /// leases' starts share the flush. On PostgreSQL committed on return, or
    /// refused ([`StateError::OwnerLost`]) once a newer owner holds the
    /// shard — the attempt is then not sent.
    async fn start_attempt_unflushed(
        &self,
        owner: Owner,
        msg: &Message,
    ) -> Result<Written, StateError>;

    /// Waits until every write made so far is durable: what is answered from
    /// a message read now is then on disk (PostgreSQL: every write read was
    /// committed).
    async fn durable(&self) -> Result<(), StateError>;

    /// Writes a message that stays in its queue (a retry scheduled). Durable
    /// on return.
    async fn put(&self, owner: Owner, msg: &Message) -> Result<(), StateError>;

    /// Writes a settled message and takes it out of its queue (the next one
    /// may go). Durable on return.
    async fn settle(&self, owner: Owner, msg: &Message) -> Result<(), StateError>;

    /// [`QueueStore::settle`], durable only with the store's next durable
    /// write — the next attempt's start, or [`QueueStore::durable`] — so that
    /// one flush serves a message's settlement and the next one's start. A
    /// reader answered from it waits for [`QueueStore::durable`] first, as
    /// for any write. On PostgreSQL the same as `settle` (a transaction).
    async fn settle_unflushed(&self, owner: Owner, msg: &Message) -> Result<Written, StateError>;

    /// Puts a failed message back at the end of its lease's queue, pending
    /// now, unless a newer epoch's message of its lease was sent or waits.
    /// Durable on return.
    async fn requeue(
        &self,
        owner: Owner,
        route: &str,
        key: &str,
        now_ms: u64,
    ) -> Result<Requeued, StateError>;

    /// Records that a message of `lease` at `epoch` may have been sent (a
    /// restored state's fence): an operator's retry of an older one is then
    /// superseded. Durable on return.
    async fn raise_sent(&self, owner: Owner, lease: &str, epoch: u64) -> Result<(), StateError>;

    /// The restore (a state generation) `lease`'s queue was last fenced for
    /// (0: none; [`super::Queue::fence_if_restored`]).
    async fn restore_fenced(&self, lease: &str) -> Result<u64, StateError>;

    /// Records that `lease`'s queue was fenced for restore `r`, written
    /// under `owner` after the fence's own writes. Durable on return.
    async fn mark_restore_fenced(
        &self,
        owner: Owner,
        lease: &str,
        r: u64,
    ) -> Result<(), StateError>;

    /// The newest epoch of `lease` of which a message was sent (0: none).
    async fn sent_epoch(&self, lease: &str) -> Result<u64, StateError>;

    /// Up to `limit` messages matching, in key order (route, then key); and
    /// how many match.
    async fn list(&self, listing: &Listing) -> Result<(Vec<Message>, u64), StateError>;

    /// Removes settled messages last changed before `before_ms`; how many.
    async fn sweep(&self, before_ms: u64) -> Result<usize, StateError>;

    /// Writes a new bulk job (SPEC §11, recovering in bulk). Durable on return.
    async fn put_job(&self, job: &super::job::Job) -> Result<(), StateError>;

    /// Every bulk job kept, newest first.
    async fn jobs(&self) -> Result<Vec<super::job::Job>, StateError>;

    /// Applies `delta` to job `id` atomically (members of a cluster may both
    /// progress it); the job after, if it exists. Durable on return.
    async fn job_progress(
        &self,
        id: &str,
        delta: &super::job::JobDelta,
    ) -> Result<Option<super::job::Job>, StateError>;

    /// The pauses in force (SPEC §11, pause and resume).
    async fn paused(&self) -> Result<super::pause::Paused, StateError>;

    /// Pauses `what` from `since_ms` (kept if already paused), or resumes it
    /// (`None`). An operator's setting, not a delivery write: any instance
    /// may write it, under no owner. Durable on return.
    async fn set_paused(
        &self,
        what: &super::pause::Pausable,
        since_ms: Option<u64>,
    ) -> Result<(), StateError>;
}

#[async_trait]
impl QueueStore for SledQueue {
    fn held_by_route(&self) -> Option<Vec<(String, Held)>> {
        Some(SledQueue::held_by_route(self))
    }

    async fn accept(
        &self,
        _owner: Owner,
        msg: Message,
        envelope: &Envelope,
        bound: &QueueBound,
        admitted: Admitted,
    ) -> Result<Accepted, StateError> {
        // The bound is sled's: there fencegate's memory holds the requests.
        SledQueue::accept(self, msg, envelope, bound, || admitted()).await
    }

    async fn get(&self, route: &str, key: &str) -> Result<Option<Message>, StateError> {
        SledQueue::get(self, route, key)
    }

    async fn envelope(&self, route: &str, key: &str) -> Result<Option<Envelope>, StateError> {
        SledQueue::envelope(self, route, key)
    }

    async fn head(&self, lease: &str) -> Result<Option<Message>, StateError> {
        SledQueue::head(self, lease)
    }

    async fn front(&self, lease: &str, max: usize) -> Result<Vec<Message>, StateError> {
        SledQueue::front(self, lease, max)
    }

    async fn leases_with_work(&self) -> Result<Vec<String>, StateError> {
        SledQueue::leases_with_work(self)
    }

    async fn holding_for(
        &self,
        _routes: &[(&str, &str, bool)],
    ) -> Result<std::collections::BTreeSet<(String, String)>, StateError> {
        SledQueue::holding(self)
    }

    async fn other_kind(
        &self,
        routes: &[(&str, bool)],
    ) -> Result<Option<(String, bool)>, StateError> {
        SledQueue::other_kind(self, routes)
    }

    async fn depth(&self) -> Result<Depth, StateError> {
        SledQueue::depth(self)
    }

    fn depth_now(&self) -> Option<Result<Depth, StateError>> {
        Some(SledQueue::depth(self))
    }

    async fn start_attempt_unflushed(
        &self,
        _owner: Owner,
        msg: &Message,
    ) -> Result<Written, StateError> {
        SledQueue::start_attempt_unflushed(self, msg).map(|()| Written::Unflushed)
    }

    async fn durable(&self) -> Result<(), StateError> {
        SledQueue::durable(self).await
    }

    async fn put(&self, _owner: Owner, msg: &Message) -> Result<(), StateError> {
        SledQueue::put(self, msg).await
    }

    async fn settle(&self, _owner: Owner, msg: &Message) -> Result<(), StateError> {
        SledQueue::settle(self, msg).await
    }

    async fn settle_unflushed(&self, _owner: Owner, msg: &Message) -> Result<Written, StateError> {
        SledQueue::settle_unflushed(self, msg).map(|()| Written::Unflushed)
    }

    async fn requeue(
        &self,
        _owner: Owner,
        route: &str,
        key: &str,
        now_ms: u64,
    ) -> Result<Requeued, StateError> {
        SledQueue::requeue(self, route, key, now_ms).await
    }

    async fn raise_sent(&self, _owner: Owner, lease: &str, epoch: u64) -> Result<(), StateError> {
        SledQueue::raise_sent(self, lease, epoch).await
    }

    async fn restore_fenced(&self, lease: &str) -> Result<u64, StateError> {
        SledQueue::restore_fenced(self, lease)
    }

    async fn mark_restore_fenced(
        &self,
        _owner: Owner,
        lease: &str,
        r: u64,
    ) -> Result<(), StateError> {
        SledQueue::mark_restore_fenced(self, lease, r).await
    }

    async fn put_job(&self, job: &super::job::Job) -> Result<(), StateError> {
        SledQueue::put_job(self, job).await
    }

    async fn jobs(&self) -> Result<Vec<super::job::Job>, StateError> {
        SledQueue::jobs(self)
    }

    async fn job_progress(
        &self,
        id: &str,
        delta: &super::job::JobDelta,
    ) -> Result<Option<super::job::Job>, StateError> {
        SledQueue::job_progress(self, id, delta).await
    }

    async fn paused(&self) -> Result<super::pause::Paused, StateError> {
        SledQueue::paused(self)
    }

    async fn set_paused(
        &self,
        what: &super::pause::Pausable,
        since_ms: Option<u64>,
    ) -> Result<(), StateError> {
        SledQueue::set_paused(self, what, since_ms).await
    }

    async fn sent_epoch(&self, lease: &str) -> Result<u64, StateError> {
        SledQueue::sent_epoch(self, lease)
    }

    async fn list(&self, listing: &Listing) -> Result<(Vec<Message>, u64), StateError> {
        SledQueue::list(self, listing)
    }

    async fn sweep(&self, before_ms: u64) -> Result<usize, StateError> {
        SledQueue::sweep(self, before_ms).await
    }
}

#[async_trait]
impl QueueStore for PgQueue {
    async fn accept(
        &self,
        owner: Owner,
        msg: Message,
        envelope: &Envelope,
        _bound: &QueueBound,
        admitted: Admitted,
    ) -> Result<Accepted, StateError> {
        PgQueue::accept(self, owner, msg, envelope, admitted).await
    }

    async fn get(&self, route: &str, key: &str) -> Result<Option<Message>, StateError> {
        PgQueue::get(self, route, key).await
    }

    async fn envelope(&self, route: &str, key: &str) -> Result<Option<Envelope>, StateError> {
        PgQueue::envelope(self, route, key).await
    }

    async fn head(&self, lease: &str) -> Result<Option<Message>, StateError> {
        PgQueue::head(self, lease).await
    }

    async fn front(&self, lease: &str, max: usize) -> Result<Vec<Message>, StateError> {
        PgQueue::front(self, lease, max).await
    }

    async fn leases_with_work(&self) -> Result<Vec<String>, StateError> {
        PgQueue::leases_with_work(self).await
    }

    async fn holding_for(
        &self,
        routes: &[(&str, &str, bool)],
    ) -> Result<std::collections::BTreeSet<(String, String)>, StateError> {
        PgQueue::holding_for(self, routes).await
    }

    async fn other_kind(
        &self,
        routes: &[(&str, bool)],
    ) -> Result<Option<(String, bool)>, StateError> {
        PgQueue::other_kind(self, routes).await
    }

    async fn depth(&self) -> Result<Depth, StateError> {
        PgQueue::depth(self).await
    }

    fn depth_now(&self) -> Option<Result<Depth, StateError>> {
        None
    }

    async fn start_attempt_unflushed(
        &self,
        owner: Owner,
        msg: &Message,
    ) -> Result<Written, StateError> {
        PgQueue::start_attempt(self, owner, msg)
            .await
            .map(|()| Written::Durable)
    }

    async fn durable(&self) -> Result<(), StateError> {
        Ok(())
    }

    async fn put(&self, owner: Owner, msg: &Message) -> Result<(), StateError> {
        PgQueue::put(self, owner, msg).await
    }

    async fn settle(&self, owner: Owner, msg: &Message) -> Result<(), StateError> {
        PgQueue::settle(self, owner, msg).await
    }

    async fn settle_unflushed(&self, owner: Owner, msg: &Message) -> Result<Written, StateError> {
        PgQueue::settle(self, owner, msg)
            .await
            .map(|()| Written::Durable)
    }

    async fn requeue(
        &self,
        owner: Owner,
        route: &str,
        key: &str,
        now_ms: u64,
    ) -> Result<Requeued, StateError> {
        PgQueue::requeue(self, owner, route, key, now_ms).await
    }

    async fn raise_sent(&self, owner: Owner, lease: &str, epoch: u64) -> Result<(), StateError> {
        PgQueue::raise_sent(self, owner, lease, epoch).await
    }

    async fn restore_fenced(&self, lease: &str) -> Result<u64, StateError> {
        PgQueue::restore_fenced(self, lease).await
    }

    async fn mark_restore_fenced(
        &self,
        owner: Owner,
        lease: &str,
        r: u64,
    ) -> Result<(), StateError> {
        PgQueue::mark_restore_fenced(self, owner, lease, r).await
    }

    async fn put_job(&self, job: &super::job::Job) -> Result<(), StateError> {
        PgQueue::put_job(self, job).await
    }

    async fn jobs(&self) -> Result<Vec<super::job::Job>, StateError> {
        PgQueue::jobs(self).await
    }

    async fn job_progress(
        &self,
        id: &str,
        delta: &super::job::JobDelta,
    ) -> Result<Option<super::job::Job>, StateError> {
        PgQueue::job_progress(self, id, delta).await
    }

    async fn paused(&self) -> Result<super::pause::Paused, StateError> {
        PgQueue::paused(self).await
    }

    async fn set_paused(
        &self,
        what: &super::pause::Pausable,
        since_ms: Option<u64>,
    ) -> Result<(), StateError> {
        PgQueue::set_paused(self, what, since_ms).await
    }

    async fn sent_epoch(&self, lease: &str) -> Result<u64, StateError> {
        PgQueue::sent_epoch(self, lease).await
    }

    async fn list(&self, listing: &Listing) -> Result<(Vec<Message>, u64), StateError> {
        PgQueue::list(self, listing).await
    }

    async fn sweep(&self, before_ms: u64) -> Result<usize, StateError> {
        PgQueue::sweep(self, before_ms).await
    }
}
