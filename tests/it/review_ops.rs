//! Review of issue 30 (traces, shutdown delay): each test is a finding that
//! failed on the reviewed code and holds since its fix.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use http::HeaderValue;

use crate::support::otlp::Receiver;
use crate::support::*;

/// A worker's `tracestate` with a byte outside ASCII (obs-text: hyper accepts
/// it) is copied into the exported span's `trace_state`, a protobuf `string`:
/// not UTF-8, so the collector refuses the whole export request and every
/// other request's spans in that batch are lost (one worker poisons everyone's
/// traces). The same bytes are also passed on to the destination unchecked.
/// Expected: an invalid `tracestate` is dropped (W3C: a vendor that cannot
/// parse it does not propagate it), the other request's spans arrive.
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

/// Whether `pid` has a handler installed for SIGTERM (`SigCgt` in /proc).
fn catches_sigterm(pid: u32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigCgt:"))
        .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
        .is_some_and(|m| m & (1 << (15 - 1)) != 0)
}

/// SIGTERM twice while start-up waits on a store that does not answer: the
/// handlers are installed before `build`, but nothing reads them until `run`,
/// and the two signals coalesce into one. So once the store answers fencegate
/// goes on: binds, prints its ready line and serves the whole shutdown delay
/// (here 60 s) — a second signal "exits at once" everywhere but in start-up,
/// and a pod killed while starting is held until SIGKILL. Expected: no ready
/// line; the process exits without listening.
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
