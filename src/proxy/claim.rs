//! Phase 1, parse the claim (SPEC §3, §7): what the request's headers say —
//! its epoch and token, the worker's dedup key, whether a cluster peer relayed
//! it — checked in the order a refusal names them, and its body, read whole or
//! left to stream.

use std::sync::Arc;

use bytes::Bytes;
use http::request::Parts;
use http::Method;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;

use super::{Proxy, Route};
use crate::access::Seen;
use crate::admission::Claim;
use crate::cluster::peer as relay;
use crate::config::DeriveKey;
use crate::dedup::DedupKey;
use crate::epoch::Epoch;
use crate::error::ProxyError;
use crate::headers::{
    IDEMPOTENCY_KEY_NAME, LEASE_EPOCH_NAME, LEASE_TOKEN_NAME, PEER_NAME, PEER_TOKEN_NAME,
};
use crate::streaming::{UpBody, Upload, UploadState};

/// What phase 1 read off a request's headers.
pub(super) struct Parsed<'p> {
    /// The epoch and token admission judges (phase 3).
    pub(super) claim: Claim<'p>,
    /// The worker's `Idempotency-Key`.
    pub(super) worker_key: Option<DedupKey>,
    /// Relayed by a cluster peer (SPEC §10.2): served here, never relayed again.
    pub(super) relayed: bool,
    /// The route records this request's outcome (SPEC §6).
    pub(super) record: bool,
    /// The body is read whole before admission ([`read_body`]): a recorded
    /// request's (its key and fingerprint need it) and a signed one's (its
    /// signature covers the body); any other is streamed to the upstream once
    /// admitted.
    pub(super) whole: bool,
}

impl Proxy {
    /// Reads the claim off the request's headers, refusing what SPEC §7 refuses
    /// in this order: an `Upgrade`, the epoch, the worker's key, a repeated
    /// token, a peer's header without the peer token, a declared length over
    /// the route's limit. The epoch goes into `seen` as soon as it is read.
    #[inline]
    pub(super) fn parse<'p>(
        &self,
        route: &Route,
        parts: &'p Parts,
        seen: &mut Seen,
    ) -> Result<Parsed<'p>, ProxyError> {
        // SPEC §7: a protocol switch (WebSocket, h2c) is refused, never silently
        // downgraded to a plain request by stripping its hop-by-hop headers.
        if parts.headers.contains_key(http::header::UPGRADE) {
            return Err(ProxyError::UpgradeUnsupported);
        }
        let epoch = single_header(&parts.headers, &LEASE_EPOCH_NAME)
            .map_err(|_| ProxyError::EpochMalformed("is repeated: send exactly one"))?
            .ok_or_else(|| ProxyError::EpochMissing {
                lease: route.lease.clone(),
                token: route.require_token,
            })?;
        let epoch = Epoch::parse_header(epoch.as_bytes()).ok_or(ProxyError::EpochMalformed(
            "must be a plain decimal u64: digits only, no sign, no spaces, no leading zero",
        ))?;
        seen.epoch = Some(epoch.get());
        let worker_key = match single_header(&parts.headers, &IDEMPOTENCY_KEY_NAME) {
            Err(()) => return Err(ProxyError::DedupKeyMalformed("repeated")),
            Ok(None) => None,
            Ok(Some(v)) => {
                Some(DedupKey::parse(v.as_bytes()).map_err(ProxyError::DedupKeyMalformed)?)
            }
        };
        // SPEC §11: a queued route finds its message again by key; refused
        // here, before admission, so that it changes nothing (not the mark).
        if route.queued && worker_key.is_none() && route.derive_key == DeriveKey::None {
            return Err(ProxyError::DedupKeyMissing {
                route: route.name.clone(),
            });
        }
        // Two tokens: neither can be trusted, and the worker is told why.
        let token: Option<&[u8]> = single_header(&parts.headers, &LEASE_TOKEN_NAME)
            .map_err(|()| ProxyError::TokenRepeated)?
            .map(http::HeaderValue::as_bytes);
        let relayed = self.relayed(&parts.headers)?;
        // SPEC §6: a worker's own key is always honoured; without one, a safe
        // method is never recorded (a poll must not be answered from an old record).
        let safe = matches!(
            parts.method,
            Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
        );
        let record = worker_key.is_some() || (!safe && route.derive_key == DeriveKey::Content);
        refuse_declared_length(parts, route.max_body_bytes)?;
        Ok(Parsed {
            claim: Claim { epoch, token },
            worker_key,
            relayed,
            record,
            whole: record || route.signer.is_some() || route.queued,
        })
    }

    /// SPEC §10.2: whether the request was relayed by a cluster peer. A request
    /// naming a peer without the cluster's peer token is refused, and so is any
    /// request naming a peer on a single instance (it has no peers).
    fn relayed(&self, headers: &http::HeaderMap) -> Result<bool, ProxyError> {
        if !headers.contains_key(PEER_NAME) {
            return Ok(false);
        }
        let presented = headers
            .get(PEER_TOKEN_NAME)
            .map(http::HeaderValue::as_bytes);
        match (self.mode.cluster(), presented) {
            (Some(c), Some(t)) if relay::token_matches(t, c.peer_token()) => Ok(true),
            _ => Err(ProxyError::PeerUnauthorized),
        }
    }
}

/// The request body: whole, or still arriving from the worker.
pub(super) enum Payload {
    Whole(Bytes),
    Stream(Incoming),
}

impl Payload {
    /// The body as it is sent on, and how far a streamed one got (`None`: sent
    /// whole).
    pub(super) fn upload(self, limit: usize) -> (UpBody, Option<Arc<UploadState>>) {
        match self {
            Payload::Whole(b) => (UpBody::from(b), None),
            Payload::Stream(b) => {
                let (u, state) = Upload::new(b, limit);
                (UpBody::stream(u), Some(state))
            }
        }
    }
}

/// The single value of a header: `Ok(None)` if absent, `Err` if repeated.
fn single_header<'a>(
    h: &'a http::HeaderMap,
    name: &http::HeaderName,
) -> Result<Option<&'a http::HeaderValue>, ()> {
    let mut it = h.get_all(name).iter();
    match (it.next(), it.next()) {
        (None, _) => Ok(None),
        (Some(v), None) => Ok(Some(v)),
        (Some(_), Some(_)) => Err(()),
    }
}

/// Refuses a body whose declared length is over `limit` before reading any (413).
fn refuse_declared_length(parts: &Parts, limit: usize) -> Result<(), ProxyError> {
    let declared = parts
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    match declared {
        Some(len) if len > limit as u64 => Err(ProxyError::BodyTooLarge { limit }),
        _ => Ok(()),
    }
}

/// Reads the whole request body within the route's timeout, refusing more
/// than its `max_body_bytes` (413).
pub(super) async fn read_body(body: Incoming, route: &Route) -> Result<Bytes, ProxyError> {
    let limit = route.max_body_bytes;
    match tokio::time::timeout(route.timeout, Limited::new(body, limit).collect()).await {
        Ok(Ok(c)) => Ok(c.to_bytes()),
        Ok(Err(e))
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(ProxyError::BodyTooLarge { limit })
        }
        // The client went away or sent a broken body: nothing was admitted.
        Ok(Err(e)) => Err(ProxyError::BodyUnreadable {
            detail: e.to_string(),
        }),
        Err(_) => Err(ProxyError::BodyTimeout),
    }
}
