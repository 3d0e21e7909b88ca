//! The queue's metrics (SPEC §11), read at scrape time.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use super::{ms, Queue};
use crate::metrics::emit;

/// Reads the queue's figures when scraped.
pub(crate) struct QueueCollector(pub(crate) Arc<Queue>);

impl std::fmt::Debug for QueueCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("QueueCollector")
    }
}

impl Collector for QueueCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let q = &self.0;
        let now = ms(q.ctx.clock.now());
        let mut depth: HashMap<String, (i64, u64)> = HashMap::new();
        for r in q.ctx.live.current().routes.iter().filter(|r| r.queued) {
            depth.insert(r.name.clone(), (0, now));
        }
        let found = match q.store.depth_now() {
            Some(d) => d.unwrap_or_default(),
            None => q.depth.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        };
        for (route, (n, oldest)) in found {
            depth.insert(route, (n as i64, oldest.min(now)));
        }
        let mut rows: Vec<_> = depth.into_iter().collect();
        rows.sort();
        emit(
            &mut enc,
            "fencegate_queue_depth",
            "Queued messages not settled (pending or being delivered), per route",
            MetricType::Gauge,
            rows.iter()
                .map(|(r, (n, _))| (vec![("route", r.clone())], ConstGauge::new(*n)))
                .collect(),
        )?;
        emit(
            &mut enc,
            "fencegate_queue_oldest_pending_seconds",
            "Age of the oldest message not settled, per route (0: none)",
            MetricType::Gauge,
            rows.iter()
                .map(|(r, (_, oldest))| {
                    (
                        vec![("route", r.clone())],
                        ConstGauge::new(now.saturating_sub(*oldest) as f64 / 1000.0),
                    )
                })
                .collect(),
        )?;
        let pauses = q.pauses();
        let live = q.ctx.live.current();
        emit(
            &mut enc,
            "fencegate_queue_paused",
            "1 while a queued route's deliveries are paused, by the route or by its lease (SPEC §11): acceptances go on, no attempt starts",
            MetricType::Gauge,
            live.routes
                .iter()
                .filter(|r| r.queued)
                .map(|r| {
                    let held = pauses.holds(r.lease.as_str(), &r.name);
                    (vec![("route", r.name.clone())], ConstGauge::new(i64::from(held)))
                })
                .collect(),
        )?;
        drop(live);
        if let Some(mut held) = q.store.held_by_route() {
            held.sort_by(|a, b| a.0.cmp(&b.0));
            emit(
                &mut enc,
                "fencegate_queue_held_bytes",
                "Bytes of the requests kept for queued messages not delivered nor dropped, per route (sled: held in memory; bounded by queue_max_bytes)",
                MetricType::Gauge,
                held.iter()
                    .map(|(r, h)| (vec![("route", r.clone())], ConstGauge::new(h.bytes as i64)))
                    .collect(),
            )?;
        }
        let mut attempts: Vec<_> = q
            .counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .attempts
            .iter()
            .map(|((r, o), n)| ((r.clone(), *o), *n))
            .collect();
        attempts.sort();
        emit(
            &mut enc,
            "fencegate_queue_attempts",
            "Delivery attempts by route and outcome (delivered, retry, failed, not_sent)",
            MetricType::Counter,
            attempts
                .into_iter()
                .map(|((r, o), n)| {
                    (
                        vec![("route", r), ("outcome", o.to_owned())],
                        ConstCounter::new(n),
                    )
                })
                .collect(),
        )?;
        emit(
            &mut enc,
            "fencegate_queue_unknown_outcomes",
            "Attempts whose outcome was unknown (timed out, reset, or out at a crash): the message is sent again with the same webhook-id",
            MetricType::Counter,
            vec![(vec![], ConstCounter::new(q.unknown.load(Ordering::Relaxed)))],
        )
    }
}
