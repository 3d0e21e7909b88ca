//! A skeptical review of issue 28 (shard ownership as PostgreSQL rows): attempts
//! to break SPEC §5, §6 and §10 at the destination. Tests named `f*` assert the
//! SPEC rule and FAIL on 617daf3 (findings); `held_*` tests pass (what was
//! tried and held).
//!
//! On 617daf3: F1, F2a, F2b, F3, F3b and F4 failed in every run (3 of 3; F3
//! and F3b 6 of 6); F3c (default gate_ttl and margin, 1 s drain timeout)
//! needs the right phase of the anchor reads (see its doc) and tries up to six
//! lost renewals: it failed in 1 of 2 runs (in the other, 5 of 6 lost renewals
//! self-fenced the owner but each time the old upload was aborted first);
//! `held_rows_edited_by_hand_without_freeing_them` passes.
//!
//! Fixed since (each test now holds): F1 — the owner writes its `gate_ttl` in
//! its row and a contender waits the longer of the two; F2a — only a release
//! (which names its generation) frees a row at once; F2b — the database
//! refuses to delete ownership rows; F3, F3b, F3c, F4 — a tenure stopped here
//! has its requests end (answered or aborted at its deadline, outcomes written
//! under its generation) before the shard is taken again here or released.
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
    ) + &route("resend", "in_doubt = \"resend\"\n")
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
    // (Polled: the origin signals arrivals, not a held body's end.)
    let deadline = Instant::now() + Duration::from_secs(20);
    while !origin
        .log()
        .iter()
        .any(|a| a.header("x-test-hold-body").as_deref() == Some(&n) && a.completed.is_some())
    {
        assert!(
            Instant::now() < deadline,
            "the upload was never read to its end"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
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
    let (fenced_at, retaken) = watch_tenure(&a, g0, t0, Duration::from_secs(40)).await;
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

/// The owner row's renewal count, read straight from the database.
fn renewals(db_name: &str) -> u64 {
    PgServer::shared()
        .psql(
            db_name,
            "SELECT renewals FROM fencegate_owners WHERE shard = 0",
        )
        .parse()
        .unwrap_or(0)
}

/// F3b — F3's cause with gate_ttl 10 s (the default), margin 3 s and one
/// lost renewal: fg-a's statements to PostgreSQL are held for ~3 s (a
/// network blip) across one renewal, then the connections are cut — the
/// renewal failed, nothing committed. Its window (from min(send, last
/// answered anchor read) + 7 s) closes before the next renewal (3.3 s
/// later), which succeeds: fg-a re-takes its own row at once and, 1 s
/// (drain timeout) later, forwards epoch e+1 — while the self-fenced
/// tenure's epoch-e upload, due to be aborted only at gate_ttl, is still
/// being written. (Whether the window closes first depends on the phase of
/// the anchor reads: a run where it did not is reported and passes.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f3b_one_lost_renewal_then_a_retake_forwards_above_the_old_tenures_request() {
    skip_without_python!();
    skip_without_postgres!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let (db_name, db) = PgServer::shared().new_database();
    let port: u16 = db
        .split("port=")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|p| p.parse().ok())
        .unwrap();
    let relay = crate::support::relay::Relay::start(port).await;
    let a = member(&s3, &relay.url(&db_name), &origin, "fg-a", ("10s", "3s"));
    eventually("fg-a serves shard 0", || serves(&a, 0)).await;
    let epochs = s3.epochs().await;
    let w1 = acquire(&epochs, LEASE, "worker-1", Duration::from_secs(300)).await;
    let up = held_upload(&origin, &a, &w1, "up").await;
    let (renewed, retaken) = blip_until_retake(&relay, &db_name, &a).await;
    let t0 = Instant::now();
    let Some(_) = retaken else {
        origin.release("up");
        return; // held this time: the window outlived the lost renewal
    };
    let w2 = force_next_epoch(&epochs, LEASE, "worker-2", Duration::from_secs(300)).await;
    let r = post(&a, "/billing/x", &w2, "b: epoch e+1 via the new tenure").await;
    eprintln!(
        "b -> {} at {:?} after the last renewal",
        r.status,
        renewed.elapsed()
    );
    check_upload_after(&origin, "up", up, "b:", t0).await;
}

/// Waits for a renewal of fg-a's row, holds fg-a's statements to PostgreSQL
/// from 1.5 s after it until 4.3 s after it (across the next renewal, due
/// 3.3 s after), then cuts them: that renewal failed, nothing committed.
/// Returns when the renewal was seen and when fg-a served the shard again
/// under a newer generation (`None`: not within 10 s, or never fenced).
async fn blip_until_retake(
    relay: &crate::support::relay::Relay,
    db_name: &str,
    a: &Fencegate,
) -> (Instant, Option<Duration>) {
    let (renewed, _, retaken) = blip(relay, db_name, a).await;
    (renewed, retaken)
}

