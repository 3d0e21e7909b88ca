//! A second skeptical review (after f32e619, "gate objects are judged, not
//! believed"): attempts to break SPEC §5, §6 and §10 at the destination
//! through the new rules — proven releases, the MAC's binding, gate_ttl,
//! `shards_in_use` and `last_record`. Each test asserts the SPEC rule; the
//! ones named `f*` failed on 6841ca9.

use std::time::{Duration, Instant};

use fencegate::epoch::{object_key, Epoch, EpochRecord, LeaseName};

use crate::review::{
    dump, forge_next, gates, member_config, next_renewal, serves, single_config, start_member,
    PEER_TOKEN,
};
use crate::support::*;

const LEASE: &str = "billing";

/// SPEC §5's check at the destination: for requests x, y of one lease with
/// epoch(x) < epoch(y), x was complete before y arrived. The violations.
fn order_violations(log: &[Arrival]) -> Vec<String> {
    let mut out = Vec::new();
    for x in log {
        for y in log {
            if let (Some(ex), Some(ey)) = (x.epoch(), y.epoch()) {
                if ex < ey && x.completed.is_none_or(|c| c > y.arrived) {
                    out.push(format!(
                        "{:?} (epoch {ex}) not complete when {:?} (epoch {ey}) arrived",
                        String::from_utf8_lossy(&x.body),
                        String::from_utf8_lossy(&y.body)
                    ));
                }
            }
        }
    }
    out
}

