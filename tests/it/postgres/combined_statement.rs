//! Claims and outcomes of concurrent requests in ONE PostgreSQL statement, one
//! commit (issue 27): a claim and the outcome of one key together, a statement
//! cut or chosen as a deadlock victim, an outcome of a lost shard beside a
//! claim of a held one, and two instances' statements over the same keys. No
//! destination-level rule breaks; a lost shard's outcome and a takeover also
//! show the liveness coupling the combination brings (an outcome failing, or a
//! takeover waiting, because of an unrelated claim's lock wait).
//!
//! Each library-level test forces a chosen mix into one statement: a claim of
//! a key the test's own transaction holds uncommitted (`KeyHold`) keeps the
//! single batch worker waiting at the database; whatever is submitted
//! meanwhile (each future polled once, which queues its write) goes out
//! together as the next statement once the hold is rolled back (`CommitStats`
//! shows one commit for it).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use fencegate::state::postgres::PostgresState;
use fencegate::state::{Begun, End, Generation, Owner, State, StateError, StateStore};

use super::{
    claim, connect_waiting, db_state, ended, keyed_answer, pg_config, rig, rkey, tally, until,
    Answer, STRICT,
};
use crate::support::postgres::{KeyHold, PgServer};
use crate::support::relay::Relay;
use crate::support::Gateway;

type Queued<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Polls `f` once (its write is queued at the gatherer) and hands it back.
async fn queue<'a, T>(f: impl Future<Output = T> + Send + 'a) -> Queued<'a, T> {
    let mut f: Queued<'a, T> = Box::pin(f);
    tokio::select! {
        biased;
        _ = &mut f => panic!("a queued write finished before its batch ran"),
        () = std::future::ready(()) => {}
    }
    f
}

/// The batch worker busy: a claim of `key` waits at the database on the
/// test's own uncommitted record of it until the hold is released.
struct Blocked {
    hold: KeyHold,
    claim: tokio::task::JoinHandle<Result<Begun, StateError>>,
}

async fn block_worker(
    pg: &PgServer,
    db: &str,
    url: &str,
    s: &Arc<PostgresState>,
    owner: Owner,
    key: &str,
) -> Blocked {
    let hold = KeyHold::start(url, "pay", owner.shard, key).await;
    let claim = {
        let (s, k) = (s.clone(), rkey(key));
        tokio::spawn(async move { s.begin(owner, &k, &claim(9, 100), STRICT).await })
    };
    until("the blocking claim waits at the database", || {
        pg.waits_on_a_lock(db, "/* fencegate: claims */")
    })
    .await;
    Blocked { hold, claim }
}

impl Blocked {
    async fn release(self) {
        self.hold.release().await;
        assert!(matches!(self.claim.await.unwrap(), Ok(Begun::Claimed)));
    }
}

fn body_of(pg: &PgServer, db: &str, key: &str) -> String {
    pg.psql(
        db,
        &format!(
            "SELECT coalesce(status::text, '-') || ' ' || coalesce(encode(body, 'escape'), '-') \
             FROM fencegate_dedup WHERE route = 'pay' AND key = '{key}'"
        ),
    )
}

// ---------------------------------------------------------------------------
// A claim and the outcome of the SAME key in one statement (a retry of a key
// still in flight arrives as its request ends).

