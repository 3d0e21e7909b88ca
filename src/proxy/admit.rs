//! Phase 3, admit (SPEC §4–§5): the fence judges the claim and may wait out a
//! drain; phase 4, protect (SPEC §7 `upstream_held`): the route's in-flight
//! limit, its hold on a `Retry-After` and its breaker.

use super::{server_error, Route};
use crate::admission::Claim;
use crate::error::ProxyError;
use crate::fence::Fence;
use crate::gate::Pass;
use crate::protect;
use crate::telemetry::{Attrs, Spans};

/// Admits the request under its lease's fence: a pass, once any older
/// requests it waited for have drained. Traced as `admission`
/// ([`admission`]), and the drain as a span of its own ([`drained`]).
pub(super) async fn admit(
    route: &Route,
    fence: &Fence,
    claim: Claim<'_>,
) -> Result<Pass, ProxyError> {
    let started = crate::clock::stopwatch();
    let pass = fence
        .admit(claim, route.require_token, route.drain_timeout)
        .await?;
    route
        .metrics
        .admission
        .observe(started.elapsed().as_secs_f64());
    Ok(pass)
}

/// The span `admission`: the lease, the epoch, whether a peer relayed the
/// request, and the decision.
pub(super) fn admission<'r>(
    a: &mut Attrs,
    route: &Route,
    claim: Claim<'_>,
    relayed: bool,
    admitted: &'r Result<Pass, ProxyError>,
) -> Option<&'r str> {
    a.str("fencegate.lease", route.lease.to_string())
        .int("fencegate.epoch", claim.epoch.get() as i64)
        .bool("fencegate.relayed", relayed)
        .str(
            "fencegate.admission",
            admitted.as_ref().map_or_else(|e| e.code(), |_| "admitted"),
        );
    server_error(admitted)
}

/// The span `drain`: the wait for older requests to drain, when admission
/// waited for one.
pub(super) fn drained(route: &Route, claim: Claim<'_>, pass: &Pass, spans: &mut Spans) {
    if let Some(waited) = pass.drain_waited() {
        spans.add("drain", waited, |a| {
            a.str("fencegate.lease", route.lease.to_string())
                .int("fencegate.epoch", claim.epoch.get() as i64);
        });
    }
}

/// Protecting the destination (SPEC §9): refused here, after admission (a
/// stale worker learns it is stale) and before the dedup claim, so that a
/// refusal records nothing and the worker's key stays free (§6 unchanged). A
/// replay is refused too while the route is held: it is served on the retry.
///
/// The instance's upstream budget (SPEC §9 "Limits") is asked first: a
/// request it has no place for touches none of the route's state.
pub(super) fn protect(route: &Route) -> Result<protect::Ticket, ProxyError> {
    let held = |refused| ProxyError::UpstreamHeld {
        route: route.name.clone(),
        refused,
    };
    let budget = route
        .upstreams
        .try_slot()
        .ok_or_else(|| held(route.protect.refuse_for_budget()))?;
    let mut ticket = route.protect.enter(&route.protect_cfg).map_err(held)?;
    ticket.hold(budget);
    Ok(ticket)
}
