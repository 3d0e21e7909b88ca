//! SPEC §10: gate objects written by someone else — forged, garbage, replayed
//! from another prefix, or an older build's — are judged, not believed: none
//! lets a second owner, or a single instance, forward beside a live one, and a
//! release is final only when sealed by its own set-up. Each test asserts what
//! the destination received (SPEC §5, §6).

use std::time::{Duration, Instant};

use fencegate::epoch::{object_key, Epoch, EpochRecord, LeaseName};

use crate::support::gate::{forge_next, gates, next_renewal, single_config};
use crate::support::members::{
    a_done_b_arrived, member_config, order_violations, serves, start_member, wait_serves, LEASE,
    PEER_TOKEN,
};
use crate::support::*;

/// SPEC §10 / §5: a `release` "of a single instance" (`mode: "single"`, which
/// carries no MAC a cluster could check) forged as the next gate epoch of a
/// shard a healthy member owns does not let another member forward epoch e+1
/// while the owner's epoch e request is still in flight at the destination.
/// Failed when the cluster believed such an object (Foreign): the release was
/// free at once, another member took the shard and, after its settle (the drain
/// timeout, 1 s), forwarded epoch e+1 while the healthy old owner — which learnt
/// of it only at its next renewal (gate_ttl/3) — still had an epoch e request
/// in flight at the destination. No stall, no timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_single_release_never_lets_a_second_owner_in_early() {
    skip_without_python!();
    skip_without_postgres!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let (_db_name, db) = crate::support::postgres::PgServer::shared().new_database();
    // Renewed every 10 s, so the old owner learns late.
    let gate = ("30s", "2s");
    let m1 = start_member(&s3, &db, &origin, "fg-a", 1, gate);
    eventually("fg-a serves shard 0", || serves(&m1, 0)).await;
    let m2 = start_member(&s3, &db, &origin, "fg-b", 1, gate);
    eventually("fg-b knows fg-a owns shard 0", || async {
        m2.admin_json("/v1/cluster").await["shard_map"][0]["owner"] == "fg-a"
    })
    .await;
    let epochs = s3.epochs().await;
    let w1 = acquire(&epochs, LEASE, "worker-1", Duration::from_secs(120)).await;
    let g = gates(&s3).await;
    // Right after fg-a's renewal: its next one is ~10 s away.
    let renewed = next_renewal(&g, 0).await;
    let a = held_a(&m1, &origin, &w1, "a: epoch e via fg-a").await;
    let forged = forge_next(&g, 0, |e| {
        format!(
            r#"{{"v":1,"lease":"0000","epoch":{e},"kind":"release","holder":"fg-nobody","mode":"single","shards":1}}"#
        )
        .into_bytes()
    })
    .await;
    let t0 = Instant::now();
    eprintln!("fg-a renewed at gate epoch {renewed}; forged release at {forged}");
    let taken = async {
        while !serves(&m2, 0).await {
            if t0.elapsed() > Duration::from_secs(25) {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        true
    }
    .await;
    eprintln!(
        "fg-b serves shard 0: {taken} after {:?}; fg-a still serves: {}",
        t0.elapsed(),
        serves(&m1, 0).await
    );
    let w2 = force_next_epoch(&epochs, LEASE, "worker-2", Duration::from_secs(120)).await;
    let b = post(&m2, "/billing/x", &w2, "b: epoch e+1 via fg-b").await;
    eprintln!("b -> {} after {:?}", b.status, t0.elapsed());
    origin.release("a");
    let a = a.await.unwrap();
    eprintln!("a -> {:?}", a.as_ref().map(|r| r.status));
    let log = dump_arrivals(&origin, t0);
    let (a_done, b_arr) = a_done_b_arrived(&log);
    if let Some(b_arr) = b_arr {
        assert!(
            a_done.is_some_and(|d| d <= b_arr),
            "SPEC §5: epoch e+1 (via fg-b, after a forged single-mode release) arrived while epoch e (via the healthy owner fg-a) was in flight"
        );
    }
}

/// SPEC §10 ("a single instance and a cluster never share a prefix") / §5: a
/// garbage object as the next gate epoch of a healthy cluster's shard 0 does
/// not let a single instance (sled state, no flag) start (the test ends there).
/// Failed when the single instance's guard judged an unparsable latest object
/// free, skipped the state check, and after its create looked at no other shard
/// (the object before its own did not parse): it started at once, while the
/// cluster member kept serving until its next renewal (gate_ttl/3), both
/// set-ups forwarding the same lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_in_a_clusters_shard_0_never_lets_a_single_instance_serve_beside_it() {
    skip_without_python!();
    skip_without_postgres!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let (_db_name, db) = crate::support::postgres::PgServer::shared().new_database();
    let m1 = start_member(&s3, &db, &origin, "fg-a", 1, ("30s", "2s"));
    eventually("fg-a serves shard 0", || serves(&m1, 0)).await;
    let epochs = s3.epochs().await;
    let w1 = acquire(&epochs, LEASE, "worker-1", Duration::from_secs(120)).await;
    let g = gates(&s3).await;
    next_renewal(&g, 0).await;
    let a = held_a(&m1, &origin, &w1, "a: epoch e via the cluster").await;
    forge_next(&g, 0, |_| b"garbage".to_vec()).await;
    let t0 = Instant::now();
    let mut single = Fencegate::unstarted("127.0.0.1:0", "", &single_config(&s3, &origin), &[]);
    let started = single.spawn(None);
    eprintln!(
        "single instance: {:?} after {:?}",
        started.as_ref().map(|_| "listening").map_err(|e| e
            .lines()
            .next()
            .unwrap_or("")
            .to_owned()),
        t0.elapsed()
    );
    if started.is_err() {
        origin.release("a");
        return;
    }
    let w2 = force_next_epoch(&epochs, LEASE, "worker-2", Duration::from_secs(120)).await;
    let b = post(
        &single,
        "/billing/x",
        &w2,
        "b: epoch e+1 via the single instance",
    )
    .await;
    eprintln!(
        "b -> {} after {:?}; cluster member still serves: {}",
        b.status,
        t0.elapsed(),
        serves(&m1, 0).await
    );
    origin.release("a");
    let a = a.await.unwrap();
    eprintln!("a -> {:?}", a.as_ref().map(|r| r.status));
    let log = dump_arrivals(&origin, t0);
    let (a_done, b_arr) = a_done_b_arrived(&log);
    assert!(
        b_arr.is_none() || a_done.is_some_and(|d| d <= b_arr.unwrap()),
        "SPEC §5: e+1 via the single instance arrived while e via the cluster was in flight"
    );
    panic!("SPEC §10: a single instance started on a prefix a live cluster serves");
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
    let a = held_a(&m1, &origin, &w1, "a: epoch e via fg-a").await;
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
    let log = dump_arrivals(&t.origin, t0);
    let v = order_violations(&log);
    assert!(v.is_empty(), "SPEC §5 broken at the destination: {v:#?}");
}

