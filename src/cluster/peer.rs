//! Relaying a request to its shard's owner (SPEC §10.2): once, as it came — the
//! worker's method, path, headers (its lease token included: the owner admits it)
//! and body — with `X-Fencegate-Peer` and the cluster's peer token; the owner's
//! answer (its replay, refusal or the upstream's response) goes back as is.

use std::time::Duration;

use std::sync::Arc;

use http::{header, HeaderValue, Request, Response, Uri};

use crate::forward::{self, HttpsClient, Peer, UpstreamError, PEER_NAME, PEER_TOKEN_NAME};
use crate::streaming::{ProxyBody, Streamed, UpBody};

/// Why a relay failed.
#[derive(Debug)]
pub enum RelayFailed {
    /// Nothing reached the owner: the worker gets 503 `shard_unavailable`.
    NotSent(String),
    /// The owner may have received the request, and forwarded it, before the
    /// relay failed (its connection reset by a kill, a timeout): the outcome is
    /// unknown, 504 `upstream_timeout` — never a code that says "not forwarded".
    Uncertain(String),
}

/// Relays the request to the owner at `base` (its `advertise` URL).
#[allow(clippy::too_many_arguments)]
pub async fn relay(
    client: &HttpsClient,
    base: &str,
    me: &str,
    peer_token: &str,
    parts: http::request::Parts,
    body: UpBody,
    client_hop: &Peer,
    timeout: Duration,
) -> Result<Response<ProxyBody>, RelayFailed> {
    let pq = parts
        .uri
        .path_and_query()
        .map_or(parts.uri.path(), |pq| pq.as_str());
    let uri: Uri = format!("{}{pq}", base.trim_end_matches('/'))
        .parse()
        .map_err(|e| RelayFailed::NotSent(format!("the owner's advertise URL {base:?}: {e}")))?;
    let host = uri
        .authority()
        .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        .ok_or_else(|| {
            RelayFailed::NotSent(format!("the owner's advertise URL {base:?} has no host"))
        })?;
    let mut headers = parts.headers;
    forward::strip_hop_by_hop(&mut headers);
    let orig_host = headers.remove(header::HOST);
    headers.remove(header::CONTENT_LENGTH);
    forward::append_forwarding(&mut headers, client_hop, orig_host.as_ref())
        .map_err(RelayFailed::NotSent)?;
    headers.insert(header::HOST, host);
    headers.insert(
        PEER_NAME,
        HeaderValue::from_str(me).map_err(|e| RelayFailed::NotSent(e.to_string()))?,
    );
    let mut token = HeaderValue::from_str(peer_token)
        .map_err(|e| RelayFailed::NotSent(format!("peer token: {e}")))?;
    token.set_sensitive(true);
    headers.insert(PEER_TOKEN_NAME, token);
    let mut req = Request::new(body);
    *req.method_mut() = parts.method;
    *req.uri_mut() = uri;
    *req.headers_mut() = headers;
    let stop = std::pin::pin!(std::future::pending::<&'static str>());
    let failed = |e: UpstreamError| match e {
        UpstreamError::Unreachable(d) => RelayFailed::NotSent(d),
        UpstreamError::Uncertain(d) => RelayFailed::Uncertain(d),
    };
    let mut head = forward::send(client, req, timeout, stop)
        .await
        .map_err(failed)?;
    // The owner's answer is streamed back like an upstream's (no cap), the owner
    // holding the pass; `timeout` between two pieces of it.
    let body = match forward::read_ready(&mut head, 64 << 10).map_err(failed)? {
        (b, true) => ProxyBody::from(b),
        (prefix, false) => ProxyBody::Stream(Box::new(Streamed::new(
            prefix,
            head.body,
            None,
            timeout,
            head.conn,
            Arc::from("(relayed to the shard's owner)"),
        ))),
    };
    Ok(forward::to_response(head.status, head.headers, body))
}

/// Compares a presented peer token with ours in constant time.
pub fn token_matches(presented: &[u8], ours: &str) -> bool {
    let ours = ours.as_bytes();
    if presented.len() != ours.len() || ours.is_empty() {
        return false;
    }
    presented
        .iter()
        .zip(ours)
        .fold(0u8, |acc, (a, b)| acc | (a ^ b))
        == 0
}
