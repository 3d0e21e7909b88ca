//! Phase 6, forward (SPEC §3, §5, §9): the upstream request built (and
//! signed), the last checks right before it is sent, the send and the answer
//! read, and how the exchange settles — answered, or failed with what may have
//! been sent.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request};
use http_body_util::Full;

use super::claim::Payload;
use super::{Proxy, Route, LOG};
use crate::config::InDoubtPolicy;
use crate::dedup::DedupKey;
use crate::error::{Doubt, ProxyError};
use crate::fence::Fence;
use crate::forward::{self, ClientHop, UpstreamError, UpstreamHead};
use crate::gate::Pass;
use crate::protect;
use crate::streaming::{
    Exchange, ExchangeEnd, ProxyBody, Streamed, UpBody, UploadEnd, UploadState,
};
use crate::telemetry::{Attrs, Kind, Spans};

/// How much of an unrecorded route's answer is sent whole when it has all
/// arrived with its head (no streaming machinery for a small answer).
const READY_BYTES: usize = 64 << 10;

/// What goes to the upstream.
pub(super) struct Outgoing {
    parts: http::request::Parts,
    body: UpBody,
    /// How far a streamed body got (`None`: sent whole).
    upload: Option<Arc<UploadState>>,
    /// The route records this request's outcome: read its answer up to
    /// `max_replay_bytes` before anything is sent on.
    recorded: bool,
    /// Its place under the route's protection (SPEC §9), reported back.
    protect: protect::Ticket,
    /// The whole body, when the route signs what it forwards.
    signed: Option<Bytes>,
}

impl Outgoing {
    #[inline]
    pub(super) fn new(
        route: &Route,
        parts: http::request::Parts,
        body: Payload,
        recorded: bool,
        protect: protect::Ticket,
    ) -> Outgoing {
        // What a signature covers: the body as it will be sent.
        let signed = match &body {
            Payload::Whole(b) if route.signer.is_some() => Some(b.clone()),
            _ => None,
        };
        let (body, upload) = body.upload(route.max_body_bytes);
        Outgoing {
            parts,
            body,
            upload,
            recorded,
            protect,
            signed,
        }
    }
}

/// How a forwarded request is known (its dedup key and request id), where
/// the forward notes its upstream time for the access line, and its spans.
pub(super) struct Trace<'a> {
    pub(super) key: &'a DedupKey,
    pub(super) request_id: &'a HeaderValue,
    pub(super) upstream_time: &'a mut Option<Duration>,
    pub(super) spans: &'a mut Spans,
}

/// An upstream's answer: whole in `body`, or `body` is what was read before
/// streaming began and `rest` streams it all (from `body` on).
pub(super) struct Answer {
    pub(super) status: http::StatusCode,
    pub(super) headers: http::HeaderMap,
    pub(super) body: Bytes,
    rest: Option<Box<Streamed>>,
}

impl Answer {
    pub(super) fn into_response(self) -> http::Response<ProxyBody> {
        let body = match self.rest {
            None => ProxyBody::Full(Full::new(self.body)),
            Some(s) => ProxyBody::Stream(s),
        };
        forward::to_response(self.status, self.headers, body)
    }
}

/// Whether any byte of a request may have reached the upstream.
#[derive(Debug, Clone, Copy)]
pub(super) enum Sent {
    Nothing,
    Maybe,
}

/// A request from its send until its exchange with the upstream settles
/// ([`Proxy::answered`] or [`Proxy::failed`]): what it holds until then, and
/// what a failure reports.
struct AtUpstream<'a> {
    route: &'a Route,
    pass: Pass,
    protect: protect::Ticket,
    /// SPEC §5: in flight until both ends of the exchange are over — the body
    /// sent whole and the answer read to its last byte. An upstream that answers
    /// an upload early must not see a newer epoch before the upload's last byte.
    exchange: Exchange,
    /// The answer's end (the body's goes with the request).
    answer_end: ExchangeEnd,
    upload: Option<Arc<UploadState>>,
    recorded: bool,
    key: &'a DedupKey,
    request_id: &'a HeaderValue,
    /// Kept for the failure log: the request itself is consumed by the send.
    uri: http::Uri,
}