async fn wait_serves(fg: &Fencegate, shard: u32, limit: Duration) -> Option<Duration> {
    let t = Instant::now();
    while !serves(fg, shard).await {
        if t.elapsed() > limit {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Some(t.elapsed())
}

/// Two members of a 1-shard cluster, fg-a owning shard 0, fg-b watching; a
/// worker tenure; an epoch-e request held at the destination via fg-a, sent
/// right after fg-a's renewal.
struct TwoMembers {
    _s3: S3Server,
    origin: Origin,
    m1: Fencegate,
    m2: Fencegate,
    epochs: fencegate::lease::Epochs,
    w1: fencegate::lease::acquire::Holding,
    g: fencegate::lease::Epochs,
    a: tokio::task::JoinHandle<Result<Reply, String>>,
}

async fn two_members(gate_a: (&str, &str), gate_b: (&str, &str)) -> TwoMembers {
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let (_db_name, db) = crate::support::postgres::PgServer::shared().new_database();
    let m1 = start_member(&s3, &db, &origin, "fg-a", 1, gate_a);
    eventually("fg-a serves shard 0", || serves(&m1, 0)).await;
    let m2 = start_member(&s3, &db, &origin, "fg-b", 1, gate_b);
    eventually("fg-b knows fg-a owns shard 0", || async {
        m2.admin_json("/v1/cluster").await["shard_map"][0]["owner"] == "fg-a"
    })
    .await;
    let epochs = s3.epochs().await;
    let w1 = acquire(&epochs, LEASE, "worker-1", Duration::from_secs(300)).await;
    let g = gates(&s3).await;
    let renewed = next_renewal(&g, 0).await;
    eprintln!("fg-a renewed shard 0 at gate epoch {renewed}");
    let a = spawn_post(
        &m1,
        &w1,
        &[("x-test-hold", "a")],
        b"a: epoch e via fg-a".to_vec(),
    );
    origin
        .wait_until("a", |l| l.iter().any(|x| x.body.starts_with(b"a:")))
        .await;
    TwoMembers {
        _s3: s3,
        origin,
        m1,
        m2,
        epochs,
        w1,
        g,
        a,
    }
}

/// After a forge at `t0`: waits for fg-b to serve shard 0, sends e+1 through
/// fg-b and then e again through fg-a (the stale leader), releases the held
/// request and checks SPEC §5 at the destination.
async fn finish_two_members(t: TwoMembers, t0: Instant, limit: Duration) {
    let taken = wait_serves(&t.m2, 0, limit).await;
    eprintln!(
        "fg-b serves shard 0: {taken:?} after the forge; fg-a still serves: {}",
        serves(&t.m1, 0).await
    );
    let Some(_) = taken else {
        t.origin.release("a");
        return; // held: fg-b did not take the shard early
    };
    let w2 = force_next_epoch(&t.epochs, LEASE, "worker-2", Duration::from_secs(300)).await;
    let b = post(&t.m2, "/billing/x", &w2, "b: epoch e+1 via fg-b").await;
    eprintln!("b -> {} at {:?}", b.status, t0.elapsed());
    let late = post(&t.m1, "/billing/x", &t.w1, "a2: epoch e via fg-a, after b").await;
    eprintln!("a2 -> {} at {:?}", late.status, t0.elapsed());
    t.origin.release("a");
    let a = t.a.await.unwrap();
    eprintln!(
        "a -> {:?} at {:?}",
        a.as_ref().map(|r| (r.status, r.error_code())),
        t0.elapsed()
    );
    let log = dump(&t.origin, t0);
    let v = order_violations(&log);
    assert!(v.is_empty(), "SPEC §5 broken at the destination: {v:#?}");
}

/// F1 — SPEC §10 ("a release whose released_token hashes to the released
/// epoch's token_sha256 is final") / §5. The proof proves only that the
/// release's writer knew the token of the acquire just before it — and that
/// acquire may be the attacker's own. Anyone who can write under `.gate/`
/// writes, over a healthy member's live gate epoch N, an unsealed acquire
/// N+1 with a token of its choosing and then a release N+2 carrying that
/// token: "proven", so final at once. fg-b takes the shard, settles (1 s) and
/// forwards epoch e+1 while fg-a — which learns at its next renewal,
/// gate_ttl/3 = 10 s later — still has epoch e in flight, and forwards a
/// stale leader's epoch e after e+1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f1_attackers_own_acquire_and_its_proven_release_free_a_live_members_shard_at_once() {
    skip_without_python!();
    if !crate::support::postgres::available_or_skip() {
        return;
    }
    let t = two_members(("30s", "2s"), ("30s", "2s")).await;
    let name = LeaseName::parse("0000").unwrap();
    let tok = "a token the attacker chose";
    let acq = forge_next(&t.g, 0, |e| {
        EpochRecord::acquire(
            &name,
            Epoch::new(e),
            "fg-nobody",
            tok.as_bytes(),
            Duration::from_secs(1),
        )
        .to_json()
    })
    .await;
    let rel = forge_next(&t.g, 0, |e| {
        // (The design this attacked let a release carrying the released
        // epoch's token end a tenure at once; releases are now final only
        // when sealed by their own set-up.)
        EpochRecord::release(&name, Epoch::new(e), "fg-nobody").to_json()
    })
    .await;
    let t0 = Instant::now();
    eprintln!("forged acquire at gate epoch {acq}, its proven release at {rel}");
    assert_eq!(rel, acq + 1);
    finish_two_members(t, t0, Duration::from_secs(25)).await;
}

/// F2 — SPEC §10: an untrusted object (garbage) frees a gate lease
/// "no sooner than gate_ttl after its LastModified" — the READER's gate_ttl.
/// The tenure it cut short was written with the holder's gate_ttl (ttl_ms
/// 60 s, renewed every 20 s), and the holder learns of the loss only at that
/// renewal. Members with different gate_ttl (nothing in the config or the
/// SPEC forbids it; a rolling config change makes it routine): garbage over
/// fg-a's (60 s) epoch lets fg-b (3 s) in after ~4.5 s, while fg-a keeps
/// forwarding until ~20 s. With ownership rows (issue 28) the same mistake
/// let fg-b take fg-a's row after its own 3 s + grace; the owner now writes
/// its `gate_ttl` in the row and a contender waits the longer of the two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f2_garbage_frees_after_the_readers_shorter_gate_ttl_while_the_holder_still_forwards() {
    skip_without_python!();
    if !crate::support::postgres::available_or_skip() {
        return;
    }
    let t = two_members(("60s", "2s"), ("3s", "1s")).await;
    let forged = forge_next(&t.g, 0, |_| b"garbage".to_vec()).await;
    let t0 = Instant::now();
    eprintln!("garbage at gate epoch {forged}");
    finish_two_members(t, t0, Duration::from_secs(15)).await;
}

