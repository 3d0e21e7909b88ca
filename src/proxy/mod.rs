//! The request path (SPEC §3–§6): route → validate headers → read body → admit
//! (fence) → dedup → forward (abortable by a drain) → record → answer.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;

pub(crate) mod routes;

pub(crate) use routes::{Route, RouteTable};

use crate::access::{self, Seen};
use crate::admission::Claim;
use crate::clock::Clock;
use crate::cluster::{peer as relay, Placement};
use crate::config::{DeriveKey, InDoubtPolicy};
use crate::dedup::{self, Action, Begin, Dedup, DedupKey, Outcome};
use crate::epoch::Epoch;
use crate::error::{Doubt, ProxyError};
use crate::fence::{Fence, Fences};
use crate::forward::{self, ClientHop, HttpsClient, UpstreamError};
use crate::gate::Pass;
use crate::headers::{
    IDEMPOTENCY_KEY_NAME, LEASE_EPOCH_NAME, LEASE_TOKEN_NAME, PEER_NAME, PEER_TOKEN_NAME,
    REQUEST_ID,
};
use crate::live::LiveConfig;
use crate::metrics::Metrics;
use crate::protect;
use crate::shared::{Mode, Shared};
use crate::state::StateStore;
use crate::streaming::{Exchange, ProxyBody, Streamed, UpBody, Upload, UploadEnd, UploadState};
use crate::telemetry::{Kind, Spans, Telemetry};

/// How much of an unrecorded route's answer is sent whole when it has all
/// arrived with its head (no streaming machinery for a small answer).
const READY_BYTES: usize = 64 << 10;

pub(crate) struct Proxy {
    /// The routes and the access-log switch, as the last reload left them.
    live: Arc<LiveConfig>,
    dedup: Arc<Dedup>,
    fences: Arc<Fences>,
    mode: Mode,
    /// The state store, asked per request whether its database still belongs
    /// to this set-up (SPEC §10).
    state: Arc<dyn StateStore>,
    /// Pooled connections to cluster peers (SPEC §10.2).
    peers: Option<HttpsClient>,
    metrics: Arc<Metrics>,
    /// Wall-clock time: `webhook-timestamp`, and a `Retry-After` date that
    /// comes without a `Date`.
    clock: Arc<dyn Clock>,
    /// Cancelled when shutdown gives up on in-flight requests.
    abandon: tokio_util::sync::CancellationToken,
    /// Trace export (`[telemetry]`); `None`: no request is traced.
    telemetry: Option<Arc<Telemetry>>,
}

impl Proxy {
    pub(crate) fn new(
        shared: &Shared,
        metrics: Arc<Metrics>,
        peers: Option<HttpsClient>,
        clock: Arc<dyn Clock>,
        telemetry: Option<Arc<Telemetry>>,
    ) -> Proxy {
        Proxy {
            telemetry,
            live: shared.live.clone(),
            dedup: shared.dedup.clone(),
            fences: shared.fences.clone(),
            mode: shared.mode.clone(),
            state: shared.state.clone(),
            peers,
            metrics,
            clock,
            abandon: tokio_util::sync::CancellationToken::new(),
        }
    }

    /// Shutdown's last resort: every request still forwarding ends now, in doubt.
    pub(crate) fn abandon_all(&self) {
        self.abandon.cancel();
    }

    /// The token [`Proxy::abandon_all`] cancels.
    pub(crate) fn abandon_token(&self) -> tokio_util::sync::CancellationToken {
        self.abandon.clone()
    }