/// done + the key's retry in one statement: the retry is not claimed (the key
/// was forwarded), and the done is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_and_the_done_of_one_key_in_one_statement_never_claim_it_again() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (db, url) = pg.new_database();
    let s = PostgresState::connect(&pg_config(&url)).await.unwrap();
    let owner = Owner::SINGLE;
    for round in 0..5 {
        let k = format!("a1-{round}");
        let key = rkey(&k);
        assert!(matches!(
            s.begin(owner, &key, &claim(1, 1_000), STRICT).await,
            Ok(Begun::Claimed)
        ));
        let blocked = block_worker(pg, &db, &url, &s, owner, &format!("a1-block-{round}")).await;
        let before = s.stats();
        let retry_claim = claim(1, 1_500);
        // The retry's claim first or the outcome first: both orders.
        let (done, retry) = if round % 2 == 0 {
            let d = queue(s.finish(owner, &key, End::Done(ended(1, 1_000, State::Done)))).await;
            let r = queue(s.begin(owner, &key, &retry_claim, STRICT)).await;
            (d, r)
        } else {
            let r = queue(s.begin(owner, &key, &retry_claim, STRICT)).await;
            let d = queue(s.finish(owner, &key, End::Done(ended(1, 1_000, State::Done)))).await;
            (d, r)
        };
        blocked.release().await;
        let (done, retry) = tokio::join!(done, retry);
        let after = s.stats();
        eprintln!(
            "round {round}: done {done:?}; retry {:?}; commits +{} records +{}",
            retry.as_ref().map(|b| match b {
                Begun::Claimed => "CLAIMED".to_owned(),
                Begun::Exists(r) => format!("exists {:?}", r.state),
            }),
            after.batches - before.batches,
            after.records - before.records
        );
        done.unwrap();
        match retry.unwrap() {
            Begun::Claimed => panic!("round {round}: the retry of a forwarded key was claimed"),
            Begun::Exists(r) => assert!(matches!(r.state, State::InFlight | State::Done)),
        }
        assert_eq!(db_state(pg, &db, &k), "1");
        assert_eq!(body_of(pg, &db, &k), "201 made");
        // One commit for the blocker, one for the combined statement.
        assert_eq!(after.batches - before.batches, 2, "not one statement");
        // A later retry replays.
        match s
            .begin(owner, &key, &claim(1, 2_000), STRICT)
            .await
            .unwrap()
        {
            Begun::Exists(r) => assert_eq!(r.state, State::Done),
            Begun::Claimed => panic!("claimed after done"),
        }
    }
}

/// A delete (nothing sent) + two retries of the key in the same gathered
/// batch: the second retry goes in a round of its own. At most one claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_and_two_retries_of_one_key_in_one_batch_claim_it_once() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (db, url) = pg.new_database();
    let s = PostgresState::connect(&pg_config(&url)).await.unwrap();
    let owner = Owner::SINGLE;
    for round in 0..4 {
        let k = format!("a2-{round}");
        let key = rkey(&k);
        assert!(matches!(
            s.begin(owner, &key, &claim(1, 1_000), STRICT).await,
            Ok(Begun::Claimed)
        ));
        let blocked = block_worker(pg, &db, &url, &s, owner, &format!("a2-block-{round}")).await;
        let (c2, c3) = (claim(1, 1_500), claim(1, 1_600));
        let del = queue(s.finish(owner, &key, End::Delete)).await;
        let r2 = queue(s.begin(owner, &key, &c2, STRICT)).await;
        let r3 = queue(s.begin(owner, &key, &c3, STRICT)).await;
        blocked.release().await;
        let (del, r2, r3) = tokio::join!(del, r2, r3);
        del.unwrap();
        let claimed = [r2.unwrap(), r3.unwrap()]
            .iter()
            .filter(|b| matches!(b, Begun::Claimed))
            .count();
        eprintln!(
            "round {round}: claims won {claimed}; state {}",
            db_state(pg, &db, &k)
        );
        assert!(claimed <= 1, "two claims of one key");
        assert_eq!(claimed, 1, "a freed key was never claimed by its retries");
        assert_eq!(db_state(pg, &db, &k), "0");
    }
}

// ---------------------------------------------------------------------------
// A combined statement cut (TCP relay) with a claim and a done in it:
// while it waits at the database, or after it committed.

/// Where the relay cuts the combined statement.
#[derive(Debug, Clone, Copy)]
enum Cut {
    /// While it waits at the database: its outcome is unknown. The test's
    /// hold ends before the background rewrite of the done, or after it.
    Waiting { rewrite_first: bool },
    /// After it committed, its reply held in the relay.
    Committed,
}

