//! Forwarding to the upstream (SPEC §3): the path-prefix mapping ([`Target`]),
//! header hygiene, the client's hop appended ([`ClientHop`]), and the exchange —
//! upstream failures classified by what the worker may conclude (nothing sent
//! vs. outcome unknown). The client is `client.rs`: plain-HTTP upstreams on
//! connections driven by their requests (`inline.rs`), HTTPS ones on
//! hyper-util's pool over rustls; a route's TLS client certificate is
//! `client_auth.rs`, Standard Webhooks signing `sign.rs`; the header names are
//! `crate::headers`.

mod client;
pub mod client_auth;
mod inline;
pub mod sign;

pub use client::{client, tls_config, HttpsClient};
// Transitional (issue 26): `cluster/peer.rs`, restructured next, still imports
// these names from here (`build_request` reads the two header names through
// this import too). Remove with that import.
pub(crate) use crate::headers::{PEER_NAME, PEER_TOKEN_NAME};
pub(crate) use ClientHop as Peer;

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, Uri};

use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper_util::client::legacy::connect::{capture_connection, CaptureConnection};

use crate::headers::{LEASE_TOKEN_NAME, X_FORWARDED_FOR};
use crate::streaming::{CutConn, UpBody};

/// Hop-by-hop headers (RFC 9110 §7.6.1) plus the proxy-hop credentials. Typed
/// names: removing by `&str` parses the name again on every request.
const HOP_BY_HOP: [HeaderName; 10] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHORIZATION,
    header::PROXY_AUTHENTICATE,
    header::EXPECT,
];

/// How an upstream exchange failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum UpstreamError {
    /// Could not connect: no byte of the request was sent.
    #[error("{0}")]
    Unreachable(String),
    /// Timed out or failed after the request may have been sent: outcome unknown.
    #[error("{0}")]
    Uncertain(String),
}

/// An upstream response whose head has arrived; its body is still to be read.
#[derive(Debug)]
pub struct UpstreamHead {
    /// The upstream's status.
    pub status: http::StatusCode,
    /// Hop-by-hop headers and `Content-Length` removed (the body sent on says its
    /// own length).
    pub headers: HeaderMap,
    /// The body, streamed to the worker.
    pub body: UpstreamBody,
    /// The connection it came on, to cut if the exchange is ended early.
    pub conn: ConnCut,
}

/// How an exchange's upstream connection is cut (SPEC §5: an abort stops
/// writing at once): through hyper-util's capture of it, or this exchange's
/// hold on a connection fencegate drives itself.
#[derive(Debug, Clone)]
pub struct ConnCut(CutVia);

#[derive(Debug, Clone)]
enum CutVia {
    Captured(CaptureConnection),
    Own(inline::OwnCut),
}

impl crate::streaming::CutConn for ConnCut {
    /// Cuts the HTTP/1 connection the request was sent on, if it got one.
    fn cut(&self) {
        match &self.0 {
            CutVia::Captured(c) => crate::cutoff::cut(c),
            CutVia::Own(h) => h.cut(),
        }
    }
}

/// An upstream response's body, from either pool ([`HttpsClient`]).
pub struct UpstreamBody(BodyVia);

enum BodyVia {
    /// hyper-util's: its connection task reads it.
    Pooled(Incoming),
    /// fencegate's own: reading it drives its connection.
    Own(inline::OwnBody),
}

