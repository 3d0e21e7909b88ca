//! SPEC §10: the anchor — a cluster's one gate lease, on shard 0, which any
//! member keeps — and a single instance on the same prefix: an old anchor
//! epoch deleted by a lifecycle rule hides no live cluster, and a cluster and
//! a single instance starting at once never both serve.

use std::time::{Duration, Instant};

use fencegate::epoch::{object_key, Epoch, LeaseName};

use crate::support::gate::{gates, next_renewal, single_config};
use crate::support::members::{
    member_config, order_violations, serves, start_member, LEASE, PEER_TOKEN,
};
use crate::support::*;

/// SPEC §10 ("which shards a set-up has used is read from the store") with
/// SPEC §2 ("fencegate never depends on old epoch objects existing; only the
/// latest one must never be deleted"): a cluster's only gate lease is the
/// anchor on shard 0, which any member keeps. Its old epoch 1 is deleted (as a
/// lifecycle rule would) once a newer anchor exists, fg-a (shard 0's owner)
/// stops, and a single instance started with `--takeover-may-duplicate` is
/// still refused while fg-b serves shard 1 (the flag accepts repeated
/// deliveries of the old instance's keys, not two set-ups forwarding at once).
/// Failed when every shard had its own gate objects: a lifecycle rule deleting
/// shard 1's epoch 1 hid fg-b's live shard from a single instance that took
/// shard 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_old_anchor_epoch_hides_no_live_cluster_from_a_single_instance() {
    skip_without_python!();
    skip_without_postgres!();
    single_instance_beside_a_two_member_cluster(true).await;
}

/// The control of the test above: without the deletion, the single instance
/// finds the live anchor and exits 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_anchor_epoch_kept_a_single_instance_is_refused() {
    skip_without_python!();
    skip_without_postgres!();
    single_instance_beside_a_two_member_cluster(false).await;
}

/// Two members of a 2-shard cluster (fg-a serving shard 0, fg-b shard 1, the
/// anchor's old epoch 1 deleted when `delete`), an epoch-e request held at the
/// destination through fg-b, fg-a stopped; then a single instance with
/// `--takeover-may-duplicate`. Refused: the test ends. Started: SPEC §5 is
/// checked at the destination, and the test fails.
async fn single_instance_beside_a_two_member_cluster(delete: bool) {
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
    let a = held_a(&m2, &origin, &w1, "a: epoch e via fg-b").await;
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
    let log = dump_arrivals(&origin, t0);
    let v = order_violations(&log);
    assert!(v.is_empty(), "SPEC §5 broken at the destination: {v:#?}");
    panic!("SPEC §10: a single instance serves beside a live cluster member");
}

/// SPEC §10: a single instance stops gracefully (its release), then a cluster
/// member and another single instance start at the same moment: at most one of
/// them serves (the destination gets a request through each, e+1 through the
/// second).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_and_a_single_instance_starting_at_once_after_a_release_never_both_serve() {
    skip_without_python!();
    skip_without_postgres!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let (_db_name, db) = crate::support::postgres::PgServer::shared().new_database();
    let mut a = Fencegate::start(&single_config(&s3, &origin));
    a.terminate();
    let port = free_port();
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
    dump_arrivals(&origin, Instant::now());
    assert!(
        served.iter().filter(|(_, ok)| *ok).count() <= 1,
        "SPEC §10: both set-ups forwarded: {served:?}"
    );
}
