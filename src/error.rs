//! Every response fencegate makes itself, in one place: SPEC §7's status, error
//! code, JSON body (`{"error", "message", ...context}`) and `X-Fencegate-Error`.
//!
//! Modules return typed errors; this is the only code that knows their statuses.
//! A worker's `message` says what happened and then what to do next
//! ([`ProxyError::next_step`]); the access log keeps only what happened.

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode};
use http_body_util::Full;
use serde_json::{json, Map, Value};

use crate::admission::Refusal;
use crate::dedup::{record_path, DedupError, Differs, KeyFrees};
use crate::epoch::{Epoch, LeaseName};
use crate::fence::FenceError;
use crate::protect::{Reason as HeldReason, Refused};
use crate::state::{State, StateError};

pub(crate) const ERROR_HEADER: &str = "x-fencegate-error";

/// Why fencegate answered a request itself instead of the upstream.
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum ProxyError {
    #[error("no route matches this path")]
    RouteNotFound,
    /// A path no route takes whatever the routes are (SPEC §3): a dot segment
    /// or an encoded slash could escape a route's prefix at the upstream.
    #[error("this path has a dot segment (`.`, `..`, or `%2e`) or an encoded slash (`%2F`), which could reach outside a route's prefix at the upstream: no route takes it")]
    PathUnroutable,
    #[error("X-Lease-Epoch is required: this route is fenced by lease {lease}")]
    EpochMissing {
        lease: LeaseName,
        /// The route requires `X-Lease-Token` too.
        token: bool,
    },
    #[error("X-Lease-Epoch {0}")]
    EpochMalformed(&'static str),
    #[error("X-Lease-Token is repeated: send exactly one")]
    TokenRepeated,
    #[error("Idempotency-Key must be 1-255 visible ASCII characters ({0})")]
    DedupKeyMalformed(&'static str),
    #[error("request body exceeds the route's limit of {limit} bytes")]
    BodyTooLarge { limit: usize },
    #[error("the request body could not be read: {detail}")]
    BodyUnreadable { detail: String },
    #[error("the request body did not arrive within the route's timeout")]
    BodyTimeout,
    #[error("{0}")]
    Refused(Refusal),
    #[error("the lease store cannot be reached and epoch {epoch} of lease {lease} cannot be validated from cache: {detail}")]
    StoreUnavailable {
        lease: LeaseName,
        epoch: Epoch,
        detail: String,
    },
    #[error("fencegate's state (marks and dedup records) cannot be written: {detail}")]
    StateUnavailable { detail: String },
    #[error("a request with this idempotency key is already in flight")]
    DedupInFlight { key: String },
    #[error("the outcome of an earlier request with this idempotency key is unknown (the key is in doubt)")]
    DedupInDoubt { route: String, key: String },
    #[error("this idempotency key was used for a different request: {}", differs_text(.differs))]
    DedupKeyReused {
        route: String,
        key: String,
        differs: Differs,
        frees: KeyFrees,
    },
    #[error("a request with this idempotency key was delivered; its response was not stored (too large, or resolved as delivered by an operator)")]
    DedupDone { key: String, status: Option<u16> },
    #[error("route {route} queues what it accepts and needs a key to find it again: this request has no Idempotency-Key and the route's derive_key is \"none\"")]
    DedupKeyMissing { route: String },
    #[error("the queued message with this idempotency key failed: {detail}")]
    DeliveryFailed {
        key: String,
        status: Option<u16>,
        detail: String,
    },
    #[error("the queued message with this idempotency key was dropped by an operator")]
    DeliveryDropped { key: String },
    #[error("no queued message has this route and key")]
    DeliveryNotFound,
    #[error("protocol upgrades (WebSocket, h2c) are not proxied")]
    UpgradeUnsupported,
    #[error("the upstream could not be reached; nothing was sent")]
    UpstreamUnreachable { detail: String },
    #[error("the upstream did not answer in time or the connection failed after the request was sent; the outcome is unknown")]
    UpstreamTimeout { detail: String, doubt: Doubt },
    #[error("aborted: epoch {newer} of lease {lease} was admitted and this older request did not finish within the drain timeout; the outcome is unknown")]
    DrainAborted {
        lease: LeaseName,
        epoch: Epoch,
        newer: Epoch,
        doubt: Doubt,
    },
    #[error("fencegate shut down while this request was at the upstream; the outcome is unknown")]
    ShuttingDown { doubt: Doubt },
    #[error("lease {lease} is not served here right now; retry shortly")]
    ShardUnavailable { lease: LeaseName },
    #[error("X-Fencegate-Peer is only accepted from this cluster's instances, with the cluster's peer token")]
    PeerUnauthorized,
    #[error("{}", held_text(.route, .refused.reason))]
    UpstreamHeld { route: String, refused: Refused },
    #[error("route {route} was changed by a reload while this request was read")]
    RouteChanged { route: String },
    #[error("route {route}'s queue is full ({bound}: {limit})")]
    QueueFull {
        route: String,
        bound: &'static str,
        limit: u64,
    },
}

/// Why route `route` forwards nothing now (SPEC §9, protecting the destination).
fn held_text(route: &str, reason: HeldReason) -> String {
    match reason {
        HeldReason::InFlightLimit { limit } => format!(
            "route {route} has {limit} requests at its upstream already (its max_in_flight)"
        ),
        HeldReason::RetryAfter => format!(
            "route {route} is held: its upstream answered 429 or 503 with a Retry-After that has not passed"
        ),
        HeldReason::ConnectionBudget => format!(
            "route {route}: every upstream request this instance's descriptor budget allows is out"
        ),
        HeldReason::BreakerOpen => format!(
            "route {route}'s circuit breaker is open: its upstream failed repeatedly and is let rest"
        ),
        HeldReason::Rate => {
            format!("route {route} has sent as many requests as its rate allows for now")
        }
    }
}

/// Where a request whose outcome is unknown leaves its dedup key (SPEC §6): what
/// a 504's worker may do next.
#[derive(Debug, Clone)]
pub(crate) enum Doubt {
    /// Nothing reached the upstream: the key, if any, is free again.
    NotSent,
    /// The key's record is `in_doubt` now.
    Key {
        route: String,
        key: String,
        /// The route's `in_doubt = "resend"`.
        resend: bool,
    },
    /// The request kept no dedup record (no key, or `derive_key = "none"`).
    Unrecorded,
    /// Relayed to the shard's owner, which may have forwarded it.
    Relayed,
}

impl Doubt {
    fn next_step(&self) -> String {
        match self {
            Doubt::NotSent => {
                "Nothing reached the upstream and the idempotency key, if any, is free: \
                 sending it again (with a current epoch) is safe"
                    .into()
            }
            Doubt::Key {
                key, resend: true, ..
            } => format!(
                "Idempotency key {key} is now in doubt; this route resends such requests \
                 (in_doubt = \"resend\"): a retry with the same key and request is forwarded \
                 again, so the destination may get it twice"
            ),
            Doubt::Key { route, key, .. } => format!(
                "Idempotency key {key} is now in doubt: a retry with it gets 409 \
                 dedup_in_doubt, never a second delivery, until an operator has checked the \
                 destination and resolved it on fencegate's admin listener ({}). {}",
                resolve_hint(route, key),
                RESOLVE_MEANS
            ),
            Doubt::Unrecorded => "Nothing was recorded for it (no idempotency key): check the \
                 destination before sending it again"
                .into(),
            Doubt::Relayed => "The shard's owner may have forwarded it: a retry with the same \
                 idempotency key tells where it stands (the stored answer, or 409 \
                 dedup_in_doubt); without a key, check the destination first"
                .into(),
        }
    }

    fn context(&self, ctx: &mut Map<String, Value>) {
        if let Doubt::Key { key, .. } = self {
            ctx.insert("dedup_key".into(), json!(key));
        }
    }
}

/// What each resolution of an in-doubt key does.
const RESOLVE_MEANS: &str = "\"delivered\" makes it done (a retry gets 409 dedup_done); \
     \"not_delivered\" frees it for a retry";

/// Where an operator resolves `key` of `route`: the admin API and the page.
fn resolve_hint(route: &str, key: &str) -> String {
    format!(
        "POST {}/resolve with {{\"outcome\": \"delivered\"}} or \
         {{\"outcome\": \"not_delivered\"}} and the admin token, or the operator's page: \
         GET / in a browser, under \"In doubt\"",
        record_path(route, key)
    )
}

fn differs_text(d: &Differs) -> String {
    match d {
        Differs::Method(first) => format!("its method differs (the first request was {first})"),
        Differs::Path(first) => format!("its path differs (the first request's was {first})"),
        Differs::QueryOrBody => "same method and path, but the query or the body differs".into(),
        Differs::Unknown => "its method, path, query or body differs".into(),
    }
}

/// Why the admin API answered with an error (SPEC §8), mapped here like
/// [`ProxyError`] and with the same body.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AdminError {
    #[error("no such admin endpoint")]
    NoSuchEndpoint,
    #[error("no route named {0:?}")]
    RouteNotFound(String),
    #[error("route {0:?} is not queued: only queued deliveries pause")]
    RouteNotQueued(String),
    #[error("no queued route uses lease {0:?}")]
    LeaseNotFound(String),
    #[error("no bulk job has this id")]
    JobNotFound,
    #[error("the dedup key is malformed ({0})")]
    DedupKeyMalformed(&'static str),
    #[error("no record for that key")]
    RecordNotFound,
    #[error("the record is {}, not in_doubt", .0.as_str())]
    NotInDoubt(State),
    #[error("{0}")]
    BadRequest(&'static str),
    #[error(
        "mutating admin calls are disabled: set [server] admin_token or FENCEGATE_ADMIN_TOKEN"
    )]
    Disabled,
    #[error("a valid Authorization: Bearer token is required")]
    Unauthorized,
    #[error("the state store: {0}")]
    State(#[from] StateError),
    #[error("this instance does not serve the route's lease right now")]
    ShardUnavailable,
    #[error("this endpoint takes {0}")]
    MethodNotAllowed(&'static str),
    #[error("refused: the request did not come from the operator page of this listener")]
    CrossSite,
    #[error("{0}")]
    Delivery(#[from] crate::queue::message::Edit),
    #[error("too many wrong admin tokens from this address: try again after Retry-After ({0} s)")]
    TooManyAttempts(u64),
}

impl AdminError {
    pub(crate) fn status_and_code(&self) -> (StatusCode, &'static str) {
        use AdminError as E;
        match self {
            E::NoSuchEndpoint => (StatusCode::NOT_FOUND, "not_found"),
            E::RouteNotFound(_) => (StatusCode::NOT_FOUND, "route_not_found"),
            E::RouteNotQueued(_) => (StatusCode::CONFLICT, "route_not_queued"),
            E::LeaseNotFound(_) => (StatusCode::NOT_FOUND, "lease_not_found"),
            E::JobNotFound => (StatusCode::NOT_FOUND, "delivery_job_not_found"),
            E::DedupKeyMalformed(_) => (StatusCode::BAD_REQUEST, "dedup_key_malformed"),
            E::RecordNotFound => (StatusCode::NOT_FOUND, "dedup_record_not_found"),
            E::NotInDoubt(_) => (StatusCode::CONFLICT, "dedup_not_in_doubt"),
            E::BadRequest(_) => (StatusCode::BAD_REQUEST, "bad_request"),
            E::Disabled => (StatusCode::FORBIDDEN, "admin_disabled"),
            E::Unauthorized => (StatusCode::UNAUTHORIZED, "unauthorized"),
            E::State(_) => (StatusCode::SERVICE_UNAVAILABLE, "state_unavailable"),
            E::ShardUnavailable => (StatusCode::SERVICE_UNAVAILABLE, "shard_unavailable"),
            E::MethodNotAllowed(_) => (StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed"),
            E::CrossSite => (StatusCode::FORBIDDEN, "cross_site_refused"),
            E::TooManyAttempts(_) => (StatusCode::TOO_MANY_REQUESTS, "too_many_attempts"),
            E::Delivery(e) => match e {
                crate::queue::message::Edit::NotFound => {
                    (StatusCode::NOT_FOUND, "delivery_not_found")
                }
                crate::queue::message::Edit::Conflict(_) => {
                    (StatusCode::CONFLICT, "delivery_conflict")
                }
                crate::queue::message::Edit::Superseded(_) => {
                    (StatusCode::CONFLICT, "delivery_superseded")
                }
                crate::queue::message::Edit::State(_) => {
                    (StatusCode::SERVICE_UNAVAILABLE, "state_unavailable")
                }
                crate::queue::message::Edit::NotServed => {
                    (StatusCode::SERVICE_UNAVAILABLE, "shard_unavailable")
                }
            },
        }
    }

    pub(crate) fn to_response(&self) -> Response<Full<Bytes>> {
        let (status, code) = self.status_and_code();
        let mut resp = error_response(status, code, self.to_string(), Map::new());
        if status == StatusCode::UNAUTHORIZED {
            resp.headers_mut().insert(
                http::header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer"),
            );
        }
        if let AdminError::TooManyAttempts(secs) = self {
            resp.headers_mut()
                .insert(http::header::RETRY_AFTER, HeaderValue::from(*secs));
        }
        if let AdminError::MethodNotAllowed(allow) = self {
            resp.headers_mut()
                .insert(http::header::ALLOW, HeaderValue::from_static(allow));
        }
        resp
    }
}

/// The body and headers every fencegate-made error shares (SPEC §7).
fn error_response(
    status: StatusCode,
    code: &'static str,
    message: String,
    mut body: Map<String, Value>,
) -> Response<Full<Bytes>> {
    body.insert("error".into(), json!(code));
    body.insert("message".into(), json!(message));
    let bytes = serde_json::to_vec(&Value::Object(body)).unwrap_or_default();
    let mut resp = Response::new(Full::new(Bytes::from(bytes)));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(
        http::header::CACHE_CONTROL,
        HeaderValue::from_static("no-store"),
    );
    h.insert(ERROR_HEADER, HeaderValue::from_static(code));
    if status == StatusCode::SERVICE_UNAVAILABLE {
        h.insert(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    resp
}

/// A request hyper refuses before fencegate sees it (SPEC §7, §9 "Limits"):
/// the head broke HTTP/1.1's grammar or a head limit. hyper writes such an
/// answer itself; [`crate::server`] replaces it with this one, whole, in
/// fencegate's format (`X-Fencegate-Error` and a JSON body), and the
/// connection closes after it.
pub(crate) fn unparsable_head(status: u16) -> Vec<u8> {
    let (status, code, message) = match status {
        414 => (
            StatusCode::URI_TOO_LONG,
            "uri_too_long",
            "The request target is longer than 65534 bytes",
        ),
        431 => (
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "headers_too_large",
            "The request head has more than 100 header fields or more than 128 KiB",
        ),
        505 => (
            StatusCode::HTTP_VERSION_NOT_SUPPORTED,
            "request_malformed",
            "The request's HTTP version is not supported",
        ),
        _ => (
            StatusCode::BAD_REQUEST,
            "request_malformed",
            "The request head is not valid HTTP/1.1",
        ),
    };
    let body = serde_json::to_vec(&json!({
        "error": code,
        "message": format!("{message}; nothing was forwarded and the connection is closed"),
    }))
    .unwrap_or_default();
    let mut out = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncache-control: no-store\r\n\
         {ERROR_HEADER}: {code}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    out
}

impl From<Refusal> for ProxyError {
    fn from(r: Refusal) -> Self {
        ProxyError::Refused(r)
    }
}

impl From<DedupError> for ProxyError {
    fn from(e: DedupError) -> Self {
        match e {
            DedupError::InFlight { key } => ProxyError::DedupInFlight { key },
            DedupError::InDoubt { route, key } => ProxyError::DedupInDoubt { route, key },
            DedupError::KeyReused {
                route,
                key,
                differs,
                frees,
            } => ProxyError::DedupKeyReused {
                route,
                key,
                differs,
                frees,
            },
            DedupError::Done { key, status } => ProxyError::DedupDone { key, status },
            DedupError::State(e) => ProxyError::StateUnavailable {
                detail: e.to_string(),
            },
        }
    }
}

impl From<FenceError> for ProxyError {
    fn from(e: FenceError) -> Self {
        match e {
            FenceError::Refused(r) => ProxyError::Refused(r),
            FenceError::StoreUnavailable {
                lease,
                epoch,
                detail,
            } => ProxyError::StoreUnavailable {
                lease,
                epoch,
                detail,
            },
            FenceError::State(d) => ProxyError::StateUnavailable {
                detail: d.to_string(),
            },
            FenceError::Stopped { lease } => ProxyError::ShardUnavailable { lease },
        }
    }
}

impl ProxyError {
    /// The SPEC §7 status and code.
    pub(crate) fn status_and_code(&self) -> (StatusCode, &'static str) {
        use ProxyError as E;
        match self {
            E::RouteNotFound | E::PathUnroutable => (StatusCode::NOT_FOUND, "route_not_found"),
            E::EpochMissing { .. } => (StatusCode::PRECONDITION_REQUIRED, "epoch_missing"),
            E::EpochMalformed(_) => (StatusCode::BAD_REQUEST, "epoch_malformed"),
            E::TokenRepeated => (StatusCode::FORBIDDEN, "token_invalid"),
            E::DedupKeyMalformed(_) => (StatusCode::BAD_REQUEST, "dedup_key_malformed"),
            E::BodyTooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, "body_too_large"),
            // Not in SPEC §7's table: a body that breaks off or trickles in.
            E::BodyUnreadable { .. } => (StatusCode::BAD_REQUEST, "body_malformed"),
            E::BodyTimeout => (StatusCode::REQUEST_TIMEOUT, "body_timeout"),
            E::Refused(r) => match r {
                Refusal::TokenMissing { .. } => (StatusCode::UNAUTHORIZED, "token_missing"),
                Refusal::TokenInvalid { .. } => (StatusCode::FORBIDDEN, "token_invalid"),
                Refusal::EpochUnknown { .. } => (StatusCode::FORBIDDEN, "epoch_unknown"),
                Refusal::EpochInvalid { .. } => (StatusCode::FORBIDDEN, "epoch_invalid"),
                Refusal::Stale { .. } => (StatusCode::CONFLICT, "epoch_stale"),
                Refusal::Expired { .. } => (StatusCode::CONFLICT, "lease_expired"),
            },
            E::StoreUnavailable { .. } | E::StateUnavailable { .. } => {
                (StatusCode::SERVICE_UNAVAILABLE, "store_unavailable")
            }
            E::ShardUnavailable { .. } => (StatusCode::SERVICE_UNAVAILABLE, "shard_unavailable"),
            E::PeerUnauthorized => (StatusCode::FORBIDDEN, "peer_unauthorized"),
            // Sent, then abandoned: like a timeout, the outcome is unknown.
            E::ShuttingDown { .. } => (StatusCode::GATEWAY_TIMEOUT, "upstream_timeout"),
            E::DedupInFlight { .. } => (StatusCode::CONFLICT, "dedup_in_flight"),
            E::DedupInDoubt { .. } => (StatusCode::CONFLICT, "dedup_in_doubt"),
            E::DedupKeyReused { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "dedup_key_reused"),
            E::DedupDone { .. } => (StatusCode::CONFLICT, "dedup_done"),
            E::DedupKeyMissing { .. } => (StatusCode::BAD_REQUEST, "dedup_key_missing"),
            E::DeliveryFailed { .. } => (StatusCode::CONFLICT, "delivery_failed"),
            E::DeliveryDropped { .. } => (StatusCode::CONFLICT, "delivery_dropped"),
            E::DeliveryNotFound => (StatusCode::NOT_FOUND, "delivery_not_found"),
            E::UpgradeUnsupported => (StatusCode::NOT_IMPLEMENTED, "upgrade_unsupported"),
            E::UpstreamUnreachable { .. } => (StatusCode::BAD_GATEWAY, "upstream_unreachable"),
            E::UpstreamTimeout { .. } => (StatusCode::GATEWAY_TIMEOUT, "upstream_timeout"),
            E::DrainAborted { .. } => (StatusCode::GATEWAY_TIMEOUT, "drain_aborted"),
            E::UpstreamHeld { .. } => (StatusCode::SERVICE_UNAVAILABLE, "upstream_held"),
            E::QueueFull { .. } => (StatusCode::SERVICE_UNAVAILABLE, "queue_full"),
            E::RouteChanged { .. } => (StatusCode::SERVICE_UNAVAILABLE, "route_changed"),
        }
    }

    /// The cause behind an upstream or body failure (the JSON body's `detail`),
    /// for the access line: what an operator needs to tell one 502 from another.
    pub(crate) fn detail(&self) -> Option<&str> {
        use ProxyError as E;
        match self {
            E::UpstreamUnreachable { detail }
            | E::UpstreamTimeout { detail, .. }
            | E::StateUnavailable { detail }
            | E::BodyUnreadable { detail } => Some(detail),
            _ => None,
        }
    }

    pub(crate) fn code(&self) -> &'static str {
        self.status_and_code().1
    }

    /// Context fields for the JSON body.
    fn context(&self, ctx: &mut Map<String, Value>) {
        use ProxyError as E;
        let lease = |ctx: &mut Map<String, Value>, l: &LeaseName| {
            ctx.insert("lease".into(), json!(l.as_str()));
        };
        match self {
            E::Refused(r) => r.context(ctx),
            E::StoreUnavailable {
                lease: l, epoch, ..
            } => {
                lease(ctx, l);
                ctx.insert("epoch".into(), json!(epoch.get()));
            }
            E::BodyTooLarge { limit } => {
                ctx.insert("limit_bytes".into(), json!(limit));
            }
            E::DedupInFlight { key }
            | E::DedupInDoubt { key, .. }
            | E::DedupKeyReused { key, .. } => {
                ctx.insert("dedup_key".into(), json!(key));
            }
            E::DedupDone { key, status } => {
                ctx.insert("dedup_key".into(), json!(key));
                ctx.insert("upstream_status".into(), json!(status));
            }
            E::DeliveryFailed {
                key,
                status,
                detail,
            } => {
                ctx.insert("dedup_key".into(), json!(key));
                ctx.insert("upstream_status".into(), json!(status));
                ctx.insert("detail".into(), json!(detail));
            }
            E::DeliveryDropped { key } => {
                ctx.insert("dedup_key".into(), json!(key));
            }
            E::UpstreamUnreachable { detail }
            | E::StateUnavailable { detail }
            | E::BodyUnreadable { detail } => {
                ctx.insert("detail".into(), json!(detail));
            }
            E::UpstreamTimeout { detail, doubt } => {
                ctx.insert("detail".into(), json!(detail));
                doubt.context(ctx);
            }
            E::DrainAborted {
                lease: l,
                epoch,
                newer,
                doubt,
            } => {
                lease(ctx, l);
                ctx.insert("epoch".into(), json!(epoch.get()));
                ctx.insert("latest_epoch".into(), json!(newer.get()));
                doubt.context(ctx);
            }
            E::ShuttingDown { doubt } => doubt.context(ctx),
            E::UpstreamHeld { refused, .. } => {
                ctx.insert("detail".into(), json!(refused.reason.as_str()));
            }
            E::QueueFull { bound, limit, .. } => {
                ctx.insert("detail".into(), json!(bound));
                ctx.insert("limit".into(), json!(limit));
            }
            E::ShardUnavailable { lease: l } | E::EpochMissing { lease: l, .. } => lease(ctx, l),
            E::RouteNotFound
            | E::PathUnroutable
            | E::EpochMalformed(_)
            | E::TokenRepeated
            | E::DedupKeyMalformed(_)
            | E::BodyTimeout
            | E::UpgradeUnsupported
            | E::DedupKeyMissing { .. }
            | E::DeliveryNotFound
            | E::RouteChanged { .. }
            | E::PeerUnauthorized => {}
        }
    }

    /// What the worker (or its operator) does next, for the message: SPEC §7's
    /// codes are stable, this text is for people. `None` where the message
    /// already says it.
    pub(crate) fn next_step(&self) -> Option<String> {
        use ProxyError as E;
        Some(match self {
            E::RouteNotFound => "Send it under one of the path prefixes of fencegate's routes \
                ([[route]] path_prefix in its config)"
                .into(),
            E::PathUnroutable => "Send the path in its plain form, without dot segments \
                or an encoded slash"
                .into(),
            E::EpochMissing { lease, token } => format!(
                "Acquire an epoch of lease {lease} (`fencegate lease acquire --lease {lease} \
                 --holder ID`, or SPEC §2) and send its number as X-Lease-Epoch: N{}",
                if *token {
                    " with its token as X-Lease-Token: T"
                } else {
                    ""
                }
            ),
            E::EpochMalformed(_) | E::TokenRepeated | E::DedupKeyMalformed(_) => return None,
            E::BodyTooLarge { limit } => format!(
                "Nothing was forwarded: send at most {limit} bytes (the route's max_body_bytes)"
            ),
            E::BodyUnreadable { .. } => {
                "Nothing was forwarded: send the request again with its whole body".into()
            }
            E::BodyTimeout => "Nothing was forwarded: send the body within the route's \
                timeout_ms"
                .into(),
            E::Refused(r) => refusal_next_step(r),
            E::StoreUnavailable { .. } | E::StateUnavailable { .. } => {
                "Nothing was forwarded: retry after Retry-After".into()
            }
            E::ShardUnavailable { .. } => "Nothing was forwarded: retry after Retry-After".into(),
            E::PeerUnauthorized => "Workers send no X-Fencegate-Peer; a cluster member needs \
                the cluster's [cluster] peer_token"
                .into(),
            E::DedupInFlight { .. } => "Wait for it to end, then retry with the same key: you \
                get its stored answer, or 409 dedup_in_doubt if its outcome stays unknown"
                .into(),
            E::DedupInDoubt { route, key } => format!(
                "It may have reached the destination: do not resend it under another key. An \
                 operator checks the destination and resolves the key on fencegate's admin \
                 listener ({}). {}",
                resolve_hint(route, key),
                RESOLVE_MEANS
            ),
            E::DedupKeyReused {
                route, key, frees, ..
            } => format!(
                "Use a new key for a new request. This key {}",
                match frees {
                    KeyFrees::At(ms) => format!(
                        "frees at {} ([dedup] ttl after the first request's outcome)",
                        crate::clock::rfc3339(crate::dedup::ms_to_system(*ms))
                    ),
                    KeyFrees::AfterFirstEnds => "is still in flight: it frees at once if \
                        nothing is delivered, else [dedup] ttl after its outcome"
                        .into(),
                    KeyFrees::WhenResolved => format!(
                        "is in doubt and frees only when an operator resolves it as \
                         not delivered ({})",
                        resolve_hint(route, key)
                    ),
                }
            ),
            E::DedupDone { .. } => "The action happened: do not send it again under another \
                key; the destination holds its result"
                .into(),
            E::UpgradeUnsupported => "Send a plain HTTP request".into(),
            E::DedupKeyMissing { .. } => "Nothing was queued: send an Idempotency-Key (or set \
                the route's derive_key = \"content\")"
                .into(),
            E::DeliveryFailed { .. } => "Do not send it again under another key without \
                checking the destination: an operator may retry it (POST \
                /v1/deliveries/{route}/{key}/retry on the admin listener) or drop it"
                .into(),
            E::DeliveryDropped { .. } => "An operator decided it is not to be delivered; a \
                new message needs a new key"
                .into(),
            E::DeliveryNotFound => return None,
            E::UpstreamUnreachable { .. } => Doubt::NotSent.next_step(),
            E::UpstreamTimeout { doubt, .. } | E::ShuttingDown { doubt } => doubt.next_step(),
            E::DrainAborted { doubt, .. } => format!(
                "This worker's epoch is superseded: stop sending with it. {}",
                doubt.next_step()
            ),
            E::RouteChanged { .. } => "Nothing was accepted or forwarded: send it again, and it \
                 meets the routes as the reload left them"
                .to_owned(),
            E::QueueFull { .. } => "Nothing was accepted and nothing recorded for this \
                 request (its idempotency key, if any, is free): send it again after \
                 Retry-After, once deliveries have drained the queue"
                .to_owned(),
            E::UpstreamHeld { refused, .. } => format!(
                "Nothing was forwarded and nothing recorded for this request (its idempotency \
                 key, if any, is as it was before it): send it again after Retry-After ({} s)",
                refused.retry_after_secs
            ),
        })
    }

    /// The `message` of the JSON body: what happened, then what to do next.
    fn message(&self) -> String {
        match self.next_step() {
            Some(next) => format!("{self}. {next}."),
            None => self.to_string(),
        }
    }

    /// The response fencegate sends for this error.
    pub(crate) fn to_response(&self) -> Response<Full<Bytes>> {
        let (status, code) = self.status_and_code();
        let mut ctx = Map::new();
        self.context(&mut ctx);
        let mut resp = error_response(status, code, self.message(), ctx);
        if let ProxyError::UpstreamHeld { refused, .. } = self {
            // Counting down to the end of a hold or a cool-down (SPEC §7).
            resp.headers_mut().insert(
                http::header::RETRY_AFTER,
                HeaderValue::from(refused.retry_after_secs),
            );
        }
        if status == StatusCode::UNAUTHORIZED {
            // RFC 9110 §11.6.1: a 401 names how to authenticate.
            resp.headers_mut().insert(
                http::header::WWW_AUTHENTICATE,
                HeaderValue::from_static("X-Lease-Token realm=\"fencegate\""),
            );
        }
        resp
    }
}

/// The next step after an admission refusal (SPEC §4).
fn refusal_next_step(r: &Refusal) -> String {
    match r {
        Refusal::TokenMissing { .. } => "Send the token of the epoch you hold as X-Lease-Token \
            (the token `fencegate lease acquire` printed)"
            .into(),
        Refusal::TokenInvalid { .. } => "Send the token issued with this epoch: one of another \
            epoch or holder never matches"
            .into(),
        Refusal::EpochUnknown { lease, .. } => format!(
            "Send the number of an epoch you acquired of lease {lease} (SPEC §2; latest_epoch \
             is the newest fencegate knows)"
        ),
        Refusal::EpochInvalid { lease, .. } => {
            format!("Acquire a new epoch of lease {lease} and send with that one")
        }
        Refusal::Stale { lease, .. } => format!(
            "A newer epoch of lease {lease} exists — another worker took the lease over, or \
             this worker renewed it into a new epoch: send nothing more with this epoch; use \
             the newest one you hold, or acquire a new one before working again"
        ),
        Refusal::Expired { lease, .. } => format!(
            "Your tenure has ended: stop this work, and acquire lease {lease} again before new \
             work (renew before expires_at next time)"
        ),
    }
}

impl Refusal {
    fn context(&self, ctx: &mut Map<String, Value>) {
        let (lease, epoch) = self.lease_epoch();
        ctx.insert("lease".into(), json!(lease.as_str()));
        if let Some(e) = epoch {
            ctx.insert("epoch".into(), json!(e.get()));
        }
        match self {
            Refusal::Stale {
                high_water_mark,
                latest_epoch,
                ..
            } => {
                ctx.insert("high_water_mark".into(), json!(high_water_mark.get()));
                ctx.insert("latest_epoch".into(), json!(latest_epoch.get()));
            }
            Refusal::EpochUnknown { latest_epoch, .. } => {
                ctx.insert("latest_epoch".into(), json!(latest_epoch.get()));
            }
            Refusal::Expired { expired_at, .. } => {
                ctx.insert(
                    "expired_at".into(),
                    json!(crate::clock::rfc3339(*expired_at)),
                );
            }
            Refusal::EpochInvalid { reason, .. } => {
                ctx.insert("reason".into(), json!(reason));
            }
            Refusal::TokenMissing { .. } | Refusal::TokenInvalid { .. } => {}
        }
    }
}