impl std::fmt::Debug for UpstreamBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            BodyVia::Pooled(_) => "UpstreamBody(pooled)",
            BodyVia::Own(_) => "UpstreamBody(own)",
        })
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match &mut self.get_mut().0 {
            BodyVia::Pooled(b) => std::pin::Pin::new(b).poll_frame(cx),
            BodyVia::Own(b) => std::pin::Pin::new(b).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.0 {
            BodyVia::Pooled(b) => b.is_end_stream(),
            BodyVia::Own(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.0 {
            BodyVia::Pooled(b) => b.size_hint(),
            BodyVia::Own(b) => b.size_hint(),
        }
    }
}

/// The part of a route forwarding needs.
#[derive(Clone)]
pub struct Target {
    /// `path_prefix` of the route, e.g. `/billing/`.
    pub prefix: String,
    /// `http` or `https`, from the upstream URL.
    pub scheme: http::uri::Scheme,
    /// Host and port of the upstream.
    pub authority: http::uri::Authority,
    /// `Host` for the upstream, made once: left to the client, it is formatted
    /// for every request.
    pub host: HeaderValue,
    /// Path of the upstream base URL, ending in `/`.
    pub base_path: String,
    /// The route's `dedup_header`, carrying the dedup key upstream (SPEC §3).
    pub dedup_header: HeaderName,
    /// Set on every forwarded request, replacing the worker's (secrets).
    pub fixed_headers: Vec<(HeaderName, HeaderValue)>,
}

impl Target {
    /// The target of a route: `upstream` parsed, `upstream_headers` resolved; an error
    /// says which is wrong.
    pub fn new(
        prefix: &str,
        upstream: &str,
        dedup_header: &str,
        fixed_headers: Vec<(HeaderName, HeaderValue)>,
    ) -> Result<Target, String> {
        let uri: Uri = upstream
            .parse()
            .map_err(|e| format!("upstream {upstream:?}: {e}"))?;
        let scheme = uri.scheme().cloned().ok_or("upstream needs a scheme")?;
        let authority = uri.authority().cloned().ok_or("upstream needs a host")?;
        // The client's own rule: the port only when it is not the scheme's default.
        let default_port = if scheme == http::uri::Scheme::HTTPS {
            443
        } else {
            80
        };
        let host = match authority.port_u16() {
            Some(p) if p != default_port => format!("{}:{p}", authority.host()),
            _ => authority.host().to_owned(),
        };
        let host = HeaderValue::from_str(&host).map_err(|e| format!("upstream host: {e}"))?;
        let mut base_path = uri.path().to_owned();
        if !base_path.ends_with('/') {
            base_path.push('/');
        }
        Ok(Target {
            prefix: prefix.to_owned(),
            scheme,
            authority,
            host,
            base_path,
            dedup_header: HeaderName::from_bytes(dedup_header.as_bytes())
                .map_err(|e| e.to_string())?,
            fixed_headers,
        })
    }

    /// Whether `path` belongs to this route (`/billing/...` or exactly `/billing`):
    /// the definition the proxy's route index is tested against.
    pub fn matches(&self, path: &str) -> bool {
        path.starts_with(&self.prefix)
            || path.len() + 1 == self.prefix.len() && self.prefix.starts_with(path)
    }

    /// Maps a request target to the upstream URI: prefix replaced by the base path.
    pub fn upstream_uri(&self, path: &str, query: Option<&str>) -> Result<Uri, String> {
        self.upstream_uri_of(path.get(self.prefix.len()..).unwrap_or(""), query)
    }

    /// The upstream URI of `rest`, a request path without the route's prefix
    /// (a queued message keeps that, so that a reload's new prefix or upstream
    /// applies to it).
    pub fn upstream_uri_of(&self, rest: &str, query: Option<&str>) -> Result<Uri, String> {
        let mut pq = String::with_capacity(
            self.base_path.len() + rest.len() + 1 + query.map_or(0, str::len),
        );
        pq.push_str(&self.base_path);
        pq.push_str(rest);
        if let Some(q) = query {
            pq.push('?');
            pq.push_str(q);
        }
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(pq)
            .build()
            .map_err(|e| e.to_string())
    }
}

/// True when a path contains `.`/`..` segments, plain or percent-encoded: such a
/// path could escape the route's prefix at the upstream, so it matches no route.
pub fn has_dot_segments(path: &str) -> bool {
    // Allocation-free (it runs on every request): a segment is a dot segment when
    // it is one or two dots, each plain or `%2e` in any case; `%2f` in any case
    // anywhere also counts.
    fn is_dot_segment(seg: &[u8]) -> bool {
        let (mut rest, mut dots) = (seg, 0);
        while !rest.is_empty() {
            rest = match rest {
                [b'.', tail @ ..] => tail,
                [b'%', b'2', e, tail @ ..] if e.eq_ignore_ascii_case(&b'e') => tail,
                _ => return false,
            };
            dots += 1;
        }
        dots == 1 || dots == 2
    }
    // Most paths have neither a dot nor a percent sign: one pass says so.
    if !path.bytes().any(|b| b == b'.' || b == b'%') {
        return false;
    }
    path.split('/').any(|seg| is_dot_segment(seg.as_bytes()))
        || path
            .as_bytes()
            .windows(3)
            .any(|w| w[0] == b'%' && w[1] == b'2' && w[2].eq_ignore_ascii_case(&b'f'))
}

/// Removes hop-by-hop headers and every header named in `Connection`.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Usually there are none: one pass over the names is cheaper than hashing
    // each of the ten names for a removal.
    if !headers.keys().any(|k| HOP_BY_HOP.contains(k)) {
        return;
    }
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    for n in named {
        headers.remove(n);
    }
    for h in &HOP_BY_HOP {
        headers.remove(h);
    }
}

