//! A queued route's phase 5 (SPEC §11): instead of claiming the key and
//! forwarding, the admitted request is written into its lease's queue under
//! its pass, durably, and answered `202 Accepted`; a retry of its key is
//! answered from the message. And the worker's status URL.

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Response, StatusCode};
use http_body_util::Full;
use serde_json::json;
use sha2::{Digest, Sha256};

use super::{Proxy, Route};
use crate::access::Seen;
use crate::admission::Claim;
use crate::config::DeriveKey;
use crate::dedup::{self, escape_segment, Action, DedupKey, KeyFrees};
use crate::error::ProxyError;
use crate::fence::Fence;
use crate::forward::{self, ClientHop};
use crate::gate::Pass;
use crate::queue::{ms, Accepted, Envelope, Message, Queue, Status};
use crate::state::RequestLine;
use crate::streaming::ProxyBody;

/// The proxy listener's path of a message's status (the `Location` of its 202).
pub(crate) const STATUS_PREFIX: &str = "/.fencegate/deliveries/";

/// The status URL of `route`, `key` (the key escaped as a path segment).
pub(crate) fn status_path(route: &str, key: &str) -> String {
    format!(
        "{STATUS_PREFIX}{}/{}",
        escape_segment(route),
        escape_segment(key)
    )
}

/// What a message keeps of its request's claim: the epoch, and the token's
/// hash (the status URL's credential).
pub(super) struct Claimed {
    epoch: crate::epoch::Epoch,
    token_sha256: Option<String>,
}

impl Claimed {
    pub(super) fn of(claim: Claim<'_>) -> Claimed {
        Claimed {
            epoch: claim.epoch,
            token_sha256: claim.token.map(|t| hex::encode(Sha256::digest(t))),
        }
    }
}

/// A message as the worker and the admin API see it.
pub(crate) fn view(m: &Message) -> serde_json::Value {
    json!({
        "route": m.route,
        "dedup_key": m.key,
        "lease": m.lease,
        "epoch": m.epoch,
        "seq": m.seq,
        "status": m.status.as_str(),
        "attempts": m.attempts,
        "unknown_outcomes": m.unknown_outcomes,
        "accepted_at": crate::clock::rfc3339(dedup::ms_to_system(m.accepted_ms)),
        "updated_at": crate::clock::rfc3339(dedup::ms_to_system(m.updated_ms)),
        "next_attempt_at": (m.status == Status::Pending)
            .then(|| crate::clock::rfc3339(dedup::ms_to_system(m.next_attempt_ms))),
        "last_status": m.last_status,
        "last_error": m.last_error,
        "location": status_path(&m.route, &m.key),
    })
}

/// `202 Accepted` for a message pending or being delivered.
fn accepted(m: &Message) -> Response<ProxyBody> {
    let mut resp = Response::new(ProxyBody::from(Full::new(Bytes::from(view(m).to_string()))));
    *resp.status_mut() = StatusCode::ACCEPTED;
    let h = resp.headers_mut();
    h.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert("x-fencegate-delivery", HeaderValue::from_static("queued"));
    if let Ok(k) = HeaderValue::from_str(&m.key) {
        h.insert("x-fencegate-dedup-key", k);
    }
    if let Ok(l) = HeaderValue::from_str(&status_path(&m.route, &m.key)) {
        h.insert(http::header::LOCATION, l);
    }
    resp
}

/// What a retry of a key with a message gets (SPEC §11, as §6 answers one).
fn answer_from(
    m: Message,
    this: &Action,
    ttl: std::time::Duration,
) -> Result<Response<ProxyBody>, ProxyError> {
    // SPEC §11 "the same key again" is §6's judgment, made by dedup's code.
    let mut first = [0u8; 32];
    let readable = hex::decode_to_slice(&m.fingerprint, &mut first).is_ok();
    // Unreadable: no request is the same as it, and what differs is unknown.
    let line = readable.then(|| RequestLine::new(&m.method, &m.path));
    // A settled message keeps its key until it is swept, `[dedup] ttl` after
    // it settled (SPEC §11), as a done record does.
    let frees = if m.status.is_settled() {
        let ttl = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        KeyFrees::At(m.updated_ms.saturating_add(ttl))
    } else {
        KeyFrees::AfterFirstEnds
    };
    this.repeats(&m.route, &m.key, (&first, line.as_ref()), frees)?;
    match m.status {
        Status::Pending | Status::Delivering => Ok(accepted(&m)),
        Status::Delivered => {
            let stored = dedup::replay_done(&m.key, m.answer.as_ref().map(|a| a.stored()))?;
            Ok(stored.to_response().map(ProxyBody::from))
        }
        Status::Failed => Err(ProxyError::DeliveryFailed {
            key: m.key,
            status: m.last_status,
            detail: m.last_error.unwrap_or_default(),
        }),
        Status::Dropped => Err(ProxyError::DeliveryDropped { key: m.key }),
    }
}

