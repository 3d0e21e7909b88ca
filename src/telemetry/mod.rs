//! Traces (docs/traces.md): the W3C trace context a worker (or a relaying
//! peer) sends, a span per request with a child per step of the request path
//! (admission, a drain it waited for, the dedup claim, the upstream call, the
//! outcome write, a relay to the shard's owner), the context passed on to the
//! upstream or the owner, and the spans exported over OTLP/HTTP protobuf.
//!
//! Off unless `[telemetry] otlp_endpoint` is set: the proxy then holds no
//! [`Telemetry`] and every hook is one branch on an empty [`Spans`] — no clock
//! read, no allocation, headers untouched. Spans are recorded here rather than
//! through `tracing` (a `tracing` span per request cost ~5% of a forwarded
//! request) or the OpenTelemetry SDK (its OTLP exporter brings a second HTTP
//! stack and gRPC): a request's spans are plain values, appended to a bounded
//! queue when it ends ([`export`]), encoded by hand ([`otlp`]).
//!
//! Spans carry the route, lease, epoch, outcome, status and refusal code, never
//! a token, a secret, a header value or a body.

mod context;
mod export;
mod otlp;

use std::borrow::Cow;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Instant, UNIX_EPOCH};

use http::{HeaderMap, HeaderValue, Uri};
use tokio_util::sync::CancellationToken;

use crate::clock::{Clock, SystemClock};
use crate::config::TelemetryConfig;
use crate::metrics::Metrics;

pub(crate) use context::{TRACEPARENT, TRACESTATE};

/// What the proxy traces with, when export is configured.
pub(crate) struct Telemetry {
    queue: Arc<export::Queue>,
    /// Roots are sampled when their trace id's last 8 bytes (big-endian) are below
    /// this (`None`: all are), as OpenTelemetry's `TraceIdRatioBased` does.
    sample_below: Option<u64>,
    /// Wall-clock nanoseconds since the Unix epoch at `anchor`: span times are
    /// this plus a monotonic measurement (a clock step moves no span).
    anchor_unix_nanos: u64,
    anchor: Instant,
}

impl Telemetry {
    /// `None` when `[telemetry] otlp_endpoint` is unset; else the proxy's
    /// telemetry and the exporter task (it ends after `stop`, having sent what
    /// was queued). `instance` names a cluster member (`service.instance.id`).
    pub(crate) fn start(
        cfg: &TelemetryConfig,
        instance: Option<&str>,
        metrics: &Metrics,
        client: crate::forward::HttpsClient,
        stop: CancellationToken,
    ) -> Result<Option<Started>, String> {
        let Some(endpoint) = &cfg.otlp_endpoint else {
            return Ok(None);
        };
        let url: Uri = format!("{}/v1/traces", endpoint.trim_end_matches('/'))
            .parse()
            .map_err(|e| format!("[telemetry] otlp_endpoint {endpoint:?}: {e}"))?;
        let mut attributes = vec![
            ("service.name", Value::Str(cfg.service_name.clone().into())),
            (
                "service.version",
                Value::Str(env!("CARGO_PKG_VERSION").into()),
            ),
        ];
        if let Some(id) = instance {
            attributes.push(("service.instance.id", Value::Str(id.to_owned().into())));
        }
        let queue = Arc::new(export::Queue::new(cfg.max_queue_spans, metrics));
        let task = tokio::spawn(export::run(
            queue.clone(),
            client,
            url,
            otlp::Resource { attributes },
            stop,
        ));
        let anchor = crate::clock::stopwatch();
        let since_epoch = SystemClock
            .now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let telemetry = Telemetry {
            queue,
            sample_below: (cfg.sample_ratio < 1.0)
                .then(|| (cfg.sample_ratio * 2f64.powi(64)) as u64),
            anchor_unix_nanos: u64::try_from(since_epoch.as_nanos()).unwrap_or(u64::MAX),
            anchor,
        };
        Ok(Some(Started {
            telemetry: Arc::new(telemetry),
            exporter: task,
        }))
    }

    /// The spans of a request arriving with `headers`: a child of its
    /// `traceparent` when it has exactly one valid one (recorded if that says
    /// sampled), else a new trace (recorded per `sample_ratio`). A request not
    /// recorded gets [`Spans::off`] and its headers pass on unchanged.
    pub(crate) fn request(self: &Arc<Self>, headers: &HeaderMap) -> Spans {
        let (trace_id, parent, trace_state) = match context::TraceParent::from_headers(headers) {
            Some(p) if p.sampled => (p.trace_id, Some(p.parent_id), context::tracestate(headers)),
            Some(_) => return Spans::off(),
            None => {
                let mut id = [0u8; 16];
                crate::entropy::fill(&mut id);
                let low = u64::from_be_bytes(id[8..].try_into().unwrap_or_default());
                if self.sample_below.is_some_and(|below| low >= below) {
                    return Spans::off();
                }
                (id, None, None)
            }
        };
        Spans(Some(Box::new(Recording {
            telemetry: self.clone(),
            trace_id,
            span_id: span_id(),
            parent,
            trace_state,
            start: crate::clock::stopwatch(),
            children: Vec::new(),
        })))
    }