/// SPEC §10 / §5: anyone who can write under `.gate/` writes, over a healthy
/// member's live gate epoch N, an unsealed acquire N+1 with a token of its
/// choosing and then a release N+2 carrying that token. fg-b does not take the
/// shard early, and nothing reaches the destination out of epoch order: a
/// release is final only when sealed by its own set-up. Failed when a release
/// whose `released_token` hashed to the released epoch's `token_sha256` was
/// final at once ("proven") — which proves only that its writer knew the token
/// of the acquire just before it, and that acquire may be the attacker's own:
/// fg-b took the shard, settled (1 s) and forwarded epoch e+1 while fg-a —
/// which learnt at its next renewal, gate_ttl/3 = 10 s later — still had epoch
/// e in flight, and forwarded a stale leader's epoch e after e+1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attackers_own_acquire_and_release_never_free_a_live_members_shard() {
    skip_without_python!();
    skip_without_postgres!();
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

/// SPEC §10, with members whose `gate_ttl` differs (nothing in the config or
/// the SPEC forbids it; a rolling config change makes it routine): garbage over
/// the gate epoch of fg-a (gate_ttl 60 s, renewed every 20 s) does not let fg-b
/// (gate_ttl 3 s) serve while fg-a still forwards: the owner writes its
/// `gate_ttl` in its row and a contender waits the longer of the two. Failed
/// when an untrusted object freed a gate lease "no sooner than gate_ttl after
/// its LastModified" by the READER's gate_ttl: fg-b got in after ~4.5 s while
/// fg-a, which learns of the loss only at its renewal, kept forwarding until
/// ~20 s; and, with ownership rows, when fg-b took fg-a's row after its own
/// 3 s + grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_frees_a_shard_only_after_the_holders_longer_gate_ttl() {
    skip_without_python!();
    skip_without_postgres!();
    let t = two_members(("60s", "2s"), ("3s", "1s")).await;
    let forged = forge_next(&t.g, 0, |_| b"garbage".to_vec()).await;
    let t0 = Instant::now();
    eprintln!("garbage at gate epoch {forged}");
    finish_two_members(t, t0, Duration::from_secs(15)).await;
}

/// SPEC §10 (a member's sealed object "is believed"; "a cluster serves no
/// shard until shard 0's latest gate object is its own set-up's"): a sealed
/// object copied from another prefix's history (a staging cluster with the same
/// peer token) over a live single instance's guard, at another epoch, does not
/// let a cluster member start and serve beside the single instance. Failed when
/// the MAC covered the object's own `lease` and `epoch` fields but the verdict
/// never checked them against the key, and nothing bound it to the prefix: the
/// copy (or one from this prefix's own history) was judged `Ours`, hid the
/// single instance from the member's start-up check (no conflict), anchored the
/// prefix, and the member served shard 1 at once while the single instance
/// forwarded the same lease until its next renewal (gate_ttl/3 = 10 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealed_object_replayed_from_another_prefix_never_anchors_a_cluster_beside_a_single_instance(
) {
    skip_without_python!();
    skip_without_postgres!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let pg = crate::support::postgres::PgServer::shared();
    let (_d1, staging_db) = pg.new_database();
    let (_d2, db) = pg.new_database();
    let gate = ("30s", "2s");
    // A staging cluster on another prefix, same peer token.
    let port = free_port();
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
    let a = held_a(&single, &origin, &w1, "a: epoch e via the single instance").await;
    let copied = forge_next(&g, 0, |_| sealed.to_vec()).await;
    let t0 = Instant::now();
    eprintln!("copied it as production gate epoch {copied}");
    // A cluster member (2 shards; billing is shard 1) starts on production.
    let port = free_port();
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
    let log = dump_arrivals(&origin, t0);
    let v = order_violations(&log);
    assert!(v.is_empty(), "SPEC §5 broken at the destination: {v:#?}");
    panic!("SPEC §10: a cluster member serves beside a live single instance");
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
    skip_without_postgres!();
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
    let port = free_port();
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