/// Removes the operator page's session cookie from `Cookie` headers. Browsers
/// scope cookies by host, not port: one that opened the admin page sends the
/// session to the proxy listener on the same host too, and it must not reach an
/// upstream. Other cookies pass unchanged; a header left empty is dropped.
pub fn strip_admin_cookie(headers: &mut HeaderMap) {
    use crate::headers::ADMIN_SESSION_COOKIE as COOKIE;
    fn is_ours(pair: &str) -> bool {
        pair.split_once('=')
            .is_some_and(|(n, _)| n.trim() == COOKIE)
    }
    let carries = |v: &HeaderValue| v.to_str().is_ok_and(|s| s.split(';').any(is_ours));
    if !headers.get_all(header::COOKIE).iter().any(carries) {
        return;
    }
    let kept: Vec<HeaderValue> = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| {
            let Ok(text) = v.to_str() else {
                return Some(v.clone()); // not ours: ours is ASCII
            };
            let rest: Vec<&str> = text
                .split(';')
                .map(str::trim)
                .filter(|pair| !pair.is_empty() && !is_ours(pair))
                .collect();
            (!rest.is_empty()).then(|| HeaderValue::from_str(&rest.join("; ")).ok())?
        })
        .collect();
    headers.remove(header::COOKIE);
    for v in kept {
        headers.append(header::COOKIE, v);
    }
}

/// The hop a client connection adds to the forwarding headers (`X-Forwarded-For`,
/// `Forwarded`), worked out once per connection rather than formatted again for
/// every request on it. The worker's connection, not another fencegate instance
/// (that is a cluster peer, `cluster::peer`).
#[derive(Debug, Clone)]
pub struct ClientHop {
    /// The client's address, for the access log.
    pub addr: SocketAddr,
    /// The client's IP, as appended to `X-Forwarded-For`.
    ip: HeaderValue,
    /// `for=...;proto=...`, the start of this hop's `Forwarded` element.
    forwarded: String,
    /// A request a cluster peer relayed: its client's hop is in the headers already.
    relayed: bool,
}

impl ClientHop {
    /// `proto` is how the client reached fencegate (`http` or `https`).
    pub fn new(addr: SocketAddr, proto: &str) -> ClientHop {
        let ip = addr.ip().to_string();
        let forwarded = if addr.is_ipv6() {
            format!("for=\"[{ip}]\";proto={proto}")
        } else {
            format!("for={ip};proto={proto}")
        };
        ClientHop {
            addr,
            // An IP address is always a valid header value.
            ip: HeaderValue::from_str(&ip).unwrap_or(HeaderValue::from_static("unknown")),
            forwarded,
            relayed: false,
        }
    }

    /// The same client, reached through a cluster peer (SPEC §10.2) that
    /// appended its hop already.
    pub fn relayed(&self) -> ClientHop {
        ClientHop {
            relayed: true,
            ..self.clone()
        }
    }
}