    /// Serves one request. Must run to completion even if the client goes away
    /// (the server finishes it in the background): dedup records and the gate must
    /// never be left half-done.
    ///
    /// No `tracing` span per request: creating and recording one cost ~5% of a
    /// forwarded request's CPU. The access line carries the request's fields;
    /// trace spans ([`crate::telemetry`]) exist only when export is configured.
    pub(crate) async fn handle(
        self: Arc<Self>,
        mut req: Request<Incoming>,
        hop: Arc<ClientHop>,
    ) -> Response<ProxyBody> {
        let started = crate::clock::stopwatch();
        let mut spans = match &self.telemetry {
            Some(t) => t.request(req.headers()),
            None => Spans::off(),
        };
        let keyed = spans.is_on() && req.headers().contains_key(IDEMPOTENCY_KEY_NAME);
        let request_id = access::request_id(req.headers_mut());
        let method = req.method().clone();
        let uri = req.uri().clone();
        let mut seen = Seen::default();
        // This request's config to its end, whatever a reload does meanwhile.
        let live = self.live.current();
        let route = live.routes.find(&method, uri.path());
        let mut refusal = None;
        let (mut resp, outcome) = match route {
            None => {
                self.metrics.request("", "refused", "route_not_found");
                refusal = Some(ProxyError::RouteNotFound);
                (
                    ProxyError::RouteNotFound.to_response().map(ProxyBody::from),
                    "refused",
                )
            }
            Some(route) => match self
                .serve(route, req, &hop, &mut seen, &request_id, &mut spans)
                .await
            {
                Ok((resp, outcome)) => {
                    if outcome == "forwarded" {
                        route.metrics.forwarded.inc();
                    } else {
                        self.metrics.request(&route.name, outcome, "");
                    }
                    (resp, outcome)
                }
                Err(e) => {
                    self.metrics.request(&route.name, "refused", e.code());
                    let resp = e.to_response().map(ProxyBody::from);
                    refusal = Some(e);
                    (resp, "refused")
                }
            },
        };
        if live.access_log {
            access::Line {
                method: &method,
                path: uri.path(),
                route: route.map(|r| r.name.as_str()),
                lease: route.map(|r| r.lease.as_str()),
                status: resp.status().as_u16(),
                outcome,
                refusal: refusal.as_ref(),
                seen: &seen,
                client: hop.addr,
                request_id: &request_id,
                elapsed: started.elapsed(),
            }
            .emit();
        }
        let status = resp.status();
        spans.finish(
            || match route {
                Some(r) => format!("{method} {}", r.target.prefix),
                None => method.to_string(),
            },
            |a| {
                a.str("http.request.method", method.to_string())
                    .int("http.response.status_code", i64::from(status.as_u16()))
                    .str("fencegate.outcome", outcome)
                    .bool("fencegate.dedup_key.present", keyed);
                if let Ok(id) = request_id.to_str() {
                    a.str("fencegate.request_id", id.to_owned());
                }
                if let Some(r) = route {
                    a.str("http.route", r.target.prefix.clone())
                        .str("fencegate.route", r.name.clone())
                        .str("fencegate.lease", r.lease.to_string());
                }
                if let Some(e) = seen.epoch {
                    a.int("fencegate.epoch", e as i64);
                }
                if let Some(e) = &refusal {
                    a.str("fencegate.error_code", e.code());
                }
            },
            status.is_server_error().then(|| {
                refusal
                    .as_ref()
                    .map_or("upstream answered a server error", ProxyError::code)
            }),
        );
        resp.headers_mut().insert(REQUEST_ID, request_id);
        resp
    }

