//! Traces (docs/traces.md): what fencegate exports over OTLP/HTTP, decoded by
//! the official `opentelemetry-proto` bindings (`scripts/otlp_receiver.py`),
//! and the `traceparent` the destination receives. The peer hop is in
//! `cluster/mod.rs` (it needs PostgreSQL).

use std::time::Duration;

use http::HeaderValue;

use crate::support::otlp::{one, Receiver, Span};
use crate::support::*;

const WORKER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const WORKER_SPAN: &str = "00f067aa0ba902b7";

/// A fencegate on the `dir` store with routes `/billing/` (dedup records) and
/// `/jobs/` (fencing only), exporting to `receiver` when given.
async fn gateway(
    receiver: Option<&Receiver>,
    telemetry_extra: &str,
) -> (
    Origin,
    Fencegate,
    fencegate::lease::Epochs,
    tempfile::TempDir,
) {
    let origin = Origin::start().await;
    let leases = tempfile::tempdir().unwrap();
    let fg = Fencegate::start(&format!(
        "{}{}{}{}",
        dir_store_toml(leases.path()),
        route_toml("billing", "billing", &origin, ""),
        route_toml(
            "jobs",
            "jobs",
            &origin,
            "derive_key = \"none\"\ndrain_timeout_ms = 10000\n"
        ),
        receiver.map_or(String::new(), |r| r.toml(telemetry_extra)),
    ));
    let epochs = dir_epochs(leases.path());
    (origin, fg, epochs, leases)
}

/// The `traceparent` the destination received for the request carrying `payload`:
/// (trace id, parent span id, flags).
fn upstream_traceparent(origin: &Origin, payload: &str) -> (String, String, String) {
    let a = origin
        .log()
        .into_iter()
        .find(|a| a.body == payload.as_bytes())
        .unwrap_or_else(|| panic!("{payload:?} never reached the destination"));
    let tp = a.header("traceparent").expect("a traceparent upstream");
    let parts: Vec<&str> = tp.split('-').collect();
    assert_eq!(parts.len(), 4, "{tp}");
    assert_eq!(parts[0], "00");
    (parts[1].into(), parts[2].into(), parts[3].into())
}