/// F3 — SPEC §10.1 ("refuses (exit 2) to take the guard over from an
/// instance whose state differs unless started with
/// --takeover-may-duplicate") / §6. The guard's start-up checks read the
/// latest gate object that parses, walking back at most 32 epochs; 33
/// garbage objects leave nothing to check, and the state check is skipped.
/// A (sled) delivered charge-1 and was killed; B (another data_dir, no flag)
/// is refused — until 33 garbage objects are written, then it starts and
/// charge-1's retry is delivered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f3_33_garbage_objects_skip_the_guards_state_check() {
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

/// F4 — SPEC §10 ("which shards a set-up has used is read from the store")
/// vs SPEC §2 ("fencegate never depends on old epoch objects existing; only
/// the latest one must never be deleted"). Found when every shard had its own
/// gate objects: a lifecycle rule deleting shard 1's epoch 1 hid fg-b's live
/// shard from a single instance that took shard 0. Since issue 28 a cluster's
/// only gate lease is the anchor on shard 0, which any member keeps: here its
/// old epoch 1 is deleted (as a lifecycle rule would) once a newer anchor
/// exists, fg-a (shard 0's owner) stops, and a single instance started with
/// `--takeover-may-duplicate` must still be refused while fg-b serves shard 1.
/// (The flag accepts repeated deliveries of the old instance's keys, not two
/// set-ups forwarding at once.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f4_a_deleted_first_epoch_hides_a_live_shard_from_a_single_instance() {
    skip_without_python!();
    if !crate::support::postgres::available_or_skip() {
        return;
    }
    f4_run(true).await;
}

/// F4's control: without the deletion, the single instance finds the live
/// anchor and exits 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f4_control_with_every_first_epoch_the_single_instance_is_refused() {
    skip_without_python!();
    if !crate::support::postgres::available_or_skip() {
        return;
    }
    f4_run(false).await;
}