/// Appends this hop to `X-Forwarded-For` and `Forwarded` (SPEC §3), unless the
/// request was relayed by a cluster peer that appended the client's hop already.
pub fn append_forwarding(
    headers: &mut HeaderMap,
    hop: &ClientHop,
    orig_host: Option<&HeaderValue>,
) -> Result<(), String> {
    if hop.relayed {
        return Ok(());
    }
    let xff = match headers.get(X_FORWARDED_FOR).map(HeaderValue::as_bytes) {
        Some(prev) => {
            let mut v = Vec::with_capacity(prev.len() + 2 + hop.ip.len());
            v.extend_from_slice(prev);
            v.extend_from_slice(b", ");
            v.extend_from_slice(hop.ip.as_bytes());
            HeaderValue::from_maybe_shared(Bytes::from(v)).map_err(|e| e.to_string())?
        }
        None => hop.ip.clone(),
    };
    headers.insert(X_FORWARDED_FOR, xff);
    let prev = headers
        .get(header::FORWARDED)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty());
    let host = orig_host
        .and_then(|h| h.to_str().ok())
        .filter(|h| !h.contains(['"', ';', ',']));
    let mut fwd = String::with_capacity(
        prev.map_or(0, |p| p.len() + 2) + hop.forwarded.len() + host.map_or(0, |h| h.len() + 8),
    );
    if let Some(p) = prev {
        fwd.push_str(p);
        fwd.push_str(", ");
    }
    fwd.push_str(&hop.forwarded);
    if let Some(h) = host {
        fwd.push_str(";host=\"");
        fwd.push_str(h);
        fwd.push('"');
    }
    headers.insert(
        header::FORWARDED,
        HeaderValue::from_maybe_shared(Bytes::from(fwd)).map_err(|e| e.to_string())?,
    );
    Ok(())
}

/// Builds the upstream request from the worker's, per SPEC §3. Takes the worker's
/// head by value: its header map becomes the upstream's, edited in place.
pub fn build_request(
    target: &Target,
    parts: http::request::Parts,
    body: UpBody,
    hop: &ClientHop,
    dedup_key: &str,
) -> Result<Request<UpBody>, String> {
    let uri = target.upstream_uri(parts.uri.path(), parts.uri.query())?;
    let mut headers = parts.headers;
    end_to_end(&mut headers, hop)?;
    route_headers(target, &mut headers, dedup_key)?;
    let mut req = Request::new(body);
    *req.method_mut() = parts.method;
    *req.uri_mut() = uri;
    *req.headers_mut() = headers;
    Ok(req)
}

/// The worker's part of SPEC §3's headers: hop-by-hop, the lease token, a
/// peer's headers, `Content-Length` and the admin cookie removed, this hop
/// appended to `X-Forwarded-For` and `Forwarded`. What a queued message keeps.
pub fn end_to_end(headers: &mut HeaderMap, hop: &ClientHop) -> Result<(), String> {
    strip_hop_by_hop(headers);
    let orig_host = headers.remove(header::HOST);
    headers.remove(LEASE_TOKEN_NAME);
    headers.remove(PEER_NAME);
    headers.remove(PEER_TOKEN_NAME);
    headers.remove(header::CONTENT_LENGTH);
    strip_admin_cookie(headers);
    append_forwarding(headers, hop, orig_host.as_ref())
}

/// The route's part of SPEC §3's headers, set when the request is sent: the
/// upstream's `Host`, the dedup key, `upstream_headers` (replacing the
/// worker's).
pub fn route_headers(
    target: &Target,
    headers: &mut HeaderMap,
    dedup_key: &str,
) -> Result<(), String> {
    headers.insert(header::HOST, target.host.clone());
    headers.insert(
        target.dedup_header.clone(),
        HeaderValue::from_str(dedup_key).map_err(|e| e.to_string())?,
    );
    for (n, v) in &target.fixed_headers {
        headers.insert(n.clone(), v.clone());
    }
    Ok(())
}

