//! SPEC §10.1, the instance guard: one single instance per lease store and prefix.

use std::time::{Duration, Instant};

use crate::support::*;

const LEASE: &str = "billing";

/// `[store]` with a short gate lease (renewed every second) and the route.
fn config(s3: &S3Server, origin: &Origin) -> String {
    format!(
        "{}gate_ttl = \"3s\"\nself_fence_margin = \"1s\"\n{}",
        s3.store_toml(200)
            .replace("timeout_ms = 1500", "timeout_ms = 1000"),
        route_toml("billing", LEASE, origin, "")
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_instance_on_the_same_store_exits_2_naming_the_holder() {
    skip_without_python!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let fg = Fencegate::start(&config(&s3, &origin));
    let id = std::fs::read_to_string(data_dir(&fg).join("state").join(fencegate::guard::ID_FILE))
        .unwrap();
    let (code, stderr) = serve_expecting_exit(&config(&s3, &origin));
    assert_eq!(code, Some(2), "{stderr}");
    let first_line = stderr.lines().next().unwrap_or_default();
    assert!(
        first_line.contains(id.trim()) && first_line.contains("until"),
        "names the holder and when its lease ends: {first_line}"
    );
    // The first one still serves.
    let epochs = s3.epochs().await;
    let a = acquire(&epochs, LEASE, "worker-a", Duration::from_secs(30)).await;
    assert_eq!(post(&fg, "/billing/x", &a, "still here").await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_instance_takes_its_guard_back_at_once_after_kill_9() {
    skip_without_python!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let mut fg = Fencegate::start(&config(&s3, &origin));
    let started = Instant::now();
    fg.restart(); // kill -9, same data_dir (same instance id)
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "did not wait for its own gate lease to expire: {:?}",
        started.elapsed()
    );
    let epochs = s3.epochs().await;
    let a = acquire(&epochs, LEASE, "worker-a", Duration::from_secs(30)).await;
    assert_eq!(
        post(&fg, "/billing/x", &a, "after restart").await.status,
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_instance_takes_over_only_after_expiry_plus_grace_and_says_so() {
    skip_without_python!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let mut first = Fencegate::start(&config(&s3, &origin));
    first.kill9();
    let killed = Instant::now();
    // Refused while the dead instance's gate lease (3 s) plus grace (500 ms) runs.
    let (code, _) = serve_expecting_exit(&config(&s3, &origin));
    assert_eq!(code, Some(2));
    let mut second = loop {
        let attempt = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Fencegate::start_with_args(
                "127.0.0.1:0",
                "",
                &config(&s3, &origin),
                &[],
                &["--takeover-may-duplicate"],
            )
        }));
        if let Ok(fg) = attempt {
            break fg;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(15),
            "never taken over"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        killed.elapsed() >= Duration::from_millis(3000),
        "taken over {:?} after the kill, before the gate lease (3 s) ended",
        killed.elapsed()
    );
    assert!(
        second.stderr().contains("forwarded again"),
        "says loudly that the old instance's records are elsewhere: {}",
        second.stderr()
    );
    second.kill9();
}

/// SPEC §10.1 (issue 25, point 2): a single instance whose marks and dedup
/// records are elsewhere (another data_dir) never takes the guard over without
/// the operator's word, even once the old instance's gate lease has ended: the
/// retry of a key the old one delivered would be delivered again. With
/// `--takeover-may-duplicate` it does, and says so. Failed when any instance
/// took over after expiry + grace with only a warning: `charge-42` reached the
/// destination twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_with_other_state_takes_over_only_when_told_duplicates_may_follow() {
    skip_without_python!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let mut first = Fencegate::start(&config(&s3, &origin));
    let epochs = s3.epochs().await;
    let a = acquire(&epochs, LEASE, "worker-a", Duration::from_secs(60)).await;
    let charge = || keyed(&first, "/billing/x", &a, "charge-42", "charge");
    assert_eq!(send(charge()).await.status, 200);
    assert!(first.terminate().success());
    let (code, stderr) = serve_expecting_exit(&config(&s3, &origin));
    assert_eq!(code, Some(2), "{stderr}");
    let line = stderr.lines().next().unwrap_or_default();
    assert!(
        line.contains("--takeover-may-duplicate") && line.contains("sled:"),
        "names where each keeps its deliveries and the flag: {line}"
    );
    assert_eq!(origin.log().len(), 1, "nothing was forwarded again");
    let second = Fencegate::start_with_args(
        "127.0.0.1:0",
        "",
        &config(&s3, &origin),
        &[],
        &["--takeover-may-duplicate"],
    );
    assert!(
        second.stderr().contains("forwarded again"),
        "{}",
        second.stderr()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_that_cannot_renew_stops_forwarding_and_resumes_later() {
    skip_without_python!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let fg = Fencegate::start(&config(&s3, &origin));
    let epochs = s3.epochs().await;
    let a = acquire(&epochs, LEASE, "worker-a", Duration::from_secs(60)).await;
    assert_eq!(post(&fg, "/billing/x", &a, "before").await.status, 200);
    // The store stops answering: no renewal. Within gate_ttl − margin (2 s) of
    // the last renewal, forwarding stops — the cached epoch is still valid.
    s3.pause();
    let paused = Instant::now();
    let mut forwarded_during = 0;
    let refused = loop {
        // Each a new request (a repeat would be a replay, which forwards nothing).
        let r = post(&fg, "/billing/x", &a, &format!("during {forwarded_during}")).await;
        if r.status == 200 {
            forwarded_during += 1;
        } else {
            r.assert_error(503, "shard_unavailable");
            assert!(r.headers.contains_key("retry-after"));
            break paused.elapsed();
        }
        assert!(
            paused.elapsed() < Duration::from_secs(10),
            "never stopped forwarding"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!("refused {refused:?} after the store stopped answering");
    // Refused requests never reached the destination, and nothing arrived there
    // later than gate_ttl − margin (2 s) after the pause (the last renewal came
    // before it). A request may wait out a store read (timeout 1 s) before its
    // refusal, so the refusal's own time is not the measure.
    let during: Vec<Instant> = origin
        .log()
        .iter()
        .filter(|a| a.body.starts_with(b"during"))
        .map(|a| a.arrived)
        .collect();
    assert_eq!(during.len(), forwarded_during);
    if let Some(last) = during.iter().max() {
        let after = last.saturating_duration_since(paused);
        assert!(
            after <= Duration::from_millis(2500),
            "forwarded {after:?} after the store stopped answering"
        );
    }
    s3.resume();
    eventually(
        "forwarding resumes once the guard is held again",
        || async { post(&fg, "/billing/x", &a, "after").await.status == 200 },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_releases_the_guard_for_a_successor_at_once() {
    skip_without_python!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let mut first = Fencegate::start(&config(&s3, &origin));
    assert!(first.terminate().success());
    let stopped = Instant::now();
    // Another data_dir: the operator accepts that its deliveries are elsewhere.
    let _second = Fencegate::start_with_args(
        "127.0.0.1:0",
        "",
        &config(&s3, &origin),
        &[],
        &["--takeover-may-duplicate"],
    );
    assert!(
        stopped.elapsed() < Duration::from_secs(3),
        "the successor waited {:?} (a release should let it in at once)",
        stopped.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_instance_refuses_a_prefix_a_cluster_uses() {
    skip_without_python!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    // A live gate object of a 16-shard cluster under the prefix.
    let store = s3.store().await;
    let lease = fencegate::epoch::LeaseName::parse("0000").unwrap();
    let mut rec = fencegate::epoch::EpochRecord::acquire(
        &lease,
        fencegate::epoch::Epoch::new(1),
        "fg-cluster-a",
        b"token",
        Duration::from_secs(60),
    );
    rec.mode = Some("cluster".into());
    rec.shards = Some(16);
    rec.advertise = Some("http://10.0.0.1:8080".into());
    let key = fencegate::epoch::object_key(
        &format!("{PREFIX}.gate/"),
        &lease,
        fencegate::epoch::Epoch::new(1),
    );
    store
        .create_if_absent(&key, bytes::Bytes::from(rec.to_json()))
        .await
        .unwrap();
    let (code, stderr) = serve_expecting_exit(&config(&s3, &origin));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("cluster") && stderr.contains("16"),
        "{stderr}"
    );
}
