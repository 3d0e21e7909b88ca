//! What the scrape reads from the running instance (SPEC §8): marks, in-flight
//! requests, drains, store calls, flush batches, dedup counters and the
//! cluster's shards — values that live elsewhere, read at scrape time so that
//! the request path pays nothing for them. Registered once [`Shared`] exists.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use super::{emit, Metrics};
use crate::shared::Shared;

/// Adds the state store's series and the scrape-time collector of `shared`.
pub fn register(metrics: &Metrics, shared: Arc<Shared>) {
    metrics.with_registry(|registry| {
        shared.state_metrics.register(registry);
        registry.register_collector(Box::new(StateCollector(shared)));
    });
}

/// Reads marks, drains, store calls, flushes and dedup counters at scrape time.
struct StateCollector(Arc<Shared>);

impl std::fmt::Debug for StateCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StateCollector")
    }
}

impl Collector for StateCollector {
    /// One pass at scrape time, family by family in the order docs/metrics.md
    /// lists them.
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let shared = &self.0;
        upstream_budget(&mut enc, shared)?;
        leases(&mut enc, shared)?;
        store_clock_and_state(&mut enc, shared)?;
        match &shared.mode {
            crate::shared::Mode::Cluster(cl) => cluster_metrics(&mut enc, cl)?,
            crate::shared::Mode::Single(guard) => emit(
                &mut enc,
                "fencegate_instance_guard_held",
                "1 while this single instance holds its instance guard and may forward (SPEC §10.1); 0: nothing is forwarded",
                MetricType::Gauge,
                vec![(vec![], ConstGauge::new(i64::from(guard.may_forward())))],
            )?,
        }
        route_protection(&mut enc, shared)
    }
}

/// The descriptor budget's upstream share (SPEC §9 "Limits"): in use and its limit.
fn upstream_budget(enc: &mut DescriptorEncoder, shared: &Shared) -> Result<(), std::fmt::Error> {
    let up = &shared.upstreams;
    emit(
        enc,
        "fencegate_upstream_requests_in_use",
        "Requests holding a place of the descriptor budget's upstream share now (forwards, relays, queued attempts); refusals past fencegate_upstream_requests_limit are upstream_held connection_budget",
        MetricType::Gauge,
        vec![(vec![], ConstGauge::new(up.in_use() as i64))],
    )?;
    emit(
        enc,
        "fencegate_upstream_requests_limit",
        "The descriptor budget's upstream share: requests at an upstream at once",
        MetricType::Gauge,
        vec![(vec![], ConstGauge::new(up.limit as i64))],
    )?;
    Ok(())
}

/// Per lease: the gate (mark, latest epoch, in flight, in doubt, raises and
/// drains) and its lease store calls; and the set-up conflict that stops
/// them all.
fn leases(enc: &mut DescriptorEncoder, shared: &Shared) -> Result<(), std::fmt::Error> {
    let fences = shared.fences.all();
    let lease = |f: &crate::fence::Fence| vec![("lease", f.lease().as_str().to_owned())];
    let views: Vec<_> = fences.iter().map(|f| (lease(f), f.view(), f)).collect();
    let g = |f: &dyn Fn(&crate::fence::FenceView) -> i64| -> Vec<_> {
        views
            .iter()
            .map(|(l, v, _)| (l.clone(), ConstGauge::new(f(v))))
            .collect()
    };
    emit(
        enc,
        "fencegate_high_water_mark",
        "Durable high-water mark per lease",
        MetricType::Gauge,
        g(&|v| v.gate.mark.get() as i64),
    )?;
    emit(
        enc,
        "fencegate_latest_known_epoch",
        "Latest epoch seen in the store per lease",
        MetricType::Gauge,
        g(&|v| v.latest_known.get() as i64),
    )?;
    emit(
        enc,
        "fencegate_in_flight",
        "Admitted requests not yet answered by the upstream, per lease",
        MetricType::Gauge,
        g(&|v| v.gate.in_flight as i64),
    )?;
    emit(
        enc,
        "fencegate_in_doubt_in_drain",
        "Requests whose outcome is unknown (timed out, reset) that a drain still waits for, per lease",
        MetricType::Gauge,
        g(&|v| v.gate.in_doubt as i64),
    )?;
    emit(
        enc,
        "fencegate_state_set_up_conflict",
        "1 while the database's set-up record names another set-up, or is gone (SPEC §10): nothing is forwarded",
        MetricType::Gauge,
        vec![(
            vec![],
            ConstGauge::new(i64::from(shared.state.set_up_conflict().is_some())),
        )],
    )?;
    emit(
        enc,
        "fencegate_store_ok",
        "1 when the last refresh of the lease's epochs succeeded",
        MetricType::Gauge,
        g(&|v| i64::from(v.store_ok)),
    )?;
    let c = |f: &dyn Fn(&crate::fence::FenceView, &crate::fence::Fence) -> u64| -> Vec<_> {
        views
            .iter()
            .map(|(l, v, fc)| (l.clone(), ConstCounter::new(f(v, fc))))
            .collect()
    };
    emit(
        enc,
        "fencegate_mark_raises",
        "High-water mark raises (a newer epoch admitted)",
        MetricType::Counter,
        c(&|v, _| v.gate.raises),
    )?;
    emit(
        enc,
        "fencegate_drains_started",
        "Mark raises that had to wait for older requests in flight",
        MetricType::Counter,
        c(&|v, _| v.gate.drains_started),
    )?;
    emit(
        enc,
        "fencegate_drains_aborted",
        "Drains that timed out and aborted older requests",
        MetricType::Counter,
        c(&|v, _| v.gate.drains_aborted),
    )?;
    let mut calls = Vec::new();
    for (l, _, f) in &views {
        for (op, v) in [("list", &f.calls.lists), ("get", &f.calls.gets)] {
            let mut labels = l.clone();
            labels.push(("op", op.to_owned()));
            calls.push((labels, ConstCounter::new(v.load(Ordering::Relaxed))));
        }
    }
    emit(
        enc,
        "fencegate_store_calls",
        "Lease store calls by lease and operation",
        MetricType::Counter,
        calls,
    )?;
    emit(
        enc,
        "fencegate_store_errors",
        "Failed lease store refreshes",
        MetricType::Counter,
        c(&|_, f| f.calls.errors.load(Ordering::Relaxed)),
    )?;
    emit(
        enc,
        "fencegate_store_on_demand_reads",
        "Store reads triggered by a request above the latest known epoch",
        MetricType::Counter,
        c(&|_, f| f.calls.on_demand.load(Ordering::Relaxed)),
    )?;
    Ok(())
}