impl Proxy {
    /// Forwards the admitted request under its pass and reads the answer: whole
    /// (a recorded route's up to `max_replay_bytes`; any other's as far as it has
    /// already arrived), or the head with the rest to stream. From the head on,
    /// the request's [`Exchange`] holds the pass until the body has been sent and
    /// the answer read to its last byte (SPEC §5). Ends the pass (or leaves it
    /// lingering when the outcome is unknown) on a failure and says whether
    /// anything may have been sent.
    pub(super) async fn forward(
        &self,
        route: &Route,
        fence: &Fence,
        out: Outgoing,
        hop: &ClientHop,
        pass: Pass,
        Trace {
            key,
            request_id,
            upstream_time,
            spans,
        }: Trace<'_>,
    ) -> (Result<Answer, ProxyError>, Sent) {
        let mut upstream_req = match self.build(route, out.parts, out.body, hop, key, out.signed) {
            Ok(r) => r,
            Err(detail) => {
                return (
                    Err(ProxyError::UpstreamUnreachable { detail }),
                    Sent::Nothing,
                )
            }
        };
        // The last checks, right before the send (nothing is awaited between
        // them and it).
        if pass.is_aborted() {
            // Aborted before anything was sent: the key is free again.
            return (
                Err(drain_aborted(route, &pass, Doubt::NotSent)),
                Sent::Nothing,
            );
        }
        if !self.mode.may_forward(fence.owner()) || self.state.set_up_conflict().is_some() {
            // The tenure (the instance guard, or a cluster's owner row and anchor)
            // could not be renewed in time, or the database is another set-up's
            // now: another instance may serve it (SPEC §10).
            let lease = route.lease.clone();
            return (Err(ProxyError::ShardUnavailable { lease }), Sent::Nothing);
        }
        let upstream_started = crate::clock::stopwatch();
        // The upstream's spans are children of this step's.
        let calling = spans.onward(upstream_req.headers_mut());
        let upstream_method = spans.is_on().then(|| upstream_req.method().clone());
        let exchange = Exchange::new();
        let at = AtUpstream {
            route,
            pass,
            protect: out.protect,
            answer_end: exchange.end(),
            exchange,
            upload: out.upload,
            recorded: out.recorded,
            key,
            request_id,
            uri: upstream_req.uri().clone(),
        };
        let stop = stop_on(&at.pass, &self.abandon);
        tokio::pin!(stop);
        let upstream_req = upstream_req.map(|b| b.until_sent(at.exchange.end()));
        let result = match forward::send(&route.client, upstream_req, route.timeout, stop.as_mut())
            .await
        {
            Ok(mut head) => {
                let read = if at.recorded {
                    let deadline = tokio::time::Instant::from_std(upstream_started) + route.timeout;
                    forward::read_up_to(&mut head, route.max_replay_bytes, deadline, stop.as_mut())
                        .await
                } else {
                    forward::read_ready(&mut head, READY_BYTES)
                };
                read.map(|got| (head, got))
            }
            Err(e) => Err(e),
        };
        calling.end(spans, "upstream", Kind::Client, &result, |result, a| {
            upstream_span(a, upstream_method.as_ref(), &at.uri, result)
        });
        let upstream_elapsed = upstream_started.elapsed();
        *upstream_time = Some(upstream_elapsed);
        route
            .metrics
            .upstream
            .observe(upstream_elapsed.as_secs_f64());
        match result {
            Ok((head, read)) => (Ok(self.answered(at, head, read)), Sent::Maybe),
            Err(e) => {
                let (err, sent) = self.failed(at, e, upstream_elapsed);
                (Err(err), sent)
            }
        }
    }

    /// The upstream request. Built only once the request will really be
    /// forwarded (not for a replay); signed last, so that nothing the worker or
    /// `upstream_headers` set replaces the signature (SPEC §3).
    #[inline]
    fn build(
        &self,
        route: &Route,
        parts: http::request::Parts,
        body: UpBody,
        hop: &ClientHop,
        key: &DedupKey,
        signed: Option<Bytes>,
    ) -> Result<Request<UpBody>, String> {
        let mut r = forward::build_request(&route.target, parts, body, hop, key.as_str())?;
        if let (Some(signer), Some(b)) = (&route.signer, &signed) {
            // Scoped like the dedup record (SPEC §6: per route): two
            // routes' deliveries with one key are two messages to a
            // receiver that deduplicates on `webhook-id`.
            let id = format!("{}:{}", route.name, key.as_str());
            signer.sign(r.headers_mut(), &id, self.clock.now(), b)?;
        }
        Ok(r)
    }