    async fn serve<'s>(
        &self,
        route: &Route,
        req: Request<Incoming>,
        hop: &ClientHop,
        seen: &'s mut Seen,
        request_id: &HeaderValue,
        spans: &mut Spans,
    ) -> Result<(Response<ProxyBody>, &'static str), ProxyError> {
        let (parts, body) = req.into_parts();
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
            "must be a plain decimal u64: digits only, no sign, no spaces",
        ))?;
        seen.epoch = Some(epoch.get());
        let worker_key = match single_header(&parts.headers, &IDEMPOTENCY_KEY_NAME) {
            Err(()) => return Err(ProxyError::DedupKeyMalformed("repeated")),
            Ok(None) => None,
            Ok(Some(v)) => {
                Some(DedupKey::parse(v.as_bytes()).map_err(ProxyError::DedupKeyMalformed)?)
            }
        };
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
        refuse_declared_length(&parts, route.max_body_bytes)?;
        // A recorded request is read whole (its key and fingerprint need it), and
        // so is a signed one (its signature covers the body); any other is
        // streamed to the upstream once admitted.
        let body = if record || route.signer.is_some() {
            Payload::Whole(read_body(body, route.max_body_bytes, route.timeout).await?)
        } else {
            Payload::Stream(body)
        };
        let fence = match self.place(route, relayed) {
            Served::Here(f) => f?,
            Served::There { owner, url } => {
                let body = match body {
                    Payload::Whole(b) => UpBody::from(b),
                    Payload::Stream(b) => UpBody::stream(Upload::new(b, route.max_body_bytes).0),
                };
                // The owner's spans are children of this one.
                let relaying = spans.begin();
                let mut parts = parts;
                spans.propagate(relaying, &mut parts.headers);
                let relayed = self.relay(route, &owner, &url, parts, body, hop).await;
                spans.end(
                    relaying,
                    "peer.relay",
                    Kind::Client,
                    |a| {
                        a.str("fencegate.peer", owner);
                        if let Ok(r) = &relayed {
                            a.int("http.response.status_code", i64::from(r.status().as_u16()));
                        }
                    },
                    relayed.as_ref().err().map(ProxyError::code),
                );
                return Ok((relayed?, "relayed"));
            }
        };
        let hop = &if relayed { hop.relayed() } else { hop.clone() };

        let admit_started = crate::clock::stopwatch();
        let claim = Claim { epoch, token };
        let admitting = spans.begin();
        let admitted = fence
            .admit(claim, route.require_token, route.drain_timeout)
            .await
            .map_err(ProxyError::from);
        spans.end(
            admitting,
            "admission",
            Kind::Internal,
            |a| {
                a.str("fencegate.lease", route.lease.to_string())
                    .int("fencegate.epoch", epoch.get() as i64)
                    .bool("fencegate.relayed", relayed)
                    .str(
                        "fencegate.admission",
                        admitted.as_ref().map_or_else(|e| e.code(), |_| "admitted"),
                    );
            },
            server_error(&admitted),
        );
        let pass = admitted?;
        if let Some(waited) = pass.drain_waited() {
            spans.add("drain", waited, |a| {
                a.str("fencegate.lease", route.lease.to_string())
                    .int("fencegate.epoch", epoch.get() as i64);
            });
        }
        route
            .metrics
            .admission
            .observe(admit_started.elapsed().as_secs_f64());
        // Protecting the destination (SPEC §9): refused here, after admission (a
        // stale worker learns it is stale) and before the dedup claim, so that a
        // refusal records nothing and the worker's key stays free (§6 unchanged).
        // A replay is refused too while the route is held: it is served on the
        // retry.
        let protect_ticket = route.protect.enter(&route.protect_cfg).map_err(|refused| {
            ProxyError::UpstreamHeld {
                route: route.name.clone(),
                refused,
            }
        })?;

        let path_query = parts
            .uri
            .path_and_query()
            .map_or(parts.uri.path(), |pq| pq.as_str());
        let method = parts.method.as_str();
        let key = match (worker_key, &body) {
            (Some(k), _) => k,
            (None, Payload::Whole(b)) if record => {
                DedupKey::derive(&route.name, method, path_query, b)
            }
            (None, _) => DedupKey::fresh(),
        };
        let key: &'s DedupKey = seen.key.insert(key);
        let ticket = match &body {
            Payload::Whole(b) if record => {
                // Not raced against a drain abort: a record must never be left
                // `in_flight` by a request that stopped halfway through writing it.
                let claiming = spans.begin();
                let begun = self
                    .dedup
                    .begin(
                        fence.owner(),
                        &route.name,
                        key,
                        Action::new(method, path_query, b),
                        epoch,
                        route.in_doubt,
                    )
                    .await
                    .map_err(ProxyError::from);
                spans.end(
                    claiming,
                    "dedup.claim",
                    Kind::Internal,
                    |a| {
                        a.str(
                            "fencegate.dedup",
                            match &begun {
                                Ok(Begin::Forward(_)) => "claimed",
                                Ok(Begin::Replay(_)) => "replay",
                                Err(e) => e.code(),
                            },
                        );
                    },
                    server_error(&begun),
                );
                match begun? {
                    Begin::Replay(stored) => {
                        return Ok((stored.to_response().map(ProxyBody::from), "replayed"))
                    }
                    Begin::Forward(t) => Some(t),
                }
            }
            Payload::Whole(_) | Payload::Stream(_) => None,
        };
        // What a signature covers: the body as it will be sent.
        let signed = match &body {
            Payload::Whole(b) if route.signer.is_some() => Some(b.clone()),
            _ => None,
        };
        let (body, upload) = match body {
            Payload::Whole(b) => (UpBody::from(b), None),
            Payload::Stream(b) => {
                let (u, state) = Upload::new(b, route.max_body_bytes);
                (UpBody::stream(u), Some(state))
            }
        };
        let (result, sent) = self
            .forward(
                route,
                &fence,
                Outgoing {
                    parts,
                    body,
                    upload,
                    recorded: ticket.is_some(),
                    protect: protect_ticket,
                    signed,
                },
                hop,
                pass,
                Trace {
                    key,
                    request_id,
                    upstream_time: &mut seen.upstream,
                    spans,
                },
            )
            .await;
        // The key's record follows from how the forward ended, in one place. A
        // response larger than `max_replay_bytes` is recorded `done` without its
        // body (what was read is over the limit), durably, before any of it is
        // streamed to the worker (SPEC §6).
        if let Some(t) = ticket {
            let outcome = match (&result, sent) {
                (Ok(a), _) => Outcome::Response {
                    status: a.status,
                    headers: &a.headers,
                    body: &a.body,
                    retryable: route.retryable.contains(&a.status.as_u16()),
                    max_replay_bytes: route.max_replay_bytes,
                },
                (Err(_), Sent::Nothing) => Outcome::NotSent,
                (Err(_), Sent::Maybe) => Outcome::Unknown,
            };
            let recorded = match outcome {
                Outcome::Response { .. } => "response",
                Outcome::NotSent => "not_sent",
                Outcome::Unknown => "unknown",
            };
            let writing = spans.begin();
            let written = self.finish_quietly(t, outcome).await;
            spans.end(
                writing,
                "dedup.outcome",
                Kind::Internal,
                |a| {
                    a.str("fencegate.dedup.outcome", recorded);
                },
                (!written).then_some("not recorded"),
            );
        }
        result.map(|a| (a.into_response(), "forwarded"))
    }

    /// Forwards the admitted request under its pass and reads the answer: whole
    /// (a recorded route's up to `max_replay_bytes`; any other's as far as it has
    /// already arrived), or the head with the rest to stream. From the head on,
    /// the request's [`Exchange`] holds the pass until the body has been sent and
    /// the answer read to its last byte (SPEC §5). Ends the pass (or leaves it
    /// lingering when the outcome is unknown) on a failure and says whether
    /// anything may have been sent.
    async fn forward(
        &self,
        route: &Route,
        fence: &Fence,
        Outgoing {
            parts,
            body,
            upload,
            recorded,
            protect,
            signed,
        }: Outgoing,
        hop: &ClientHop,
        pass: Pass,
        Trace {
            key,
            request_id,
            upstream_time,
            spans,
        }: Trace<'_>,
    ) -> (Result<Answer, ProxyError>, Sent) {
        // Built only once the request will really be forwarded (not for a replay);
        // signed last, so that nothing the worker or `upstream_headers` set
        // replaces the signature (SPEC §3).
        let built = forward::build_request(&route.target, parts, body, hop, key.as_str()).and_then(
            |mut r| {
                if let (Some(signer), Some(b)) = (&route.signer, &signed) {
                    // Scoped like the dedup record (SPEC §6: per route): two
                    // routes' deliveries with one key are two messages to a
                    // receiver that deduplicates on `webhook-id`.
                    let id = format!("{}:{}", route.name, key.as_str());
                    signer.sign(r.headers_mut(), &id, self.clock.now(), b)?;
                }
                Ok(r)
            },
        );
        let mut upstream_req = match built {
            Ok(r) => r,
            Err(detail) => {
                return (
                    Err(ProxyError::UpstreamUnreachable { detail }),
                    Sent::Nothing,
                )
            }
        };
        if pass.is_aborted() {
            // Aborted before anything was sent: the key is free again.
            return (
                Err(drain_aborted(route, &pass, Doubt::NotSent)),
                Sent::Nothing,
            );
        }
        if !self.mode.may_forward(fence.owner()) || self.state.set_up_conflict().is_some() {
            // The gate lease (the instance guard, or the shard's in a cluster) could
            // not be renewed in time: another instance may serve it now (SPEC §10).
            let lease = route.lease.clone();
            return (Err(ProxyError::ShardUnavailable { lease }), Sent::Nothing);
        }
        let upstream_started = crate::clock::stopwatch();
        // The upstream's spans are children of this one.
        let calling = spans.begin();
        spans.propagate(calling, upstream_req.headers_mut());
        // Kept for the failure log: the request itself is consumed by the send.
        let upstream_uri = upstream_req.uri().clone();
        let upstream_method = spans.is_on().then(|| upstream_req.method().clone());
        let stop = stop_on(&pass, &self.abandon);
        tokio::pin!(stop);
        // SPEC §5: in flight until both ends of the exchange are over — the body
        // sent whole and the answer read to its last byte. An upstream that answers
        // an upload early must not see a newer epoch before the upload's last byte.
        let exchange = Exchange::new();
        let answer_end = exchange.end();
        let upstream_req = upstream_req.map(|b| b.until_sent(exchange.end()));
        let result = match forward::send(&route.client, upstream_req, route.timeout, stop.as_mut())
            .await
        {
            Ok(mut head) => {
                let read = if recorded {
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
        let upstream_elapsed = upstream_started.elapsed();
        *upstream_time = Some(upstream_elapsed);
        spans.end(
            calling,
            "upstream",
            Kind::Client,
            |a| {
                let method = upstream_method.as_ref().map_or("", Method::as_str);
                a.str("http.request.method", method.to_owned()).str(
                    "server.address",
                    upstream_uri.host().unwrap_or("").to_owned(),
                );
                if let Some(p) = upstream_uri.port_u16() {
                    a.int("server.port", i64::from(p));
                }
                match &result {
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
            },
            result.as_ref().err().map(|e| match e {
                UpstreamError::Unreachable(d) | UpstreamError::Uncertain(d) => d.as_str(),
            }),
        );
        route
            .metrics
            .upstream
            .observe(upstream_elapsed.as_secs_f64());
        let answered = |head: &forward::UpstreamHead, protect: protect::Ticket| {
            let slot = protect.answered(head.status, &head.headers, || self.clock.now());
            exchange.keep(slot);
        };
        let e = match result {
            Ok((head, (body, true))) => {
                // The answer is whole; the body may still be on its way.
                answered(&head, protect);
                let rest_stop = stop_on(&pass, &self.abandon);
                exchange.hold(pass);
                drop(answer_end);
                exchange.watch(rest_stop, head.conn);
                let answer = Answer {
                    status: head.status,
                    headers: head.headers,
                    body,
                    rest: None,
                };
                return (Ok(answer), Sent::Maybe);
            }
            Ok((head, (prefix, false))) => {
                answered(&head, protect);
                let rest_stop = stop_on(&pass, &self.abandon);
                exchange.hold(pass);
                exchange.watch(rest_stop, head.conn.clone());
                let rest = Streamed::new(
                    prefix.clone(),
                    head.body,
                    Some(answer_end),
                    route.timeout,
                    head.conn,
                    Arc::from(route.name.as_str()),
                );
                let answer = Answer {
                    status: head.status,
                    headers: head.headers,
                    body: prefix,
                    rest: Some(Box::new(rest)),
                };
                return (Ok(answer), Sent::Maybe);
            }
            Err(e) => e,
        };
        // A failure: the connection was cut (or never carried anything), and the
        // pass stays this function's to end or leave lingering.
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
            route = %route.name,
            upstream = %UriNoQuery(&upstream_uri),
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
        (Err(err), sent)
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

    /// Where the route's request is served: by this instance's fence of the
    /// lease, or by the shard's owner (never for a request a peer relayed: it is
    /// relayed once at most).
    fn place(&self, route: &Route, relayed: bool) -> Served {
        let unavailable = || ProxyError::ShardUnavailable {
            lease: route.lease.clone(),
        };
        if self.state.set_up_conflict().is_some() {
            // The database is another set-up's now (SPEC §10): nothing is
            // served here, nor relayed to an owner it names.
            return Served::Here(Err(unavailable()));
        }
        if let Some(f) = &route.fence {
            return Served::Here(Ok(f.clone()));
        }
        let Some(cluster) = self.mode.cluster() else {
            return Served::Here(Err(unavailable()));
        };
        match cluster.place(route.shard) {
            Placement::Local(owner) => Served::Here(
                self.fences
                    .get(&route.lease)
                    .filter(|f| f.owner() == owner)
                    .ok_or_else(unavailable),
            ),
            Placement::Peer { owner, url } if !relayed => Served::There { owner, url },
            Placement::Peer { .. } | Placement::Unavailable => {
                cluster.nudge();
                Served::Here(Err(unavailable()))
            }
        }
    }

    /// Relays the request to the shard's owner (SPEC §10.2).
    async fn relay(
        &self,
        route: &Route,
        owner: &str,
        url: &str,
        parts: http::request::Parts,
        body: UpBody,
        hop: &ClientHop,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let (Some(cluster), Some(client)) = (self.mode.cluster(), &self.peers) else {
            return Err(ProxyError::ShardUnavailable {
                lease: route.lease.clone(),
            });
        };
        // The owner may wait out a drain (or a takeover's settle) and then the
        // upstream: allow for both.
        let timeout = route.timeout + 2 * route.drain_timeout + Duration::from_secs(1);
        cluster.peer_forwards.fetch_add(1, Ordering::Relaxed);
        relay::relay(
            client,
            url,
            cluster.id(),
            cluster.peer_token(),
            parts,
            body,
            hop,
            timeout,
        )
        .await
        .inspect(|resp| {
            // The owner is handing the shard over (or lost it): look again now —
            // only on its own 503 (with an error code), and not when it refused
            // to protect the destination (SPEC §9) or passed on the
            // destination's 503: neither says anything of the shard.
            let owners = resp
                .headers()
                .get(crate::error::ERROR_HEADER)
                .is_some_and(|c| c != "upstream_held");
            if resp.status() == http::StatusCode::SERVICE_UNAVAILABLE && owners {
                cluster.nudge();
            }
        })
        .map_err(|failed| {
            cluster.nudge();
            cluster.peer_failures.fetch_add(1, Ordering::Relaxed);
            match failed {
                relay::RelayFailed::NotSent(detail) => {
                    tracing::warn!(route = %route.name, lease = %route.lease, owner, detail, "the shard's owner could not be reached");
                    ProxyError::ShardUnavailable {
                        lease: route.lease.clone(),
                    }
                }
                // The owner may have forwarded it: 503 would tell the worker it
                // was not (found by the cluster fault campaign, a kill -9 of the
                // owner while it had the relayed request at the destination).
                relay::RelayFailed::Uncertain(detail) => {
                    tracing::warn!(route = %route.name, lease = %route.lease, owner, detail, "the shard's owner did not answer; it may have forwarded the request");
                    ProxyError::UpstreamTimeout {
                        detail,
                        doubt: Doubt::Relayed,
                    }
                }
            }
        })
    }

    /// Records a forward's outcome. A failure here must not change the worker's
    /// answer: the upstream's response (or the forwarding error) is the truth
    /// about the action. The `in_flight` record was durable before forwarding, so
    /// a retry is refused (`dedup_in_flight`, or `dedup_in_doubt` after a restart),
    /// never repeated.
    async fn finish_quietly(&self, ticket: dedup::Ticket, outcome: Outcome<'_>) -> bool {
        let written = self.dedup.finish(ticket, outcome).await;
        if let Err(e) = &written {
            tracing::error!(error = %e, "could not record the outcome of a forwarded request; a retry of its key is refused until the outcome is settled (PostgreSQL: written again in the background) or a restart makes it in doubt");
        }
        written.is_ok()
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

/// How a forwarded request is known (its dedup key and request id), where
/// the forward notes its upstream time for the access line, and its spans.
struct Trace<'a> {
    key: &'a DedupKey,
    request_id: &'a HeaderValue,
    upstream_time: &'a mut Option<Duration>,
    spans: &'a mut Spans,
}

/// A span's error status for a step that failed with a 5xx refusal (a 4xx one
/// is the request's fault, not the step's: its code is an attribute).
fn server_error<T>(r: &Result<T, ProxyError>) -> Option<&'static str> {
    match r {
        Err(e) if e.status_and_code().0.is_server_error() => Some(e.code()),
        _ => None,
    }
}

/// Who serves a request ([`Proxy::place`]).
enum Served {
    Here(Result<Arc<Fence>, ProxyError>),
    There { owner: String, url: String },
}

/// The request body: whole, or still arriving from the worker.
enum Payload {
    Whole(Bytes),
    Stream(Incoming),
}

/// What goes to the upstream.
struct Outgoing {
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

/// An upstream's answer: whole in `body`, or `body` is what was read before
/// streaming began and `rest` streams it all (from `body` on).
struct Answer {
    status: http::StatusCode,
    headers: http::HeaderMap,
    body: Bytes,
    rest: Option<Box<Streamed>>,
}

impl Answer {
    fn into_response(self) -> Response<ProxyBody> {
        let body = match self.rest {
            None => ProxyBody::Full(Full::new(self.body)),
            Some(s) => ProxyBody::Stream(s),
        };
        forward::to_response(self.status, self.headers, body)
    }
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

/// Whether any byte of a request may have reached the upstream.
#[derive(Debug, Clone, Copy)]
enum Sent {
    Nothing,
    Maybe,
}

fn drain_aborted(route: &Route, pass: &crate::gate::Pass, doubt: Doubt) -> ProxyError {
    ProxyError::DrainAborted {
        lease: route.lease.clone(),
        epoch: pass.epoch(),
        newer: pass.newer_epoch(),
        doubt,
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
fn refuse_declared_length(parts: &http::request::Parts, limit: usize) -> Result<(), ProxyError> {
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

/// Reads the whole request body, refusing more than `limit` bytes (413).
async fn read_body(body: Incoming, limit: usize, timeout: Duration) -> Result<Bytes, ProxyError> {
    match tokio::time::timeout(timeout, Limited::new(body, limit).collect()).await {
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
