//! Where the queue is kept (SPEC §11): on sled beside the marks (a single
//! instance, [`super::sled`]) or in PostgreSQL, every write under the shard
//! owner's generation (a cluster, or a single instance on PostgreSQL,
//! [`super::postgres`]).

use std::sync::Arc;

use super::message::{Accepted, Envelope, Message, Requeued, Status};
use crate::state::{Owner, StateError};

/// Where the queue is kept: sled (a single instance) or PostgreSQL (a
/// cluster, or a single instance on PostgreSQL). Writes name the [`Owner`]
/// they are made under; sled has one owner and ignores it.
pub enum QueueStore {
    /// Trees beside the marks, on sled.
    Sled(super::sled::SledQueue),
    /// Tables beside the dedup records, in PostgreSQL.
    Postgres(super::postgres::PgQueue),
}

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

impl QueueStore {
    /// Accepts `msg` (its `seq` is assigned here) with its request, unless its
    /// key has a message already; `admitted` is asked once the lease's next
    /// place is held and before it is taken (SPEC §11: a pass aborted by a
    /// newer epoch's drain takes no place after it). Durable on return.
    pub async fn accept(
        &self,
        owner: Owner,
        msg: Message,
        envelope: &Envelope,
        bound: &super::message::QueueBound,
        admitted: Admitted,
    ) -> Result<Accepted, StateError> {
        match self {
            // The bound is sled's: there fencegate's memory holds the requests.
            QueueStore::Sled(s) => s.accept(msg, envelope, bound, || admitted()).await,
            QueueStore::Postgres(p) => p.accept(owner, msg, envelope, admitted).await,
        }
    }

    /// The message of `route`, `key`, if there is one.
    pub async fn get(&self, route: &str, key: &str) -> Result<Option<Message>, StateError> {
        match self {
            QueueStore::Sled(s) => s.get(route, key),
            QueueStore::Postgres(p) => p.get(route, key).await,
        }
    }

    /// The request of `route`, `key`.
    pub async fn envelope(&self, route: &str, key: &str) -> Result<Option<Envelope>, StateError> {
        match self {
            QueueStore::Sled(s) => s.envelope(route, key),
            QueueStore::Postgres(p) => p.envelope(route, key).await,
        }
    }

    /// The first message of `lease` not settled, if any.
    pub async fn head(&self, lease: &str) -> Result<Option<Message>, StateError> {
        match self {
            QueueStore::Sled(s) => s.head(lease),
            QueueStore::Postgres(p) => p.head(lease).await,
        }
    }

    /// Up to `max` messages at the front of `lease`'s queue that have the
    /// epoch of its head (in place order): what `ordering = "none"` may send
    /// at once.
    pub async fn front(&self, lease: &str, max: usize) -> Result<Vec<Message>, StateError> {
        match self {
            QueueStore::Sled(s) => s.front(lease, max),
            QueueStore::Postgres(p) => p.front(lease, max).await,
        }
    }

    /// Leases with messages not settled (start-up, a takeover).
    pub async fn leases_with_work(&self) -> Result<Vec<String>, StateError> {
        match self {
            QueueStore::Sled(s) => s.leases_with_work(),
            QueueStore::Postgres(p) => p.leases_with_work().await,
        }
    }

    /// (route, lease) of messages that may still be sent, at least those
    /// [`super::conflict`] looks for among `routes` (name, lease, queued):
    /// on sled every one (one pass), on PostgreSQL only those (index reads).
    pub async fn holding_for(
        &self,
        routes: &[(&str, &str, bool)],
    ) -> Result<std::collections::BTreeSet<(String, String)>, StateError> {
        match self {
            QueueStore::Sled(s) => s.holding(),
            QueueStore::Postgres(p) => p.holding_for(routes).await,
        }
    }

    /// The first of `routes` (name, queued) whose name keeps state of the
    /// other kind ([`super::history_conflict`]): a direct route's name with
    /// messages kept, a queued route's name with dedup records. Index probes
    /// by route on either store.
    pub async fn other_kind(
        &self,
        routes: &[(&str, bool)],
    ) -> Result<Option<(String, bool)>, StateError> {
        match self {
            QueueStore::Sled(s) => s.other_kind(routes),
            QueueStore::Postgres(p) => p.other_kind(routes).await,
        }
    }

    /// Per route, how many messages are not settled and when the oldest
    /// lease head among them was accepted (metrics).
    pub async fn depth(&self) -> Result<Depth, StateError> {
        match self {
            QueueStore::Sled(s) => s.depth(),
            QueueStore::Postgres(p) => p.depth().await,
        }
    }

    /// Requests kept — `route`'s and every route's — where fencegate's memory
    /// holds them (sled); `None` for PostgreSQL, whose database does.
    pub fn held(&self, route: &str) -> Option<(super::message::Held, super::message::Held)> {
        match self {
            QueueStore::Sled(s) => Some(s.held(route)),
            QueueStore::Postgres(_) => None,
        }
    }

    /// [`QueueStore::depth`] without waiting, where the store can answer so
    /// (sled); `None` for PostgreSQL, whose figures are read in the
    /// background.
    pub fn depth_now(&self) -> Option<Result<Depth, StateError>> {
        match self {
            QueueStore::Sled(s) => Some(s.depth()),
            QueueStore::Postgres(_) => None,
        }
    }