async fn f4_run(delete: bool) {
    assert_eq!(
        fencegate::cluster::shard_of(&LeaseName::parse(LEASE).unwrap(), 2),
        1
    );
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let (_db_name, db) = crate::support::postgres::PgServer::shared().new_database();
    let gate = ("30s", "2s");
    let mut m1 = start_member(&s3, &db, &origin, "fg-a", 2, gate);
    eventually("fg-a serves shard 0", || serves(&m1, 0)).await;
    let m2 = start_member(&s3, &db, &origin, "fg-b", 2, gate);
    let t = Instant::now();
    while !(serves(&m1, 0).await && serves(&m2, 1).await) {
        assert!(t.elapsed() < Duration::from_secs(60), "did not balance");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("fg-a serves shard 0, fg-b shard 1 after {:?}", t.elapsed());
    let g = gates(&s3).await;
    if delete {
        // Only an old anchor may go: wait for the next one.
        let latest = next_renewal(&g, 0).await;
        let first = object_key(
            g.prefix(),
            &LeaseName::parse("0000").unwrap(),
            Epoch::new(1),
        );
        g.store().delete(&first).await.unwrap();
        eprintln!("deleted {first} (an old epoch object, as a lifecycle rule would); the anchor is at {latest}");
    }
    let epochs = s3.epochs().await;
    let w1 = acquire(&epochs, LEASE, "worker-1", Duration::from_secs(300)).await;
    let a = spawn_post(
        &m2,
        &w1,
        &[("x-test-hold", "a")],
        b"a: epoch e via fg-b".to_vec(),
    );
    origin
        .wait_until("a", |l| l.iter().any(|x| x.body.starts_with(b"a:")))
        .await;
    let t0 = Instant::now();
    m1.terminate();
    let mut single = Fencegate::unstarted_with_args(
        "127.0.0.1:0",
        "",
        &single_config(&s3, &origin),
        &[],
        &["--takeover-may-duplicate"],
    );
    let started = single.spawn(None);
    eprintln!(
        "single instance: {:?} at {:?}",
        started.as_ref().map(|_| "listening").map_err(|e| e
            .lines()
            .last()
            .unwrap_or("")
            .to_owned()),
        t0.elapsed()
    );
    if started.is_err() {
        // Refused: the cluster's live anchor was found (held), with or
        // without its first epoch.
        origin.release("a");
        return;
    }
    let w2 = force_next_epoch(&epochs, LEASE, "worker-2", Duration::from_secs(300)).await;
    let b = post(
        &single,
        "/billing/x",
        &w2,
        "b: epoch e+1 via the single instance",
    )
    .await;
    eprintln!(
        "b -> {} at {:?}; fg-b still serves shard 1: {}",
        b.status,
        t0.elapsed(),
        serves(&m2, 1).await
    );
    let late = post(&m2, "/billing/x", &w1, "a2: epoch e via fg-b, after b").await;
    eprintln!("a2 -> {} at {:?}", late.status, t0.elapsed());
    origin.release("a");
    let a = a.await.unwrap();
    eprintln!("a -> {:?}", a.as_ref().map(|r| (r.status, r.error_code())));
    let log = dump(&origin, t0);
    let v = order_violations(&log);
    assert!(v.is_empty(), "SPEC §5 broken at the destination: {v:#?}");
    panic!("SPEC §10: a single instance serves beside a live cluster member");
}

/// F5 — SPEC §10 (a member's sealed object "is believed"; "a cluster serves no
/// shard until shard 0's latest gate object is its own set-up's"). The MAC
/// covers the object's own `lease` and `epoch` fields but the verdict never
/// checks them against the key, and nothing binds it to the prefix: a sealed
/// object copied from another prefix's history (a staging cluster with the
/// same peer token) — or from this one's — at another epoch is judged
/// `Ours`. Copied over a live single instance's guard, it hides the single
/// instance from a cluster member's start-up check (no conflict), anchors the
/// prefix, and the member serves shard 1 at once while the single instance
/// forwards the same lease until its next renewal (gate_ttl/3 = 10 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f5_a_sealed_object_replayed_from_another_prefix_anchors_a_cluster_beside_a_live_single_instance(
) {
    skip_without_python!();
    if !crate::support::postgres::available_or_skip() {
        return;
    }
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let pg = crate::support::postgres::PgServer::shared();
    let (_d1, staging_db) = pg.new_database();
    let (_d2, db) = pg.new_database();
    let gate = ("30s", "2s");
    // A staging cluster on another prefix, same peer token.
    let port = crate::review::free_port();
    let staging_cfg = member_config(&s3, &staging_db, &origin, "fg-x", port, 2, gate, PEER_TOKEN)
        .replace("prefix = \"fencegate/\"", "prefix = \"staging/\"");
    assert!(staging_cfg.contains("prefix = \"staging/\""));
    let mut x = Fencegate::start_listening(&format!("127.0.0.1:{port}"), "", &staging_cfg, &[]);
    eventually("fg-x serves staging shard 0", || serves(&x, 0)).await;
    let store = s3.store().await;
    let sealed = store
        .get(&object_key(
            "staging/.gate/",
            &LeaseName::parse("0000").unwrap(),
            Epoch::new(1),
        ))
        .await
        .unwrap()
        .unwrap()
        .body;
    x.kill9();
    eprintln!(
        "sealed staging object: {}",
        String::from_utf8_lossy(&sealed)
    );
    // Production: a single instance (gate_ttl 30 s, renewed every 10 s).
    let single_cfg = single_config(&s3, &origin)
        .replace("gate_ttl = \"6s\"", "gate_ttl = \"30s\"")
        .replace("self_fence_margin = \"1s\"", "self_fence_margin = \"2s\"");
    let single = Fencegate::start(&single_cfg);
    let epochs = s3.epochs().await;
    let w1 = acquire(&epochs, LEASE, "worker-1", Duration::from_secs(300)).await;
    let g = gates(&s3).await;
    next_renewal(&g, 0).await;
    let a = spawn_post(
        &single,
        &w1,
        &[("x-test-hold", "a")],
        b"a: epoch e via the single instance".to_vec(),
    );
    origin
        .wait_until("a", |l| l.iter().any(|x| x.body.starts_with(b"a:")))
        .await;
    let copied = forge_next(&g, 0, |_| sealed.to_vec()).await;
    let t0 = Instant::now();
    eprintln!("copied it as production gate epoch {copied}");
    // A cluster member (2 shards; billing is shard 1) starts on production.
    let port = crate::review::free_port();
    let mut m = Fencegate::unstarted(
        &format!("127.0.0.1:{port}"),
        "",
        &member_config(&s3, &db, &origin, "fg-b", port, 2, gate, PEER_TOKEN),
        &[],
    );
    let started = m.spawn(None);
    eprintln!(
        "cluster member: {:?} at {:?}",
        started.as_ref().map(|_| "listening").map_err(|e| e
            .lines()
            .last()
            .unwrap_or("")
            .to_owned()),
        t0.elapsed()
    );
    if started.is_err() {
        origin.release("a");
        return; // held
    }
    let served = wait_serves(&m, 1, Duration::from_secs(8)).await;
    eprintln!("fg-b serves shard 1: {served:?}");
    if served.is_none() {
        origin.release("a");
        return;
    }
    let w2 = force_next_epoch(&epochs, LEASE, "worker-2", Duration::from_secs(300)).await;
    let b = post(&m, "/billing/x", &w2, "b: epoch e+1 via fg-b").await;
    eprintln!("b -> {} at {:?}", b.status, t0.elapsed());
    let late = post(
        &single,
        "/billing/x",
        &w1,
        "a2: epoch e via the single instance, after b",
    )
    .await;
    eprintln!("a2 -> {} at {:?}", late.status, t0.elapsed());
    origin.release("a");
    let a = a.await.unwrap();
    eprintln!("a -> {:?}", a.as_ref().map(|r| (r.status, r.error_code())));
    let log = dump(&origin, t0);
    let v = order_violations(&log);
    assert!(v.is_empty(), "SPEC §5 broken at the destination: {v:#?}");
    panic!("SPEC §10: a cluster member serves beside a live single instance");
}