/// A keyed request with the worker's `traceparent`: the request span is its
/// child (SERVER, remote parent), admission, the dedup claim, the upstream call
/// (CLIENT) and the outcome write are the request span's children with the
/// route's facts as attributes; the destination gets a `traceparent` whose
/// parent is the upstream span, and the worker's `tracestate`. A retry of the
/// key is answered from its record: a claim that replays, no upstream span. No
/// lease token, key or body in any byte exported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_a_span_with_its_steps_as_children() {
    skip_without_python!();
    let receiver = Receiver::start(false);
    let (origin, fg, epochs, _l) = gateway(Some(&receiver), "service_name = \"fg-test\"").await;
    let w = acquire(&epochs, "billing", "w", Duration::from_secs(60)).await;
    let send_traced = |payload: &'static str| {
        let req = worker_req(
            &fg.url("/billing/charge?card=4242"),
            w.epoch.get(),
            &w.token,
        )
        .header("idempotency-key", "key-secret-1")
        .header("traceparent", format!("00-{WORKER_TRACE}-{WORKER_SPAN}-01"))
        .header("tracestate", "vendor=abc")
        .body(body(payload))
        .unwrap();
        send(req)
    };
    let r = send_traced("payload-one").await;
    assert_eq!(r.status, 200);
    let spans = receiver.trace(WORKER_TRACE, 1);
    let request = one(&spans, "POST /billing/");
    assert_eq!(request.parent(), WORKER_SPAN);
    assert_eq!(request.kind(), "SPAN_KIND_SERVER");
    assert_eq!(request.0["trace_state"], "vendor=abc");
    // SpanFlags: sampled, and the parent is another process's.
    assert_eq!(request.0["flags"], 0x301);
    assert_eq!(request.attr("fencegate.route"), "billing");
    assert_eq!(request.attr("fencegate.lease"), "billing");
    assert_eq!(request.attr("fencegate.epoch"), w.epoch.get());
    assert_eq!(request.attr("fencegate.outcome"), "forwarded");
    assert_eq!(request.attr("http.response.status_code"), 200);
    assert_eq!(request.attr("http.route"), "/billing/");
    assert_eq!(request.attr("http.request.method"), "POST");
    assert_eq!(request.attr("fencegate.dedup_key.present"), true);
    assert_eq!(
        request.attr("fencegate.request_id").as_str(),
        r.headers["x-request-id"].to_str().ok()
    );
    assert_eq!(request.resource("service.name"), "fg-test");
    assert_eq!(request.0["scope"], "fencegate");
    assert_eq!(request.status(), 0);
    let mut names: Vec<&str> = spans.iter().map(Span::name).collect();
    names.sort();
    assert_eq!(
        names,
        [
            "POST /billing/",
            "admission",
            "dedup.claim",
            "dedup.outcome",
            "upstream"
        ],
        "no drain: nothing older was in flight"
    );
    for s in spans.iter().filter(|s| s.name() != "POST /billing/") {
        assert_eq!(s.parent(), request.span_id(), "{s:?}");
        let (start, end) = (s.0["start"].as_u64().unwrap(), s.0["end"].as_u64().unwrap());
        assert!(start <= end, "{s:?}");
        assert!(
            start >= request.0["start"].as_u64().unwrap()
                && end <= request.0["end"].as_u64().unwrap(),
            "within the request span: {s:?}"
        );
    }
    let admission = one(&spans, "admission");
    assert_eq!(admission.attr("fencegate.admission"), "admitted");
    assert_eq!(admission.attr("fencegate.epoch"), w.epoch.get());
    assert_eq!(
        one(&spans, "dedup.claim").attr("fencegate.dedup"),
        "claimed"
    );
    assert_eq!(
        one(&spans, "dedup.outcome").attr("fencegate.dedup.outcome"),
        "response"
    );
    let upstream = one(&spans, "upstream");
    assert_eq!(upstream.kind(), "SPAN_KIND_CLIENT");
    assert_eq!(upstream.attr("http.response.status_code"), 200);
    assert_eq!(upstream.attr("server.address"), "127.0.0.1");
    assert_eq!(upstream.attr("server.port"), origin.addr.port());
    // What the destination received: the upstream span as its parent.
    let (trace, parent, flags) = upstream_traceparent(&origin, "payload-one");
    assert_eq!(
        (trace.as_str(), parent.as_str(), flags.as_str()),
        (WORKER_TRACE, upstream.span_id(), "01")
    );
    let arrived = origin.log();
    assert_eq!(
        arrived[0].header("tracestate").as_deref(),
        Some("vendor=abc")
    );

    // The retry: answered from the record.
    let again = send_traced("payload-one").await;
    assert_eq!(again.headers["x-fencegate-replayed"], "true");
    let spans = receiver.trace(WORKER_TRACE, 2);
    let replay = spans
        .iter()
        .find(|s| s.kind() == "SPAN_KIND_SERVER" && s.attr("fencegate.outcome") == "replayed")
        .expect("the replay's request span");
    let children: Vec<&Span> = spans
        .iter()
        .filter(|s| s.parent() == replay.span_id())
        .collect();
    let mut names: Vec<&str> = children.iter().map(|s| s.name()).collect();
    names.sort();
    assert_eq!(names, ["admission", "dedup.claim"]);
    assert_eq!(
        one(&spans, "dedup.outcome").parent(),
        request.span_id(),
        "only the first wrote an outcome"
    );
    assert!(children
        .iter()
        .any(|s| s.name() == "dedup.claim" && s.attr("fencegate.dedup") == "replay"));
    assert_eq!(origin.count(), 1);

    // A refusal: the admission says why; nothing goes upstream.
    let forged = worker_req(&fg.url("/billing/charge"), w.epoch.get(), "not-the-token")
        .header("traceparent", format!("00-{WORKER_TRACE}-{WORKER_SPAN}-01"))
        .body(body("forged"))
        .unwrap();
    send(forged).await.assert_error(403, "token_invalid");
    let spans = receiver.trace(WORKER_TRACE, 3);
    let refused = spans
        .iter()
        .find(|s| s.kind() == "SPAN_KIND_SERVER" && s.attr("fencegate.outcome") == "refused")
        .expect("the refusal's request span");
    assert_eq!(refused.attr("fencegate.error_code"), "token_invalid");
    assert_eq!(refused.attr("http.response.status_code"), 403);
    assert_eq!(refused.status(), 0, "a 4xx is the worker's, not an error");
    let children: Vec<&Span> = spans
        .iter()
        .filter(|s| s.parent() == refused.span_id())
        .collect();
    assert_eq!(children.len(), 1, "{children:?}");
    assert_eq!(children[0].attr("fencegate.admission"), "token_invalid");

    // Nothing secret was exported: no token, no key, no body, no query.
    let raw = receiver.raw();
    for secret in [
        w.token.as_str(),
        "not-the-token",
        "key-secret-1",
        "payload-one",
        "card=4242",
    ] {
        assert!(
            !raw.windows(secret.len()).any(|x| x == secret.as_bytes()),
            "{secret:?} was exported"
        );
    }
}