impl Proxy {
    /// Accepts an admitted request into its lease's queue (SPEC §11): its key
    /// (the worker's, else derived from the request whatever its method), the
    /// request as it will be sent, and its message, written durably under
    /// `pass` — which ends only once the write is durable, so a newer epoch's
    /// raise waits for it. Answered `202`, or from the key's message. One
    /// sequence on purpose: each step holds what the next relies on (the
    /// pass, then the route's kind).
    pub(super) async fn accept(
        &self,
        queue: &std::sync::Arc<Queue>,
        admitted: Admitted<'_>,
        seen: &mut Seen,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let Admitted {
            route,
            fence,
            parts,
            body,
            hop,
            pass,
            claim,
            worker_key,
        } = admitted;
        let method = parts.method.as_str().to_owned();
        let path_query = parts
            .uri
            .path_and_query()
            .map_or(parts.uri.path(), |pq| pq.as_str())
            .to_owned();
        let derived_from = (route.derive_key == DeriveKey::Content).then_some(&body[..]);
        let key = DedupKey::of_request(worker_key, &route.name, &method, &path_query, derived_from)
            .ok_or_else(|| ProxyError::DedupKeyMissing {
                route: route.name.clone(),
            })?;
        let key = seen.key.insert(key);
        let action = Action::new(&method, &path_query, &body);
        let fingerprint = hex::encode(action.fingerprint);
        if let Some(m) = queue
            .store
            .get(&route.name, key.as_str())
            .await
            .map_err(state)?
        {
            // Another request's acceptance may not be on disk yet: answer
            // from it only once it is.
            queue.store.durable().await.map_err(state)?;
            if !m.status.is_settled() {
                // A worker's retry of a message whose acceptance it was not
                // told of (a 503 on a COMMIT that landed later): its
                // deliverer may not know of it either.
                queue.wake(&m.lease);
            }
            return answer_from(m, &action, self.dedup.ttl());
        }
        if !self.mode.may_forward(fence.owner()) || self.state.set_up_conflict().is_some() {
            // This instance cannot deliver now (SPEC §10): accept nothing it
            // could not send.
            return Err(ProxyError::ShardUnavailable {
                lease: route.lease.clone(),
            });
        }
        let envelope = envelope_of(route, parts, hop, method, body)?;
        let epoch = claim.epoch;
        let msg = message_of(
            route,
            key,
            claim,
            &action,
            fingerprint,
            ms(self.clock.now()),
        );
        // A reload since this request found its route (its body may have
        // been slow) may have made the name direct, or moved it to another
        // lease: the checks of the reload saw no message of it, so none is
        // written now (SPEC §11, the rule of kinds). Sent again, it meets the
        // routes as they are. No reload looks at the queue or swaps the
        // routes from here until the write has ended (however long it waits
        // for its lease's transaction).
        let kinds = queue.kinds.read().await;
        let unchanged = self
            .live
            .current()
            .routes
            .get(&route.name)
            .is_some_and(|r| r.queued && r.lease == route.lease);
        if !unchanged {
            return Err(ProxyError::RouteChanged {
                route: route.name.clone(),
            });
        }
        let done = queue
            .store
            .accept(fence.owner(), msg, &envelope, &route.queue_bound, {
                let abort = pass.abort_signal();
                std::sync::Arc::new(move || !abort.is_aborted())
            })
            .await
            .map_err(state);
        drop(kinds);
        // Durable (or failed): a newer epoch's raise may go on.
        let newer = pass.newer_epoch();
        drop(pass);
        if done.is_err() {
            // The outcome may be unknown (a COMMIT whose answer was lost): a
            // message committed anyway must not wait for the lease's next
            // acceptance. A wake with nothing to send is harmless. (One that
            // lands later still is found by the queue's once-a-second look
            // on PostgreSQL, `Queue::read_depth`.)
            queue.wake(route.lease.as_str());
        }
        match done? {
            Accepted::New(m) => {
                crate::failpoint::hit("queue_accepted");
                queue.wake(&m.lease);
                Ok(accepted(&m))
            }
            Accepted::Exists(m) => {
                queue.store.durable().await.map_err(state)?;
                if !m.status.is_settled() {
                    queue.wake(&m.lease);
                }
                answer_from(m, &action, self.dedup.ttl())
            }
            Accepted::Full { bound, limit } => Err(ProxyError::QueueFull {
                route: route.name.clone(),
                bound,
                limit,
            }),
            Accepted::Aborted => Err(ProxyError::DrainAborted {
                lease: route.lease.clone(),
                epoch,
                newer,
                doubt: crate::error::Doubt::NotSent,
            }),
        }
    }
}