    fn unix_nanos(&self, at: Instant) -> u64 {
        let since = at.saturating_duration_since(self.anchor);
        self.anchor_unix_nanos
            .saturating_add(u64::try_from(since.as_nanos()).unwrap_or(u64::MAX))
    }
}

/// Trace export, started ([`Telemetry::start`]).
pub(crate) struct Started {
    pub telemetry: Arc<Telemetry>,
    /// Ends after the stop token, having sent what was queued.
    pub exporter: tokio::task::JoinHandle<()>,
}

/// A random, non-zero span id.
fn span_id() -> [u8; 8] {
    crate::entropy::u64().max(1).to_be_bytes()
}

/// One request's spans: empty when tracing is off or the request is not sampled.
#[derive(Default)]
pub(crate) struct Spans(Option<Box<Recording>>);

struct Recording {
    telemetry: Arc<Telemetry>,
    trace_id: [u8; 16],
    /// The request span's id: every child's parent.
    span_id: [u8; 8],
    /// The worker's (or relaying peer's) span; `None`: a new trace.
    parent: Option<[u8; 8]>,
    trace_state: Option<HeaderValue>,
    start: Instant,
    children: Vec<SpanData>,
}

/// A child span begun ([`Spans::step`]).
#[derive(Debug, Clone, Copy)]
struct Begun {
    id: [u8; 8],
    at: Instant,
}

/// A step begun by [`Spans::onward`], its span named in the request it sends
/// on; [`Onward::end`] ends it.
#[must_use = "a step begun is ended by Onward::end"]
pub(crate) struct Onward(Option<Begun>);

impl Onward {
    /// Ends the step's span now, with the attributes and the error status
    /// `describe` reads off its output (never called when off).
    pub(crate) fn end<T>(
        self,
        spans: &mut Spans,
        name: &'static str,
        kind: Kind,
        output: &T,
        describe: impl for<'r> FnOnce(&'r T, &mut Attrs) -> Option<&'r str>,
    ) {
        let (Some(r), Some(b)) = (spans.0.as_mut(), self.0) else {
            return;
        };
        let end = crate::clock::stopwatch();
        let mut a = Attrs::default();
        let error = describe(output, &mut a);
        r.child(b.id, name, kind, (b.at, end), a, error);
    }
}

/// A step's work under its span ([`Spans::step`]): the work's output, once
/// the span has ended. Holds the work pinned where its caller made it, so
/// that wrapping it moves nothing.
#[must_use = "a step does nothing unless awaited"]
pub(crate) struct Step<'s, 'w, W, D> {
    spans: &'s mut Spans,
    work: Pin<&'w mut W>,
    begun: Option<Begun>,
    name: &'static str,
    kind: Kind,
    describe: Option<D>,
}

impl<W, D> Future for Step<'_, '_, W, D>
where
    W: Future,
    D: for<'r> FnOnce(&'r W::Output, &mut Attrs) -> Option<&'r str> + Unpin,
{
    type Output = W::Output;

    // Inlined where the step is awaited, as the work's poll would be without
    // the step (a call here costs the request path its register saves and two
    // copies of the output).
    #[inline(always)]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<W::Output> {
        let this = self.get_mut();
        let out = std::task::ready!(this.work.as_mut().poll(cx));
        if let Some(describe) = this.describe.take() {
            Onward(this.begun).end(this.spans, this.name, this.kind, &out, describe);
        }
        Poll::Ready(out)
    }
}

/// A span's kind (OTLP `SpanKind`).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Kind {
    Internal,
    Server,
    Client,
}