/// Without a `traceparent` (or with a malformed one) a request starts a new
/// trace: a root span, and a fresh, valid `traceparent` to the destination —
/// never the malformed one. A worker's unsampled `traceparent` is respected:
/// nothing recorded, its header passed on unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_or_malformed_traceparent_starts_a_new_trace() {
    skip_without_python!();
    let receiver = Receiver::start(false);
    let (origin, fg, epochs, _l) = gateway(Some(&receiver), "").await;
    let w = acquire(&epochs, "jobs", "w", Duration::from_secs(60)).await;
    let malformed = "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01";
    let unsampled = format!("00-{WORKER_TRACE}-{WORKER_SPAN}-00");
    for (payload, tp) in [
        ("none", None),
        ("malformed", Some(malformed)),
        ("unsampled", Some(unsampled.as_str())),
    ] {
        let mut req = worker_req(&fg.url("/jobs/run"), w.epoch.get(), &w.token);
        if let Some(tp) = tp {
            req = req.header("traceparent", tp);
        }
        assert_eq!(send(req.body(body(payload)).unwrap()).await.status, 200);
    }
    for payload in ["none", "malformed"] {
        let (trace, parent, flags) = upstream_traceparent(&origin, payload);
        assert_eq!(flags, "01");
        assert_ne!(trace, WORKER_TRACE.to_lowercase());
        let spans = receiver.trace(&trace, 1);
        let request = one(&spans, "POST /jobs/");
        assert_eq!(request.parent(), "", "a root span");
        assert_eq!(request.0["flags"], 0x101, "a local root");
        assert_eq!(request.attr("fencegate.dedup_key.present"), false);
        assert_eq!(one(&spans, "upstream").span_id(), parent);
        let mut names: Vec<&str> = spans.iter().map(Span::name).collect();
        names.sort();
        assert_eq!(
            names,
            ["POST /jobs/", "admission", "upstream"],
            "fencing only"
        );
    }
    let passed = origin
        .log()
        .into_iter()
        .find(|a| a.body == "unsampled".as_bytes())
        .unwrap();
    assert_eq!(passed.header("traceparent"), Some(unsampled));
    // Stopping flushes the queue: whatever was recorded has arrived after it.
    let mut fg = fg;
    assert!(fg.terminate().success());
    assert!(
        receiver
            .spans()
            .iter()
            .all(|s| s.trace_id() != WORKER_TRACE),
        "the unsampled request was not recorded"
    );
}

