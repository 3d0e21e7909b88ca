//! The queue's records (SPEC §11): what a message is, and where it is kept —
//! on sled beside the marks (a single instance, [`super::sled`]) or in
//! PostgreSQL, every write under the shard owner's generation (a cluster, or
//! a single instance on PostgreSQL, [`super::postgres`]).

use std::sync::Arc;

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::state::{Owner, StateError, StoredResponse};

/// Where a message stands (SPEC §11).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Accepted; waiting for its turn or its next attempt.
    Pending,
    /// An attempt was written as started: its request may be on the wire.
    Delivering,
    /// The destination answered 2xx.
    Delivered,
    /// The last attempt failed, or the destination refused it for good.
    Failed,
    /// An operator dropped it.
    Dropped,
}

impl Status {
    /// The name SPEC, the admin API and the metrics use.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Pending => "pending",
            Status::Delivering => "delivering",
            Status::Delivered => "delivered",
            Status::Failed => "failed",
            Status::Dropped => "dropped",
        }
    }

    /// Parses [`Status::as_str`]'s names.
    pub fn parse(s: &str) -> Option<Status> {
        [
            Status::Pending,
            Status::Delivering,
            Status::Delivered,
            Status::Failed,
            Status::Dropped,
        ]
        .into_iter()
        .find(|st| st.as_str() == s)
    }

    /// Settled: no attempt will be made unless an operator retries it.
    pub fn is_settled(self) -> bool {
        matches!(self, Status::Delivered | Status::Failed | Status::Dropped)
    }
}

/// A stored answer (the 2xx that delivered a message), bytes in base64.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Answer {
    /// The destination's status.
    pub status: u16,
    /// Its headers, values in base64.
    pub headers: Vec<(String, String)>,
    /// `None` when over the route's `max_replay_bytes`.
    pub body: Option<String>,
}

impl Answer {
    /// Keeps `status`, `headers` and `body` (if whole and within the limit).
    pub fn new(status: u16, headers: &http::HeaderMap, body: Option<&[u8]>) -> Answer {
        Answer {
            status,
            headers: headers
                .iter()
                .map(|(n, v)| (n.as_str().to_owned(), STANDARD.encode(v.as_bytes())))
                .collect(),
            body: body.map(|b| STANDARD.encode(b)),
        }
    }

    /// As a dedup record keeps one, to be replayed the same way (SPEC §6).
    pub fn stored(&self) -> StoredResponse {
        StoredResponse {
            status: self.status,
            headers: self
                .headers
                .iter()
                .filter_map(|(n, v)| Some((n.clone(), STANDARD.decode(v).ok()?)))
                .collect(),
            body: self
                .body
                .as_ref()
                .and_then(|b| STANDARD.decode(b).ok())
                .map(Bytes::from),
        }
    }
}

/// One message's record: everything but its request.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Message {
    /// The route it was accepted on.
    pub route: String,
    /// Its dedup key (the worker's, or derived).
    pub key: String,
    /// The lease whose queue it is in.
    pub lease: String,
    /// The epoch it was accepted at.
    pub epoch: u64,
    /// Its place in its lease's queue (strictly increasing per lease).
    pub seq: u64,
    /// Hex SHA-256 of method, path and query, and body: tells a retry from a
    /// reused key (SPEC §6).
    pub fingerprint: String,
    /// The request's method and path (no query), to say how a reused key's
    /// request differs.
    pub method: String,
    /// The request's path, without its query.
    pub path: String,
    /// Hex SHA-256 of the lease token it was accepted with: the status URL's
    /// credential. `None` on a route with `require_token = false`.
    pub token_sha256: Option<String>,
    /// Where it stands.
    pub status: Status,
    /// Attempts started.
    pub attempts: u32,
    /// Attempts whose outcome was unknown (a timeout, a reset, a crash while
    /// one was out): the destination may have seen this message more than once.
    pub unknown_outcomes: u32,
    /// When it was accepted (ms since the Unix epoch).
    pub accepted_ms: u64,
    /// When it last changed.
    pub updated_ms: u64,
    /// When the next attempt may start (ms since the Unix epoch).
    pub next_attempt_ms: u64,
    /// The destination's last status, if it answered.
    pub last_status: Option<u16>,
    /// Why the last attempt failed.
    pub last_error: Option<String>,
    /// The answer that delivered it.
    pub answer: Option<Answer>,
}