/// The store clock's offset, the state's group commits and the dedup
/// counters.
fn store_clock_and_state(
    enc: &mut DescriptorEncoder,
    shared: &Shared,
) -> Result<(), std::fmt::Error> {
    emit(
        enc,
        "fencegate_store_clock_offset_seconds",
        "Estimated store clock minus local clock",
        MetricType::Gauge,
        vec![(
            vec![],
            ConstGauge::new(shared.store.clock().offset_ms() as f64 / 1000.0),
        )],
    )?;
    let s = shared.state.stats();
    emit(
        enc,
        "fencegate_flush_batches",
        "Group commits (sled flush + fdatasync)",
        MetricType::Counter,
        vec![(vec![], ConstCounter::new(s.batches))],
    )?;
    emit(
        enc,
        "fencegate_flush_records",
        "Writes made durable by group commits (records per flush = records / batches)",
        MetricType::Counter,
        vec![(vec![], ConstCounter::new(s.records))],
    )?;
    let d = &shared.dedup.counters;
    emit(
        enc,
        "fencegate_dedup_replays",
        "Responses answered from a done dedup record",
        MetricType::Counter,
        vec![(vec![], ConstCounter::new(d.replays.load(Ordering::Relaxed)))],
    )?;
    emit(
        enc,
        "fencegate_dedup_conflicts",
        "Dedup keys refused as in flight or reused",
        MetricType::Counter,
        vec![(
            vec![],
            ConstCounter::new(d.conflicts.load(Ordering::Relaxed)),
        )],
    )?;
    emit(
        enc,
        "fencegate_dedup_in_doubt",
        "Dedup records that became in doubt",
        MetricType::Counter,
        vec![(
            vec![],
            ConstCounter::new(d.in_doubt.load(Ordering::Relaxed)),
        )],
    )?;
    emit(
        enc,
        "fencegate_dedup_swept",
        "Expired dedup records removed",
        MetricType::Counter,
        vec![(vec![], ConstCounter::new(d.swept.load(Ordering::Relaxed)))],
    )?;
    Ok(())
}

/// SPEC §9, protecting the destination: per route, requests at the upstream,
/// a `Retry-After` hold, the breaker's state, and the refusals by reason.
fn route_protection(enc: &mut DescriptorEncoder, shared: &Shared) -> Result<(), std::fmt::Error> {
    let live = shared.live.current();
    let now = tokio::time::Instant::now();
    let views: Vec<_> = live
        .routes
        .iter()
        .map(|r| (r.name.clone(), r.protect.view(&r.protect_cfg, now)))
        .collect();
    let route = |n: &String| vec![("route", n.clone())];
    emit(
        enc,
        "fencegate_route_in_flight",
        "Requests at the route's upstream now (what max_in_flight limits)",
        MetricType::Gauge,
        views
            .iter()
            .map(|(n, v)| (route(n), ConstGauge::new(v.in_flight as i64)))
            .collect(),
    )?;
    emit(
        enc,
        "fencegate_route_held_seconds",
        "Seconds the route still holds forwards for its upstream's Retry-After (0: not held)",
        MetricType::Gauge,
        views
            .iter()
            .map(|(n, v)| {
                let s = v.held_for.map_or(0.0, |d| d.as_secs_f64());
                (route(n), ConstGauge::new(s))
            })
            .collect(),
    )?;
    let mut states = Vec::new();
    let mut opened = Vec::new();
    for (n, v) in &views {
        if let Some(b) = &v.breaker {
            for s in ["closed", "open", "half_open"] {
                let mut labels = route(n);
                labels.push(("state", s.to_owned()));
                states.push((labels, ConstGauge::new(i64::from(b.state.as_str() == s))));
            }
            opened.push((route(n), ConstCounter::new(b.opened)));
        }
    }
    emit(
        enc,
        "fencegate_route_breaker_state",
        "1 for the state the route's circuit breaker is in (closed, open, half_open); routes with a breaker only",
        MetricType::Gauge,
        states,
    )?;
    emit(
        enc,
        "fencegate_route_breaker_opened",
        "Times the route's circuit breaker opened",
        MetricType::Counter,
        opened,
    )?;
    let mut refused = Vec::new();
    for (n, v) in &views {
        for (reason, count) in crate::protect::Reason::ALL.iter().zip(v.refused) {
            let mut labels = route(n);
            labels.push(("reason", (*reason).to_owned()));
            refused.push((labels, ConstCounter::new(count)));
        }
    }
    emit(
        enc,
        "fencegate_upstream_held",
        "Requests refused 503 upstream_held, by route and reason (in_flight_limit, retry_after, breaker_open, connection_budget)",
        MetricType::Counter,
        refused,
    )
}