    /// Writes a message's attempt as started (`delivering`), with its epoch
    /// as the newest of its lease that may have been sent: from here on an
    /// operator's retry of an older message is superseded. On sled durable
    /// only with the next [`QueueStore::durable`], so that the deliverer
    /// waits for the disk outside the lock that orders edits and other
    /// leases' starts share the flush. On PostgreSQL committed on return, or
    /// refused ([`StateError::OwnerLost`]) once a newer owner holds the
    /// shard — the attempt is then not sent.
    pub async fn start_attempt_unflushed(
        &self,
        owner: Owner,
        msg: &Message,
    ) -> Result<Written, StateError> {
        match self {
            QueueStore::Sled(s) => s.start_attempt_unflushed(msg).map(|()| Written::Unflushed),
            QueueStore::Postgres(p) => p.start_attempt(owner, msg).await.map(|()| Written::Durable),
        }
    }

    /// Waits until every write made so far is durable: what is answered from
    /// a message read now is then on disk (PostgreSQL: every write read was
    /// committed).
    pub async fn durable(&self) -> Result<(), StateError> {
        match self {
            QueueStore::Sled(s) => s.durable().await,
            QueueStore::Postgres(_) => Ok(()),
        }
    }

    /// Writes a message that stays in its queue (a retry scheduled). Durable
    /// on return.
    pub async fn put(&self, owner: Owner, msg: &Message) -> Result<(), StateError> {
        match self {
            QueueStore::Sled(s) => s.put(msg).await,
            QueueStore::Postgres(p) => p.put(owner, msg).await,
        }
    }

    /// Writes a settled message and takes it out of its queue (the next one
    /// may go). Durable on return.
    pub async fn settle(&self, owner: Owner, msg: &Message) -> Result<(), StateError> {
        match self {
            QueueStore::Sled(s) => s.settle(msg).await,
            QueueStore::Postgres(p) => p.settle(owner, msg).await,
        }
    }

    /// [`QueueStore::settle`], durable only with the store's next durable
    /// write — the next attempt's start, or [`QueueStore::durable`] — so that
    /// one flush serves a message's settlement and the next one's start. A
    /// reader answered from it waits for [`QueueStore::durable`] first, as
    /// for any write. On PostgreSQL the same as `settle` (a transaction).
    pub async fn settle_unflushed(
        &self,
        owner: Owner,
        msg: &Message,
    ) -> Result<Written, StateError> {
        match self {
            QueueStore::Sled(s) => s.settle_unflushed(msg).map(|()| Written::Unflushed),
            QueueStore::Postgres(p) => p.settle(owner, msg).await.map(|()| Written::Durable),
        }
    }

    /// Puts a failed message back at the end of its lease's queue, pending
    /// now, unless a newer epoch's message of its lease was sent or waits.
    /// Durable on return.
    pub async fn requeue(
        &self,
        owner: Owner,
        route: &str,
        key: &str,
        now_ms: u64,
    ) -> Result<Requeued, StateError> {
        match self {
            QueueStore::Sled(s) => s.requeue(route, key, now_ms).await,
            QueueStore::Postgres(p) => p.requeue(owner, route, key, now_ms).await,
        }
    }

    /// Records that a message of `lease` at `epoch` may have been sent (a
    /// restored state's fence): an operator's retry of an older one is then
    /// superseded. Durable on return.
    pub async fn raise_sent(
        &self,
        owner: Owner,
        lease: &str,
        epoch: u64,
    ) -> Result<(), StateError> {
        match self {
            QueueStore::Sled(s) => s.raise_sent(lease, epoch).await,
            QueueStore::Postgres(p) => p.raise_sent(owner, lease, epoch).await,
        }
    }

    /// The restore (a state generation) `lease`'s queue was last fenced for
    /// (0: none; [`super::Queue::fence_if_restored`]).
    pub async fn restore_fenced(&self, lease: &str) -> Result<u64, StateError> {
        match self {
            QueueStore::Sled(s) => s.restore_fenced(lease),
            QueueStore::Postgres(p) => p.restore_fenced(lease).await,
        }
    }

    /// Records that `lease`'s queue was fenced for restore `r`, written
    /// under `owner` after the fence's own writes. Durable on return.
    pub async fn mark_restore_fenced(
        &self,
        owner: Owner,
        lease: &str,
        r: u64,
    ) -> Result<(), StateError> {
        match self {
            QueueStore::Sled(s) => s.mark_restore_fenced(lease, r).await,
            QueueStore::Postgres(p) => p.mark_restore_fenced(owner, lease, r).await,
        }
    }

    /// The newest epoch of `lease` of which a message was sent (0: none).
    pub async fn sent_epoch(&self, lease: &str) -> Result<u64, StateError> {
        match self {
            QueueStore::Sled(s) => s.sent_epoch(lease),
            QueueStore::Postgres(p) => p.sent_epoch(lease).await,
        }
    }

    /// Up to `limit` messages matching, in key order (route, then key); and
    /// how many match.
    pub async fn list(
        &self,
        route: Option<&str>,
        lease: Option<&str>,
        status: Option<Status>,
        limit: usize,
    ) -> Result<(Vec<Message>, u64), StateError> {
        match self {
            QueueStore::Sled(s) => s.list(route, lease, status, limit),
            QueueStore::Postgres(p) => p.list(route, lease, status, limit).await,
        }
    }

    /// Removes settled messages last changed before `before_ms`; how many.
    pub async fn sweep(&self, before_ms: u64) -> Result<usize, StateError> {
        match self {
            QueueStore::Sled(s) => s.sweep(before_ms).await,
            QueueStore::Postgres(p) => p.sweep(before_ms).await,
        }
    }
}
