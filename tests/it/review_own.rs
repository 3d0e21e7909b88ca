//! A skeptical review of issue 28 (shard ownership as PostgreSQL rows): attempts
//! to break SPEC §5, §6 and §10 at the destination. Tests named `f*` assert the
//! SPEC rule and FAIL on the code they were written against (findings);
//! `held_*` tests pass (what was tried and held).
//!
//! The destination check used throughout is R5's (tests/it/review.rs): an
//! epoch-e upload of 16 MiB is held at the origin, which reads none of its
//! body (more than loopback's socket buffers hold), so the body can only
//! reach the destination whole if the instance that forwarded it keeps
//! writing it — i.e. it was never aborted. Once an epoch e+1 request has
//! arrived, that upload must never be read whole (SPEC §5: a's body sent
//! whole before b arrived; an aborted request stops being written at once).

use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::review::{dump, free_port, serves, PEER_TOKEN};
use crate::support::postgres::PgServer;
use crate::support::*;

const LEASE: &str = "billing";
const UPLOAD: usize = 16 << 20;

macro_rules! skip_without_postgres {
    () => {
        if !$crate::support::postgres::available_or_skip() {
            return;
        }
    };
}

/// A cluster member: one route `/billing/` (fencing only, drain timeout 1 s,
/// uploads up to 64 MiB) and `/keyed/` (the same lease, dedup records) on
/// lease `billing`; `gate` is (`gate_ttl`, `self_fence_margin`).
fn member_toml(
    s3: &S3Server,
    db: &str,
    origin: &Origin,
    id: &str,
    port: u16,
    shards: u32,
    gate: (&str, &str),
) -> String {
    let route = |name: &str, extra: &str| {
        route_toml(
            name,
            LEASE,
            origin,
            &format!(
                "timeout_ms = 60000\ndrain_timeout_ms = 1000\nmax_body_bytes = {}\n{extra}",
                4 * UPLOAD
            ),
        )
    };
    format!(
        "{}gate_ttl = \"{}\"\nself_fence_margin = \"{}\"\n{}[cluster]\ninstance_id = \"{id}\"\nadvertise = \"http://127.0.0.1:{port}\"\nshards = {shards}\npeer_token = \"{PEER_TOKEN}\"\n\n{}{}",
        s3.store_toml(200)
            .replace("timeout_ms = 1500", "timeout_ms = 1000"),
        gate.0,
        gate.1,
        state_toml(db, ""),
        route("billing", "derive_key = \"none\"\n"),
        route("keyed", ""),
    )
}

fn member(s3: &S3Server, db: &str, origin: &Origin, id: &str, gate: (&str, &str)) -> Fencegate {
    let port = free_port();
    Fencegate::start_listening(
        &format!("127.0.0.1:{port}"),
        "",
        &member_toml(s3, db, origin, id, port, 1, gate),
        &[],
    )
}

/// A 16 MiB upload at `w`'s epoch through `fg`, held at the origin under
/// `name` (nothing of its body read); returns once its head has arrived.
async fn held_upload(
    origin: &Origin,
    fg: &Fencegate,
    w: &fencegate::lease::acquire::Holding,
    name: &str,
) -> tokio::task::JoinHandle<Result<Reply, String>> {
    let req = worker_req(&fg.url("/billing/upload"), w.epoch.get(), &w.token)
        .header("x-test-hold-body", name)
        .body(http_body_util::Full::new(Bytes::from(vec![b'u'; UPLOAD])))
        .unwrap();
    let up = tokio::spawn(try_send(req));
    let n = name.to_owned();
    origin
        .wait_until("the upload's head", |l| {
            l.iter()
                .any(|a| a.header("x-test-hold-body").as_deref() == Some(&n))
        })
        .await;
    up
}

