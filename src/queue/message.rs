//! The queue's records (SPEC §11): what a message is, where it stands, and
//! what a store answers. Below both stores ([`super::sled`],
//! [`super::postgres`]) and the [`super::store::QueueStore`] that picks one.

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::state::{StateError, StoredResponse};

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
    /// Past a bound of the queue (SPEC §11 `queue_full`): nothing written.
    Full {
        /// Which: `route_messages`, `route_bytes`, `total_messages`, `total_bytes`.
        bound: &'static str,
        /// Its value.
        limit: u64,
    },
}

/// A route's (or the queue's) requests kept: how many, and their bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Held {
    /// Messages whose request is kept.
    pub messages: u64,
    /// The bytes of those requests as stored.
    pub bytes: u64,
}

/// How much a queued route may keep (SPEC §11 `queue_full`).
#[derive(Debug, Clone, Copy)]
pub struct QueueBound {
    /// `[[route]] queue_max_messages`.
    pub route_messages: Option<u64>,
    /// `[[route]] queue_max_bytes`.
    pub route_bytes: Option<u64>,
    /// `[state] queue_max_messages`.
    pub total_messages: u64,
    /// `[state] queue_max_bytes`.
    pub total_bytes: u64,
}

impl QueueBound {
    /// No bound (tests and tools).
    pub const NONE: QueueBound = QueueBound {
        route_messages: None,
        route_bytes: None,
        total_messages: u64::MAX,
        total_bytes: u64::MAX,
    };

    /// Why a message of `bytes` more does not fit, with the bound, if it does not.
    pub fn refuses(&self, route: Held, total: Held, bytes: u64) -> Option<(&'static str, u64)> {
        let over = |held: u64, add: u64, max: u64| held.saturating_add(add) > max;
        if let Some(max) = self.route_messages.filter(|m| over(route.messages, 1, *m)) {
            return Some(("route_messages", max));
        }
        if let Some(max) = self.route_bytes.filter(|m| over(route.bytes, bytes, *m)) {
            return Some(("route_bytes", max));
        }
        if over(total.messages, 1, self.total_messages) {
            return Some(("total_messages", self.total_messages));
        }
        if over(total.bytes, bytes, self.total_bytes) {
            return Some(("total_bytes", self.total_bytes));
        }
        None
    }
}

/// Why an operator's retry or drop was refused.
#[derive(Debug, thiserror::Error)]
pub enum Edit {
    #[error("no queued message has this route and key")]
    /// No such message.
    NotFound,
    #[error("the message is {}: retry takes a pending or failed one, drop a pending or failed one", .0.as_str())]
    /// Its status allows neither.
    Conflict(Status),
    #[error("a message of epoch {0} of its lease was sent or waits: retrying this older one would deliver it after that one")]
    /// A newer epoch's message of its lease was sent, or waits.
    Superseded(u64),
    #[error("the state store: {0}")]
    /// The state could not be read or written.
    State(#[from] StateError),
    #[error("this instance does not serve the message's lease now (SPEC §10): act on the instance that owns its shard")]
    /// Its lease is not served here now.
    NotServed,
}

/// Which time a listing's `since` and `until` read (SPEC §11 `GET
/// /v1/deliveries`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ListedBy {
    /// When the message was accepted.
    #[default]
    Accepted,
    /// When it last changed (a settled one: when it settled).
    Updated,
}

/// An operator's listing of messages: the filters, where the page starts and
/// how long it is. Messages come in one stable order, by route then key (as
/// bytes), on every store.
#[derive(Debug, Clone, Default)]
pub struct Listing {
    /// Only this route's.
    pub route: Option<String>,
    /// Only this lease's.
    pub lease: Option<String>,
    /// Only in this status.
    pub status: Option<Status>,
    /// At or after this time (ms since the epoch), by `by`.
    pub since_ms: Option<u64>,
    /// Before this time (ms since the epoch), by `by`.
    pub until_ms: Option<u64>,
    /// Which time `since` and `until` read.
    pub by: ListedBy,
    /// The page starts after this (route, key): the `next` of the one before.
    pub after: Option<(String, String)>,
    /// The page's length at most.
    pub limit: usize,
}

impl Listing {
    /// Whether `m` matches the filters (not the page's start).
    pub fn matches(&self, m: &Message) -> bool {
        let at = match self.by {
            ListedBy::Accepted => m.accepted_ms,
            ListedBy::Updated => m.updated_ms,
        };
        self.route.as_deref().is_none_or(|r| r == m.route)
            && self.lease.as_deref().is_none_or(|l| l == m.lease)
            && self.status.is_none_or(|s| s == m.status)
            && self.since_ms.is_none_or(|t| at >= t)
            && self.until_ms.is_none_or(|t| at < t)
    }

    /// Whether `m` comes after the page's start.
    pub fn after_start(&self, m: &Message) -> bool {
        self.after.as_ref().is_none_or(|(r, k)| {
            (m.route.as_bytes(), m.key.as_bytes()) > (r.as_bytes(), k.as_bytes())
        })
    }
}
