//! SPEC §10's ownership rows (`fencegate_owners`): when a row is free. A live
//! owner's row is not taken by a member with a shorter `gate_ttl`, nor after
//! an edit by hand — an owner set to NULL is watched like a live row, the
//! database refuses to delete a row, and edits that change the watched pair
//! (owner renamed, generation bumped) let another take the row only gate_ttl +
//! grace later. Each test holds an epoch-e upload at the destination and
//! checks that it never arrives whole after epoch e+1 (`check_upload_after`).

use std::time::{Duration, Instant};

use fencegate::lease::acquire::Holding;
use fencegate::lease::Epochs;
use tokio::task::JoinHandle;

use crate::support::members::{
    check_upload_after, generation, held_upload, serves, start_upload_member, wait_serves, LEASE,
};
use crate::support::postgres::PgServer;
use crate::support::*;

/// SPEC §10 ("a row is free … once a contender has seen its (generation,
/// renewals) unchanged for gate_ttl + grace_ms") / §5, with members whose
/// `gate_ttl` differs (a rolling config change): fg-a (gate_ttl 60 s) renews
/// its row every 20 s, and fg-b (gate_ttl 3 s) does not take it while fg-a is
/// healthy and forwarding — the owner writes its `gate_ttl` in its row and a
/// contender waits the longer of the two. Failed when gate_ttl was in no row,
/// no beat and not in the anchor's MAC: fg-b saw the row unchanged for 3.5 s
/// and took it, fg-a learnt of it only at its next renewal, both served shard
/// 0 at once, and fg-b forwarded epoch e+1 while fg-a was still writing an
/// epoch-e upload, which then reached the destination whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_with_a_shorter_gate_ttl_never_takes_a_live_owners_row() {
    skip_without_python!();
    skip_without_postgres!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let (_db_name, db) = PgServer::shared().new_database();
    let a = start_upload_member(&s3, &db, &origin, "fg-a", ("60s", "2s"));
    eventually("fg-a serves shard 0", || serves(&a, 0)).await;
    let epochs = s3.epochs().await;
    let w1 = acquire(&epochs, LEASE, "worker-1", Duration::from_secs(300)).await;
    let up = held_upload(&origin, &a, &w1, "up").await;
    let t0 = Instant::now();
    let b = start_upload_member(&s3, &db, &origin, "fg-b", ("3s", "1s"));
    let took = wait_serves(&b, 0, Duration::from_secs(25)).await;
    let both = serves(&a, 0).await && serves(&b, 0).await;
    eprintln!("fg-b serves shard 0 {took:?} after it started; fg-a and fg-b both serve it: {both}");
    if took.is_none() {
        origin.release("up");
        return; // held: fg-b never took the live row
    }
    let w2 = force_next_epoch(&epochs, LEASE, "worker-2", Duration::from_secs(300)).await;
    let r = post(&b, "/billing/x", &w2, "b: epoch e+1 via fg-b").await;
    eprintln!("b -> {} at {:?}", r.status, t0.elapsed());
    check_upload_after(&origin, "up", up, "b:", t0).await;
}

/// The store, the origin, the database's name, the owner fg-a, the watching
/// fg-b, the lease store's epochs, a worker's tenure and its held upload.
type Watched = (
    S3Server,
    Origin,
    String,
    Fencegate,
    Fencegate,
    Epochs,
    Holding,
    JoinHandle<Result<Reply, String>>,
);

/// fg-a (`gate`) owns shard 0 of a 1-shard cluster with an epoch-e upload in
/// flight (held at the destination, nothing read), and fg-b knows it.
async fn owner_and_watcher(gate: (&str, &str)) -> Watched {
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let (db_name, db) = PgServer::shared().new_database();
    let a = start_upload_member(&s3, &db, &origin, "fg-a", gate);
    eventually("fg-a serves shard 0", || serves(&a, 0)).await;
    let b = start_upload_member(&s3, &db, &origin, "fg-b", gate);
    eventually("fg-b knows fg-a owns shard 0", || async {
        b.admin_json("/v1/cluster").await["shard_map"][0]["owner"] == "fg-a"
    })
    .await;
    let epochs = s3.epochs().await;
    let w1 = acquire(&epochs, LEASE, "worker-1", Duration::from_secs(300)).await;
    let up = held_upload(&origin, &a, &w1, "up").await;
    (s3, origin, db_name, a, b, epochs, w1, up)
}