/// A request that raises the epoch while an older one is in flight waits for
/// the drain: its trace has a `drain` span (the older one's has none), within
/// its admission.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_wait_is_a_span() {
    skip_without_python!();
    let receiver = Receiver::start(false);
    let (origin, fg, epochs, _l) = gateway(Some(&receiver), "").await;
    let old = acquire(&epochs, "jobs", "old", Duration::from_secs(60)).await;
    let old_tp = format!("00-{}-{WORKER_SPAN}-01", "1".repeat(32));
    let held = spawn_req(
        worker_req(&fg.url("/jobs/run"), old.epoch.get(), &old.token)
            .header("x-test-hold", "old")
            .header("traceparent", &old_tp),
        "old",
    );
    origin.wait_for(1).await;
    let new = force_next_epoch(&epochs, "jobs", "new", Duration::from_secs(60)).await;
    let new_tp = format!("00-{}-{WORKER_SPAN}-01", "2".repeat(32));
    let raising = spawn_req(
        worker_req(&fg.url("/jobs/run"), new.epoch.get(), &new.token)
            .header("traceparent", &new_tp),
        "new",
    );
    eventually("the drain started", || drains_started(&fg)).await;
    origin.release("old");
    assert_eq!(held.await.unwrap().unwrap().status, 200);
    assert_eq!(raising.await.unwrap().unwrap().status, 200);
    let spans = receiver.trace(&"2".repeat(32), 1);
    let drain = one(&spans, "drain");
    let admission = one(&spans, "admission");
    assert_eq!(drain.parent(), one(&spans, "POST /jobs/").span_id());
    assert_eq!(drain.attr("fencegate.epoch"), new.epoch.get());
    assert_eq!(drain.attr("fencegate.lease"), "jobs");
    assert!(
        drain.0["start"].as_u64() >= admission.0["start"].as_u64()
            && drain.0["end"].as_u64() <= admission.0["end"].as_u64(),
        "the drain is part of the admission: {drain:?} {admission:?}"
    );
    let old_spans = receiver.trace(&"1".repeat(32), 1);
    assert!(old_spans.iter().all(|s| s.name() != "drain"));
}

fn spawn_req(
    req: http::request::Builder,
    payload: &str,
) -> tokio::task::JoinHandle<Result<Reply, String>> {
    tokio::spawn(try_send(req.body(body(payload)).unwrap()))
}

/// Without `[telemetry]` nothing is traced: no trace metrics, the worker's
/// `traceparent` reaches the destination unchanged, and the receiver — named
/// in OpenTelemetry's usual environment variable, which fencegate does not
/// read — gets nothing, even from the flush at shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_traced_when_unset() {
    skip_without_python!();
    let receiver = Receiver::start(false);
    let origin = Origin::start().await;
    let leases = tempfile::tempdir().unwrap();
    let endpoint = format!("http://127.0.0.1:{}", receiver.port);
    let mut fg = Fencegate::start_with_env(
        &format!(
            "{}{}",
            dir_store_toml(leases.path()),
            route_toml("jobs", "jobs", &origin, "derive_key = \"none\"\n")
        ),
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str())],
    );
    let w = acquire(
        &dir_epochs(leases.path()),
        "jobs",
        "w",
        Duration::from_secs(60),
    )
    .await;
    let tp = format!("00-{WORKER_TRACE}-{WORKER_SPAN}-01");
    let req = worker_req(&fg.url("/jobs/run"), w.epoch.get(), &w.token)
        .header("traceparent", &tp)
        .body(body("plain"))
        .unwrap();
    assert_eq!(send(req).await.status, 200);
    assert_eq!(origin.log()[0].header("traceparent"), Some(tp));
    let metrics = send(
        http::Request::get(fg.admin_url("/metrics"))
            .body(Default::default())
            .unwrap(),
    )
    .await;
    assert!(!String::from_utf8_lossy(&metrics.body).contains("fencegate_trace_"));
    assert!(fg.terminate().success());
    assert!(receiver.raw().is_empty(), "nothing was exported");
}

