//! The bounded span queue and the exporter task that empties it: batches POSTed
//! to the collector's `/v1/traces`. A request only ever locks the queue to append
//! its spans: when they do not fit they are dropped and counted, never waited
//! for, and a failed export drops its batch (no retry: the next batch is newer).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{header, Request, Uri};
use http_body_util::BodyExt;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::otlp::{self, Resource};
use super::SpanData;
use crate::forward::HttpsClient;
use crate::metrics::Metrics;
use crate::streaming::UpBody;

/// Spans per export request; a full batch is sent at once.
pub(super) const BATCH: usize = 512;
/// A partial batch waits at most this long.
const FLUSH_EVERY: Duration = Duration::from_secs(1);
/// One export request's limit, connection included: meanwhile spans queue up
/// (and drop once the queue is full).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// Spans waiting for export.
pub(super) struct Queue {
    spans: Mutex<Vec<SpanData>>,
    cap: usize,
    ready: Notify,
    counts: Counts,
}

/// `fencegate_trace_spans_exported_total` and `fencegate_trace_spans_dropped_total{reason}`.
struct Counts {
    exported: Counter,
    queue_full: Counter,
    export_failed: Counter,
}

impl Counts {
    fn register(metrics: &Metrics) -> Counts {
        let dropped = Family::<Vec<(&'static str, &'static str)>, Counter>::default();
        let exported = Counter::default();
        metrics.with_registry(|r| {
            r.register(
                "fencegate_trace_spans_exported",
                "Spans the OTLP collector accepted",
                exported.clone(),
            );
            r.register(
                "fencegate_trace_spans_dropped",
                "Spans dropped, by reason: queue_full (the export queue was full: never waited for) or export_failed (the collector refused or did not answer)",
                dropped.clone(),
            );
        });
        let queue_full = dropped
            .get_or_create(&vec![("reason", "queue_full")])
            .clone();
        let export_failed = dropped
            .get_or_create(&vec![("reason", "export_failed")])
            .clone();
        Counts {
            exported,
            queue_full,
            export_failed,
        }
    }
}

impl Queue {
    pub(super) fn new(cap: usize, metrics: &Metrics) -> Queue {
        Queue {
            spans: Mutex::new(Vec::with_capacity(cap.min(BATCH))),
            cap,
            ready: Notify::new(),
            counts: Counts::register(metrics),
        }
    }

    /// Appends one request's spans, all or none (a partial trace misleads).
    pub(super) fn push(&self, spans: Vec<SpanData>) {
        let n = spans.len();
        let full_batch = {
            let mut q = crate::lock_order::lock("trace queue", &self.spans);
            if q.len() + n > self.cap {
                None
            } else {
                q.extend(spans);
                Some(q.len() >= BATCH)
            }
        };
        match full_batch {
            None => {
                self.counts.queue_full.inc_by(n as u64);
            }
            Some(true) => self.ready.notify_one(),
            Some(false) => {}
        }
    }

    pub(super) fn take(&self, max: usize) -> Vec<SpanData> {
        let mut q = crate::lock_order::lock("trace queue", &self.spans);
        let n = q.len().min(max);
        q.drain(..n).collect()
    }
}

/// Sends what the queue holds every [`FLUSH_EVERY`], or at once when a batch is
/// full, until `stop`; then sends what is left (one try each).
pub(super) async fn run(
    queue: Arc<Queue>,
    client: HttpsClient,
    url: Uri,
    resource: Resource,
    stop: CancellationToken,
) {
    let mut failing = false;
    loop {
        let stopping = tokio::select! {
            _ = queue.ready.notified() => false,
            _ = tokio::time::sleep(FLUSH_EVERY) => false,
            _ = stop.cancelled() => true,
        };
        loop {
            let batch = queue.take(BATCH);
            if batch.is_empty() {
                break;
            }
            let n = batch.len() as u64;
            let body = Bytes::from(otlp::encode(&resource, &batch));
            drop(batch);
            match post(&client, &url, body).await {
                Ok(()) => {
                    queue.counts.exported.inc_by(n);
                    if failing {
                        tracing::info!(endpoint = %url, "trace export works again");
                        failing = false;
                    }
                }
                Err(e) => {
                    queue.counts.export_failed.inc_by(n);
                    // Once per outage, not per batch: the counter says how many.
                    if !failing {
                        tracing::warn!(endpoint = %url, error = %e, "trace export failed; spans are dropped (fencegate_trace_spans_dropped_total) until it works again");
                        failing = true;
                    }
                }
            }
            if (n as usize) < BATCH {
                break;
            }
        }
        if stopping {
            return;
        }
    }
}

async fn post(client: &HttpsClient, url: &Uri, body: Bytes) -> Result<(), String> {
    let req = Request::post(url.clone())
        .header(header::CONTENT_TYPE, "application/x-protobuf")
        .body(UpBody::from(body))
        .map_err(|e| e.to_string())?;
    let exchange = async {
        let resp = client.request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status();
        // Read to the end so that the connection goes back to the pool.
        let _ = resp.into_body().collect().await;
        if status.is_success() {
            Ok(())
        } else {
            Err(format!("the collector answered {status}"))
        }
    };
    tokio::time::timeout(EXPORT_TIMEOUT, exchange)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {EXPORT_TIMEOUT:?}")))
}