/// The claim ends free (released after the statement ends: it was never
/// forwarded), the done ends written — whether the statement commits
/// before or after the background rewrite, or committed before the cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_combined_statement_frees_its_claim_and_keeps_its_done() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (db, url) = pg.new_database();
    let relay = Relay::start(pg.port).await;
    let s = connect_waiting(&relay.url(&db), 30_000).await;
    let owner = Owner::SINGLE;
    // `Committed` last: it leaves the relay holding replies.
    let cuts = [
        Cut::Waiting {
            rewrite_first: false,
        },
        Cut::Waiting {
            rewrite_first: true,
        },
        Cut::Committed,
    ];
    for (round, cut) in cuts.into_iter().enumerate() {
        let (kd, kn) = (format!("a3-done-{round}"), format!("a3-new-{round}"));
        let (done_key, new_key) = (rkey(&kd), rkey(&kn));
        assert!(matches!(
            s.begin(owner, &done_key, &claim(1, 1_000), STRICT).await,
            Ok(Begun::Claimed)
        ));
        let blocked = block_worker(pg, &db, &url, &s, owner, &format!("a3-block-{round}")).await;
        let hold_new = KeyHold::start(&url, "pay", 0, &kn).await;
        let done = queue(s.finish(owner, &done_key, End::Done(ended(1, 1_000, State::Done)))).await;
        let fresh_claim = claim(2, 1_000);
        let fresh = queue(s.begin(owner, &new_key, &fresh_claim, STRICT)).await;
        blocked.release().await;
        // The combined statement (its comment says claims) waits on the hold.
        until("the combined statement waits at the database", || {
            pg.waits_on_a_lock(&db, "/* fencegate: claims */")
        })
        .await;
        match cut {
            Cut::Waiting { rewrite_first } => {
                relay.cut();
                let (done, fresh) = tokio::join!(done, fresh);
                eprintln!(
                    "{cut:?}: done {done:?}; claim {:?}",
                    fresh.as_ref().map(|_| ())
                );
                assert!(done.is_err() && fresh.is_err());
                if rewrite_first {
                    until("the background rewrite wrote the done", || {
                        db_state(pg, &db, &kd) == "1"
                    })
                    .await;
                }
                hold_new.release().await;
            }
            Cut::Committed => {
                relay.hold_replies(true);
                hold_new.release().await;
                until("the combined statement committed", || {
                    db_state(pg, &db, &kn) == "0" && db_state(pg, &db, &kd) == "1"
                })
                .await;
                relay.cut();
                let (done, fresh) = tokio::join!(done, fresh);
                eprintln!(
                    "{cut:?}: done {done:?}; claim {:?}",
                    fresh.as_ref().map(|_| ())
                );
                assert!(fresh.is_err(), "the claim's answer was lost");
            }
        }
        // Released, the hold lets the cut statement go on: the claim is
        // freed only once it ended (it may commit its claim first), so "no
        // record" before then proves nothing (a test's false alarm, once).
        until("the cut statement ended", || {
            !pg.runs(&db, "/* fencegate: claims */")
        })
        .await;
        until("the never-forwarded claim is freed", || {
            db_state(pg, &db, &kn).is_empty()
        })
        .await;
        until("the done is written", || db_state(pg, &db, &kd) == "1").await;
        assert_eq!(body_of(pg, &db, &kd), "201 made");
        match s
            .begin(owner, &done_key, &claim(1, 3_000), STRICT)
            .await
            .unwrap()
        {
            Begun::Exists(r) => assert_eq!(r.state, State::Done),
            Begun::Claimed => panic!("a done key claimed again"),
        }
        let claimed = s.begin(owner, &new_key, &claim(2, 3_000), STRICT).await;
        assert!(
            matches!(claimed, Ok(Begun::Claimed)),
            "{cut:?}: {claimed:?}"
        );
    }
}

// ---------------------------------------------------------------------------
// The owner-row share lock spans both kinds' shards.