/// The request as the worker sent it, its end-to-end headers as SPEC §3
/// forwards them; the route's own (upstream URI, `Host`, dedup header,
/// `upstream_headers`, signature) are set per attempt, from the route as it is
/// then.
#[derive(Debug, Clone)]
pub struct Envelope {
    /// The request's method.
    pub method: String,
    /// The request's path after the route's prefix, and its query.
    pub rest: String,
    /// The request's query, if any.
    pub query: Option<String>,
    /// The headers as forwarded (hop-by-hop removed, the route's added).
    pub headers: Vec<(String, Vec<u8>)>,
    /// The body.
    pub body: Bytes,
}

#[derive(Serialize, Deserialize)]
struct EnvelopeHead {
    method: String,
    rest: String,
    query: Option<String>,
    headers: Vec<(String, String)>,
}

impl Envelope {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let head = EnvelopeHead {
            method: self.method.clone(),
            rest: self.rest.clone(),
            query: self.query.clone(),
            headers: self
                .headers
                .iter()
                .map(|(n, v)| (n.clone(), STANDARD.encode(v)))
                .collect(),
        };
        let head = serde_json::to_vec(&head).unwrap_or_default();
        let mut out = Vec::with_capacity(4 + head.len() + self.body.len());
        out.extend_from_slice(&(head.len() as u32).to_be_bytes());
        out.extend_from_slice(&head);
        out.extend_from_slice(&self.body);
        out
    }

    pub(crate) fn decode(raw: &[u8]) -> Option<Envelope> {
        let len = u32::from_be_bytes(raw.get(..4)?.try_into().ok()?) as usize;
        let head: EnvelopeHead = serde_json::from_slice(raw.get(4..4 + len)?).ok()?;
        Some(Envelope {
            method: head.method,
            rest: head.rest,
            query: head.query,
            headers: head
                .headers
                .into_iter()
                .map(|(n, v)| Some((n, STANDARD.decode(v).ok()?)))
                .collect::<Option<_>>()?,
            body: Bytes::copy_from_slice(raw.get(4 + len..)?),
        })
    }
}

/// What [`QueueStore::requeue`] did.
#[derive(Debug)]
pub enum Requeued {
    /// Pending again, at the end of its lease's queue.
    Done(Box<Message>),
    /// No such message (swept meanwhile).
    Gone,
    /// It is not failed (its status).
    NotFailed(Status),
    /// A message of this newer epoch of its lease was sent or waits.
    Superseded(u64),
}

/// What [`QueueStore::accept`] did.
#[derive(Debug)]
pub enum Accepted {
    /// Written (durable on return), with its sequence number.
    New(Message),
    /// The key has a message already: answered from it.
    Exists(Message),
    /// The request's pass was aborted before its place in the queue was taken.
    Aborted,
}

/// Where the queue is kept: sled (a single instance) or PostgreSQL (a
/// cluster, or a single instance on PostgreSQL). Writes name the [`Owner`]
/// they are made under; sled has one owner and ignores it.
pub enum QueueStore {
    /// Trees beside the marks, on sled.
    Sled(super::sled::SledQueue),
    /// Tables beside the dedup records, in PostgreSQL.
    Postgres(super::postgres::PgQueue),
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
        admitted: Admitted,
    ) -> Result<Accepted, StateError> {
        match self {
            QueueStore::Sled(s) => s.accept(msg, envelope, || admitted()).await,
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

    /// (route, lease) of every message that may still be sent (start-up and
    /// reload: [`super::conflict`]).
    pub async fn holding(
        &self,
    ) -> Result<std::collections::BTreeSet<(String, String)>, StateError> {
        match self {
            QueueStore::Sled(s) => s.holding(),
            QueueStore::Postgres(p) => p.holding().await,
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

    /// [`QueueStore::depth`] without waiting, where the store can answer so
    /// (sled); `None` for PostgreSQL, whose figures are read in the
    /// background.
    pub fn depth_now(&self) -> Option<Result<Depth, StateError>> {
        match self {
            QueueStore::Sled(s) => Some(s.depth()),
            QueueStore::Postgres(_) => None,
        }
    }

    /// Writes a message's attempt as started (`delivering`), with its epoch as
    /// the newest of its lease that may have been sent: from here on an
    /// operator's retry of an older message is superseded, whatever becomes of
    /// this one. Durable on return; in PostgreSQL refused
    /// ([`StateError::OwnerLost`]) once a newer owner holds the shard — the
    /// attempt is then not sent.
    pub async fn start_attempt(&self, owner: Owner, msg: &Message) -> Result<(), StateError> {
        match self {
            QueueStore::Sled(s) => s.start_attempt(msg).await,
            QueueStore::Postgres(p) => p.start_attempt(owner, msg).await,
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
