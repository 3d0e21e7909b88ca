//! The request path (SPEC §3–§7). [`Proxy::handle`] finds the request's route
//! and [`Proxy::serve`] runs its phases in this order; any of them may end the
//! request with a refusal ([`ProxyError`], SPEC §7):
//!
//! 1. **Parse the claim** — [`Proxy::parse`] (`claim.rs`): refuses an
//!    `Upgrade`, reads the epoch, the worker's key, the token and a peer's
//!    headers, refuses a declared length over the limit; then [`read_body`]
//!    reads the body whole (a recorded or signed request), or it is left to
//!    stream.
//! 2. **Place or relay** — [`Proxy::place`] (`place.rs`): this instance's
//!    fence of the lease, or the shard's owner, to which [`Proxy::relay`]
//!    passes the request (SPEC §10; span `peer.relay`).
//! 3. **Admit** — [`admit()`] (`admit.rs`): the fence's decision and the
//!    drain it may wait out (SPEC §4–§5; spans `admission` and `drain`:
//!    [`admission`], [`drained`]).
//!    **Queue** (a queued route, in place of 4–7): [`Proxy::accept`]
//!    (`queued.rs`) answers a repeat of its key as dedup decides (§6), else
//!    writes its message durably, within the queue's bound, and answers
//!    `202` (SPEC §11); the deliverer (`queue/deliver.rs`) sends it later.
//! 4. **Protect** — [`protect()`] (`admit.rs`): the route's in-flight limit,
//!    hold and breaker, after admission and before the dedup claim (SPEC §7
//!    `upstream_held`).
//! 5. **Claim the key** — [`Keyed::key`], [`Proxy::claim_key`] (`record.rs`):
//!    the dedup key, and for a recorded request its durable `in_flight` record
//!    or the stored answer, replayed (SPEC §6; span `dedup.claim`:
//!    [`claimed`]).
//! 6. **Forward** — [`Proxy::forward`] (`upstream.rs`): builds (and signs) the
//!    upstream request, checks right before the send that the pass was not
//!    aborted, that this instance may still forward for the lease's owner and
//!    that the database is still this set-up's (SPEC §10), sends it and reads
//!    the answer (SPEC §3, §5; span `upstream`); then [`Proxy::answered`]
//!    hands the pass to the exchange, or [`Proxy::failed`] ends it (or leaves
//!    it lingering) and says whether anything may have been sent.
//! 7. **Record** — [`outcome()`], [`Proxy::record`] (`record.rs`): the key's
//!    outcome, from how the forward ended (SPEC §6; span `dedup.outcome`:
//!    [`written`]).
//!
//! Then [`Proxy::handle`] counts the request, writes its access line and ends
//! its span.
//!
//! Tracing costs a phase one call: [`Spans::step`] around the phase's work in
//! [`Proxy::serve`], or, for a phase whose request carries its span on (the
//! relay, the upstream call), [`Spans::onward`] and [`Onward::end`] inside it.
//! A traced phase's future is pinned where `serve` makes it (`pin!` in the
//! `step` call, its output bound to a plain name): moving it into `serve`'s
//! own future would copy it whole, and a pinned future bound any other way
//! (a pattern, a `match` on its output) stays in `serve`'s future after it is
//! done, which grows every request's future by its size.
//!
//! [`Onward::end`]: crate::telemetry::Onward::end

use std::pin::pin;
use std::sync::Arc;

use http::{HeaderValue, Request, Response};
use hyper::body::Incoming;

mod admit;
mod claim;
mod place;
pub(crate) mod queued;
mod record;
mod upstream;

pub(crate) use crate::routes::{Route, RouteTable};

use crate::access::{self, Seen};
use crate::clock::Clock;
use crate::dedup::{Begin, Dedup, DedupKey};
use crate::error::ProxyError;
use crate::fence::Fences;
use crate::forward::{ClientHop, HttpsClient};
use crate::headers::{IDEMPOTENCY_KEY_NAME, REQUEST_ID};
use crate::live::LiveConfig;
use crate::metrics::Metrics;
use crate::shared::{Mode, Shared};
use crate::state::StateStore;
use crate::streaming::ProxyBody;
use crate::telemetry::{Kind, Spans, Telemetry};
use admit::{admission, admit, drained, protect};
use claim::{read_body, Parsed, Payload};
use place::Served;
use record::{claimed, outcome, written, Keyed};
use upstream::{Outgoing, Trace};