/// A collector that never answers holds one export; the spans after it fill
/// the bounded queue and are dropped and counted, while every request is
/// answered as usual. A collector that cannot be reached: every batch is
/// dropped and counted as `export_failed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_or_missing_collector_never_holds_a_request() {
    skip_without_python!();
    let stuck = Receiver::start(true);
    let (origin, fg, epochs, _l) = gateway(Some(&stuck), "max_queue_spans = 8").await;
    let w = acquire(&epochs, "jobs", "w", Duration::from_secs(60)).await;
    for i in 0..30 {
        assert_eq!(
            post(&fg, "/jobs/run", &w, &format!("r{i}")).await.status,
            200
        );
    }
    assert_eq!(origin.count(), 30);
    // 90 spans (3 a request): at most 8 queued and 8 in the stuck export.
    let full = dropped(&fg, "queue_full").await;
    assert!(full >= 90.0 - 16.0, "dropped as the queue was full: {full}");
    assert_eq!(
        fg.metric_sum("fencegate_trace_spans_exported_total").await,
        0.0
    );

    // Nobody listens on the endpoint.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let origin = Origin::start().await;
    let leases = tempfile::tempdir().unwrap();
    let fg = Fencegate::start(&format!(
        "{}{}\n[telemetry]\notlp_endpoint = \"http://127.0.0.1:{port}/\"\n",
        dir_store_toml(leases.path()),
        route_toml("jobs", "jobs", &origin, "derive_key = \"none\"\n"),
    ));
    let w = acquire(
        &dir_epochs(leases.path()),
        "jobs",
        "w",
        Duration::from_secs(60),
    )
    .await;
    for i in 0..5 {
        assert_eq!(
            post(&fg, "/jobs/run", &w, &format!("u{i}")).await.status,
            200
        );
    }
    eventually("the failed export is counted", || async {
        dropped(&fg, "export_failed").await >= 15.0
    })
    .await;
    assert!(fg.stderr().contains("trace export failed"));
}

/// `fencegate_trace_spans_dropped_total{reason}`.
async fn dropped(fg: &Fencegate, reason: &str) -> f64 {
    let r = send(
        http::Request::get(fg.admin_url("/metrics"))
            .body(Default::default())
            .unwrap(),
    )
    .await;
    let line = format!("fencegate_trace_spans_dropped_total{{reason=\"{reason}\"}} ");
    String::from_utf8_lossy(&r.body)
        .lines()
        .find_map(|l| l.strip_prefix(&line)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {line:?} in the metrics"))
}

/// A worker's `tracestate` with a byte outside ASCII (obs-text: hyper accepts
/// it) is dropped (W3C: a vendor that cannot parse it does not propagate it):
/// the other request's spans in the same export batch arrive, and the bytes do
/// not reach the destination. Failed when it was copied into the exported
/// span's `trace_state`, a protobuf `string`: not UTF-8, so the collector
/// refused the whole export request and every other request's spans in that
/// batch were lost (one worker poisoned everyone's traces); the same bytes were
/// also passed on to the destination unchecked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_ascii_tracestate_does_not_poison_the_export_batch() {
    skip_without_python!();
    let receiver = Receiver::start(false);
    let origin = Origin::start().await;
    let leases = tempfile::tempdir().unwrap();
    let mut fg = Fencegate::start(&format!(
        "{}{}{}",
        dir_store_toml(leases.path()),
        route_toml("jobs", "jobs", &origin, "derive_key = \"none\"\n"),
        receiver.toml(""),
    ));
    let w = acquire(
        &dir_epochs(leases.path()),
        "jobs",
        "w",
        Duration::from_secs(60),
    )
    .await;
    let bad = worker_req(&fg.url("/jobs/a"), w.epoch.get(), &w.token)
        .header(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        )
        .header("tracestate", HeaderValue::from_bytes(b"v=caf\xe9").unwrap())
        .body(body("poisoned"))
        .unwrap();
    assert_eq!(send(bad).await.status, 200);
    let good = worker_req(&fg.url("/jobs/b"), w.epoch.get(), &w.token)
        .body(body("innocent"))
        .unwrap();
    assert_eq!(send(good).await.status, 200);
    let passed = origin
        .log()
        .into_iter()
        .find(|a| a.body == "poisoned".as_bytes())
        .unwrap();
    // Stopping flushes the queue: both requests' spans were sent by its end.
    assert!(fg.terminate().success());
    // `spans()` panics on an export the receiver refused ("a bad export").
    let spans = receiver.spans();
    assert!(
        spans.iter().any(|s| s.name() == "POST /jobs/"),
        "the innocent request's span arrived: {spans:#?}"
    );
    assert!(
        passed
            .headers
            .get_all("tracestate")
            .iter()
            .all(|v| v.as_bytes().is_ascii()),
        "a non-ASCII tracestate reached the destination"
    );
}