/// H2 (held in the runs here) — SPEC §10: a single instance stops
/// gracefully (a proven release), then a cluster member and another single
/// instance start at the same moment. At most one of them may serve; the
/// destination gets a request through each, e+1 through the second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_proven_release_then_a_cluster_and_a_single_start_at_once() {
    skip_without_python!();
    if !crate::support::postgres::available_or_skip() {
        return;
    }
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let (_db_name, db) = crate::support::postgres::PgServer::shared().new_database();
    let mut a = Fencegate::start(&single_config(&s3, &origin));
    a.terminate();
    let port = crate::review::free_port();
    let mut m = Fencegate::unstarted(
        &format!("127.0.0.1:{port}"),
        "",
        &member_config(&s3, &db, &origin, "fg-b", port, 1, ("6s", "1s"), PEER_TOKEN),
        &[],
    );
    let mut s = Fencegate::unstarted_with_args(
        "127.0.0.1:0",
        "",
        &single_config(&s3, &origin),
        &[],
        &["--takeover-may-duplicate"],
    );
    let (rm, rs) = std::thread::scope(|sc| {
        let hm = sc.spawn(|| {
            m.spawn(None)
                .map_err(|e| e.lines().last().unwrap_or("").to_owned())
        });
        let hs = sc.spawn(|| {
            s.spawn(None)
                .map_err(|e| e.lines().last().unwrap_or("").to_owned())
        });
        (hm.join().unwrap(), hs.join().unwrap())
    });
    eprintln!("cluster member: {rm:?}; single: {rs:?}");
    tokio::time::sleep(Duration::from_secs(4)).await;
    let epochs = s3.epochs().await;
    let w1 = acquire(&epochs, LEASE, "worker-1", Duration::from_secs(300)).await;
    let w2 = force_next_epoch(&epochs, LEASE, "worker-2", Duration::from_secs(300)).await;
    let mut served = Vec::new();
    if rm.is_ok() {
        let r = post(&m, "/billing/x", &w1, "via the cluster").await;
        eprintln!("cluster -> {} {:?}", r.status, r.error_code());
        served.push(("cluster", r.status == 200));
    }
    if rs.is_ok() {
        let r = post(&s, "/billing/x", &w2, "via the single").await;
        eprintln!("single -> {} {:?}", r.status, r.error_code());
        served.push(("single", r.status == 200));
    }
    dump(&origin, Instant::now());
    assert!(
        served.iter().filter(|(_, ok)| *ok).count() <= 1,
        "SPEC §10: both set-ups forwarded: {served:?}"
    );
}

