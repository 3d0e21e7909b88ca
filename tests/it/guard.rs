//! SPEC §10.1, the instance guard: one single instance per lease store and
//! prefix — also against garbage written into the guard's gate lease — and an
//! instance cut from the store aborts what is in flight at gate_ttl.

use std::time::{Duration, Instant};

use crate::support::gate::{forge_next, gates, next_renewal, single_config};
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
    let id = std::fs::read_to_string(
        data_dir(&fg)
            .join("state")
            .join(fencegate::cluster::guard::ID_FILE),
    )
    .unwrap();
    let (code, stderr) = serve_expecting_exit(&config(&s3, &origin));
    assert_eq!(code, Some(2), "{stderr}");
    let first_line = stderr
        .lines()
        .find(|l| !l.contains("config loaded"))
        .unwrap_or_default();
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

/// This instance's id, as kept in its data_dir.
fn instance_id(fg: &Fencegate) -> String {
    std::fs::read_to_string(state_dir(fg).join(fencegate::cluster::guard::ID_FILE))
        .unwrap()
        .trim()
        .to_owned()
}

/// Writes `id` as the instance id of a data_dir not yet used (a copied one).
fn copy_id(state: &std::path::Path, id: &str) {
    std::fs::create_dir_all(state).unwrap();
    std::fs::write(
        state.join(fencegate::cluster::guard::ID_FILE),
        format!("{id}\n"),
    )
    .unwrap();
}