/// Sends `req` and waits for the response head within `timeout`, unless `stop`
/// (a drain abort, shutdown) resolves first with its reason. A timeout or a stop
/// cuts the connection the request was on (`cutoff`): not one more byte of it is
/// written.
pub async fn send(
    client: &HttpsClient,
    req: Request<UpBody>,
    timeout: Duration,
    stop: std::pin::Pin<&mut impl Future<Output = &'static str>>,
) -> Result<UpstreamHead, UpstreamError> {
    if req.uri().scheme() == Some(&http::uri::Scheme::HTTP) {
        // Dropped at a timeout or a stop, the exchange cuts its own connection.
        let exchange = inline::send(client.own(), req);
        let (resp, cut) = within(timeout, stop, exchange).await?;
        return Ok(head_of(
            resp,
            |b| UpstreamBody(BodyVia::Own(b)),
            ConnCut(CutVia::Own(cut)),
        ));
    }
    send_pooled(client, req, timeout, stop).await
}

/// `exchange` unless `timeout` passes or `stop` resolves first.
async fn within<T>(
    timeout: Duration,
    stop: std::pin::Pin<&mut impl Future<Output = &'static str>>,
    exchange: impl Future<Output = Result<T, UpstreamError>>,
) -> Result<T, UpstreamError> {
    tokio::select! {
        r = tokio::time::timeout(timeout, exchange) => r.unwrap_or_else(|_| {
            Err(UpstreamError::Uncertain(format!(
                "no response within {} ms",
                timeout.as_millis()
            )))
        }),
        why = stop => Err(UpstreamError::Uncertain(why.to_owned())),
    }
}

/// The head as the worker's answer starts from: hop-by-hop headers and
/// `Content-Length` removed.
fn head_of<B>(
    resp: Response<B>,
    body: impl FnOnce(B) -> UpstreamBody,
    conn: ConnCut,
) -> UpstreamHead {
    let (parts, b) = resp.into_parts();
    let mut headers = parts.headers;
    strip_hop_by_hop(&mut headers);
    headers.remove(header::CONTENT_LENGTH);
    UpstreamHead {
        status: parts.status,
        headers,
        body: body(b),
        conn,
    }
}

/// [`send`] on hyper-util's pool (HTTPS upstreams).
async fn send_pooled(
    client: &HttpsClient,
    mut req: Request<UpBody>,
    timeout: Duration,
    stop: std::pin::Pin<&mut impl Future<Output = &'static str>>,
) -> Result<UpstreamHead, UpstreamError> {
    let conn = ConnCut(CutVia::Captured(capture_connection(&mut req)));
    let exchange = async {
        client.pooled().request(req).await.map_err(|e| {
            let detail = error_chain(&e);
            if e.is_connect() {
                UpstreamError::Unreachable(detail)
            } else if let Some(refusal) = client_auth::handshake_refused(&e) {
                let detail = format!("{}: {detail}", refusal.why());
                match refusal {
                    client_auth::CertRefusal::NoneShown => UpstreamError::Unreachable(detail),
                    client_auth::CertRefusal::Refused => UpstreamError::Uncertain(detail),
                }
            } else {
                UpstreamError::Uncertain(detail)
            }
        })
    };
    match within(timeout, stop, exchange).await {
        Ok(resp) => Ok(head_of(resp, |b| UpstreamBody(BodyVia::Pooled(b)), conn)),
        Err(e) => {
            if let UpstreamError::Uncertain(_) = &e {
                conn.cut();
            }
            Err(e)
        }
    }
}