/// An outcome of a lost shard beside a claim on a shard still held, in one
/// statement: the outcome fails `OwnerLost` and leaves the successor's record
/// as it was; the claim succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_shards_outcome_fails_beside_a_held_shards_claim_that_succeeds() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (db, url) = pg.new_database();
    let a = PostgresState::connect(&pg_config(&url)).await.unwrap();
    let b = PostgresState::connect(&pg_config(&url)).await.unwrap();
    let on = |shard, generation| Owner {
        shard,
        generation: Generation::new(generation),
    };
    a.claim_shard(on(1, 1)).await.unwrap();
    a.claim_shard(on(2, 1)).await.unwrap();
    let lost = rkey("a4-lost");
    assert!(matches!(
        a.begin(on(2, 1), &lost, &claim(1, 1_000), STRICT).await,
        Ok(Begun::Claimed)
    ));
    // B takes shard 2: A's record becomes B's in-doubt record.
    b.claim_shard(on(2, 2)).await.unwrap();
    assert_eq!(b.recover(on(2, 2), 2_000).await.unwrap(), 1);
    let before = pg.psql(&db, "SELECT * FROM fencegate_dedup WHERE key = 'a4-lost'");
    let blocked = block_worker(pg, &db, &url, &a, on(1, 1), "a4-block").await;
    let done = queue(a.finish(on(2, 1), &lost, End::Done(ended(1, 1_000, State::Done)))).await;
    let fresh_key = rkey("a4-fresh");
    let fresh_claim = claim(2, 1_000);
    let fresh = queue(a.begin(on(1, 1), &fresh_key, &fresh_claim, STRICT)).await;
    blocked.release().await;
    let (done, fresh) = tokio::join!(done, fresh);
    eprintln!(
        "deposed done: {done:?}; claim on the held shard: {:?}",
        fresh.as_ref().map(|_| ())
    );
    assert!(
        matches!(done, Err(StateError::OwnerLost { .. })),
        "{done:?}"
    );
    assert!(matches!(fresh, Ok(Begun::Claimed)));
    assert_eq!(
        pg.psql(&db, "SELECT * FROM fencegate_dedup WHERE key = 'a4-lost'"),
        before,
        "a deposed generation's outcome changed the successor's record"
    );
}

// ---------------------------------------------------------------------------
// Destination level.

/// Many retries of each key racing its own outcome (claims and outcomes of one
/// key co-batched at random) through fencegate on PostgreSQL: every key
/// reaches the origin exactly once and ends replayable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_racing_their_keys_outcomes_reach_the_origin_once() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (db, url) = pg.new_database();
    let r = Arc::new(rig(&url, "").await);
    let pay = Arc::new(r.hold("pay").await);
    let keys: Vec<String> = (0..24).map(|i| format!("a5-{i}")).collect();
    let (b0, r0) = (
        r.fg.metric_sum("fencegate_flush_batches_total").await,
        r.fg.metric_sum("fencegate_flush_records_total").await,
    );
    let mut tasks = Vec::new();
    for k in &keys {
        for _ in 0..4 {
            let (r, pay, k) = (r.clone(), pay.clone(), k.clone());
            tasks.push(tokio::spawn(async move {
                let mut seen = Vec::new();
                for _ in 0..200 {
                    let a = keyed_answer(&r.fg, &pay, &k).await;
                    let end = matches!(a, Answer::Forwarded(200) | Answer::Replayed(200));
                    seen.push(a);
                    if end {
                        break;
                    }
                    tokio::task::yield_now().await;
                }
                seen
            }));
        }
    }
    let mut unfinished = 0;
    let mut all = Vec::new();
    for t in tasks {
        let seen = t.await.unwrap();
        all.extend(seen.iter().cloned());
        if !matches!(
            seen.last(),
            Some(Answer::Forwarded(200) | Answer::Replayed(200))
        ) {
            unfinished += 1;
            eprintln!("unfinished: {:?}", seen.last());
        }
    }
    eprintln!(
        "answers {:?}; commits {} for {} records",
        tally(&all),
        r.fg.metric_sum("fencegate_flush_batches_total").await - b0,
        r.fg.metric_sum("fencegate_flush_records_total").await - r0
    );
    let arrivals = r.arrivals_by_key();
    for k in &keys {
        assert_eq!(arrivals.get(k).copied().unwrap_or(0), 1, "{k}: arrivals");
        assert_eq!(db_state(pg, &db, k), "1");
    }
    assert_eq!(unfinished, 0);
}