/// `kill -CONT`: resumes a frozen process.
fn resume(fg: &Fencegate) {
    let ok = std::process::Command::new("kill")
        .args(["-CONT", &fg.pid().to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill -CONT {}", fg.pid());
}

/// What the resumed copy says, once (SPEC §10.1).
const SHARED_ID: &str = "two processes share instance id";

/// SPEC §10.1: a copied `instance-id` (a cloned volume or VM) is not the same
/// instance. A second process whose data_dir carries a copy of a live
/// instance's id exits 2 naming the holder — its own id, held by the other
/// process — and the first serves on. It used to take the guard back at once,
/// as a restart of the same process does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copied_instance_id_exits_2_while_its_original_lives() {
    skip_without_python!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let first = Fencegate::start(&config(&s3, &origin));
    let id = instance_id(&first);
    let (code, stderr) = serve_expecting_exit_prepared(&config(&s3, &origin), &[], |state| {
        copy_id(state, &id);
    });
    assert_eq!(code, Some(2), "{stderr}");
    let line = stderr
        .lines()
        .find(|l| !l.contains("config loaded"))
        .unwrap_or_default();
    let pid = format!("pid {} ", first.pid());
    assert!(
        line.contains(&id) && line.contains(&pid) && line.contains("until"),
        "names the holder, its process and when its lease ends: {line}"
    );
    assert!(line.contains("fresh data_dir"), "says what to do: {line}");
    // The first one still holds the guard and serves.
    let epochs = s3.epochs().await;
    let a = acquire(&epochs, LEASE, "worker-a", Duration::from_secs(30)).await;
    assert_eq!(
        post(&first, "/billing/x", &a, "still here").await.status,
        200
    );
    assert!(!first.stderr().contains(SHARED_ID), "{}", first.stderr());
}

/// SPEC §10.1: a copy of a frozen instance (its data_dir's `instance-id`
/// copied) takes the guard only after the frozen one's gate lease ends, like any
/// other instance; resumed, the frozen one finds its id in a gate epoch it did
/// not write, stops forwarding at once, says so in one line naming the other
/// process, and from then on waits for the guard like any contender. Keys sent
/// to both reach the destination at most once. (The two used to take the guard
/// from each other on every renewal, and both forwarded.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_instance_resumed_after_its_copy_took_over_stops_and_says_so() {
    skip_without_python!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let cfg = config(&s3, &origin);
    let a = Fencegate::start(&cfg);
    let id = instance_id(&a);
    let epochs = s3.epochs().await;
    let w = acquire(&epochs, LEASE, "worker-a", Duration::from_secs(120)).await;
    assert_eq!(post(&a, "/billing/x", &w, "a before").await.status, 200);
    freeze(a.pid());
    let frozen = Instant::now();
    // The copy: refused (exit 2, naming the frozen process) until the frozen
    // one's gate lease (3 s) and grace (500 ms) have passed.
    let mut b = Fencegate::unstarted("127.0.0.1:0", "", &cfg, &[]);
    copy_id(&state_dir(&b), &id);
    let a_pid = format!("pid {} ", a.pid());
    while let Err(stderr) = b.spawn(None) {
        assert!(
            stderr.contains(&a_pid),
            "names the frozen process: {stderr}"
        );
        assert!(frozen.elapsed() < Duration::from_secs(20), "never started");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        frozen.elapsed() >= Duration::from_secs(3),
        "the copy took the guard {:?} after the freeze, before the gate lease (3 s) ended",
        frozen.elapsed()
    );
    assert_eq!(post(&b, "/billing/x", &w, "b first").await.status, 200);

    resume(&a);
    let resumed = Instant::now();
    // Each key to both, until the resumed one has said it (and at least 6 keys).
    // `from_b[k]`: whether the copy answered 200 for key k.
    let (mut from_a, mut from_b) = (0, Vec::<bool>::new());
    while from_b.len() < 6 || !a.stderr().contains(SHARED_ID) {
        if resumed.elapsed() > Duration::from_secs(12) {
            break;
        }
        let key = format!("k{}", from_b.len());
        let payload = format!("key {key}");
        if send(keyed(&a, "/billing/x", &w, &key, &payload))
            .await
            .status
            == 200
        {
            from_a += 1;
        }
        from_b.push(
            send(keyed(&b, "/billing/x", &w, &key, &payload))
                .await
                .status
                == 200,
        );
    }
    let log = origin.log();
    for (k, by_b) in from_b.iter().enumerate() {
        let body = format!("key k{k}");
        let n = log.iter().filter(|x| x.body == body.as_bytes()).count();
        assert!(n <= 1, "key k{k} reached the destination {n} times");
        assert_eq!(
            n == 1,
            *by_b,
            "key k{k}: forwarded by the copy or not at all"
        );
    }
    assert_eq!(from_a, 0, "the resumed instance forwarded");
    assert!(from_b.iter().any(|ok| *ok), "the copy forwarded nothing");
    let said: Vec<String> = a
        .stderr()
        .lines()
        .filter(|l| l.contains(SHARED_ID))
        .map(str::to_owned)
        .collect();
    assert_eq!(said.len(), 1, "said once: {said:?}");
    let b_pid = format!("pid {} ", b.pid());
    assert!(
        said[0].contains("ERROR")
            && said[0].contains(&id)
            && said[0].contains(&b_pid)
            && said[0].contains("data_dir was copied; give one a fresh data_dir"),
        "{}",
        said[0]
    );
    // From then on it waits like any contender: the copy killed (its process
    // provably gone, which would let its own restart in at once), the resumed one
    // forwards again only once the copy's gate lease has ended.
    b.kill9();
    let killed = Instant::now();
    eventually("the resumed instance takes the guard again", || async {
        post(&a, "/billing/x", &w, "a again").await.status == 200
    })
    .await;
    assert!(
        killed.elapsed() >= Duration::from_secs(2),
        "took the guard back {:?} after the copy's kill: at once, not after its gate lease",
        killed.elapsed()
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
    // Refused while the release is not another instance's to believe (held,
    // gate_ttl after it), then for the state: never let in without the flag.
    let stopped = Instant::now();
    let stderr = loop {
        let (code, stderr) = serve_expecting_exit(&config(&s3, &origin));
        assert_eq!(code, Some(2), "{stderr}");
        if stderr.contains("--takeover-may-duplicate") {
            break stderr;
        }
        assert!(stopped.elapsed() < Duration::from_secs(15), "{stderr}");
    };
    let line = stderr
        .lines()
        .find(|l| !l.contains("config loaded"))
        .unwrap_or_default();
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

/// A graceful stop writes a release sealed with the instance's own key: the
/// same instance (its data_dir) starts again at once. Another instance cannot
/// tell that release from a forged one (SPEC §10: a release is final only to
/// its own set-up), so it waits gate_ttl after it — here 3 s plus grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_lets_the_same_instance_in_at_once_and_another_after_gate_ttl() {
    skip_without_python!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let mut first = Fencegate::start(&config(&s3, &origin));
    assert!(first.terminate().success());
    let stopped = Instant::now();
    first
        .spawn(None)
        .expect("the same instance starts again at once");
    assert!(
        stopped.elapsed() < Duration::from_secs(3),
        "the same instance waited {:?} (its own release lets it in at once)",
        stopped.elapsed()
    );
    assert!(first.terminate().success());
    let stopped = Instant::now();
    // Another data_dir (the operator accepts that its deliveries are elsewhere).
    let (code, stderr) =
        serve_expecting_exit_with(&config(&s3, &origin), &["--takeover-may-duplicate"]);
    assert_eq!(code, Some(2), "another instance waits gate_ttl: {stderr}");
    let _second = loop {
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
        assert!(stopped.elapsed() < Duration::from_secs(15), "never let in");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        stopped.elapsed() >= Duration::from_secs(3),
        "another instance was let in {:?} after the release, before gate_ttl",
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

/// SPEC §10.1 / §5 / §6: one unparsable object written as the next epoch of a
/// live single instance's guard (`.gate/0000/`) does not let a second single
/// instance with another data_dir start (the test ends there). Failed when gate
/// objects were believed rather than judged: the second started at once — no
/// `--takeover-may-duplicate`, no wait for the live holder's expiry — while the
/// first kept forwarding until its own self-fence deadline (it did not stop when
/// its renewal found the tenure lost). Both forwarded the same lease: an epoch
/// e+1 request reached the destination while an epoch e request was still in
/// flight there, and a key delivered by the first was delivered again by the
/// second; the test then fails on those, or at its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_garbage_gate_object_never_lets_a_second_single_instance_serve_beside_a_live_one() {
    skip_without_python!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let cfg = single_config(&s3, &origin);
    let a = Fencegate::start(&cfg);
    let epochs = s3.epochs().await;
    let w1 = acquire(&epochs, LEASE, "worker-1", Duration::from_secs(120)).await;
    assert_eq!(
        send(keyed(&a, "/billing/x", &w1, "charge-1", "charge one"))
            .await
            .status,
        200
    );
    // Garbage as the guard's next epoch.
    let g = gates(&s3).await;
    let forged = forge_next(&g, 0, |_| b"{not json".to_vec()).await;
    let t0 = Instant::now();
    eprintln!("forged gate epoch {forged}");
    // A second single instance, its own data_dir, no flag.
    let mut b = Fencegate::unstarted("127.0.0.1:0", "", &cfg, &[]);
    let started = b.spawn(None);
    eprintln!(
        "second instance start after {:?}: {:?}",
        t0.elapsed(),
        started.as_ref().map(|_| "listening").map_err(|e| e
            .lines()
            .next()
            .unwrap_or("")
            .to_owned())
    );
    if started.is_err() {
        return; // the guard held
    }
    // Both serve now? A request at epoch e through A, held at the destination...
    let held = spawn_post(&a, &w1, &[("x-test-hold", "a")], b"epoch e, via a".to_vec());
    origin
        .wait_until("a's request", |l| {
            l.iter().any(|x| x.body == b"epoch e, via a"[..])
        })
        .await;
    // ...and the next leader's request at e+1 through B.
    let w2 = force_next_epoch(&epochs, LEASE, "worker-2", Duration::from_secs(120)).await;
    let b_reply = post(&b, "/billing/x", &w2, "epoch e+1, via b").await;
    // The key A delivered, retried through B.
    let again = send(keyed(&b, "/billing/x", &w2, "charge-1", "charge one")).await;
    origin.release("a");
    let a_reply = held.await.unwrap();
    eprintln!(
        "a (e) -> {:?}; b (e+1) -> {}; charge-1 again via b -> {}; {:?} after the forge",
        a_reply.as_ref().map(|r| r.status),
        b_reply.status,
        again.status,
        t0.elapsed()
    );
    // How long A keeps forwarding after its tenure was lost to the garbage
    // object (its renewal, every 2 s, finds epoch `forged` taken).
    let w3 = force_next_epoch(&epochs, LEASE, "worker-3", Duration::from_secs(120)).await;
    let mut n = 0;
    let last_ok = loop {
        let r = post(&a, "/billing/x", &w3, &format!("a late {n}")).await;
        n += 1;
        if r.status != 200 || t0.elapsed() > Duration::from_secs(10) {
            eprintln!("a answered {} {:?} after the forge", r.status, t0.elapsed());
            break t0.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eprintln!(
        "a forwarded {} requests until {last_ok:?} after the forge",
        n - 1
    );
    let log = dump_arrivals(&origin, t0);
    let a_done = log
        .iter()
        .find(|x| x.body == b"epoch e, via a"[..])
        .unwrap()
        .completed;
    let b_arr = log
        .iter()
        .find(|x| x.body == b"epoch e+1, via b"[..])
        .map(|x| x.arrived);
    let charges = log.iter().filter(|x| x.body == b"charge one"[..]).count();
    assert!(
        b_arr.is_none() || a_done.is_some_and(|d| d <= b_arr.unwrap()),
        "SPEC §5: the epoch e+1 request arrived while the epoch e request was in flight"
    );
    assert!(charges <= 1, "SPEC §6: charge-1 delivered {charges} times");
    panic!("SPEC §10.1: a second single instance started beside a live one (garbage gate object)");
}

/// SPEC §10.1: a single instance whose guard cannot be renewed aborts a
/// request still in flight at gate_ttl after its last renewal (the destination
/// holds the request; the store is paused), not before its self-fence margin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_instance_cut_from_the_store_aborts_in_flight_at_gate_ttl() {
    skip_without_python!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let fg = Fencegate::start(&single_config(&s3, &origin));
    let epochs = s3.epochs().await;
    let w1 = acquire(&epochs, LEASE, "worker-1", Duration::from_secs(120)).await;
    let g = gates(&s3).await;
    next_renewal(&g, 0).await;
    let renewed = Instant::now();
    let a = held_a(&fg, &origin, &w1, "a: held").await;
    s3.pause();
    let r = a.await.unwrap();
    let at = renewed.elapsed();
    s3.resume();
    eprintln!(
        "a -> {:?} {:?} after the last renewal (gate_ttl 6 s)",
        r.as_ref().map(|r| (r.status, r.error_code())),
        at
    );
    assert!(
        at <= Duration::from_millis(6500),
        "aborted {at:?} after the last renewal, gate_ttl is 6 s"
    );
    assert!(at >= Duration::from_millis(5000), "aborted early: {at:?}");
}

/// SPEC §10.1 ("refuses (exit 2) to take the guard over from an instance
/// whose state differs unless started with --takeover-may-duplicate") / §6. A
/// (sled) delivered charge-1 and was killed; B (another data_dir, no flag) is
/// refused, and still refused after 33 garbage objects are written over A's
/// guard (the test ends there). Failed when the guard's start-up checks read
/// the latest gate object that parsed, walking back at most 32 epochs: 33
/// garbage objects left nothing to check, the state check was skipped, B
/// started and charge-1's retry was delivered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_three_garbage_objects_never_skip_the_guards_state_check() {
    skip_without_python!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let cfg = single_config(&s3, &origin);
    let mut a = Fencegate::start(&cfg);
    let epochs = s3.epochs().await;
    let w1 = acquire(&epochs, LEASE, "worker-1", Duration::from_secs(300)).await;
    let r = send(keyed(&a, "/billing/x", &w1, "charge-1", "charge one")).await;
    assert_eq!(r.status, 200);
    a.kill9();
    // A's guard (gate_ttl 6 s) expires; + LastModified resolution + grace.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let mut b = Fencegate::unstarted("127.0.0.1:0", "", &cfg, &[]);
    let control = b.spawn(None);
    let refused = control
        .as_ref()
        .err()
        .is_some_and(|e| e.contains("--takeover-may-duplicate"));
    eprintln!("control (no garbage): refused with the state check: {refused}");
    assert!(refused, "control: B should be refused: {control:?}");
    let g = gates(&s3).await;
    for _ in 0..33 {
        forge_next(&g, 0, |_| b"garbage".to_vec()).await;
    }
    // The last garbage object frees after gate_ttl (6 s) + 1 s + grace.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let started = b.spawn(None);
    eprintln!(
        "B after 33 garbage objects: {:?}",
        started.as_ref().map(|_| "listening").map_err(|e| e
            .lines()
            .last()
            .unwrap_or("")
            .to_owned())
    );
    if started.is_err() {
        return; // held
    }
    let w2 = force_next_epoch(&epochs, LEASE, "worker-2", Duration::from_secs(300)).await;
    let again = send(keyed(&b, "/billing/x", &w2, "charge-1", "charge one")).await;
    let n = origin
        .log()
        .iter()
        .filter(|x| x.body == b"charge one"[..])
        .count();
    eprintln!(
        "charge-1 retried via B -> {} (replayed: {:?}); delivered {n} times",
        again.status,
        again.headers.get("x-fencegate-replayed")
    );
    assert!(n <= 1, "SPEC §6: charge-1 delivered {n} times");
    panic!("SPEC §10.1: B took the guard from an instance with other state, without the flag");
}