/// Lets the held upload be read, waits until the origin is done with it, and
/// checks SPEC §5: once `later` (an e+1 request's body prefix) arrived, the
/// epoch-e upload must not have reached the destination whole.
async fn check_upload_after(
    origin: &Origin,
    name: &str,
    up: tokio::task::JoinHandle<Result<Reply, String>>,
    later: &str,
    t0: Instant,
) {
    origin.release(name);
    let n = name.to_owned();
    origin
        .wait_until("the upload read to its end", |l| {
            l.iter().any(|a| {
                a.header("x-test-hold-body").as_deref() == Some(&n) && a.completed.is_some()
            })
        })
        .await;
    let r = up.await.unwrap();
    eprintln!(
        "upload -> {:?} at {:?}",
        r.as_ref().map(|r| (r.status, r.error_code())),
        t0.elapsed()
    );
    let log = dump(origin, t0);
    let upload = log
        .iter()
        .find(|a| a.header("x-test-hold-body").as_deref() == Some(name))
        .unwrap();
    let next = log.iter().find(|a| a.body.starts_with(later.as_bytes()));
    eprintln!(
        "upload: {} of {UPLOAD} bytes read, whole: {}; e+1 arrived: {:?}",
        upload.body_read,
        upload.body_whole,
        next.map(|n| n.arrived.saturating_duration_since(t0))
    );
    assert!(
        next.is_some(),
        "the e+1 request never arrived: nothing shown"
    );
    assert!(
        !upload.body_whole,
        "SPEC §5 broken at the destination: the epoch-e upload reached it whole ({} bytes) after an epoch e+1 request had arrived",
        upload.body_read
    );
}

