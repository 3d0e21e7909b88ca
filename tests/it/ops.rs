//! SPEC §8: the admin API, metrics, shutdown, TLS, secrets, container.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};

use crate::support::*;

/// An S3 server, an origin, and fencegate with one route `billing`; worker-a holds it.
async fn billing() -> (
    S3Server,
    Origin,
    Fencegate,
    fencegate::lease::acquire::Holding,
) {
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let fg = Fencegate::start(&format!(
        "{}{}",
        s3.store_toml(200),
        route_toml("billing", "billing", &origin, "")
    ));
    let a = acquire(
        &s3.epochs().await,
        "billing",
        "worker-a",
        Duration::from_secs(60),
    )
    .await;
    (s3, origin, fg, a)
}

fn get(url: String) -> Request<Full<Bytes>> {
    Request::get(url).body(Full::default()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_endpoints_answer_and_readyz_follows_the_store() {
    skip_without_python!();
    let (s3, _origin, fg, a) = billing().await;
    assert_eq!(post(&fg, "/billing/x", &a, "one").await.status, 200);

    assert_eq!(send(get(fg.admin_url("/healthz"))).await.status, 200);
    assert_eq!(send(get(fg.admin_url("/readyz"))).await.status, 200);
    let leases = fg.admin_json("/v1/leases").await;
    let l = &leases["leases"][0];
    assert_eq!(l["lease"], "billing");
    assert_eq!(l["high_water_mark"], a.epoch.get());
    assert_eq!(l["latest_epoch"], a.epoch.get());
    assert_eq!(l["holder"], "worker-a");
    assert!(l["expires_at"].is_string());
    assert_eq!(l["in_flight"], 0);

    s3.pause();
    let r = send(get(fg.admin_url("/readyz"))).await;
    assert_eq!(r.status, 503);
    assert!(
        r.json()["problems"][0]
            .as_str()
            .unwrap()
            .contains("lease store"),
        "{}",
        r.json()
    );
    s3.resume();
    assert_eq!(send(get(fg.admin_url("/readyz"))).await.status, 200);

    // Dedup records: unknown route, unknown key, and mutations disabled without a token.
    assert_eq!(
        send(get(fg.admin_url("/v1/dedup/nope/k"))).await.status,
        404
    );
    assert_eq!(
        send(get(fg.admin_url("/v1/dedup/billing/never-used")))
            .await
            .status,
        404
    );
    let r = send(
        Request::post(fg.admin_url("/v1/dedup/billing/k/resolve"))
            .header("authorization", "Bearer anything")
            .body(body(r#"{"outcome":"delivered"}"#))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 403);
    assert_eq!(r.json()["error"], "admin_disabled");
    assert_eq!(send(get(fg.admin_url("/nope"))).await.status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_with_a_real_prometheus_parser_and_move() {
    skip_without_python!();
    let (_s3, _origin, fg, a) = billing().await;
    let parse = |text: Bytes| {
        let script = r#"
import sys, json
from prometheus_client.openmetrics.parser import text_string_to_metric_families
out = {}
for fam in text_string_to_metric_families(sys.stdin.read()):
    for s in fam.samples:
        key = s.name + json.dumps(s.labels, sort_keys=True)
        out[key] = s.value
print(json.dumps(out))
"#;
        let mut child = std::process::Command::new(test_python())
            .args(["-c", script])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child.stdin.take().unwrap().write_all(&text).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "prometheus_client rejected the exposition:\n{}",
            String::from_utf8_lossy(&text)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let before = parse(send(get(fg.admin_url("/metrics"))).await.body);
    assert_eq!(post(&fg, "/billing/x", &a, "one").await.status, 200);
    assert_eq!(
        post(&fg, "/billing/x", &a, "one").await.headers["x-fencegate-replayed"],
        "true"
    );
    send(
        worker_req(&fg.url("/billing/x"), a.epoch.get(), "bad")
            .body(body("x"))
            .unwrap(),
    )
    .await
    .assert_error(403, "token_invalid");
    let after = parse(send(get(fg.admin_url("/metrics"))).await.body);
    let v = |m: &serde_json::Value, k: &str| m.get(k).and_then(|v| v.as_f64()).unwrap_or(0.0);
    // No empty `code` label on requests that were not refused.
    let fwd = r#"fencegate_requests_total{"outcome": "forwarded", "route": "billing"}"#;
    let rep = r#"fencegate_requests_total{"outcome": "replayed", "route": "billing"}"#;
    let bad = r#"fencegate_requests_total{"code": "token_invalid", "outcome": "refused", "route": "billing"}"#;
    assert_eq!(v(&after, fwd) - v(&before, fwd), 1.0, "{after}");
    assert_eq!(v(&after, rep) - v(&before, rep), 1.0);
    assert_eq!(v(&after, bad) - v(&before, bad), 1.0);
    assert_eq!(
        v(&after, r#"fencegate_high_water_mark{"lease": "billing"}"#),
        a.epoch.get() as f64
    );
    assert!(v(&after, "fencegate_flush_batches_total{}") >= 1.0);
    // State-store latency and errors (SPEC §10.2), by operation: the forward
    // claimed its key and wrote its outcome, the replay's claim found the record.
    for (op, calls) in [("begin", 2.0), ("finish", 1.0)] {
        let count = format!(r#"fencegate_state_duration_seconds_count{{"op": "{op}"}}"#);
        assert_eq!(v(&after, &count) - v(&before, &count), calls, "{op}");
    }
    assert_eq!(
        v(
            &after,
            r#"fencegate_state_errors_total{"kind": "unavailable", "op": "begin"}"#
        ),
        0.0
    );
    assert!(after
        .as_object()
        .unwrap()
        .contains_key(r#"fencegate_state_errors_total{"kind": "owner_lost", "op": "raise_mark"}"#));
    assert!(
        v(
            &after,
            r#"fencegate_admission_duration_seconds_count{"route": "billing"}"#
        ) >= 2.0
    );
    assert!(
        v(
            &after,
            r#"fencegate_upstream_duration_seconds_count{"route": "billing"}"#
        ) >= 1.0
    );
    assert!(
        after
            .as_object()
            .unwrap()
            .iter()
            .all(|(k, _)| !k.contains(r#""code": """#) && !k.contains(r#""route": """#)),
        "no series with an empty label: {after}"
    );
    let build = after
        .as_object()
        .unwrap()
        .iter()
        .find(|(k, _)| k.starts_with("fencegate_build_info{"))
        .map(|(k, v)| (k.clone(), v.as_f64()));
    let (build, one) = build.expect("fencegate_build_info");
    assert_eq!(one, Some(1.0));
    assert!(
        build.contains(&format!(r#""version": "{}""#, env!("CARGO_PKG_VERSION")))
            && build.contains(r#""commit": "#),
        "{build}"
    );
    assert!(v(&after, "process_cpu_seconds_total{}") > 0.0, "{after}");
    assert!(v(&after, "process_resident_memory_bytes{}") > 1e6);
    assert!(v(&after, "process_open_fds{}") >= 3.0);
    assert!(v(&after, "process_max_fds{}") >= v(&after, "process_open_fds{}"));
    assert!(v(&after, "process_start_time_seconds{}") > 1.6e9);
    assert!(
        v(
            &after,
            r#"fencegate_store_calls_total{"lease": "billing", "op": "list"}"#
        ) >= 1.0
    );
    for name in [
        "fencegate_in_flight",
        "fencegate_latest_known_epoch",
        "fencegate_drains_started_total",
        "fencegate_drains_aborted_total",
        "fencegate_mark_raises_total",
        "fencegate_dedup_replays_total",
        "fencegate_dedup_conflicts_total",
        "fencegate_dedup_in_doubt_total",
        "fencegate_store_errors_total",
        "fencegate_flush_records_total",
        "fencegate_store_clock_offset_seconds",
        "fencegate_config_last_reload_successful",
    ] {
        assert!(
            after
                .as_object()
                .unwrap()
                .keys()
                .any(|k| k.starts_with(name)),
            "missing metric {name}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_the_in_flight_request_finish_and_flushes() {
    skip_without_python!();
    let (_s3, origin, mut fg, a) = billing().await;
    let slow = worker_req(&fg.url("/billing/x"), a.epoch.get(), &a.token)
        .header("idempotency-key", "during-shutdown")
        .header("x-test-hold", "slow")
        .body(body("p"))
        .unwrap();
    let in_flight = tokio::spawn(send(slow));
    origin.wait_for(1).await;
    let pid = fg.pid();
    std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    // The listener stops accepting; the admitted request is still answered.
    eventually("fencegate stopped accepting", || {
        let addr = fg.proxy;
        async move { tokio::net::TcpStream::connect(addr).await.is_err() }
    })
    .await;
    origin.release("slow");
    assert_eq!(in_flight.await.unwrap().status, 200);
    assert!(fg.wait_exit().success(), "exit 0 after SIGTERM");
    assert!(fg.stderr().contains("durable state flushed"));
    fg.spawn(None).unwrap();
    let rec = fg.admin_json("/v1/dedup/billing/during-shutdown").await;
    assert_eq!(rec["state"], "done", "{rec}");
}

/// SPEC §8 `shutdown_delay_ms` (Kubernetes endpoints and load balancers stop
/// sending late): the first SIGTERM turns `/readyz` to 503 at once while `/livez`
/// stays 200, and the proxy goes on serving for the delay — a request sent then
/// reaches the origin. Only after the delay does the proxy listener close and the
/// drain run, `/livez` still 200 throughout; then the usual exit 0 with the state
/// flushed. Breaks if readiness stays 200 during the delay, if the delay stops
/// accepting early, or if the admin listener closes with the proxy's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_fails_readiness_first_and_serves_through_the_shutdown_delay() {
    let origin = Origin::start().await;
    let store = tempfile::tempdir().unwrap();
    let mut fg = Fencegate::start_with_server(
        "shutdown_delay_ms = \"8s\"",
        &format!(
            "{}{}",
            dir_store_toml(store.path()),
            route_toml("billing", "billing", &origin, "timeout_ms = 30000")
        ),
        &[],
    );
    let a = acquire(
        &dir_epochs(store.path()),
        "billing",
        "worker-a",
        Duration::from_secs(60),
    )
    .await;
    let admin = fg.admin;
    let status = move |path: &'static str| async move {
        send(get(format!("http://{admin}{path}")))
            .await
            .status
            .as_u16()
    };
    assert_eq!(
        (status("/readyz").await, status("/livez").await),
        (200, 200)
    );

    std::process::Command::new("kill")
        .args(["-TERM", &fg.pid().to_string()])
        .status()
        .unwrap();
    eventually("/readyz answers 503 after SIGTERM", || async {
        status("/readyz").await == 503
    })
    .await;
    let r = send(get(fg.admin_url("/readyz"))).await;
    assert_eq!(r.json()["problems"][0], "shutting down", "{}", r.json());
    assert_eq!(status("/livez").await, 200, "alive while not ready");
    // Still serving during the delay: this request is forwarded (the origin
    // holds it, so the drain after the delay has something to wait for).
    let held = spawn_post(
        &fg,
        &a,
        &[("idempotency-key", "during-delay"), ("x-test-hold", "slow")],
        b"sent after SIGTERM".to_vec(),
    );
    origin.wait_for(1).await;
    assert_eq!(
        origin.log()[0].header("idempotency-key").as_deref(),
        Some("during-delay")
    );
    assert!(
        !fg.stderr().contains("finishing in-flight requests"),
        "the drain began before the request was forwarded"
    );
    // After the delay: the proxy listener closes and the drain waits for the
    // held request, while the admin listener still answers.
    eventually("the proxy stopped accepting after the delay", || {
        let addr = fg.proxy;
        async move { tokio::net::TcpStream::connect(addr).await.is_err() }
    })
    .await;
    assert_eq!(status("/livez").await, 200, "alive during the drain");
    assert_eq!(status("/readyz").await, 503);
    origin.release("slow");
    assert_eq!(held.await.unwrap().unwrap().status, 200);
    assert!(fg.wait_exit().success(), "exit 0 after SIGTERM");
    let log = fg.stderr();
    let at = |what: &str| {
        log.find(what)
            .unwrap_or_else(|| panic!("no {what:?} in the log:\n{log}"))
    };
    assert!(
        at("still serving for the shutdown delay") < at("finishing in-flight requests")
            && at("finishing in-flight requests") < at("durable state flushed"),
        "{log}"
    );
    assert_eq!(origin.count(), 1);
}

/// SPEC §8: a second signal exits at once, also during the shutdown delay (an
/// operator's Ctrl-C twice, or a supervisor's second TERM, is not held up by it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_sigterm_during_the_shutdown_delay_exits_at_once() {
    let origin = Origin::start().await;
    let store = tempfile::tempdir().unwrap();
    let mut fg = Fencegate::start_with_server(
        // Far longer than wait_exit's 20 s: only the second signal can end it.
        "shutdown_delay = \"10m\"",
        &format!(
            "{}{}",
            dir_store_toml(store.path()),
            route_toml("billing", "billing", &origin, "")
        ),
        &[],
    );
    let term = || {
        std::process::Command::new("kill")
            .args(["-TERM", &fg.pid().to_string()])
            .status()
            .unwrap()
    };
    term();
    eventually("the delay has begun", || async {
        send(get(fg.admin_url("/readyz"))).await.status == 503
    })
    .await;
    term();
    let status = fg.wait_exit();
    assert_eq!(status.code(), Some(130), "{}", fg.stderr());
    assert!(fg.stderr().contains("second signal, exiting now"));
}

/// Whether `pid` has a handler installed for SIGTERM (`SigCgt` in /proc).
fn catches_sigterm(pid: u32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigCgt:"))
        .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
        .is_some_and(|m| m & (1 << (15 - 1)) != 0)
}

/// SPEC §8: SIGTERM twice while start-up waits on a store that does not
/// answer: no ready line; the process exits without listening (a second signal
/// exits at once in start-up too). Failed when the handlers were installed
/// before `build` but nothing read them until `run`, and the two signals
/// coalesced into one: once the store answered fencegate went on, bound,
/// printed its ready line and served the whole shutdown delay (here 60 s), so a
/// pod killed while starting was held until SIGKILL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sigterms_during_start_up_exit_without_listening() {
    skip_without_python!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("fencegate.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\ndata_dir = \"{}\"\nshutdown_delay_ms = 60000\n\n{}{}",
            dir.path().join("state").display(),
            s3.store_toml(200).replace("timeout_ms = 1500", "timeout_ms = 3000"),
            route_toml("jobs", "jobs", &origin, "derive_key = \"none\"\n"),
        ),
    )
    .unwrap();
    s3.pause();
    let mut child = Command::new(bin())
        .args(["serve", "--config"])
        .arg(&config)
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.path().join("stderr.log")).unwrap())
        .spawn()
        .unwrap();
    let pid = child.id();
    let log = dir.path().join("stderr.log");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !catches_sigterm(pid) {
        assert!(
            std::time::Instant::now() < deadline,
            "no SIGTERM handler: {:?} {}",
            std::fs::read_to_string(format!("/proc/{pid}/status")),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let term = || {
        assert!(Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .unwrap()
            .success());
    };
    // Two signals sent back to back may reach the process as one (pending
    // signals of a kind coalesce): the second goes once the first was seen.
    term();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("signal received")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the first SIGTERM was never seen"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    term();
    s3.resume();
    let mut line = String::new();
    let _ = BufReader::new(child.stdout.take().unwrap()).read_line(&mut line);
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        line.trim().is_empty(),
        "asked twice to stop during start-up, it went on to listen: {line}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_deadline_abandons_the_rest_as_in_doubt() {
    skip_without_python!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let store = s3.store_toml(200);
    let mut fg = Fencegate::start(&format!(
        "{store}{}",
        route_toml("billing", "billing", &origin, "timeout_ms = 20000")
    ));
    // Shorten the shutdown deadline for this test.
    let cfg = std::fs::read_to_string(&fg.config)
        .unwrap()
        .replace("shutdown_timeout_ms = 5000", "shutdown_timeout_ms = 300");
    std::fs::write(&fg.config, cfg).unwrap();
    fg.restart();
    let a = acquire(
        &s3.epochs().await,
        "billing",
        "worker-a",
        Duration::from_secs(60),
    )
    .await;
    let stuck = worker_req(&fg.url("/billing/x"), a.epoch.get(), &a.token)
        .header("idempotency-key", "abandoned")
        .header("x-test-hold", "never")
        .body(body("p"))
        .unwrap();
    let in_flight = tokio::spawn(send(stuck));
    origin.wait_for(1).await;
    let status = fg.terminate();
    assert!(status.success());
    in_flight
        .await
        .unwrap()
        .assert_error(504, "upstream_timeout");
    fg.spawn(None).unwrap();
    assert_eq!(
        fg.admin_json("/v1/dedup/billing/abandoned").await["state"],
        "in_doubt"
    );
    origin.release("never");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_never_appear_in_logs_config_output_or_admin() {
    skip_without_python!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let secret = "sk_live_very_secret_value";
    let mut fg = Fencegate::start_with_env(
        &format!(
            "{}{}",
            s3.store_toml(200),
            route_toml(
                "billing",
                "billing",
                &origin,
                "upstream_headers = { Authorization = \"${PAY_KEY}\" }"
            )
        ),
        &[
            ("PAY_KEY", secret),
            ("FENCEGATE_ADMIN_TOKEN", "admin-token-value"),
            ("FENCEGATE_LOG", "debug"),
        ],
    );
    // FENCEGATE_LOG from the harness is overridden above: restart to be sure it applies.
    fg.restart();
    let a = acquire(
        &s3.epochs().await,
        "billing",
        "worker-a",
        Duration::from_secs(60),
    )
    .await;
    let r = send(
        worker_req(&fg.url("/billing/x"), a.epoch.get(), &a.token)
            .header("authorization", "Bearer worker-own")
            .body(body("p"))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(
        origin.log()[0].header("authorization").as_deref(),
        Some(secret)
    );
    send(
        worker_req(&fg.url("/billing/x"), a.epoch.get(), "wrong-token-value")
            .body(body("q"))
            .unwrap(),
    )
    .await;
    let _ = send(
        Request::post(fg.admin_url("/v1/dedup/billing/k/resolve"))
            .header("authorization", "Bearer admin-token-value")
            .body(body("{}"))
            .unwrap(),
    )
    .await;
    let mut seen = fg.stderr();
    for path in ["/v1/leases", "/metrics", "/readyz"] {
        seen.push_str(&String::from_utf8_lossy(
            &send(get(fg.admin_url(path))).await.body,
        ));
    }
    let check = std::process::Command::new(bin())
        .args(["check-config", "--config"])
        .arg(&fg.config)
        .env("PAY_KEY", secret)
        .output()
        .unwrap();
    assert!(check.status.success());
    seen.push_str(&String::from_utf8_lossy(&check.stdout));
    assert!(seen.contains("Authorization"), "the header name is shown");
    for s in [
        secret,
        a.token.as_str(),
        "wrong-token-value",
        "admin-token-value",
    ] {
        assert!(!seen.contains(s), "secret {s:?} leaked");
    }
    // A missing ${VAR} is a start-up error that names the variable, not a value.
    let bad = std::process::Command::new(bin())
        .args(["check-config", "--config"])
        .arg(&fg.config)
        .env_remove("PAY_KEY")
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("PAY_KEY"));
}

struct TestPki {
    ca_pem: String,
    cert_pem: String,
    key_pem: String,
}

fn pki() -> TestPki {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let leaf_key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
        .unwrap()
        .signed_by(&leaf_key, &Issuer::new(ca_params, ca_key))
        .unwrap();
    TestPki {
        ca_pem: ca_cert.pem(),
        cert_pem: leaf.pem(),
        key_pem: leaf_key.serialize_pem(),
    }
}

fn client_trusting(
    ca_pem: &str,
) -> Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>> {
    use rustls_pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls_pki_types::CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_only()
        .enable_http1()
        .enable_http2()
        .build();
    Client::builder(TokioExecutor::new()).build(https)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_listener_speaks_h2_and_https_upstreams_need_their_ca() {
    skip_without_python!();
    let s3 = S3Server::start();
    let pki = pki();
    let dir = tempfile::tempdir().unwrap();
    let (cert, key, ca) = (
        dir.path().join("cert.pem"),
        dir.path().join("key.pem"),
        dir.path().join("ca.pem"),
    );
    std::fs::write(&cert, &pki.cert_pem).unwrap();
    std::fs::write(&key, &pki.key_pem).unwrap();
    std::fs::write(&ca, &pki.ca_pem).unwrap();

    // An https origin with a certificate from the test CA.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up_addr = listener.local_addr().unwrap();
    let acceptor = {
        use rustls_pki_types::pem::PemObject;
        let certs = rustls_pki_types::CertificateDer::pem_slice_iter(pki.cert_pem.as_bytes())
            .map(Result::unwrap)
            .collect();
        let k = rustls_pki_types::PrivateKeyDer::from_pem_slice(pki.key_pem.as_bytes()).unwrap();
        let sc = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, k)
        .unwrap();
        tokio_rustls::TlsAcceptor::from(Arc::new(sc))
    };
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = listener.accept().await else {
                continue;
            };
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(s).await else {
                    return;
                };
                // Answers with the `Forwarded` header it received.
                let svc = hyper::service::service_fn(|req: Request<hyper::body::Incoming>| {
                    let fwd = req
                        .headers()
                        .get("forwarded")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                        .to_owned();
                    async move {
                        Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                            Bytes::from(format!("secure origin; forwarded: {fwd}")),
                        )))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tls), svc)
                    .await;
            });
        }
    });

    let routes = format!(
        "[[route]]\nname = \"trusted\"\npath_prefix = \"/trusted/\"\nupstream = \"https://localhost:{port}/\"\nlease = \"l\"\nca_file = \"{ca}\"\n\n\
         [[route]]\nname = \"untrusted\"\npath_prefix = \"/untrusted/\"\nupstream = \"https://localhost:{port}/\"\nlease = \"l\"\n",
        port = up_addr.port(),
        ca = ca.display()
    );
    let store = s3.store_toml(200);
    let fg = Fencegate::start(&format!("{store}{routes}"));
    // Re-start with TLS on the listener ([server.tls] lives in [server], which the harness writes).
    let cfg = std::fs::read_to_string(&fg.config).unwrap().replacen(
        "shutdown_timeout_ms = 5000\n",
        &format!(
            "shutdown_timeout_ms = 5000\n\n[server.tls]\ncert = \"{}\"\nkey = \"{}\"\n",
            cert.display(),
            key.display()
        ),
        1,
    );
    std::fs::write(&fg.config, cfg).unwrap();
    let mut fg = fg;
    fg.restart();
    let a = acquire(&s3.epochs().await, "l", "w", Duration::from_secs(60)).await;
    let client = client_trusting(&pki.ca_pem);
    let call = |path: &str| {
        Request::post(format!("https://localhost:{}{path}", fg.proxy.port()))
            .header("x-lease-epoch", a.epoch.get().to_string())
            .header("x-lease-token", &a.token)
            .body(body("hello"))
            .unwrap()
    };
    let resp = client.request(call("/trusted/x")).await.unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_2, "ALPN negotiates h2");
    assert_eq!(resp.status(), 200);
    let got = resp.into_body().collect().await.unwrap().to_bytes();
    let got = String::from_utf8_lossy(&got);
    assert!(got.starts_with("secure origin"), "{got}");
    assert!(
        got.contains(";proto=https"),
        "the worker reached fencegate over TLS: {got}"
    );
    let resp = client.request(call("/untrusted/x")).await.unwrap();
    assert_eq!(
        resp.status(),
        502,
        "an https upstream with an unknown CA is refused"
    );
    assert_eq!(resp.headers()["x-fencegate-error"], "upstream_unreachable");
}

#[test]
fn dockerfile_runtime_stage_matches_the_binary() {
    let text = std::fs::read_to_string(repo_root().join("Dockerfile")).unwrap();
    let runtime = text.rsplit("FROM ").next().unwrap();
    let line = |prefix: &str| {
        runtime
            .lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix} line"))
            .to_owned()
    };
    let parse_array = |l: &str| -> Vec<String> {
        serde_json::from_str(l.split_once(' ').unwrap().1.trim()).unwrap()
    };
    let entry = parse_array(&line("ENTRYPOINT"));
    let cmd = parse_array(&line("CMD"));
    assert_eq!(entry, vec!["/usr/local/bin/fencegate"]);
    assert!(line("USER").trim() != "USER root", "runs as non-root");
    assert!(runtime.contains("ca-certificates"));
    // The CMD's flags are the binary's flags: parse them with --help appended.
    let mut args: Vec<String> = cmd.clone();
    args.push("--help".into());
    let help = std::process::Command::new(bin())
        .args(&args)
        .output()
        .unwrap();
    assert!(
        help.status.success(),
        "CMD {cmd:?} does not parse: {}",
        String::from_utf8_lossy(&help.stderr)
    );
    // The config the CMD names is the one the image installs, and it is valid.
    let cfg_path = &cmd[cmd.iter().position(|a| a == "--config").unwrap() + 1];
    assert!(
        runtime.contains(&format!("/src/config/container.toml {cfg_path}")),
        "COPY installs {cfg_path}"
    );
    let check = std::process::Command::new(bin())
        .args(["check-config", "--config"])
        .arg(repo_root().join("config/container.toml"))
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stderr)
    );
    // EXPOSE and HEALTHCHECK agree with the config's ports.
    let cfg = fencegate::config::Config::load(&repo_root().join("config/container.toml")).unwrap();
    let expose = line("EXPOSE");
    for port in [cfg.server.listen.port(), cfg.server.admin_listen.port()] {
        assert!(expose.contains(&port.to_string()), "EXPOSE {port}");
    }
    assert!(runtime.contains(&format!(
        "http://127.0.0.1:{}/readyz",
        cfg.server.admin_listen.port()
    )));
    // No admin listener open to the network without a token.
    assert!(
        cfg.server.admin_listen.ip().is_loopback() || cfg.server.admin_token.is_some(),
        "the baked config exposes the admin API without a token"
    );
    // Every path the image uses for state is under the declared volume.
    assert!(cfg.server.data_dir.starts_with("/var/lib/fencegate"));
    assert!(runtime.contains("VOLUME [\"/var/lib/fencegate\"]"));
}

/// The binary reaches the runtime stage from the stage `BINARY` names: `build`
/// (compiled in a Rust image, the default) or `prebuilt` (built on the host;
/// scripts/image.sh, where no Rust image can be pulled). Both leave the binary and
/// the config at the paths the runtime stage copies from; the base is the
/// `BASE_IMAGE` argument (Debian bookworm, as the Rust image's glibc needs).
#[test]
fn dockerfile_takes_the_binary_and_the_base_from_build_arguments() {
    let text = std::fs::read_to_string(repo_root().join("Dockerfile")).unwrap();
    assert!(text.contains("\nARG BASE_IMAGE=debian:bookworm-slim\n"));
    assert!(text.contains("\nARG BINARY=build\n"));
    let stages: Vec<&str> = text.split("\nFROM ").skip(1).collect();
    let stage = |name: &str| {
        *stages
            .iter()
            .find(|s| s.lines().next().unwrap().ends_with(&format!(" AS {name}")))
            .unwrap_or_else(|| panic!("no stage {name}"))
    };
    let build = stage("build");
    assert!(build.contains("WORKDIR /src\n"));
    assert!(build.contains("cargo build --release --locked --bin fencegate"));
    assert!(build.contains("COPY config ./config"));
    let prebuilt = stage("prebuilt");
    assert!(prebuilt.starts_with("scratch AS prebuilt"));
    assert!(prebuilt.contains("COPY fencegate /src/target/release/fencegate\n"));
    assert!(prebuilt.contains("COPY container.toml /src/config/container.toml\n"));
    assert!(stage("binary").starts_with("${BINARY} AS binary"));
    let runtime = stages.last().unwrap();
    assert!(runtime.starts_with("${BASE_IMAGE}\n"));
    assert!(runtime
        .contains("COPY --from=binary /src/target/release/fencegate /usr/local/bin/fencegate\n"));
    // scripts/image.sh builds the `prebuilt` way, from a context holding
    // exactly what that stage copies.
    let script = std::fs::read_to_string(repo_root().join("scripts/image.sh")).unwrap();
    assert!(script.contains("--build-arg BINARY=prebuilt"));
    assert!(script.contains("objcopy --strip-debug \"$BIN\" \"$ctx/fencegate\""));
    assert!(script.contains("cp config/container.toml \"$ctx/container.toml\""));
}

/// The image's build stage copies every path the manifest names (the benches
/// Cargo.toml declares, the lockfile, src, config): without them
/// `cargo build` fails before compiling anything (a newcomer's first build did).
/// And the build context leaves out what is large and local.
#[test]
fn dockerfile_build_stage_copies_what_the_manifest_needs() {
    let text = std::fs::read_to_string(repo_root().join("Dockerfile")).unwrap();
    let build = text.split("FROM ").nth(1).unwrap();
    let copied: Vec<&str> = build
        .lines()
        .filter_map(|l| l.strip_prefix("COPY "))
        .flat_map(|l| {
            let parts: Vec<&str> = l.split_whitespace().collect();
            parts[..parts.len() - 1].to_vec()
        })
        .collect();
    let manifest: toml::Table =
        toml::from_str(&std::fs::read_to_string(repo_root().join("Cargo.toml")).unwrap()).unwrap();
    let mut needed = vec![
        "Cargo.toml".to_owned(),
        "Cargo.lock".to_owned(),
        "src".to_owned(),
        // include_str! in src/admin.rs (GET /v1/openapi.json).
        "docs/openapi.json".to_owned(),
    ];
    for table in ["bench", "test", "example"] {
        for t in manifest
            .get(table)
            .and_then(|v| v.as_array())
            .into_iter()
            .flatten()
        {
            let name = t["name"].as_str().unwrap();
            let path = t
                .get("path")
                .and_then(|p| p.as_str())
                .map(str::to_owned)
                .unwrap_or_else(|| {
                    let dir = match table {
                        "bench" => "benches",
                        "test" => "tests",
                        _ => "examples",
                    };
                    format!("{dir}/{name}.rs")
                });
            needed.push(path);
        }
    }
    for path in &needed {
        assert!(
            copied
                .iter()
                .any(|c| path == c || path.starts_with(&format!("{}/", c.trim_end_matches('/')))),
            "the build stage does not copy {path} (COPY lines: {copied:?})"
        );
        assert!(
            repo_root().join(path).exists(),
            "{path} is named but missing"
        );
    }
    let ignore = std::fs::read_to_string(repo_root().join(".dockerignore")).unwrap();
    for big in ["target/", ".venv/", "node_modules/"] {
        assert!(ignore.contains(big), ".dockerignore leaves out {big}");
    }
}

/// SPEC §8: SIGHUP reloads the listener's TLS certificate. New connections get the
/// new certificate (a client trusting only the new CA gets through; one trusting
/// only the old CA no longer does), without a restart. Breaks if the acceptor is
/// fixed at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_tls_certificate() {
    let (old, new) = (pki(), pki());
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert, &old.cert_pem).unwrap();
    std::fs::write(&key, &old.key_pem).unwrap();
    let origin = Origin::start().await;
    let store = tempfile::tempdir().unwrap();
    let fg = Fencegate::start_with_server(
        &format!(
            "[server.tls]\ncert = \"{}\"\nkey = \"{}\"\n",
            cert.display(),
            key.display()
        ),
        &format!(
            "{}{}",
            dir_store_toml(store.path()),
            route_toml("billing", "billing", &origin, "require_token = false")
        ),
        &[],
    );
    let call = |ca: &str| {
        let client = client_trusting(ca);
        let req = Request::post(format!("https://localhost:{}/billing/x", fg.proxy.port()))
            .header("x-lease-epoch", "1")
            .body(body("hello"))
            .unwrap();
        async move { client.request(req).await.map(|r| r.status()) }
    };
    call(&old.ca_pem).await.expect("the old certificate serves");
    assert!(call(&new.ca_pem).await.is_err(), "not yet the new one");
    std::fs::write(&cert, &new.cert_pem).unwrap();
    std::fs::write(&key, &new.key_pem).unwrap();
    fg.hup();
    eventually("the new certificate serves", || async {
        call(&new.ca_pem).await.is_ok()
    })
    .await;
    assert!(
        call(&old.ca_pem).await.is_err(),
        "the old certificate is gone"
    );
}

/// SPEC §8: `GET /v1/openapi.json` serves docs/openapi.json byte for byte (the
/// file is built in), without a token, and it is an OpenAPI 3.1 document of
/// this version that describes every endpoint of the index (`GET /`) with its
/// method, and nothing the index does not list but the proxy's status URL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openapi_description_is_the_file_and_covers_the_index() {
    let store = tempfile::tempdir().unwrap();
    let origin = Origin::start().await;
    let fg = Fencegate::start_with_server(
        "admin_token = \"openapi-test-token\"",
        &format!(
            "{}{}",
            dir_store_toml(store.path()),
            route_toml("billing", "billing", &origin, "")
        ),
        &[],
    );
    let file = std::fs::read(repo_root().join("docs/openapi.json")).unwrap();
    let r = send(get(fg.admin_url("/v1/openapi.json"))).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.headers["content-type"], "application/json");
    assert!(
        r.body == file,
        "the served description differs from docs/openapi.json"
    );
    let head = send(
        Request::head(fg.admin_url("/v1/openapi.json"))
            .body(Full::default())
            .unwrap(),
    )
    .await;
    assert_eq!(head.status, 200);
    assert_eq!(head.headers["content-length"], file.len().to_string());

    let doc: serde_json::Value = serde_json::from_slice(&file).expect("docs/openapi.json parses");
    assert!(doc["openapi"].as_str().unwrap().starts_with("3.1."));
    assert_eq!(doc["info"]["version"], env!("CARGO_PKG_VERSION"));
    let paths = doc["paths"].as_object().unwrap();
    let index = fg.admin_json("/").await;
    let mut listed = std::collections::BTreeSet::new();
    for e in index["endpoints"].as_array().unwrap() {
        let path = e["path"].as_str().unwrap();
        // "/v1/dedup?state=in_doubt[&route=R]…", "/v1/deliveries[?route=R]…"
        let path = path.split(['?', '[']).next().unwrap();
        let method = e["method"].as_str().unwrap().to_ascii_lowercase();
        assert!(
            paths.get(path).and_then(|p| p.get(&method)).is_some(),
            "{method} {path} is in the index but not in docs/openapi.json"
        );
        listed.insert(path.to_owned());
    }
    for (path, item) in paths {
        if item["get"]["tags"][0] == "proxy" {
            assert!(item["servers"].is_array(), "{path}: its own server");
            continue;
        }
        assert!(
            listed.contains(path),
            "{path} is described but not in the index"
        );
    }
    // Every operation that needs the admin token says so, and answers 401.
    for path in ["/v1/dedup", "/v1/deliveries"] {
        let op = &paths[path]["get"];
        assert_eq!(op["security"][0]["adminToken"], serde_json::json!([]));
        let r = send(get(fg.admin_url(path))).await;
        assert_eq!(r.status, 401, "{path}");
        assert!(op["responses"]["401"].is_object(), "{path}");
    }
}