/// The target of the request path's log lines, whichever file of `proxy/`
/// writes them: one target, as before the phases had files of their own
/// (operators filter and route logs on it).
const LOG: &str = "fencegate::proxy";

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
    /// Queued routes' messages (SPEC §11); `None` when no queue is kept.
    queue: Option<Arc<crate::queue::Queue>>,
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
            queue: shared.queue.clone(),
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
        if uri.path().starts_with(queued::STATUS_PREFIX) {
            let mut resp = self.delivery_status(&req).await;
            resp.headers_mut().insert(REQUEST_ID, request_id);
            return resp;
        }
        let route = live.routes.find(&method, uri.path());
        let mut refusal = None;
        let (mut resp, outcome) = match route {
            None => {
                self.metrics.request("", "refused", "route_not_found");
                let e = if crate::forward::has_dot_segments(uri.path()) {
                    ProxyError::PathUnroutable
                } else {
                    ProxyError::RouteNotFound
                };
                let resp = e.to_response().map(ProxyBody::from);
                refusal = Some(e);
                (resp, "refused")
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
        let h = resp.headers_mut();
        h.insert(REQUEST_ID, request_id);
        // Ours or none: an upstream's `X-Fencegate-Owner` would steer a
        // worker's next request, and its token, elsewhere.
        match seen.owner.take() {
            Some(owner) => h.insert(crate::headers::OWNER, owner),
            None => h.remove(crate::headers::OWNER),
        };
        resp
    }

    /// The phases, in order (the module doc says what each does); each may
    /// end the request with a refusal (`Err`, SPEC §7) or an answer of its own
    /// (a relay, a replay). Long on purpose: the request path read in the
    /// order the module doc lists it, each phase a named step of its own.
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
        // 1. Parse the claim.
        let Parsed {
            claim,
            worker_key,
            relayed,
            record,
            whole,
        } = self.parse(route, &parts, seen)?;
        let body = if whole {
            Payload::Whole(read_body(body, route).await?)
        } else {
            Payload::Stream(body)
        };
        // 2. Place or relay.
        let placed = self.place(route, relayed);
        if let Some(c) = self.mode.cluster() {
            // SPEC §10.2: where the lease's next request may go straight.
            seen.owner = match &placed {
                Served::Here(Ok(_)) => c.advertise_header().cloned(),
                Served::There(peer) => peer.hint(),
                Served::Here(Err(_)) => None,
            };
        }
        let fence = match placed {
            Served::Here(fence) => fence?,
            Served::There(peer) => {
                let relayed = self.relay(route, peer, parts, body, hop, spans).await;
                return Ok((relayed?, "relayed"));
            }
        };
        // A relayed request's hop is a copy; anyone else's is borrowed (a clone
        // per request was two allocations).
        let relayed_hop;
        let hop = if relayed {
            relayed_hop = hop.relayed();
            &relayed_hop
        } else {
            hop
        };
        // 3. Admit.
        let pass = spans
            .step(
                "admission",
                Kind::Internal,
                pin!(admit(route, &fence, claim)),
                |admitted, a| admission(a, route, claim, relayed, admitted),
            )
            .await?;
        drained(route, claim, &pass, spans);
        if let (Some(queue), Payload::Whole(b)) =
            (self.queue.as_ref().filter(|_| route.queued), &body)
        {
            // Queue: a queued route accepts into its lease's queue (SPEC §11).
            let b = b.clone();
            let claimed = queued::Claimed::of(claim);
            let admitted = queued::Admitted {
                route,
                fence: &fence,
                parts,
                body: b,
                hop,
                pass,
                claim: claimed,
                worker_key,
            };
            let resp = self.accept(queue, admitted, seen).await?;
            let outcome = if resp.status() == http::StatusCode::ACCEPTED {
                "queued"
            } else {
                "replayed"
            };
            return Ok((resp, outcome));
        }
        // 4. Protect.
        let protect = protect(route)?;
        // 5. Claim the key.
        let request = Keyed::new(&parts, &body, record, claim.epoch);
        let key: &'s DedupKey = seen.key.insert(request.key(route, worker_key));
        let ticket = match request.recorded {
            None => None,
            Some(b) => {
                let begun = spans
                    .step(
                        "dedup.claim",
                        Kind::Internal,
                        pin!(self.claim_key(route, &fence, key, &request, b)),
                        claimed,
                    )
                    .await?;
                match begun {
                    Begin::Forward(ticket) => Some(ticket),
                    Begin::Replay(stored) => {
                        return Ok((stored.to_response().map(ProxyBody::from), "replayed"))
                    }
                }
            }
        };
        // 6. Forward.
        let outgoing = Outgoing::new(route, parts, body, ticket.is_some(), protect);
        let trace = Trace {
            key,
            request_id,
            upstream_time: &mut seen.upstream,
            spans,
        };
        let (result, sent) = self
            .forward(route, &fence, outgoing, hop, pass, trace)
            .await;
        // 7. Record.
        if let Some(ticket) = ticket {
            let (outcome, name) = outcome(route, &result, sent);
            spans
                .step(
                    "dedup.outcome",
                    Kind::Internal,
                    pin!(self.record(ticket, outcome)),
                    |w, a| written(a, name, *w),
                )
                .await;
        }
        result.map(|a| (a.into_response(), "forwarded"))
    }
}

/// A span's error status for a step that failed with a 5xx refusal (a 4xx one
/// is the request's fault, not the step's: its code is an attribute).
fn server_error<T>(r: &Result<T, ProxyError>) -> Option<&'static str> {
    match r {
        Err(e) if e.status_and_code().0.is_server_error() => Some(e.code()),
        _ => None,
    }
}