/// SPEC §10.2's metrics: shards owned, takeovers, requests relayed to peers.
fn cluster_metrics(
    enc: &mut DescriptorEncoder,
    cl: &crate::cluster::Cluster,
) -> Result<(), std::fmt::Error> {
    let one = |n: u64| vec![(vec![], ConstCounter::new(n))];
    emit(
        enc,
        "fencegate_cluster_shards_owned",
        "Shards this instance serves now",
        MetricType::Gauge,
        vec![(vec![], ConstGauge::new(cl.owned() as i64))],
    )?;
    emit(
        enc,
        "fencegate_cluster_self_fences",
        "Shards this instance stopped serving at their forwarding deadline: their ownership (or the prefix's anchor) was not renewed in time (SPEC §10.2)",
        MetricType::Counter,
        one(cl.self_fences.load(Ordering::Relaxed)),
    )?;
    emit(
        enc,
        "fencegate_cluster_shards",
        "The set-up's shard count ([cluster] shards): the sum of fencegate_cluster_shards_owned over the members should equal it",
        MetricType::Gauge,
        vec![(vec![], ConstGauge::new(i64::from(cl.shards())))],
    )?;
    emit(
        enc,
        "fencegate_cluster_members",
        "Instances seen alive at the last heartbeat",
        MetricType::Gauge,
        vec![(vec![], ConstGauge::new(cl.members().len() as i64))],
    )?;
    emit(
        enc,
        "fencegate_cluster_takeovers",
        "Shards this instance took over",
        MetricType::Counter,
        one(cl.takeovers.load(Ordering::Relaxed)),
    )?;
    emit(
        enc,
        "fencegate_cluster_handovers",
        "Shards this instance handed over with a release",
        MetricType::Counter,
        one(cl.handovers.load(Ordering::Relaxed)),
    )?;
    emit(
        enc,
        "fencegate_peer_forwards",
        "Requests relayed to the owner of their shard",
        MetricType::Counter,
        one(cl.peer_forwards.load(Ordering::Relaxed)),
    )?;
    emit(
        enc,
        "fencegate_cluster_gate_store_calls",
        "Lease store calls made for the cluster's coordination (the prefix's anchor gate lease; set-up checks), by operation",
        MetricType::Counter,
        crate::cluster::GATE_CALL_OPS
            .iter()
            .zip(cl.gate_calls.iter())
            .map(|(op, n)| {
                (
                    vec![("op", (*op).to_owned())],
                    ConstCounter::new(n.load(Ordering::Relaxed)),
                )
            })
            .collect(),
    )?;
    emit(
        enc,
        "fencegate_cluster_db_calls",
        "Database calls made for the cluster's coordination (shard rows read, renewed, taken, released; beats)",
        MetricType::Counter,
        one(cl.db_calls.load(Ordering::Relaxed)),
    )?;
    emit(
        enc,
        "fencegate_cluster_anchor_creates",
        "Epochs of the prefix's anchor gate lease this instance created",
        MetricType::Counter,
        one(cl.anchor_creates.load(Ordering::Relaxed)),
    )?;
    emit(
        enc,
        "fencegate_cluster_set_up_conflict",
        "1 while a live gate object of another set-up (a single instance, another shard count) shares the prefix: nothing is forwarded",
        MetricType::Gauge,
        vec![(vec![], ConstGauge::new(i64::from(cl.conflict().is_some())))],
    )?;
    emit(
        enc,
        "fencegate_cluster_untrusted_gate_objects",
        "Shards whose latest gate object fails authentication (no owner taken from it, nothing relayed)",
        MetricType::Gauge,
        vec![(
            vec![],
            ConstGauge::new(
                cl.shard_statuses()
                    .iter()
                    .filter(|s| s.untrusted.is_some())
                    .count() as i64,
            ),
        )],
    )?;
    emit(
        enc,
        "fencegate_peer_failures",
        "Relayed requests the owner did not answer (503 shard_unavailable)",
        MetricType::Counter,
        one(cl.peer_failures.load(Ordering::Relaxed)),
    )
}