/// Reads `head`'s body until it ends or holds more than `max` bytes, by `deadline`
/// unless `stop` resolves first. `Ok(body, whole)`: `whole` is false when the body
/// went over `max` (the rest is still to be read). A failure cuts the connection.
pub async fn read_up_to(
    head: &mut UpstreamHead,
    max: usize,
    deadline: tokio::time::Instant,
    stop: std::pin::Pin<&mut impl Future<Output = &'static str>>,
) -> Result<(Bytes, bool), UpstreamError> {
    use http_body_util::BodyExt;
    let mut buf = bytes::BytesMut::new();
    let read = async {
        while buf.len() <= max {
            match head.body.frame().await {
                None => return Ok(true),
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        buf.extend_from_slice(&d);
                    }
                }
                Some(Err(e)) => {
                    return Err(UpstreamError::Uncertain(format!(
                        "reading the upstream's response body: {}",
                        error_chain(&e)
                    )))
                }
            }
        }
        // Whole only within `max`: one frame may have brought more than it
        // (a small answer arriving in one read), which is over the limit too.
        Ok(head.body.is_end_stream() && buf.len() <= max)
    };
    let result = tokio::select! {
        r = tokio::time::timeout_at(deadline, read) => r.unwrap_or_else(|_| {
            Err(UpstreamError::Uncertain("no complete response within the route's timeout".into()))
        }),
        why = stop => Err(UpstreamError::Uncertain(why.to_owned())),
    };
    match result {
        Ok(whole) => Ok((buf.freeze(), whole)),
        Err(e) => {
            head.conn.cut();
            Err(e)
        }
    }
}

