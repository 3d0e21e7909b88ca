//! The access log (SPEC §8): one flat line per request at info, under the target
//! `fencegate::access`, and the request id that ties that line to the upstream's
//! own logs (`X-Request-Id`, kept when the worker sent one, else made here).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use http::{HeaderMap, HeaderValue, Method};

use crate::dedup::DedupKey;
use crate::error::ProxyError;
use crate::headers::REQUEST_ID;

/// A worker's id longer than this is replaced (it ends up in every log line).
const MAX_ID_LEN: usize = 200;

/// The request's id: the worker's `X-Request-Id` when it sent exactly one value
/// of 1–200 visible ASCII characters, else a new one. Either way the header is set
/// on `headers` (so it is forwarded upstream) and its value returned.
pub(crate) fn request_id(headers: &mut HeaderMap) -> HeaderValue {
    let mut given = headers.get_all(&REQUEST_ID).iter();
    if let (Some(v), None) = (given.next(), given.next()) {
        let b = v.as_bytes();
        if !b.is_empty() && b.len() <= MAX_ID_LEN && b.iter().all(|c| c.is_ascii_graphic()) {
            return v.clone();
        }
    }
    let id = new_id();
    headers.insert(REQUEST_ID, id.clone());
    id
}

/// 32 hex digits: a random per-process prefix and a counter (unique within the
/// process without a random draw per request; distinct across processes).
fn new_id() -> HeaderValue {
    static PREFIX: OnceLock<u64> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let prefix = *PREFIX.get_or_init(crate::entropy::u64);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    // Hex without `format!` (it runs on every request: 2,200 instructions with
    // the formatter, ~300 without, in callgrind).
    let mut raw = [0u8; 16];
    raw[..8].copy_from_slice(&prefix.to_be_bytes());
    raw[8..].copy_from_slice(&n.to_be_bytes());
    let mut hex = [0u8; 32];
    let _ = hex::encode_to_slice(raw, &mut hex);
    HeaderValue::from_bytes(&hex).unwrap_or(HeaderValue::from_static("unknown"))
}

/// What a request revealed about itself before it ended, for its access line.
#[derive(Default)]
pub(crate) struct Seen {
    pub epoch: Option<u64>,
    pub key: Option<DedupKey>,
    /// Time from forwarding to the upstream's complete answer or failure.
    pub upstream: Option<Duration>,
    /// A cluster's owner hint for the answer (SPEC §10.2, `X-Fencegate-Owner`).
    pub owner: Option<http::HeaderValue>,
}

/// One request's access line.
pub(crate) struct Line<'a> {
    pub method: &'a Method,
    pub path: &'a str,
    pub route: Option<&'a str>,
    pub lease: Option<&'a str>,
    pub status: u16,
    /// `forwarded`, `replayed` or `refused`.
    pub outcome: &'static str,
    /// Why fencegate answered itself: its SPEC §7 code and message are logged.
    pub refusal: Option<&'a ProxyError>,
    pub seen: &'a Seen,
    pub client: SocketAddr,
    pub request_id: &'a HeaderValue,
    pub elapsed: Duration,
}

impl Line<'_> {
    /// Logs the line: flat fields, plain values (no Rust `Debug` forms), absent
    /// ones left out. The query string is not logged: it may carry secrets.
    pub(crate) fn emit(&self) {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        tracing::info!(
            target: "fencegate::access",
            method = self.method.as_str(),
            path = self.path,
            route = self.route,
            status = self.status,
            outcome = self.outcome,
            code = self.refusal.map(ProxyError::code),
            reason = self.refusal.map(tracing::field::display),
            detail = self.refusal.and_then(ProxyError::detail),
            lease = self.lease,
            epoch = self.seen.epoch,
            key = self.seen.key.as_ref().map(DedupKey::as_str),
            upstream_ms = self.seen.upstream.map(ms),
            elapsed_ms = ms(self.elapsed),
            client = %self.client,
            request_id = self.request_id.to_str().unwrap_or("-"),
            "request"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_usable_id_is_kept_and_anything_else_replaced() {
        let mut h = HeaderMap::new();
        h.insert(REQUEST_ID, HeaderValue::from_static("abc-1"));
        assert_eq!(request_id(&mut h), "abc-1");
        for bad in ["", "has space", &"x".repeat(MAX_ID_LEN + 1)] {
            let mut h = HeaderMap::new();
            h.insert(REQUEST_ID, HeaderValue::from_str(bad).unwrap());
            let id = request_id(&mut h);
            assert_eq!(id.len(), 32, "{bad:?}");
            assert_eq!(h.get(REQUEST_ID), Some(&id));
        }
        let mut h = HeaderMap::new();
        h.append(REQUEST_ID, HeaderValue::from_static("a"));
        h.append(REQUEST_ID, HeaderValue::from_static("b"));
        let id = request_id(&mut h);
        assert_eq!(h.get_all(REQUEST_ID).iter().collect::<Vec<_>>(), vec![&id]);
        let mut h2 = HeaderMap::new();
        assert_ne!(request_id(&mut h2), id, "fresh ids differ");
    }
}