/// An upgrade across issue 28 done one instance at a time: a member of the
/// older build still holds shard 1 through a gate lease of its own in the
/// store (this build keeps none but the anchor, and would own the shard's row
/// at the same time). The newer member refuses to start (exit 2) and says to
/// stop the older instances first; once the older gate lease has ended, it
/// starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_builds_live_shard_gate_lease_refuses_start_up() {
    skip_without_python!();
    if !crate::support::postgres::available_or_skip() {
        return;
    }
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let (_db_name, db) = crate::support::postgres::PgServer::shared().new_database();
    // What an older member wrote when it took shard 1 of 2: a sealed acquire.
    let g = gates(&s3).await;
    let shard1 = LeaseName::parse("0001").unwrap();
    let mut rec = EpochRecord::acquire(
        &shard1,
        Epoch::new(1),
        "fg-old",
        b"old token",
        Duration::from_secs(6),
    );
    rec.advertise = Some("http://127.0.0.1:9".into());
    rec.mode = Some("cluster".into());
    rec.shards = Some(2);
    fencegate::set_up::GateKey::from_peer_token(PEER_TOKEN, g.prefix()).seal(&mut rec);
    let created = g
        .store()
        .create_if_absent(
            &object_key(g.prefix(), &shard1, Epoch::new(1)),
            serde_json::to_vec(&rec).unwrap().into(),
        )
        .await
        .unwrap();
    assert_eq!(created, fencegate::lease::CreateOutcome::Created);
    let port = crate::review::free_port();
    let cfg = member_config(
        &s3,
        &db,
        &origin,
        "fg-new",
        port,
        2,
        ("6s", "1s"),
        PEER_TOKEN,
    );
    let mut m = Fencegate::unstarted(&format!("127.0.0.1:{port}"), "", &cfg, &[]);
    let err = m
        .spawn(None)
        .expect_err("started beside an older build's live gate lease");
    assert_eq!(m.last_exit.and_then(|s| s.code()), Some(2), "{err}");
    assert!(
        err.contains("\"fg-old\"") && err.contains("older") && err.contains("stop every instance"),
        "{err}"
    );
    // The older instance is gone: its lease ends (6 s + grace after its create).
    let mut started = false;
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(30) {
        let mut m = Fencegate::unstarted(&format!("127.0.0.1:{port}"), "", &cfg, &[]);
        if m.spawn(None).is_ok() {
            eventually("fg-new serves both shards", || async {
                serves(&m, 0).await && serves(&m, 1).await
            })
            .await;
            started = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(started, "did not start once the older gate lease ended");
}
