//! SPEC §8 logs, as an operator reads them from a running process: one flat access
//! line per request (with the request id the upstream also received), the switch
//! that turns it off, and every upstream failure with its cause.

use std::time::Duration;

use http::Request;

use crate::support::*;

/// A fencegate on a `dir` store with one route `billing` to `origin`, with more
/// `[server]` keys; worker-a holds the lease.
async fn gateway(
    server_extra: &str,
    origin: &Origin,
) -> (
    tempfile::TempDir,
    Fencegate,
    fencegate::lease::acquire::Holding,
) {
    gateway_to(server_extra, &route_toml("billing", "billing", origin, "")).await
}

/// [`gateway`] with the route's TOML given.
async fn gateway_to(
    server_extra: &str,
    route: &str,
) -> (
    tempfile::TempDir,
    Fencegate,
    fencegate::lease::acquire::Holding,
) {
    let store = tempfile::tempdir().unwrap();
    let fg = Fencegate::start_with_server(
        server_extra,
        &format!("{}{route}", dir_store_toml(store.path())),
        &[],
    );
    let a = acquire(
        &dir_epochs(store.path()),
        "billing",
        "worker-a",
        Duration::from_secs(60),
    )
    .await;
    (store, fg, a)
}

/// The JSON log lines of `target` in fencegate's stderr.
fn json_lines(fg: &Fencegate, target: &str) -> Vec<serde_json::Value> {
    fg.stderr()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"] == target)
        .collect()
}

/// One access line per request at info, flat JSON fields with plain values; the
/// worker's X-Request-Id is kept and a missing one made up, both sent upstream and
/// echoed back. Breaks if the line moves to debug, nests under "fields", loses a
/// field, or the id is not forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_flat_access_line_per_request_with_its_request_id() {
    let origin = Origin::start().await;
    let (_store, fg, a) = gateway("log_format = \"json\"", &origin).await;
    let kept = send(
        worker_req(&fg.url("/billing/charge?secret=1"), a.epoch.get(), &a.token)
            .header("x-request-id", "worker-id-1")
            .header("idempotency-key", "k1")
            .body(body("one"))
            .unwrap(),
    )
    .await;
    assert_eq!(kept.status, 200);
    assert_eq!(kept.headers["x-request-id"], "worker-id-1");
    let made = post(&fg, "/billing/other", &a, "two").await;
    assert_eq!(made.status, 200);
    let made_id = made.headers["x-request-id"].to_str().unwrap().to_owned();
    assert_eq!(made_id.len(), 32, "{made_id}");
    let stale = send(
        worker_req(&fg.url("/billing/x"), a.epoch.get(), "not-the-token")
            .body(body("three"))
            .unwrap(),
    )
    .await;
    stale.assert_error(403, "token_invalid");
    let lost = send(Request::get(fg.url("/nowhere")).body(body("")).unwrap()).await;
    lost.assert_error(404, "route_not_found");

    let arrived: Vec<_> = origin
        .log()
        .iter()
        .map(|r| r.header("x-request-id"))
        .collect();
    assert_eq!(
        arrived,
        vec![Some("worker-id-1".to_owned()), Some(made_id.clone())]
    );

    let lines = json_lines(&fg, "fencegate::access");
    assert_eq!(lines.len(), 4, "{lines:#?}");
    let first = &lines[0];
    assert!(first.get("fields").is_none(), "flat, not nested: {first}");
    assert_eq!(first["level"], "INFO");
    for (k, v) in [
        ("method", serde_json::json!("POST")),
        ("path", "/billing/charge".into()),
        ("route", "billing".into()),
        ("status", 200.into()),
        ("outcome", "forwarded".into()),
        ("lease", "billing".into()),
        ("epoch", a.epoch.get().into()),
        ("key", "k1".into()),
        ("request_id", "worker-id-1".into()),
    ] {
        assert_eq!(first[k], v, "{k} in {first}");
    }
    assert!(first["upstream_ms"].as_f64().is_some(), "{first}");
    assert!(
        first["client"].as_str().unwrap().starts_with("127.0.0.1:"),
        "{first}"
    );
    assert!(
        !first.to_string().contains("secret"),
        "no query in the log: {first}"
    );
    assert_eq!(lines[1]["request_id"], made_id.as_str());
    assert_eq!(lines[2]["outcome"], "refused");
    assert_eq!(lines[2]["code"], "token_invalid");
    assert!(
        lines[2]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("does not match")),
        "the refusal's message: {}",
        lines[2]
    );
    assert_eq!(lines[2]["status"], 403);
    assert!(lines[2].get("upstream_ms").is_none(), "{}", lines[2]);
    assert_eq!(lines[3]["code"], "route_not_found");
    assert!(lines[3].get("route").is_none(), "{}", lines[3]);
    assert_no_debug_values(&fg);
}