// ---------------------------------------------------------------------------
// Retried statements and lock waits.

/// A combined statement chosen as a deadlock victim (class 40) is sent again:
/// the second try writes exactly what one would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_combined_statement_retried_after_a_deadlock_writes_what_one_would() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (db, url) = pg.new_database();
    let a = connect_waiting(&url, 30_000).await;
    let on = |shard, generation| Owner {
        shard,
        generation: Generation::new(generation),
    };
    a.claim_shard(on(1, 1)).await.unwrap();
    a.claim_shard(on(2, 1)).await.unwrap();
    let k2 = rkey("a6-done");
    assert!(matches!(
        a.begin(on(2, 1), &k2, &claim(1, 1_000), STRICT).await,
        Ok(Begun::Claimed)
    ));
    // The test's transaction holds owner row 2.
    let (t, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    t.batch_execute("BEGIN; SELECT 1 FROM fencegate_owners WHERE shard = 2 FOR UPDATE")
        .await
        .unwrap();
    let blocked = block_worker(pg, &db, &url, &a, on(1, 1), "a6-block").await;
    let done = queue(a.finish(on(2, 1), &k2, End::Done(ended(1, 1_000, State::Done)))).await;
    let n = rkey("a6-new");
    let n_claim = claim(2, 1_000);
    let fresh = queue(a.begin(on(1, 1), &n, &n_claim, STRICT)).await;
    blocked.release().await;
    // The combined statement share-locks row 1, waits for row 2.
    until("the combined statement waits for owner row 2", || {
        pg.waits_on_a_lock(&db, "/* fencegate: claims */")
    })
    .await;
    // The test's transaction now wants row 1: a deadlock.
    let t = Arc::new(t);
    let second = {
        let t = t.clone();
        tokio::spawn(async move {
            t.batch_execute("SELECT 1 FROM fencegate_owners WHERE shard = 1 FOR UPDATE")
                .await
        })
    };
    let victim_was_test = second.await.unwrap().is_err();
    eprintln!(
        "deadlock victim: {}",
        if victim_was_test {
            "the test's transaction"
        } else {
            "the combined statement (retried)"
        }
    );
    if !victim_was_test {
        // Its retry waits behind the test's transaction, which now holds both.
        until("the retried statement waits", || {
            pg.waits_on_a_lock(&db, "/* fencegate: claims */")
        })
        .await;
    }
    t.batch_execute("ROLLBACK").await.unwrap();
    let (done, fresh) = tokio::join!(done, fresh);
    eprintln!("done {done:?}; claim {:?}", fresh.as_ref().map(|_| ()));
    done.unwrap();
    assert!(matches!(fresh, Ok(Begun::Claimed)));
    assert_eq!(db_state(pg, &db, "a6-done"), "1");
    assert_eq!(body_of(pg, &db, "a6-done"), "201 made");
    assert_eq!(db_state(pg, &db, "a6-new"), "0");
    assert_eq!(
        pg.psql(&db, "SELECT count(*) FROM fencegate_dedup"),
        "3",
        "blocker, done, new"
    );
}