    /// The upstream answered: its head reports to the route's protection, and
    /// from here the exchange holds the pass (and the request's in-flight slot)
    /// until both of its ends are over.
    #[inline]
    fn answered(&self, at: AtUpstream<'_>, head: UpstreamHead, read: (Bytes, bool)) -> Answer {
        let AtUpstream {
            route,
            pass,
            protect,
            exchange,
            answer_end,
            ..
        } = at;
        let slot = protect.answered(head.status, &head.headers, || self.clock.now());
        exchange.keep(slot);
        let rest_stop = stop_on(&pass, &self.abandon);
        exchange.hold(pass);
        match read {
            (body, true) => {
                // The answer is whole; the body may still be on its way.
                drop(answer_end);
                exchange.watch(rest_stop, head.conn);
                Answer {
                    status: head.status,
                    headers: head.headers,
                    body,
                    rest: None,
                }
            }
            (prefix, false) => {
                exchange.watch(rest_stop, head.conn.clone());
                let rest = Streamed::new(
                    prefix.clone(),
                    head.body,
                    Some(answer_end),
                    route.timeout,
                    head.conn,
                    Arc::from(route.name.as_str()),
                );
                Answer {
                    status: head.status,
                    headers: head.headers,
                    body: prefix,
                    rest: Some(Box::new(rest)),
                }
            }
        }
    }

    /// The exchange failed: the connection was cut (or never carried anything).
    /// Ends the pass or leaves it lingering, reports to the route's protection,
    /// logs the cause, and says what the worker is told and whether anything
    /// may have been sent.
    fn failed(
        &self,
        at: AtUpstream<'_>,
        e: UpstreamError,
        upstream_elapsed: Duration,
    ) -> (ProxyError, Sent) {
        let AtUpstream {
            route,
            pass,
            protect,
            answer_end,
            upload,
            recorded,
            key,
            request_id,
            uri,
            ..
        } = at;
        drop(answer_end);
        let aborted = pass.is_aborted();
        let abandoned = self.abandon.is_cancelled();
        // A streamed request body that did not arrive whole: the upstream got an
        // incomplete request and cannot have acted on it.
        let upload_end = upload.as_ref().map_or(UploadEnd::Complete, |u| u.get());
        // A streamed body the upstream was waiting for: the worker stalled it.
        let stalled = upload.is_some_and(|u| u.stalled_by_worker());
        let sent = match e {
            UpstreamError::Unreachable(_) if !aborted => Sent::Nothing,
            _ => Sent::Maybe,
        };
        // Where the key stands now (SPEC §6), for the worker's next step.
        let doubt = match sent {
            Sent::Nothing => Doubt::NotSent,
            Sent::Maybe if recorded => Doubt::Key {
                route: route.name.clone(),
                key: key.as_str().to_owned(),
                resend: route.in_doubt == InDoubtPolicy::Resend,
            },
            Sent::Maybe => Doubt::Unrecorded,
        };
        let aborted_err = aborted.then(|| drain_aborted(route, &pass, doubt.clone()));
        // In flight ends with the answer or a failure — except that a request
        // whose outcome is unknown may still be executing at the destination: it
        // keeps counting for a drain until the drain's timeout. Only a body known
        // to be incomplete rules that out: an empty one (a GET) is never polled,
        // so its upload still says `Sending` (found by the cluster fault campaign:
        // a timed-out poll ended a drain while the destination still executed it).
        let incomplete = matches!(upload_end, UploadEnd::TooLarge | UploadEnd::ClientFailed);
        // The breaker counts what the upstream is to blame for: no connection, no
        // answer in time, a reset — not a drain abort, shutdown or the worker's body
        // (cut off, or stalled while the upstream waited for it).
        // A request that lingers keeps its `max_in_flight` slot too (SPEC §7 "as
        // in §5"): for the drain timeout, as a drain counts it.
        let lingers = matches!(e, UpstreamError::Uncertain(_)) && !aborted && !incomplete;
        if aborted && !incomplete && matches!(sent, Sent::Maybe) {
            // Cut off by a drain abort, perhaps still running at the destination:
            // a probe stays out for a drain timeout (no second probe beside it).
            protect.cut_off(route.drain_timeout);
        } else {
            protect.failed(
                !aborted && !abandoned && !incomplete && !stalled,
                lingers.then_some(route.drain_timeout),
            );
        }
        if lingers {
            pass.linger();
        } else {
            drop(pass);
        }
        // SPEC §8: every upstream failure with its cause, for the operator
        // (the worker gets only the code and a short detail).
        tracing::warn!(
            target: LOG,
            route = %route.name,
            upstream = %UriNoQuery(&uri),
            error = %e,
            elapsed_ms = upstream_elapsed.as_secs_f64() * 1000.0,
            may_have_been_sent = matches!(e, UpstreamError::Uncertain(_)),
            request_id = request_id.to_str().unwrap_or("-"),
            "upstream request failed"
        );
        let err = match (aborted_err, upload_end, e) {
            (Some(a), ..) => a,
            (None, UploadEnd::TooLarge, _) => ProxyError::BodyTooLarge {
                limit: route.max_body_bytes,
            },
            (None, UploadEnd::ClientFailed, e) => ProxyError::BodyUnreadable {
                detail: e.to_string(),
            },
            (None, ..) if abandoned => ProxyError::ShuttingDown { doubt },
            (None, _, UpstreamError::Unreachable(d)) => {
                ProxyError::UpstreamUnreachable { detail: d }
            }
            (None, _, UpstreamError::Uncertain(d)) => {
                ProxyError::UpstreamTimeout { detail: d, doubt }
            }
        };
        (err, sent)
    }
}

