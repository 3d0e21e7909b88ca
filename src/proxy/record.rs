//! The dedup key's record (SPEC §6): phase 5, claim the key — the request's
//! key, and for a recorded request its durable `in_flight` record (or the stored
//! answer of a request done before); phase 7, record — the key's outcome, from
//! how the forward ended.

use bytes::Bytes;
use http::request::Parts;

use super::claim::Payload;
use super::server_error;
use super::upstream::{Answer, Sent};
use super::{Proxy, Route, LOG};
use crate::dedup::{self, Action, Begin, DedupKey, Outcome};
use crate::epoch::Epoch;
use crate::error::ProxyError;
use crate::fence::Fence;
use crate::telemetry::Attrs;

/// The request as its dedup key and record know it: method, path and query,
/// epoch, and the body when the route records the request (read whole).
pub(super) struct Keyed<'a> {
    method: &'a str,
    path_query: &'a str,
    epoch: Epoch,
    /// The body of a request the route records: its key is claimed
    /// ([`Proxy::claim_key`]) and its outcome recorded ([`Proxy::record`]).
    pub(super) recorded: Option<&'a Bytes>,
}

impl<'a> Keyed<'a> {
    pub(super) fn new(
        parts: &'a Parts,
        body: &'a Payload,
        record: bool,
        epoch: Epoch,
    ) -> Keyed<'a> {
        Keyed {
            method: parts.method.as_str(),
            path_query: parts
                .uri
                .path_and_query()
                .map_or(parts.uri.path(), |pq| pq.as_str()),
            epoch,
            recorded: match body {
                Payload::Whole(b) if record => Some(b),
                Payload::Whole(_) | Payload::Stream(_) => None,
            },
        }
    }

    /// The request's dedup key: the worker's, else derived from a recorded
    /// request, else a fresh one (sent on, never recorded).
    pub(super) fn key(&self, route: &Route, worker_key: Option<DedupKey>) -> DedupKey {
        let recorded = self.recorded.map(|b| &b[..]);
        DedupKey::of_request(
            worker_key,
            &route.name,
            self.method,
            self.path_query,
            recorded,
        )
        .unwrap_or_else(DedupKey::fresh)
    }
}

impl Proxy {
    /// Claims `key` for a recorded request (`body`: what it records): its
    /// `in_flight` record is durable before anything is forwarded, or the
    /// request was done before and its stored answer is replayed. Not raced
    /// against a drain abort: a record must never be left `in_flight` by a
    /// request that stopped halfway through writing it. Traced as
    /// `dedup.claim` ([`claimed`]).
    pub(super) async fn claim_key(
        &self,
        route: &Route,
        fence: &Fence,
        key: &DedupKey,
        request: &Keyed<'_>,
        body: &Bytes,
    ) -> Result<Begin, ProxyError> {
        self.dedup
            .begin(
                fence.owner(),
                &route.name,
                key,
                Action::new(request.method, request.path_query, body),
                request.epoch,
                route.in_doubt,
            )
            .await
            .map_err(ProxyError::from)
    }

    /// Records the key's outcome ([`outcome`]). A failure here must not change
    /// the worker's answer: the upstream's response (or the forwarding error) is
    /// the truth about the action. The `in_flight` record was durable before
    /// forwarding, so a retry is refused (`dedup_in_flight`, or `dedup_in_doubt`
    /// after a restart), never repeated. Says whether it was written; traced as
    /// `dedup.outcome` ([`written`]).
    pub(super) async fn record(&self, ticket: dedup::Ticket, outcome: Outcome<'_>) -> bool {
        let written = self.dedup.finish(ticket, outcome).await;
        if let Err(e) = &written {
            tracing::error!(target: LOG, error = %e, "could not record the outcome of a forwarded request; a retry of its key is refused until the outcome is settled (PostgreSQL: written again in the background) or a restart makes it in doubt");
        }
        written.is_ok()
    }
}

/// The span `dedup.claim`: what the claim found.
pub(super) fn claimed<'r>(begun: &'r Result<Begin, ProxyError>, a: &mut Attrs) -> Option<&'r str> {
    a.str(
        "fencegate.dedup",
        match begun {
            Ok(Begin::Forward(_)) => "claimed",
            Ok(Begin::Replay(_)) => "replay",
            Err(e) => e.code(),
        },
    );
    server_error(begun)
}

/// The key's outcome, from how the forward ended, decided in one place, and its
/// name on the span `dedup.outcome`. A response larger than `max_replay_bytes`
/// is recorded `done` without its body (what was read is over the limit),
/// durably, before any of it is streamed to the worker (SPEC §6).
pub(super) fn outcome<'a>(
    route: &Route,
    result: &'a Result<Answer, ProxyError>,
    sent: Sent,
) -> (Outcome<'a>, &'static str) {
    let outcome = match (result, sent) {
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
    let name = match outcome {
        Outcome::Response { .. } => "response",
        Outcome::NotSent => "not_sent",
        Outcome::Unknown => "unknown",
    };
    (outcome, name)
}

/// The span `dedup.outcome`: the outcome recorded (`name`), and whether it was
/// written.
pub(super) fn written(a: &mut Attrs, name: &'static str, written: bool) -> Option<&'static str> {
    a.str("fencegate.dedup.outcome", name);
    (!written).then_some("not recorded")
}