async fn wait_serves(fg: &Fencegate, shard: u32, limit: Duration) -> Option<Duration> {
    let t = Instant::now();
    while !serves(fg, shard).await {
        if t.elapsed() > limit {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Some(t.elapsed())
}

async fn generation(fg: &Fencegate, shard: usize) -> u64 {
    fg.admin_json("/v1/cluster").await["shard_map"][shard]["generation"]
        .as_u64()
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------
// Config mistakes.

/// F1 — SPEC §10 ("a row is free … once a contender has seen its
/// (generation, renewals) unchanged for gate_ttl + grace_ms") / §5, with
/// members whose `gate_ttl` differs (a rolling config change; nothing detects
/// it: gate_ttl is in no row, no beat and not in the anchor's MAC).
/// fg-a (gate_ttl 60 s) renews its row every 20 s; fg-b (gate_ttl 3 s) sees
/// it unchanged for 3.5 s and takes it while fg-a is healthy and forwarding.
/// fg-a learns of it only at its next renewal (its looks see the new owner
/// and change nothing). Both serve shard 0 at once; fg-b settles (1 s) and
/// forwards epoch e+1 while fg-a is still writing an epoch-e upload, which
/// then reaches the destination whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f1_a_member_with_a_shorter_gate_ttl_takes_a_live_owners_row() {
    skip_without_python!();
    skip_without_postgres!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let (_db_name, db) = PgServer::shared().new_database();
    let a = member(&s3, &db, &origin, "fg-a", ("60s", "2s"));
    eventually("fg-a serves shard 0", || serves(&a, 0)).await;
    let epochs = s3.epochs().await;
    let w1 = acquire(&epochs, LEASE, "worker-1", Duration::from_secs(300)).await;
    let up = held_upload(&origin, &a, &w1, "up").await;
    let t0 = Instant::now();
    let b = member(&s3, &db, &origin, "fg-b", ("3s", "1s"));
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

// ---------------------------------------------------------------------------
// Rows edited by hand.

/// fg-a owns shard 0 (gate_ttl 30 s: renewed every 10 s) with an epoch-e
/// upload in flight, fg-b watches; `edit` is run on the database; then as
/// [`f1_a_member_with_a_shorter_gate_ttl_takes_a_live_owners_row`].
async fn a_row_edited_by_hand(edit: &str) {
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let (db_name, db) = PgServer::shared().new_database();
    let a = member(&s3, &db, &origin, "fg-a", ("30s", "2s"));
    eventually("fg-a serves shard 0", || serves(&a, 0)).await;
    let b = member(&s3, &db, &origin, "fg-b", ("30s", "2s"));
    eventually("fg-b knows fg-a owns shard 0", || async {
        b.admin_json("/v1/cluster").await["shard_map"][0]["owner"] == "fg-a"
    })
    .await;
    let epochs = s3.epochs().await;
    let w1 = acquire(&epochs, LEASE, "worker-1", Duration::from_secs(300)).await;
    let up = held_upload(&origin, &a, &w1, "up").await;
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
    let w2 = force_next_epoch(&epochs, LEASE, "worker-2", Duration::from_secs(300)).await;
    let r = post(&b, "/billing/x", &w2, "b: epoch e+1 via fg-b").await;
    eprintln!("b -> {} at {:?}", r.status, t0.elapsed());
    check_upload_after(&origin, "up", up, "b:", t0).await;
}

/// F2a — SPEC §10 ("a row is free once released, or once a contender has
/// seen its (generation, renewals) unchanged for gate_ttl + grace"): a row
/// whose owner is set to NULL by hand (an operator "freeing" a stuck shard;
/// to the keeper it is indistinguishable from a release) is taken at once by
/// fg-b, while fg-a — healthy, renewing every 10 s — keeps serving and
/// writing its epoch-e upload after fg-b forwarded epoch e+1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f2a_an_owner_nulled_by_hand_is_taken_at_once_beside_the_live_owner() {
    skip_without_python!();
    skip_without_postgres!();
    a_row_edited_by_hand("UPDATE fencegate_owners SET owner = NULL, advertise = NULL").await;
}

/// F2b — as F2a with the row DELETED by hand: a missing row is free at once
/// (`Seen::free_at` of no row), and the take INSERTs generation 1 again —
/// the generation the first owner also had, so `OWNER_OK` (stored ≤ mine)
/// passes for BOTH owners' state writes: the generation fence is gone too.
/// Fixed: a trigger refuses to delete (or truncate) ownership rows, saying why
/// and what to do instead; F2a: a release names its generation
/// (`released_generation`), and an owner set to NULL any other way is watched
/// like a live row (the owner's renewal then fails and it stops at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f2b_a_row_deleted_by_hand_is_taken_at_once_under_a_reused_generation() {
    skip_without_python!();
    skip_without_postgres!();
    a_row_edited_by_hand("DELETE FROM fencegate_owners").await;
}

// ---------------------------------------------------------------------------
// A self-fenced tenure and the next one on the same instance.

/// F3 — SPEC §10 ("aborts what is in flight at gate_ttl — every lease of the
/// shard by that one deadline, however the shard is left"; "a successor …
/// settles: until the lease's drain timeout has passed since the takeover,
/// no raise completes") / §5. When an owner self-fences (its window, counted
/// from min(send, last answered anchor read), closes before the next renewal)
/// and a later renewal succeeds before `gate_ttl`, it takes its own row again
/// under a new generation at once (`renew_held` → `spawn_takeover`). The new
/// tenure's fence replaces nothing — the self-fenced one was already removed
/// from the registry by `stop_serving`, its requests left to abort only at the
/// old deadline, up to `self_fence_margin` later — and settles only the drain
/// timeout (1 s) before raising. Epoch e+1 is forwarded while the previous
/// tenure's epoch-e upload is still being written. No fault at all: with
/// gate_ttl 12 s and margin 7 s (a legal config: margin < gate_ttl) the
/// window (5 s from the last anchor read before the renewal, reads every 3 s)
/// closes before the next renewal (every 4 s) again and again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f3_a_retaken_tenure_forwards_above_the_self_fenced_ones_live_request() {
    skip_without_python!();
    skip_without_postgres!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let (db_name, db) = PgServer::shared().new_database();
    let a = member(&s3, &db, &origin, "fg-a", ("12s", "7s"));
    eventually("fg-a serves shard 0", || serves(&a, 0)).await;
    let epochs = s3.epochs().await;
    let w1 = acquire(&epochs, LEASE, "worker-1", Duration::from_secs(300)).await;
    let up = held_upload(&origin, &a, &w1, "up").await;
    let t0 = Instant::now();
    let g0 = generation(&a, 0).await;
    // Watch the tenure: a self-fence (served_here false) and the next
    // generation.
    let mut fenced_at = None;
    let deadline = Instant::now() + Duration::from_secs(40);
    let retaken = loop {
        let v = a.admin_json("/v1/cluster").await;
        let s = &v["shard_map"][0];
        if s["served_here"] != true && fenced_at.is_none() {
            fenced_at = Some(t0.elapsed());
        }
        if s["served_here"] == true && s["generation"].as_u64().unwrap_or(0) > g0 {
            break Some(t0.elapsed());
        }
        if Instant::now() > deadline {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    eprintln!(
        "generation {g0}: self-fenced at {fenced_at:?}, retaken (generation {}) at {retaken:?}; row {}",
        generation(&a, 0).await,
        PgServer::shared().psql(&db_name, "SELECT generation, renewals FROM fencegate_owners")
    );
    let Some(_) = retaken else {
        origin.release("up");
        return; // held: no self-fence and re-take within 40 s
    };
    let w2 = force_next_epoch(&epochs, LEASE, "worker-2", Duration::from_secs(300)).await;
    let r = post(&a, "/billing/x", &w2, "b: epoch e+1 via the new tenure").await;
    eprintln!("b -> {} at {:?}", r.status, t0.elapsed());
    check_upload_after(&origin, "up", up, "b:", t0).await;
}