/// The `upstream` span's attributes and error status.
fn upstream_span<'r>(
    a: &mut Attrs,
    method: Option<&Method>,
    uri: &http::Uri,
    result: &'r Result<(UpstreamHead, (Bytes, bool)), UpstreamError>,
) -> Option<&'r str> {
    let method = method.map_or("", Method::as_str);
    a.str("http.request.method", method.to_owned())
        .str("server.address", uri.host().unwrap_or("").to_owned());
    if let Some(p) = uri.port_u16() {
        a.int("server.port", i64::from(p));
    }
    match result {
        Ok((head, _)) => {
            a.int("http.response.status_code", i64::from(head.status.as_u16()));
        }
        Err(UpstreamError::Unreachable(_)) => {
            a.str("error.type", "unreachable");
        }
        Err(UpstreamError::Uncertain(_)) => {
            a.str("error.type", "outcome_unknown");
        }
    }
    result.as_ref().err().map(|e| match e {
        UpstreamError::Unreachable(d) | UpstreamError::Uncertain(d) => d.as_str(),
    })
}

/// Resolves when `pass` is aborted by a drain or shutdown abandons requests.
fn stop_on(
    pass: &Pass,
    abandon: &tokio_util::sync::CancellationToken,
) -> impl std::future::Future<Output = &'static str> + Send + 'static {
    let (signal, abandon) = (pass.abort_signal(), abandon.clone());
    async move {
        tokio::select! {
            _ = signal.wait() => "drain aborted",
            _ = abandon.cancelled_owned() => "abandoned at shutdown",
        }
    }
}

fn drain_aborted(route: &Route, pass: &Pass, doubt: Doubt) -> ProxyError {
    ProxyError::DrainAborted {
        lease: route.lease.clone(),
        epoch: pass.epoch(),
        newer: pass.newer_epoch(),
        doubt,
    }
}

/// An upstream URI without its query (it may carry credentials), for logs.
struct UriNoQuery<'a>(&'a http::Uri);

impl std::fmt::Display for UriNoQuery<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Host and port only: an authority's userinfo would be a credential.
        if let (Some(s), Some(h)) = (self.0.scheme_str(), self.0.host()) {
            write!(f, "{s}://{h}")?;
            if let Some(p) = self.0.port_u16() {
                write!(f, ":{p}")?;
            }
        }
        f.write_str(self.0.path())
    }
}