/// An attribute's value.
#[derive(Debug, Clone)]
pub(crate) enum Value {
    Str(Cow<'static, str>),
    Int(i64),
    Bool(bool),
}

/// A span's attributes, as its end adds them.
#[derive(Default)]
pub(crate) struct Attrs(Vec<(&'static str, Value)>);

impl Attrs {
    pub(crate) fn str(&mut self, key: &'static str, v: impl Into<Cow<'static, str>>) -> &mut Self {
        self.0.push((key, Value::Str(v.into())));
        self
    }

    pub(crate) fn int(&mut self, key: &'static str, v: i64) -> &mut Self {
        self.0.push((key, Value::Int(v)));
        self
    }

    pub(crate) fn bool(&mut self, key: &'static str, v: bool) -> &mut Self {
        self.0.push((key, Value::Bool(v)));
        self
    }
}

/// A finished span, queued for export.
pub(crate) struct SpanData {
    trace_id: [u8; 16],
    span_id: [u8; 8],
    parent: Option<[u8; 8]>,
    /// Whether `parent` is another process's (the worker's, a relaying peer's).
    remote_parent: bool,
    trace_state: Option<HeaderValue>,
    name: Cow<'static, str>,
    kind: Kind,
    start: u64,
    end: u64,
    attributes: Vec<(&'static str, Value)>,
    /// Status ERROR with this message.
    error: Option<String>,
}

impl Spans {
    /// No spans: tracing is off, or this request is not sampled.
    pub(crate) fn off() -> Spans {
        Spans(None)
    }

    /// Whether this request is traced.
    pub(crate) fn is_on(&self) -> bool {
        self.0.is_some()
    }

    /// Runs `work` as one step of the request path, at one call a step
    /// (`let out = spans.step("admission", Kind::Internal, pin!(work),
    /// describe).await;`): a child span of the request's, begun now and ended
    /// when `work` is done, with the attributes and the error status `describe`
    /// reads off its output. Off: `work` runs as it would alone — no clock
    /// read, no span id drawn, `describe` never called.
    ///
    /// `work` is pinned where the caller makes it (`pin!` in this call) and is
    /// never moved: a future moved into an awaiting one is copied whole. Bind
    /// the output to a plain name: a pinned future whose output is bound to a
    /// pattern or matched on at once stays in the caller's future after it is
    /// done, and the caller's future grows by its size (rustc's layout).
    pub(crate) fn step<'s, 'w, W, D>(
        &'s mut self,
        name: &'static str,
        kind: Kind,
        work: Pin<&'w mut W>,
        describe: D,
    ) -> Step<'s, 'w, W, D>
    where
        W: Future,
        D: for<'r> FnOnce(&'r W::Output, &mut Attrs) -> Option<&'r str>,
    {
        Step {
            begun: self.begin(),
            spans: self,
            work,
            name,
            kind,
            describe: Some(describe),
        }
    }

    /// Begins a step whose request is sent on (to the upstream, or to the
    /// shard's owner) and sets that request's `traceparent` to name the step's
    /// span as the parent, with the worker's `tracestate`; [`Onward::end`] ends
    /// it. Headers untouched when off.
    pub(crate) fn onward(&self, headers: &mut HeaderMap) -> Onward {
        let begun = self.begin();
        if let (Some(r), Some(b)) = (self.0.as_ref(), begun) {
            headers.insert(TRACEPARENT, context::traceparent(&r.trace_id, &b.id));
            match &r.trace_state {
                Some(s) => headers.insert(TRACESTATE, s.clone()),
                None => headers.remove(TRACESTATE),
            };
        }
        Onward(begun)
    }

    /// Starts a child span of the request span now (`None` when off: the clock
    /// is not even read).
    fn begin(&self) -> Option<Begun> {
        self.0.as_ref().map(|_| Begun {
            id: span_id(),
            at: crate::clock::stopwatch(),
        })
    }

    /// A child span that ran from `from` to `to`, measured elsewhere (a drain).
    pub(crate) fn add(
        &mut self,
        name: &'static str,
        (from, to): (Instant, Instant),
        attrs: impl FnOnce(&mut Attrs),
    ) {
        if let Some(r) = self.0.as_mut() {
            let mut a = Attrs::default();
            attrs(&mut a);
            r.child(span_id(), name, Kind::Internal, (from, to), a, None);
        }
    }

    /// Ends the request span (named `name`, a SERVER span) and queues the
    /// request's spans for export; a full queue drops them (counted).
    pub(crate) fn finish(
        self,
        name: impl FnOnce() -> String,
        attrs: impl FnOnce(&mut Attrs),
        error: Option<&str>,
    ) {
        self.finish_as(Kind::Server, name, attrs, error);
    }

    /// [`Spans::finish`] with the root span of another kind (a queued
    /// message's delivery attempt is no server span: nobody waits on it).
    pub(crate) fn finish_as(
        self,
        kind: Kind,
        name: impl FnOnce() -> String,
        attrs: impl FnOnce(&mut Attrs),
        error: Option<&str>,
    ) {
        let Some(r) = self.0 else {
            return;
        };
        let mut r = *r;
        let end = crate::clock::stopwatch();
        let mut a = Attrs::default();
        attrs(&mut a);
        let t = &r.telemetry;
        let request = SpanData {
            trace_id: r.trace_id,
            span_id: r.span_id,
            parent: r.parent,
            remote_parent: r.parent.is_some(),
            trace_state: r.trace_state.clone(),
            name: Cow::Owned(name()),
            kind,
            start: t.unix_nanos(r.start),
            end: t.unix_nanos(end),
            attributes: a.0,
            error: error.map(str::to_owned),
        };
        r.children.push(request);
        t.queue.push(r.children);
    }
}

impl Recording {
    fn child(
        &mut self,
        id: [u8; 8],
        name: &'static str,
        kind: Kind,
        (from, to): (Instant, Instant),
        a: Attrs,
        error: Option<&str>,
    ) {
        let t = &self.telemetry;
        self.children.push(SpanData {
            trace_id: self.trace_id,
            span_id: id,
            parent: Some(self.span_id),
            remote_parent: false,
            trace_state: self.trace_state.clone(),
            name: Cow::Borrowed(name),
            kind,
            start: t.unix_nanos(from),
            end: t.unix_nanos(to.max(from)),
            attributes: a.0,
            error: error.map(str::to_owned),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn telemetry(ratio: f64, queue: usize) -> (Arc<Telemetry>, Arc<Metrics>) {
        let metrics = Metrics::new();
        let cfg = TelemetryConfig {
            // Nobody listens there; the exporter is stopped at once anyway.
            otlp_endpoint: Some("http://127.0.0.1:9".into()),
            sample_ratio: ratio,
            max_queue_spans: queue,
            ..TelemetryConfig::default()
        };
        let tls = crate::forward::tls_config(None, None).unwrap();
        let stop = CancellationToken::new();
        stop.cancel();
        let started = Telemetry::start(
            &cfg,
            None,
            &metrics,
            crate::forward::client(tls, std::time::Duration::from_secs(1), 4),
            stop,
        )
        .unwrap()
        .unwrap();
        (started.telemetry, metrics)
    }

    fn with_traceparent(v: &'static str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(TRACEPARENT, HeaderValue::from_static(v));
        h
    }

    #[tokio::test]
    async fn sampling_follows_the_parent_else_the_ratio() {
        let (never, _) = telemetry(0.0, 10);
        assert!(!never.request(&HeaderMap::new()).is_on());
        let sampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert!(never.request(&with_traceparent(sampled)).is_on());
        let (always, _) = telemetry(1.0, 10);
        assert!(always.request(&HeaderMap::new()).is_on());
        let unsampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
        assert!(!always.request(&with_traceparent(unsampled)).is_on());
        // Off: nothing begun, headers untouched, nothing described.
        let mut off = Spans::off();
        assert!(off.begin().is_none());
        let mut h = with_traceparent(unsampled);
        let out = off
            .step(
                "step",
                Kind::Internal,
                std::pin::pin!(async { 7 }),
                |_, _| unreachable!("a step is not described when off"),
            )
            .await;
        let onward = off.onward(&mut h);
        onward.end(&mut off, "step", Kind::Client, &out, |_, _| {
            unreachable!("a step is not described when off")
        });
        assert_eq!(out, 7);
        assert_eq!(h[TRACEPARENT], unsampled);
    }

    #[tokio::test]
    async fn a_step_is_a_child_span_its_request_names_as_parent() {
        let (t, _) = telemetry(1.0, 10);
        let sampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let mut spans = t.request(&with_traceparent(sampled));
        let mut h = HeaderMap::new();
        let onward = spans.onward(&mut h);
        let out: Result<(), String> = Err("cut".to_owned());
        onward.end(&mut spans, "upstream", Kind::Client, &out, |r, a| {
            a.str("error.type", "outcome_unknown");
            r.as_ref().err().map(String::as_str)
        });
        assert_eq!(out, Err("cut".to_owned()));
        spans.finish(|| "GET".into(), |_| {}, None);
        let queued = t.queue.take(10);
        let (step, request) = (&queued[0], &queued[1]);
        assert_eq!(step.name, "upstream");
        assert_eq!(step.parent, Some(request.span_id));
        assert_eq!(step.error.as_deref(), Some("cut"));
        assert_eq!(step.attributes.len(), 1);
        let sent = h[TRACEPARENT].to_str().unwrap();
        assert!(
            sent.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"),
            "{sent}"
        );
        assert!(sent.contains(&hex::encode(step.span_id)), "{sent}");
    }

    #[tokio::test]
    async fn a_request_that_does_not_fit_the_queue_is_dropped_whole() {
        let (t, metrics) = telemetry(1.0, 5);
        for children in [2, 2, 1] {
            // 3 spans: queued; 3 more: 6 > 5, all dropped; 2: fit.
            let mut s = t.request(&HeaderMap::new());
            for _ in 0..children {
                s.step("step", Kind::Internal, std::pin::pin!(async {}), |_, _| {
                    None
                })
                .await;
            }
            s.finish(|| "GET".into(), |_| {}, None);
        }
        assert_eq!(t.queue.take(100).len(), 5);
        let text = metrics.render();
        assert!(
            text.contains("fencegate_trace_spans_dropped_total{reason=\"queue_full\"} 3"),
            "{text}"
        );
    }
}
