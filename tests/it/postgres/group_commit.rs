//! The PostgreSQL group commit under faults: claims and outcomes of concurrent
//! requests written in batches, and the background settling of a batch whose
//! answer was lost — against the destination-level rules of SPEC §6, §7 and
//! §10: a key whose claim timed out is not left in flight, a deposed owner's
//! settle changes nothing its successor owns, one claim per key however the
//! batches fall, and a late outcome re-write never touches a takeover.

use std::time::{Duration, Instant};

use fencegate::state::postgres::PostgresState;
use fencegate::state::{Begun, End, Generation, Owner, State, StateError, StateStore, TakeOver};

use super::{
    answer, claim, connect_waiting, db_state, ended, keyed_answer, pg_config, refused, rig, rkey,
    timed, until, Answer, STRICT,
};
use crate::support::postgres::{KeyHold, PgServer};
use crate::support::relay::Relay;
use crate::support::*;

/// Opens `n` pooled connections at once (as a loaded instance has them), so
/// that a background statement does not queue behind a timed-out one on the
/// same connection.
async fn warm_pool(s: &std::sync::Arc<PostgresState>, n: usize) {
    let mut tasks = Vec::new();
    for i in 0..n {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            // A read that holds its connection a little while.
            let _ = s.get(&rkey(&format!("warm-{i}"))).await;
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

// ---------------------------------------------------------------------------
// A claim batch that times out while its statement waits at the database, and
// commits after its background settle has run.

/// docs/operations.md ("no answer within timeout_ms … is settled in the
/// background"): a worker's request whose claim batch got no answer within
/// `timeout_ms` (the statement waits at the database, e.g. on a lock or a slow
/// commit) is refused 503 and nothing is forwarded; once the database is well
/// again its retries get the key forwarded, once. Failed when the background
/// settle ran at once, found nothing (the claim had not committed yet) and
/// declared the batch settled: the claim committed after the settling DELETE,
/// the key stayed `in_flight`, every retry was `409 dedup_in_flight`, and the
/// destination never received it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_commits_after_its_batch_timed_out_does_not_block_its_key() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (db, url) = pg.new_database();
    let r = rig(&url, "timeout_ms = 1000").await;
    let pay = r.hold("pay").await;
    // Several connections in the pool, as under load.
    let warm: Vec<_> = (0..6)
        .map(|i| {
            let k = format!("warm-{i}");
            timed(keyed(
                &r.fg,
                &format!("/pay/{k}"),
                &pay,
                &k,
                &format!("pay {k}"),
            ))
        })
        .collect();
    for w in warm {
        assert_eq!(w.await.unwrap().0, Answer::Forwarded(200));
    }
    // A second pooled connection, for sure: a claim waits at the database on
    // one while a mark raise (the `feed` lease's first request) takes another.
    {
        let w = "warm-blocked";
        let holder = KeyHold::start(&url, "pay", 0, w).await;
        let pending = timed(keyed(
            &r.fg,
            &format!("/pay/{w}"),
            &pay,
            w,
            &format!("pay {w}"),
        ));
        until("the warm claim waits at the database", || {
            pg.waits_on_a_lock(&db, "/* fencegate: claims */")
        })
        .await;
        let feed = r.hold("feed").await;
        let tick = worker_req(&r.fg.url("/feed/tick"), feed.epoch.get(), &feed.token)
            .body(body("tick"))
            .unwrap();
        assert_eq!(answer(try_send(tick).await), Answer::Forwarded(200));
        holder.release().await;
        assert_eq!(pending.await.unwrap().0, Answer::Forwarded(200));
    }
    // The race needs the settling DELETE on another pooled connection than
    // the timed-out claim (on the same one it queues behind the claim and
    // works): a loaded pool has several. Up to five rounds, a key each.
    let mut blocked = None;
    for round in 0..5 {
        let key = format!("claim-timed-out-{round}");
        let holder = KeyHold::start(&url, "pay", 0, &key).await;
        let pending = timed(keyed(
            &r.fg,
            &format!("/pay/{key}"),
            &pay,
            &key,
            &format!("pay {key}"),
        ));
        until("the claim batch waits at the database", || {
            pg.waits_on_a_lock(&db, "/* fencegate: claims */")
        })
        .await;
        let (a, took) = pending.await.unwrap();
        eprintln!("round {round}: the claim that timed out: {a:?} after {took:?}");
        assert_eq!(a, refused("store_unavailable"));
        // The background settle has run by now (its first try is immediate).
        tokio::time::sleep(Duration::from_millis(1500)).await;
        // The lock goes away (the slow transaction rolls back): the database
        // is well again, and the claim's statement commits.
        holder.release().await;
        until("the orphaned claim statement finished", || {
            !pg.waits_on_a_lock(&db, "/* fencegate: claims */")
        })
        .await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let state = db_state(pg, &db, &key);
        eprintln!("round {round}: record state {state:?} after settling");
        if state == "0" {
            blocked = Some(key);
            break;
        }
        assert_eq!(
            keyed_answer(&r.fg, &pay, &key).await,
            Answer::Forwarded(200)
        );
        assert_eq!(r.arrivals_of(&key), 1);
    }
    let Some(key) = blocked else {
        eprintln!("no round left its key in flight");
        return;
    };
    // The worker retries, for 15 s.
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut answers = Vec::new();
    loop {
        let a = keyed_answer(&r.fg, &pay, &key).await;
        answers.push(a.clone());
        if a == Answer::Forwarded(200) || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let arrivals = r.arrivals_of(&key);
    let state = db_state(pg, &db, &key);
    eprintln!(
        "retries: {} (last {:?}); arrivals {arrivals}; record state {state:?}",
        answers.len(),
        answers.last()
    );
    assert!(arrivals <= 1, "delivered {arrivals} times");
    assert_eq!(
        arrivals,
        1,
        "the key is never forwarded after a transient database slowness: \
         every retry answered {:?}, the record is {state:?} (0 = in_flight, never settled)",
        answers.last()
    );
}

/// The same at the library level: `begin` fails (unknown outcome) after
/// `timeout_ms`; when the statement then commits, the key does not stay in
/// flight (nothing would ever write its outcome): the background settling frees
/// it and a retry's `begin` claims it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_claim_that_commits_later_is_freed_not_left_in_flight() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (db, url) = pg.new_database();
    let s = connect_waiting(&url, 1000).await;
    warm_pool(&s, 4).await;
    let owner = Owner::SINGLE;
    let key = rkey("lib-timed-out");
    let holder = KeyHold::start(&url, "pay", 0, &key.key).await;
    let begun = s.begin(owner, &key, &claim(1, 1_000), STRICT).await;
    eprintln!("begin: {begun:?}");
    assert!(
        matches!(&begun, Err(StateError::Write(d)) if d.contains("unknown")),
        "{begun:?}"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    holder.release().await;
    until("the orphaned claim statement finished", || {
        !pg.waits_on_a_lock(&db, "/* fencegate: claims */")
    })
    .await;
    // Give the background settling every chance (it retries each second).
    tokio::time::sleep(Duration::from_secs(4)).await;
    let record = s.get(&key).await.unwrap();
    let again = s.begin(owner, &key, &claim(1, 2_000), STRICT).await;
    eprintln!(
        "record after settling: {:?}; a retry's begin: {:?}",
        record.as_ref().map(|r| r.state),
        again.as_ref().map(|b| matches!(b, Begun::Claimed))
    );
    assert_eq!(
        record.map(|r| r.state),
        None,
        "a claim that was never forwarded is left in flight, unsettled"
    );
    assert!(matches!(again, Ok(Begun::Claimed)));
}

// ---------------------------------------------------------------------------
// A deposed owner's settling delete, conditioned on its generation.

/// SPEC §10 (every state write of an owner is conditioned on its generation):
/// owner A's claim batch commits and its answer is lost (503, nothing
/// forwarded); A cannot reach the database. B takes the shard over
/// (claim_shard + recover): A's claim is now B's `in_doubt` record, listed for
/// B's operator, and it stays so when A reaches the database again. Failed when
/// the settling delete was not conditioned on the generation: A's background
/// settle deleted B's record, a write of a deposed generation after the
/// takeover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deposed_owners_settle_never_deletes_the_successors_in_doubt_record() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (db, url) = pg.new_database();
    let relay = Relay::start(pg.port).await;
    let old = connect_waiting(&relay.url(&db), 30_000).await;
    let new = connect_waiting(&url, 30_000).await;
    let five = |generation| Owner {
        shard: 5,
        generation: Generation::new(generation),
    };
    old.claim_shard(five(1)).await.unwrap();
    // The batch statements prepared on the pooled connection (a prepare is a
    // round trip of its own, which a held reply would stop).
    let warm = rkey("warm");
    assert!(matches!(
        old.begin(five(1), &warm, &claim(9, 500), STRICT).await,
        Ok(Begun::Claimed)
    ));
    old.finish(five(1), &warm, fencegate::state::End::Delete)
        .await
        .unwrap();
    let key = rkey("settled-after-takeover");
    relay.hold_replies(true);
    let begun = {
        let (old, key) = (old.clone(), key.clone());
        tokio::spawn(async move { old.begin(five(1), &key, &claim(1, 1_000), STRICT).await })
    };
    until("the claim committed", || db_state(pg, &db, &key.key) == "0").await;
    relay.refuse(true);
    relay.cut();
    let r = begun.await.unwrap();
    assert!(r.is_err(), "the claim's answer was lost: {r:?}");
    // B takes over.
    new.claim_shard(five(2)).await.unwrap();
    assert_eq!(new.recover(five(2), 2_000).await.unwrap(), 1);
    assert_eq!(db_state(pg, &db, &key.key), "2", "B's in_doubt record");
    // A reaches the database again.
    relay.hold_replies(false);
    relay.refuse(false);
    tokio::time::sleep(Duration::from_secs(4)).await;
    let state = db_state(pg, &db, &key.key);
    eprintln!("B's in_doubt record after A's settle: {state:?}");
    assert_eq!(
        state, "2",
        "the deposed owner (generation 1) deleted the successor's record after the takeover"
    );
}

// ---------------------------------------------------------------------------
// One claim per key, one outcome per claim

/// One key claimed concurrently many times on one instance (same and
/// next batches) and on a second instance (a concurrent batch): exactly one
/// claim wins; every other sees the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_claimed_in_one_and_in_concurrent_batches_wins_once() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (_db, url) = pg.new_database();
    let a = PostgresState::connect(&pg_config(&url)).await.unwrap();
    let b = PostgresState::connect(&pg_config(&url)).await.unwrap();
    for round in 0..20 {
        let key = rkey(&format!("dup-{round}"));
        let mut tasks = Vec::new();
        for i in 0..12 {
            let s = if i % 2 == 0 { a.clone() } else { b.clone() };
            let key = key.clone();
            tasks.push(tokio::spawn(async move {
                s.begin(Owner::SINGLE, &key, &claim(1, 1_000), STRICT).await
            }));
        }
        let mut claimed = 0;
        for t in tasks {
            match t.await.unwrap() {
                Ok(Begun::Claimed) => claimed += 1,
                Ok(Begun::Exists(r)) => assert_eq!(r.state, State::InFlight),
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(claimed, 1, "round {round}: {claimed} claims of one key");
    }
}

/// One claim per key with a worker hanging up while its claim waits at the database (in a
/// batch): the request goes on without its client (FinishOnDrop) and the key
/// reaches the origin at most once; a retry afterwards is a replay or a 409,
/// never a second delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_hanging_up_while_its_claim_is_in_a_batch_is_delivered_once() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (db, url) = pg.new_database();
    let r = rig(&url, "timeout_ms = 10000").await;
    let pay = r.hold("pay").await;
    assert_eq!(
        keyed_answer(&r.fg, &pay, "warm").await,
        Answer::Forwarded(200)
    );
    let key = "hung-up";
    let holder = KeyHold::start(&url, "pay", 0, key).await;
    let req = keyed(
        &r.fg,
        &format!("/pay/{key}"),
        &pay,
        key,
        &format!("pay {key}"),
    );
    let sent =
        tokio::spawn(
            async move { tokio::time::timeout(Duration::from_secs(30), try_send(req)).await },
        );
    until("the claim batch waits at the database", || {
        pg.waits_on_a_lock(&db, "/* fencegate: claims */")
    })
    .await;
    // The worker hangs up.
    sent.abort();
    let _ = sent.await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    holder.release().await;
    until("the claim settled", || {
        !pg.waits_on_a_lock(&db, "/* fencegate: claims */")
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let retry = keyed_answer(&r.fg, &pay, key).await;
    eprintln!(
        "after the hang-up: arrivals {}, record {:?}, retry {retry:?}",
        r.arrivals_of(key),
        db_state(pg, &db, key)
    );
    assert!(
        matches!(retry, Answer::Replayed(200) | Answer::Forwarded(200)),
        "{retry:?}"
    );
    assert_eq!(r.arrivals_of(key), 1);
    assert_eq!(keyed_answer(&r.fg, &pay, key).await, Answer::Replayed(200));
    assert_eq!(r.arrivals_of(key), 1);
}

/// A `done` commits and its answer is lost (the outcome batch
/// is unknown; the instance cannot reach the database, so the background
/// re-write waits). The `done` expires and a new request takes the key over
/// (in flight again, a new claim). When the old instance's re-write finally
/// lands it must match nothing: the successor's in-flight record and then its
/// own `done` stand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_outcome_rewrite_never_touches_a_takeover_of_its_key() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (db, url) = pg.new_database();
    let relay = Relay::start(pg.port).await;
    let old = connect_waiting(&relay.url(&db), 30_000).await;
    let new = PostgresState::connect(&pg_config(&url)).await.unwrap();
    let o = Owner::SINGLE;
    let warm = rkey("warm");
    assert!(matches!(
        old.begin(o, &warm, &claim(9, 500), STRICT).await,
        Ok(Begun::Claimed)
    ));
    old.finish(o, &warm, End::Done(ended(9, 500, State::Done)))
        .await
        .unwrap();
    let key = rkey("late-rewrite");
    assert!(matches!(
        old.begin(o, &key, &claim(1, 1_000), STRICT).await,
        Ok(Begun::Claimed)
    ));
    relay.hold_replies(true);
    let fin = {
        let (old, key) = (old.clone(), key.clone());
        tokio::spawn(async move {
            old.finish(o, &key, End::Done(ended(1, 1_000, State::Done)))
                .await
        })
    };
    until("done committed", || db_state(pg, &db, &key.key) == "1").await;
    relay.refuse(true);
    relay.cut();
    assert!(fin.await.unwrap().is_err(), "the outcome's answer was lost");
    // The done expires; a new request takes the key over.
    let expired = TakeOver {
        in_doubt: false,
        done_before_ms: 1_000_000,
    };
    assert!(matches!(
        new.begin(o, &key, &claim(1, 2_000_000), expired).await,
        Ok(Begun::Claimed)
    ));
    relay.hold_replies(false);
    relay.refuse(false);
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        db_state(pg, &db, &key.key),
        "0",
        "the successor's claim was overwritten by a late re-write"
    );
    let mut mine = ended(1, 2_000_000, State::Done);
    mine.response.as_mut().unwrap().status = 202;
    new.finish(o, &key, End::Done(mine)).await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let r = new.get(&key).await.unwrap().unwrap();
    assert_eq!(r.state, State::Done);
    assert_eq!(
        r.response.map(|r| r.status),
        Some(202),
        "the successor's done stands"
    );
}