/// No field of any log line is a Rust `Debug` rendering: an enum variant
/// (`"outcome":"Delivered"`, the old access line's), `Some(…)` or a struct dump.
/// Messages are prose and are not judged.
fn assert_no_debug_values(fg: &Fencegate) {
    let all: Vec<serde_json::Value> = fg
        .stderr()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert!(!all.is_empty(), "JSON lines in {}", fg.stderr());
    for line in &all {
        let Some(fields) = line.as_object() else {
            continue;
        };
        for (k, v) in fields {
            let Some(s) = v.as_str() else { continue };
            if ["message", "reason", "error", "cause"].contains(&k.as_str()) {
                continue;
            }
            let variant = s.starts_with(|c: char| c.is_ascii_uppercase())
                && s.chars().any(|c| c.is_ascii_lowercase())
                && s.chars().all(|c| c.is_ascii_alphanumeric());
            assert!(
                !variant && !s.contains("Some(") && !s.contains(" { "),
                "{k} = {s:?} looks like a Debug value: {line}"
            );
        }
    }
}

/// `[server] access_log = false` turns the access line off (the requests still
/// flow and are still counted). Breaks if the switch is ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_can_be_turned_off() {
    let origin = Origin::start().await;
    let (_store, fg, a) = gateway("log_format = \"json\"\naccess_log = false", &origin).await;
    assert_eq!(post(&fg, "/billing/x", &a, "one").await.status, 200);
    assert_eq!(origin.count(), 1);
    assert!(json_lines(&fg, "fencegate::access").is_empty());
}

/// An upstream that cannot be reached is logged at warn with its URL (no query),
/// the error chain down to the OS error, and the elapsed time. Breaks if the log
/// says only "the upstream could not be reached".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_failure_is_logged_with_url_cause_and_elapsed_time() {
    let origin = Origin::start().await;
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let route = route_toml("billing", "billing", &origin, "")
        .replace(&origin.url("/v1/"), &format!("http://127.0.0.1:{port}/v1/"));
    let (_store, fg, a) = gateway_to("log_format = \"json\"", &route).await;
    let r = post(&fg, "/billing/charge?token=x", &a, "one").await;
    r.assert_error(502, "upstream_unreachable");
    let failures = json_lines(&fg, "fencegate::proxy");
    let f = failures
        .iter()
        .find(|l| l["message"] == "upstream request failed")
        .unwrap_or_else(|| panic!("no failure line: {}", fg.stderr()));
    assert_eq!(f["level"], "WARN");
    assert_eq!(
        f["upstream"],
        format!("http://127.0.0.1:{port}/v1/charge"),
        "{f}"
    );
    let error = f["error"].as_str().unwrap();
    assert!(error.contains("Connection refused"), "{error}");
    assert!(f["elapsed_ms"].as_f64().is_some(), "{f}");
    assert_eq!(f["route"], "billing");
    assert_eq!(f["request_id"], r.headers["x-request-id"].to_str().unwrap());
}