/// fg-a owns shard 0 (gate_ttl 30 s: renewed every 10 s) with an epoch-e
/// upload in flight, fg-b watches; `edit` is run on the database (or refused by
/// it); then, if fg-b takes the row, a keyed request through the deposed fg-a
/// and epoch e+1 through fg-b, and SPEC §5 checked at the destination.
async fn a_row_edited_by_hand(edit: &str) {
    let (_s3, origin, db_name, a, b, epochs, w1, up) = owner_and_watcher(("30s", "2s")).await;
    let gen_a = generation(&a, 0).await;
    let pg = PgServer::shared();
    eprintln!(
        "before: {}",
        pg.psql(
            &db_name,
            "SELECT shard, generation, owner, renewals FROM fencegate_owners"
        )
    );
    if let Err(e) = pg.try_psql(&db_name, edit) {
        // Refused by the database (rows are never deleted): nothing moves.
        eprintln!("{edit:?} refused: {e}");
        assert!(e.contains("never deleted"), "{e}");
    }
    let t0 = Instant::now();
    let took = wait_serves(&b, 0, Duration::from_secs(25)).await;
    let both = serves(&a, 0).await && serves(&b, 0).await;
    eprintln!(
        "after {edit:?}: fg-b serves shard 0 {took:?} later; both serve it: {both}; generations a {gen_a} b {}; row {}",
        generation(&b, 0).await,
        pg.psql(&db_name, "SELECT shard, generation, owner, renewals FROM fencegate_owners")
    );
    if took.is_none() {
        origin.release("up");
        return;
    }
    // A state write of the deposed owner, after the take: a keyed request.
    // With the generation raised it fails (503); with the row re-inserted at
    // generation 1 it commits and is forwarded.
    let k = send(keyed(
        &a,
        "/keyed/k",
        &w1,
        "key-after-take",
        "keyed via fg-a after the take",
    ))
    .await;
    eprintln!(
        "a keyed request through the deposed fg-a after the take -> {} {:?}; its record: {}",
        k.status,
        k.error_code(),
        pg.psql(
            &db_name,
            "SELECT key, state, owner_generation FROM fencegate_dedup"
        )
    );
    let w2 = force_next_epoch(&epochs, LEASE, "worker-2", Duration::from_secs(300)).await;
    let r = post(&b, "/billing/x", &w2, "b: epoch e+1 via fg-b").await;
    eprintln!("b -> {} at {:?}", r.status, t0.elapsed());
    check_upload_after(&origin, "up", up, "b:", t0).await;
}

/// SPEC §10 ("a row is free once released, or once a contender has seen its
/// (generation, renewals) unchanged for gate_ttl + grace"): a row whose owner is
/// set to NULL by hand (an operator "freeing" a stuck shard) is not free at
/// once: only a release, which names its generation (`released_generation`),
/// is; an owner set to NULL any other way is watched like a live row (the
/// owner's renewal then fails and it stops at once). Failed when to the keeper
/// it was indistinguishable from a release: fg-b took the row at once, while
/// fg-a — healthy, renewing every 10 s — kept serving and writing its epoch-e
/// upload after fg-b forwarded epoch e+1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_nulled_by_hand_is_not_taken_beside_the_live_owner() {
    skip_without_python!();
    skip_without_postgres!();
    a_row_edited_by_hand("UPDATE fencegate_owners SET owner = NULL, advertise = NULL").await;
}

/// As the test above, with the row DELETED by hand: a trigger refuses to
/// delete (or truncate) ownership rows, saying why and what to do instead, and
/// nothing moves. Failed when a missing row was free at once (`Seen::free_at`
/// of no row) and the take INSERTed generation 1 again — the generation the
/// first owner also had, so `OWNER_OK` (stored ≤ mine) passed for BOTH owners'
/// state writes: the generation fence was gone too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_row_deleted_by_hand_is_refused_and_no_generation_is_reused() {
    skip_without_python!();
    skip_without_postgres!();
    a_row_edited_by_hand("DELETE FROM fencegate_owners").await;
}

/// SPEC §10 / §5: rows edited by hand in ways that do NOT free them
/// (the owner renamed to an unknown instance, the renewal count or the
/// generation bumped) change the watched pair: the live owner's next renewal
/// finds its row gone and stops at once (its in-flight upload aborted), and
/// the other member waits gate_ttl + grace from the edit before it takes the
/// row. Nothing reaches the destination out of order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_edited_by_hand_without_freeing_them_are_taken_only_after_gate_ttl() {
    skip_without_python!();
    skip_without_postgres!();
    for edit in [
        "UPDATE fencegate_owners SET owner = 'fg-nobody'",
        "UPDATE fencegate_owners SET generation = generation + 5",
    ] {
        let (_s3, origin, db_name, a, b, epochs, _, up) = owner_and_watcher(("6s", "2s")).await;
        let pg = PgServer::shared();
        pg.psql(&db_name, edit);
        let t0 = Instant::now();
        let row = || pg.psql(&db_name, "SELECT generation, owner FROM fencegate_owners");
        let edited = row();
        // Whichever member takes the row next (fg-a, having lost it, may):
        // a take raises the generation.
        let deadline = t0 + Duration::from_secs(25);
        let taken = loop {
            let now = row();
            if now != edited && !now.ends_with("fg-nobody") {
                break now;
            }
            assert!(Instant::now() < deadline, "{edit:?}: nobody took the row");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let next = if taken.ends_with("fg-a") { &a } else { &b };
        eventually("the taker serves", || serves(next, 0)).await;
        let took = t0.elapsed();
        eprintln!(
            "{edit:?}: {} serves shard 0 under generation {} {took:?} after the edit",
            next.admin_json("/v1/cluster").await["instance_id"],
            generation(next, 0).await
        );
        assert!(
            took >= Duration::from_millis(6000),
            "{edit:?}: taken {took:?} after the edit"
        );
        let w2 = force_next_epoch(&epochs, LEASE, "worker-2", Duration::from_secs(300)).await;
        let r = post(next, "/billing/x", &w2, "b: epoch e+1 via the next owner").await;
        assert_eq!(r.status, 200);
        check_upload_after(&origin, "up", up, "b:", t0).await;
    }
}
