//! SPEC §11's rule of kinds against what the state holds: routes to run
//! beside the messages a queue keeps (start-up, reload, a takeover), and a
//! route name's history (its messages, or its dedup records).

use super::QueueStore;
use crate::state::StateError;

/// Why `routes` cannot serve beside the messages this queue holds (start-up
/// and reload, SPEC §11), if they cannot: a direct route on a lease whose
/// queue holds messages that may still be sent would overtake them, and a
/// queued route moved to another lease would answer that lease's workers from
/// them (and deliver them in the old lease's order).
pub(crate) async fn conflict(
    store: &dyn QueueStore,
    routes: &[crate::config::RouteConfig],
) -> Result<Option<String>, StateError> {
    let routes: Vec<(&str, &str, bool)> = routes
        .iter()
        .map(|r| {
            (
                r.name.as_str(),
                r.lease.as_str(),
                r.delivery == crate::config::Delivery::Queued,
            )
        })
        .collect();
    if let Some(why) = conflict_of(store, &routes).await? {
        return Ok(Some(why));
    }
    history_conflict(store, &routes).await
}

/// A route's history follows its name (SPEC §11): a direct route whose name
/// keeps queued messages (any status: a settled one answers its key until
/// `[dedup] ttl` after it settled), or a queued route whose name keeps dedup
/// records of a direct route, would answer a worker's retry of one of those
/// keys by delivering it again. Read from the state, so that no way of
/// getting the config there — one reload, two, a restart — slips past it.
pub(super) async fn history_conflict(
    store: &dyn QueueStore,
    routes: &[(&str, &str, bool)],
) -> Result<Option<String>, StateError> {
    let names: Vec<(&str, bool)> = routes.iter().map(|&(n, _, q)| (n, q)).collect();
    let Some((name, queued)) = store.other_kind(&names).await? else {
        return Ok(None);
    };
    Ok(Some(if queued {
        format!(
            "route {name:?} is queued, and the state keeps dedup records of a direct route of that name (done ones for [dedup] ttl after they were done, in-doubt ones until an operator resolves them): a worker's retry of one of their keys would be queued and delivered again. Keep the route direct, give the queued route a new name, or wait until those records expire (GET /v1/dedup/{name}/KEY on the admin listener)"
        )
    } else {
        format!(
            "route {name:?} is direct, and the state keeps queued messages under its name (settled ones for [dedup] ttl after they settled): a worker's retry of one of their keys would be forwarded again. Keep the route queued, give the direct route a new name, or wait until they expire (GET /v1/deliveries?route={name} on the admin listener)"
        )
    }))
}

/// [`conflict`] for routes given as (name, lease, queued).
pub(super) async fn conflict_of(
    store: &dyn QueueStore,
    routes: &[(&str, &str, bool)],
) -> Result<Option<String>, StateError> {
    let holding = store.holding_for(routes).await?;
    // The messages that may still be sent are queued routes as far as the
    // rule of kinds goes (SPEC §11): the one rule, with the routes to run.
    let held = holding
        .iter()
        .map(|(route, lease)| crate::config::RouteKind {
            name: route,
            lease,
            queued: true,
        });
    let kinds = routes
        .iter()
        .map(|&(name, lease, queued)| crate::config::RouteKind {
            name,
            lease,
            queued,
        });
    if let Some((q, d)) = crate::config::mixed_delivery(held.chain(kinds)) {
        let (name, route, lease) = (d.name, q.name, q.lease);
        return Ok(Some(if d.lease == q.lease {
            format!(
                "route {name:?} would forward lease {lease}'s requests directly, but its queue still holds messages that may be sent (pending, or failed and retriable): a direct request could reach the destination before an older one. Keep the lease's routes queued until those are delivered or dropped (GET /v1/deliveries?lease={lease} on the admin listener)"
            )
        } else {
            // Its messages would wait for a queued route of that name, and a
            // worker's retry of one of their keys would be forwarded
            // directly meanwhile: both could arrive.
            format!(
                "route {route:?} holds messages of lease {lease} that may still be sent, and would forward requests directly: a worker's retry of one of their keys would reach the destination beside the queued message. Deliver or drop them first (GET /v1/deliveries?route={route} on the admin listener), or give the direct route a new name"
            )
        }));
    }
    for &(name, r_lease, queued) in routes {
        for (route, lease) in &holding {
            if queued && route == name && lease != r_lease {
                return Ok(Some(format!(
                    "route {route:?} holds messages of lease {lease} that may still be sent, and would move to lease {r_lease}: deliver or drop them first (GET /v1/deliveries?route={route} on the admin listener), or give the route a new name"
                )));
            }
        }
    }
    Ok(None)
}