/// Reads what has already arrived of `head`'s body, without waiting, up to `max`
/// bytes: `Ok(body, whole)` as [`read_up_to`]. Trailers are dropped, as a buffered
/// answer drops them.
pub fn read_ready(head: &mut UpstreamHead, max: usize) -> Result<(Bytes, bool), UpstreamError> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let mut buf = bytes::BytesMut::new();
    while buf.len() <= max {
        if head.body.is_end_stream() {
            return Ok((buf.freeze(), true));
        }
        match std::pin::Pin::new(&mut head.body).poll_frame(&mut cx) {
            std::task::Poll::Ready(Some(Ok(f))) => {
                if let Ok(d) = f.into_data() {
                    buf.extend_from_slice(&d);
                }
            }
            std::task::Poll::Ready(None) => return Ok((buf.freeze(), true)),
            std::task::Poll::Ready(Some(Err(e))) => {
                head.conn.cut();
                return Err(UpstreamError::Uncertain(format!(
                    "reading the upstream's response body: {}",
                    error_chain(&e)
                )));
            }
            std::task::Poll::Pending => break,
        }
    }
    Ok((buf.freeze(), false))
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// The worker-facing response for an upstream answer.
pub fn to_response<B>(status: http::StatusCode, headers: HeaderMap, body: B) -> Response<B> {
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    *resp.headers_mut() = headers;
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target() -> Target {
        Target::new("/billing/", "http://up:9/v1", "Idempotency-Key", vec![]).unwrap()
    }

    #[test]
    fn prefix_is_replaced_by_the_upstream_path() {
        let t = target();
        assert_eq!(
            t.upstream_uri("/billing/charges", Some("a=1"))
                .unwrap()
                .to_string(),
            "http://up:9/v1/charges?a=1"
        );
        assert_eq!(
            t.upstream_uri("/billing", None).unwrap().to_string(),
            "http://up:9/v1/"
        );
        assert!(
            t.matches("/billing/x")
                && t.matches("/billing")
                && !t.matches("/billingx")
                && !t.matches("/bill")
        );
    }

    #[test]
    fn dot_segments_are_detected() {
        for p in [
            "/billing/../admin",
            "/billing/%2E%2e/x",
            "/billing/./x",
            "/billing/a%2Fb",
        ] {
            assert!(has_dot_segments(p), "{p}");
        }
        assert!(!has_dot_segments("/billing/a.b/..c"));
    }

    /// The definition `has_dot_segments` must agree with (it was the implementation
    /// until an allocation-free one replaced it).
    fn has_dot_segments_by_definition(path: &str) -> bool {
        path.split('/').any(|seg| {
            let lower = seg.to_ascii_lowercase();
            let decoded = lower.replace("%2e", ".");
            decoded == "." || decoded == ".."
        }) || path.to_ascii_lowercase().contains("%2f")
    }

    proptest::proptest! {
        #[test]
        fn dot_segments_match_their_definition(path in "[./%2eEfFa]{0,16}") {
            proptest::prop_assert_eq!(
                has_dot_segments(&path),
                has_dot_segments_by_definition(&path),
                "{}", path
            );
        }
    }

    #[test]
    fn the_admin_session_cookie_never_goes_upstream() {
        let mut h = HeaderMap::new();
        h.append(
            header::COOKIE,
            HeaderValue::from_static("a=1; fencegate_admin=s3cret; b=2"),
        );
        h.append(
            header::COOKIE,
            HeaderValue::from_static("fencegate_admin=again"),
        );
        h.append(
            header::COOKIE,
            HeaderValue::from_static("not_fencegate_admin=kept"),
        );
        strip_admin_cookie(&mut h);
        let left: Vec<_> = h.get_all(header::COOKIE).iter().collect();
        assert_eq!(left, ["a=1; b=2", "not_fencegate_admin=kept"]);
        let mut plain = HeaderMap::new();
        plain.insert(header::COOKIE, HeaderValue::from_static("session=abc"));
        strip_admin_cookie(&mut plain);
        assert_eq!(plain[header::COOKIE], "session=abc", "untouched");
    }

    #[test]
    fn hygiene_strips_hop_by_hop_and_the_token() {
        let req = Request::builder()
            .uri("/billing/x")
            .header("connection", "keep-alive, x-secret-hop")
            .header("x-secret-hop", "1")
            .header("keep-alive", "timeout=5")
            .header("proxy-authorization", "Basic abc")
            .header("x-lease-token", "tok")
            .header("x-lease-epoch", "7")
            .header("x-forwarded-for", "10.0.0.1")
            .header("idempotency-key", "worker-chosen")
            .header("host", "fencegate.local")
            .body(())
            .unwrap();
        let (parts, _) = req.into_parts();
        let out = build_request(
            &target(),
            parts,
            Bytes::new().into(),
            &ClientHop::new("127.0.0.1:5555".parse().unwrap(), "http"),
            "k1",
        )
        .unwrap();
        let h = out.headers();
        for gone in [
            "connection",
            "x-secret-hop",
            "keep-alive",
            "proxy-authorization",
            "x-lease-token",
        ] {
            assert!(h.get(gone).is_none(), "{gone}");
        }
        // The worker's Host names fencegate; the upstream gets its own.
        assert_eq!(h["host"], "up:9");
        assert_eq!(h["x-lease-epoch"], "7");
        assert_eq!(h["x-forwarded-for"], "10.0.0.1, 127.0.0.1");
        assert_eq!(
            h["forwarded"],
            "for=127.0.0.1;proto=http;host=\"fencegate.local\""
        );
        assert_eq!(h["idempotency-key"], "k1");
    }

    #[test]
    fn forwarded_elements_are_appended_and_ipv6_is_quoted() {
        let req = Request::builder()
            .uri("/billing/x")
            .header("forwarded", "for=10.0.0.1")
            .header("host", "bad\"host")
            .body(())
            .unwrap();
        let (parts, _) = req.into_parts();
        let hop = ClientHop::new("[::1]:5555".parse().unwrap(), "https");
        let out = build_request(&target(), parts, Bytes::new().into(), &hop, "k1").unwrap();
        let h = out.headers();
        // A host that would break the element's syntax is left out.
        assert_eq!(h["forwarded"], "for=10.0.0.1, for=\"[::1]\";proto=https");
        assert_eq!(h["x-forwarded-for"], "::1");
    }

    #[test]
    fn upstream_host_omits_the_default_port() {
        for (up, host) in [
            ("http://up/v1", "up"),
            ("http://up:80/", "up"),
            ("https://up:443/", "up"),
            ("https://up:8443/", "up:8443"),
            ("http://[::1]:9/", "[::1]:9"),
        ] {
            let t = Target::new("/b/", up, "Idempotency-Key", vec![]).unwrap();
            assert_eq!(t.host, host, "{up}");
        }
    }
}