/// The share lock spans both kinds' shards: a combined statement whose claim
/// (shard 1) waits on a lock holds shard 2's owner row (its outcome's)
/// meanwhile. The rules hold — the done of generation 1 commits before the
/// takeover of shard 2 — but the takeover of shard 2 waits on a key of shard 1
/// (the liveness coupling the combination brings).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_of_an_outcomes_shard_waits_on_a_claims_lock() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (db, url) = pg.new_database();
    let a = connect_waiting(&url, 30_000).await;
    let b = PostgresState::connect(&pg_config(&url)).await.unwrap();
    let on = |shard, generation| Owner {
        shard,
        generation: Generation::new(generation),
    };
    a.claim_shard(on(1, 1)).await.unwrap();
    a.claim_shard(on(2, 1)).await.unwrap();
    let k = rkey("a9-done");
    assert!(matches!(
        a.begin(on(2, 1), &k, &claim(1, 1_000), STRICT).await,
        Ok(Begun::Claimed)
    ));
    let blocked = block_worker(pg, &db, &url, &a, on(1, 1), "a9-block").await;
    let hold_n = KeyHold::start(&url, "pay", 1, "a9-new").await;
    let done = queue(a.finish(on(2, 1), &k, End::Done(ended(1, 1_000, State::Done)))).await;
    let n = rkey("a9-new");
    let n_claim = claim(2, 1_000);
    let fresh = queue(a.begin(on(1, 1), &n, &n_claim, STRICT)).await;
    blocked.release().await;
    until("the combined statement waits on shard 1's key", || {
        pg.waits_on_a_lock(&db, "/* fencegate: claims */")
    })
    .await;
    let takeover = {
        let b = b.clone();
        tokio::spawn(async move { b.claim_shard(on(2, 2)).await })
    };
    until("the takeover of shard 2 waits", || {
        pg.waits_on_a_lock(&db, "INSERT INTO fencegate_owners")
    })
    .await;
    eprintln!("the takeover of shard 2 waits on a claim of shard 1 blocked on a key lock");
    hold_n.release().await;
    takeover.await.unwrap().unwrap();
    let (done, fresh) = tokio::join!(done, fresh);
    eprintln!("done {done:?}; claim {:?}", fresh.as_ref().map(|_| ()));
    done.unwrap();
    assert!(matches!(fresh, Ok(Begun::Claimed)));
    assert_eq!(db_state(pg, &db, "a9-done"), "1");
    assert_eq!(b.recover(on(2, 2), 5_000).await.unwrap(), 0);
}

/// Two instances' combined statements over the same keys and shards (each key
/// claimed on both, its winner's done racing the losers' retries): one claim
/// per key, every done written, and no deadlock at the database
/// (`pg_stat_database.deadlocks`: a retried statement would hide one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_combined_statements_never_deadlock() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (db, url) = pg.new_database();
    let a = PostgresState::connect(&pg_config(&url)).await.unwrap();
    let b = PostgresState::connect(&pg_config(&url)).await.unwrap();
    let on = |shard| Owner {
        shard,
        generation: Generation::new(1),
    };
    for shard in 1..=4 {
        a.claim_shard(on(shard)).await.unwrap();
    }
    let deadlocks = || {
        pg.psql(
            &db,
            &format!("SELECT deadlocks FROM pg_stat_database WHERE datname = '{db}'"),
        )
        .parse::<u64>()
        .unwrap()
    };
    let before = deadlocks();
    let keys: Vec<(String, u32)> = (0..60)
        .map(|i| (format!("a10-{i}"), 1 + (i * 7 % 4) as u32))
        .collect();
    let mut tasks = Vec::new();
    for round in 0..3 {
        for (i, (k, shard)) in keys.iter().enumerate() {
            // Keys in a different order per instance and round.
            let s = if (i + round) % 2 == 0 {
                a.clone()
            } else {
                b.clone()
            };
            let (k, owner) = (rkey(k), on(*shard));
            tasks.push(tokio::spawn(async move {
                loop {
                    match s.begin(owner, &k, &claim(1, 1_000), STRICT).await {
                        Ok(Begun::Claimed) => {
                            s.finish(owner, &k, End::Done(ended(1, 1_000, State::Done)))
                                .await
                                .unwrap();
                            return 1;
                        }
                        Ok(Begun::Exists(r)) if r.state == State::Done => return 0,
                        Ok(Begun::Exists(_)) => tokio::task::yield_now().await,
                        Err(e) => panic!("{e}"),
                    }
                }
            }));
        }
    }
    let mut claimed = 0;
    for t in tasks {
        claimed += t.await.unwrap();
    }
    let after = deadlocks();
    eprintln!(
        "claims won {claimed} of {} keys; deadlocks {}",
        keys.len(),
        after - before
    );
    assert_eq!(claimed, keys.len());
    assert_eq!(
        pg.psql(&db, "SELECT count(*) FROM fencegate_dedup WHERE state = 1"),
        keys.len().to_string()
    );
    assert_eq!(after, before, "deadlocks at the database");
}
