//! Relaying a request to its shard's owner (SPEC §10.2): once, as it came — the
//! worker's method, path, headers (its lease token included: the owner admits it)
//! and body — with `X-Fencegate-Peer` and the cluster's peer token; the owner's
//! answer (its replay, refusal or the upstream's response) goes back as is.

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Request, Response, Uri};
use http_body_util::Full;

use crate::forward::{self, HttpsClient, Peer, UpstreamError, PEER_NAME, PEER_TOKEN_NAME};

/// Largest answer relayed from a peer (the owner applies the route's own limits).
const MAX_PEER_BODY: usize = 64 << 20;

/// Why a relay failed: the worker gets 503 `shard_unavailable`.
#[derive(Debug)]
pub struct RelayFailed(pub String);

/// Relays the request to the owner at `base` (its `advertise` URL).
#[allow(clippy::too_many_arguments)]
pub async fn relay(
    client: &HttpsClient,
    base: &str,
    me: &str,
    peer_token: &str,
    parts: http::request::Parts,
    body: Bytes,
    client_hop: &Peer,
    timeout: Duration,
) -> Result<Response<Full<Bytes>>, RelayFailed> {
    let pq = parts
        .uri
        .path_and_query()
        .map_or(parts.uri.path(), |pq| pq.as_str());
    let uri: Uri = format!("{}{pq}", base.trim_end_matches('/'))
        .parse()
        .map_err(|e| RelayFailed(format!("the owner's advertise URL {base:?}: {e}")))?;
    let host = uri
        .authority()
        .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        .ok_or_else(|| RelayFailed(format!("the owner's advertise URL {base:?} has no host")))?;
    let mut headers = parts.headers;
    forward::strip_hop_by_hop(&mut headers);
    let orig_host = headers.remove(header::HOST);
    headers.remove(header::CONTENT_LENGTH);
    forward::append_forwarding(&mut headers, client_hop, orig_host.as_ref())
        .map_err(RelayFailed)?;
    headers.insert(header::HOST, host);
    headers.insert(
        PEER_NAME,
        HeaderValue::from_str(me).map_err(|e| RelayFailed(e.to_string()))?,
    );
    let mut token =
        HeaderValue::from_str(peer_token).map_err(|e| RelayFailed(format!("peer token: {e}")))?;
    token.set_sensitive(true);
    headers.insert(PEER_TOKEN_NAME, token);
    let mut req = Request::new(Full::new(body));
    *req.method_mut() = parts.method;
    *req.uri_mut() = uri;
    *req.headers_mut() = headers;
    match forward::send(
        client,
        req,
        timeout,
        MAX_PEER_BODY,
        std::future::pending::<&'static str>(),
    )
    .await
    {
        Ok(resp) => Ok(forward::to_response(resp)),
        Err(UpstreamError::Unreachable(d) | UpstreamError::Uncertain(d)) => Err(RelayFailed(d)),
    }
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