/// Watches shard 0 at `a` for up to `limit`: when it stopped serving it (a
/// self-fence) and when it served it again under a generation above `g0`,
/// each counted from `from`.
async fn watch_tenure(
    a: &Fencegate,
    g0: u64,
    from: Instant,
    limit: Duration,
) -> (Option<Duration>, Option<Duration>) {
    let mut fenced_at = None;
    let deadline = Instant::now() + limit;
    loop {
        let v = a.admin_json("/v1/cluster").await;
        let s = &v["shard_map"][0];
        if s["served_here"] != true && fenced_at.is_none() {
            fenced_at = Some(from.elapsed());
        }
        if s["served_here"] == true && s["generation"].as_u64().unwrap_or(0) > g0 {
            return (fenced_at, Some(from.elapsed()));
        }
        if Instant::now() > deadline {
            return (fenced_at, None);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// [`blip_until_retake`], also returning when fg-a self-fenced.
async fn blip(
    relay: &crate::support::relay::Relay,
    db_name: &str,
    a: &Fencegate,
) -> (Instant, Option<Duration>, Option<Duration>) {
    let db_name = db_name.to_owned();
    let g0 = generation(a, 0).await;
    // A renewal just committed.
    let n = renewals(&db_name);
    while renewals(&db_name) == n {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let renewed = Instant::now();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    relay.hold_requests(true);
    // The next renewal (3.3 s after the last) is held, then cut.
    tokio::time::sleep_until((renewed + Duration::from_millis(4300)).into()).await;
    let held = relay.held_requests();
    relay.cut();
    eprintln!("{held} bytes of statements held, then cut");
    let (fenced_at, retaken) = watch_tenure(a, g0, renewed, Duration::from_secs(10)).await;
    eprintln!(
        "after the last renewal: self-fenced at {fenced_at:?}, retaken at {retaken:?} (generation {g0} -> {})",
        generation(a, 0).await
    );
    (renewed, fenced_at, retaken)
}

/// F4 — SPEC §6 ("an upstream answer → done"; "the same key again: done with
/// the same request → the stored response") across F3's self re-take: a
/// keyed request (route `in_doubt = "resend"`) is at the destination when
/// fg-a loses one renewal and re-takes its own row. The re-take's recovery
/// turns the old generation's `in_flight` records — this very process's
/// request, still being served — `in_doubt`; the destination then answers,
/// the worker gets 200, and the `done` write fails on the old generation. The
/// key stays in doubt, and its retry (the worker lost the 200: a dropped
/// connection) is sent again: delivered twice. (With `in_doubt = "reject"`
/// the retry is refused 409 instead of being answered from the record.)
/// The destination answers after the self-fence and before the stopped
/// tenure's abort deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f4_a_self_retake_turns_its_own_answered_request_in_doubt_and_resends_it() {
    skip_without_python!();
    skip_without_postgres!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let (db_name, db) = PgServer::shared().new_database();
    let port: u16 = db
        .split("port=")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|p| p.parse().ok())
        .unwrap();
    let relay = crate::support::relay::Relay::start(port).await;
    let a = member(&s3, &relay.url(&db_name), &origin, "fg-a", ("10s", "3s"));
    eventually("fg-a serves shard 0", || serves(&a, 0)).await;
    let epochs = s3.epochs().await;
    let w1 = acquire(&epochs, LEASE, "worker-1", Duration::from_secs(300)).await;
    let mut req = keyed(&a, "/resend/pay", &w1, "pay-1", "pay once");
    req.headers_mut()
        .insert("x-test-hold", "pay".parse().unwrap());
    let first = tokio::spawn(try_send(req));
    origin
        .wait_until("the keyed request", |l| {
            l.iter().any(|x| x.body.starts_with(b"pay once"))
        })
        .await;
    // The destination answers once fg-a has self-fenced, before its abort
    // deadline (held past that deadline, the request is aborted and its key
    // is rightly in doubt).
    let release_when_fenced = async {
        let t = Instant::now();
        while a.admin_json("/v1/cluster").await["shard_map"][0]["served_here"] == true
            && t.elapsed() < Duration::from_secs(15)
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        origin.release("pay");
    };
    let ((_renewed, _fenced, retaken), ()) =
        tokio::join!(blip(&relay, &db_name, &a), release_when_fenced);
    let r = first.await.unwrap();
    eprintln!(
        "the keyed request -> {:?}",
        r.as_ref().map(|r| (r.status, r.error_code()))
    );
    let pg = PgServer::shared();
    let record = || {
        pg.psql(
            &db_name,
            "SELECT key, state, owner_generation FROM fencegate_dedup WHERE key = 'pay-1'",
        )
    };
    eprintln!(
        "its record (state 0 in flight, 1 done, 2 in doubt): {}",
        record()
    );
    if retaken.is_none() {
        return; // held this time: no self-fence
    }
    // Outcome writes that fail are written again in the background: give
    // them time.
    tokio::time::sleep(Duration::from_secs(3)).await;
    eprintln!("3 s later: {}", record());
    let again = send(keyed(&a, "/resend/pay", &w1, "pay-1", "pay once")).await;
    eprintln!(
        "the retry -> {} {:?} replayed {:?}",
        again.status,
        again.error_code(),
        again.headers.get("x-fencegate-replayed")
    );
    let delivered = origin
        .log()
        .iter()
        .filter(|x| x.header("idempotency-key").as_deref() == Some("pay-1"))
        .count();
    assert_eq!(
        r.map(|r| r.status.as_u16()).ok(),
        Some(200),
        "the first request was answered by the destination"
    );
    assert_eq!(
        delivered, 1,
        "SPEC §6: key pay-1 was answered 200 once and delivered {delivered} times"
    );
}

/// F3c — F3b with gate_ttl and self_fence_margin at their defaults (10 s,
/// 2 s) and the test routes' drain timeout (1 s < margin): one lost renewal
/// self-fences the owner only when the last anchor read before the renewal
/// preceding it was sent 1.3–2.5 s earlier (the phase of the two loops moves
/// by 0.83 s a renewal), so up to four renewals are tried, one lost at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f3c_default_gate_ttl_and_margin_one_lost_renewal_at_the_wrong_phase() {
    skip_without_python!();
    skip_without_postgres!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let (db_name, db) = PgServer::shared().new_database();
    let port: u16 = db
        .split("port=")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|p| p.parse().ok())
        .unwrap();
    let relay = crate::support::relay::Relay::start(port).await;
    let a = member(&s3, &relay.url(&db_name), &origin, "fg-a", ("10s", "2s"));
    eventually("fg-a serves shard 0", || serves(&a, 0)).await;
    let epochs = s3.epochs().await;
    let w1 = acquire(&epochs, LEASE, "worker-1", Duration::from_secs(300)).await;
    let mut up = held_upload(&origin, &a, &w1, "up-0").await;
    for attempt in 0..6 {
        let (renewed, fenced, retaken) = blip(&relay, &db_name, &a).await;
        let t0 = Instant::now();
        let (Some(fenced), Some(retaken)) = (fenced, retaken) else {
            eprintln!("attempt {attempt}: no self-fence");
            continue;
        };
        if retaken.saturating_sub(fenced) > Duration::from_millis(800) {
            // The old deadline (margin 2 s after the self-fence) comes before
            // the new tenure's settle (1 s) ends: wait for the abort.
            let deadline = Instant::now() + Duration::from_secs(5);
            while !up.is_finished() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        if up.is_finished() {
            // Aborted at the old deadline before the re-take: held this
            // time. Another upload, another phase.
            eprintln!(
                "attempt {attempt}: the upload was aborted before the re-take: {:?}",
                up.await.unwrap().map(|r| (r.status, r.error_code()))
            );
            up = held_upload(&origin, &a, &w1, &format!("up-{}", attempt + 1)).await;
            continue;
        }
        let name = origin
            .log()
            .iter()
            .filter_map(|x| x.header("x-test-hold-body"))
            .last()
            .unwrap();
        let w2 = force_next_epoch(&epochs, LEASE, "worker-2", Duration::from_secs(300)).await;
        let r = post(&a, "/billing/x", &w2, "b: epoch e+1 via the new tenure").await;
        eprintln!(
            "attempt {attempt}: b -> {} at {:?} after the last renewal",
            r.status,
            renewed.elapsed()
        );
        check_upload_after(&origin, &name, up, "b:", t0).await;
        return;
    }
    eprintln!("held: no attempt showed it");
}

// ---------------------------------------------------------------------------
// What held.

/// Held — SPEC §10 / §5: rows edited by hand in ways that do NOT free them
/// (the owner renamed to an unknown instance, the renewal count or the
/// generation bumped) change the watched pair: the live owner's next renewal
/// finds its row gone and stops at once (its in-flight upload aborted), and
/// the other member waits gate_ttl + grace from the edit before it takes the
/// row. Nothing reaches the destination out of order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_rows_edited_by_hand_without_freeing_them() {
    skip_without_python!();
    skip_without_postgres!();
    for edit in [
        "UPDATE fencegate_owners SET owner = 'fg-nobody'",
        "UPDATE fencegate_owners SET generation = generation + 5",
    ] {
        let s3 = S3Server::start();
        let origin = Origin::start().await;
        let (db_name, db) = PgServer::shared().new_database();
        let a = member(&s3, &db, &origin, "fg-a", ("6s", "2s"));
        eventually("fg-a serves shard 0", || serves(&a, 0)).await;
        let b = member(&s3, &db, &origin, "fg-b", ("6s", "2s"));
        eventually("fg-b knows fg-a owns shard 0", || async {
            b.admin_json("/v1/cluster").await["shard_map"][0]["owner"] == "fg-a"
        })
        .await;
        let epochs = s3.epochs().await;
        let w1 = acquire(&epochs, LEASE, "worker-1", Duration::from_secs(300)).await;
        let up = held_upload(&origin, &a, &w1, "up").await;
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