/// An admitted request handed to its lease's queue: what
/// [`Proxy::accept`] writes, and the pass it writes under.
pub(super) struct Admitted<'a> {
    pub route: &'a Route,
    pub fence: &'a Fence,
    pub parts: Parts,
    pub body: Bytes,
    pub hop: &'a ClientHop,
    pub pass: Pass,
    pub claim: Claimed,
    pub worker_key: Option<DedupKey>,
}

/// The request as it will be sent (SPEC §11): its end-to-end headers, the
/// path below the route's prefix, the query and the body.
fn envelope_of(
    route: &Route,
    mut parts: Parts,
    hop: &ClientHop,
    method: String,
    body: Bytes,
) -> Result<Envelope, ProxyError> {
    forward::end_to_end(&mut parts.headers, hop)
        .map_err(|detail| ProxyError::UpstreamUnreachable { detail })?;
    let rest = parts
        .uri
        .path()
        .get(route.target.prefix.len()..)
        .unwrap_or("")
        .to_owned();
    Ok(Envelope {
        method,
        rest,
        query: parts.uri.query().map(str::to_owned),
        headers: parts
            .headers
            .iter()
            .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
            .collect(),
        body,
    })
}

/// A new message of `key`, pending from `now` at the claim's epoch.
fn message_of(
    route: &Route,
    key: &DedupKey,
    claim: Claimed,
    action: &Action,
    fingerprint: String,
    now: u64,
) -> Message {
    Message {
        route: route.name.clone(),
        key: key.as_str().to_owned(),
        lease: route.lease.as_str().to_owned(),
        epoch: claim.epoch.get(),
        seq: 0,
        fingerprint,
        method: action.request.method.clone(),
        path: action.request.path.clone(),
        token_sha256: claim.token_sha256,
        status: Status::Pending,
        attempts: 0,
        unknown_outcomes: 0,
        accepted_ms: now,
        updated_ms: now,
        next_attempt_ms: now,
        last_status: None,
        last_error: None,
        answer: None,
    }
}

fn state(e: crate::state::StateError) -> ProxyError {
    ProxyError::StateUnavailable {
        detail: e.to_string(),
    }
}

impl Proxy {
    /// `GET {STATUS_PREFIX}{route}/{key}` on the proxy listener: the message's
    /// status for its worker, authenticated by the lease token it was accepted
    /// with (none on a route with `require_token = false`).
    pub(super) async fn delivery_status<B>(&self, req: &http::Request<B>) -> Response<ProxyBody> {
        self.status_of(req)
            .await
            .unwrap_or_else(|e| e.to_response().map(ProxyBody::from))
    }

    async fn status_of<B>(
        &self,
        req: &http::Request<B>,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        use crate::admission::Refusal;
        if !matches!(*req.method(), http::Method::GET | http::Method::HEAD) {
            return Err(ProxyError::RouteNotFound);
        }
        let rest = &req.uri().path()[STATUS_PREFIX.len()..];
        let Some((route, key)) = rest.split_once('/') else {
            return Err(ProxyError::DeliveryNotFound);
        };
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8()
                .map(|c| c.into_owned())
        };
        let (Ok(route), Ok(key)) = (decode(route), decode(key)) else {
            return Err(ProxyError::DeliveryNotFound);
        };
        if !dedup::could_name(&route, &key) {
            return Err(ProxyError::DeliveryNotFound);
        }
        let queue = self.queue.as_ref().ok_or(ProxyError::DeliveryNotFound)?;
        let m = queue
            .store
            .get(&route, &key)
            .await
            .map_err(state)?
            .ok_or(ProxyError::DeliveryNotFound)?;
        if let Some(want) = &m.token_sha256 {
            let lease = crate::epoch::LeaseName::parse(&m.lease)
                .map_err(|_| ProxyError::DeliveryNotFound)?;
            let mut tokens = req.headers().get_all(crate::headers::LEASE_TOKEN).iter();
            let (Some(t), None) = (tokens.next(), tokens.next()) else {
                return Err(ProxyError::Refused(Refusal::TokenMissing { lease }));
            };
            if hex::encode(Sha256::digest(t.as_bytes())) != *want {
                return Err(ProxyError::Refused(Refusal::TokenInvalid {
                    lease,
                    epoch: crate::epoch::Epoch::new(m.epoch),
                }));
            }
        }
        // What is shown is on disk (another request may have just written it).
        queue.store.durable().await.map_err(state)?;
        let mut resp = Response::new(ProxyBody::from(Full::new(Bytes::from(
            view(&m).to_string(),
        ))));
        resp.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        Ok(resp)
    }
}
