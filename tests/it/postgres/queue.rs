//! SPEC §11 on PostgreSQL, at the store: every queue write is conditioned on
//! the shard's owner generation. A deposed owner's attempt is never written as
//! started — not one sent before the takeover and held on the way to the
//! database — so it is never sent; its outcome writes fail the same way; the
//! successor reads the queue where the deposed owner left it.

use std::sync::Arc;

use bytes::Bytes;
use fencegate::queue::postgres::PgQueue;
use fencegate::queue::{Accepted, Message, Status};
use fencegate::state::ownership::RowVersion;
use fencegate::state::{Generation, Owner, OwnershipStore, StateError, StateStore};

use super::pg_config;
use crate::support::postgres::PgServer;
use crate::support::queue::{envelope, message};
use crate::support::relay::Relay;
use crate::support::*;
use fencegate::config::StateConfig;
use fencegate::state::postgres::PostgresState;

async fn accept(q: &PgQueue, owner: Owner, key: &str, epoch: u64) -> Message {
    match q
        .accept(owner, message(key, epoch), &envelope(), Arc::new(|| true))
        .await
        .unwrap()
    {
        Accepted::New(m) => m,
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deposed_owners_queue_writes_are_refused_even_in_flight_at_the_takeover() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (db, url) = pg.new_database();
    let relay = Relay::start(pg.port).await;
    let old_db = PostgresState::connect(&StateConfig {
        timeout_ms: 30_000,
        ..pg_config(&relay.url(&db))
    })
    .await
    .unwrap();
    let new_db = PostgresState::connect(&pg_config(&url)).await.unwrap();
    let gen = |generation| Owner {
        shard: 3,
        generation: Generation::new(generation),
    };
    old_db.claim_shard(gen(1)).await.unwrap();
    let (old, new) = (PgQueue::new(old_db.clone()), PgQueue::new(new_db.clone()));

    // Places follow acceptance, and a key accepted twice is one message.
    let m1 = accept(&old, gen(1), "m1", 1).await;
    let m2 = accept(&old, gen(1), "m2", 1).await;
    assert!(m1.seq < m2.seq);
    match old
        .accept(gen(1), message("m1", 1), &envelope(), Arc::new(|| true))
        .await
        .unwrap()
    {
        Accepted::Exists(m) => assert_eq!(m.seq, m1.seq),
        other => panic!("{other:?}"),
    }
    // An aborted pass takes no place.
    assert!(matches!(
        old.accept(gen(1), message("m3", 1), &envelope(), Arc::new(|| false))
            .await
            .unwrap(),
        Accepted::Aborted
    ));
    assert!(new.get("hook", "m3").await.unwrap().is_none());
    assert_eq!(
        new.envelope("hook", "m1").await.unwrap().map(|e| e.body),
        Some(Bytes::from_static(b"body"))
    );

    // The old owner's "attempt started" for m1, held in the relay across the
    // takeover: refused, so m1 is never sent by it.
    let mut started = m1.clone();
    started.status = Status::Delivering;
    started.attempts = 1;
    relay.hold_requests(true);
    let attempt = {
        let (old, started) = (PgQueue::new(old_db.clone()), started.clone());
        tokio::spawn(async move { old.start_attempt(gen(1), &started).await })
    };
    eventually("the attempt's write is held in the relay", || async {
        relay.held_requests() > 0
    })
    .await;
    new_db.claim_shard(gen(2)).await.unwrap();
    relay.hold_requests(false);
    let r = attempt.await.unwrap();
    assert!(
        matches!(r, Err(StateError::OwnerLost { stored, .. }) if stored == Generation::new(2)),
        "an attempt written after the takeover: {r:?}"
    );
    assert_eq!(
        new.head("hook").await.unwrap().map(|m| (m.key, m.status)),
        Some(("m1".into(), Status::Pending)),
        "the successor finds m1 as it was, not started"
    );
    // Every other write of the deposed owner fails the same way.
    let mut done = m1.clone();
    done.status = Status::Delivered;
    assert!(matches!(
        old.settle(gen(1), &done).await,
        Err(StateError::OwnerLost { .. })
    ));
    assert!(matches!(
        old.put(gen(1), &started).await,
        Err(StateError::OwnerLost { .. })
    ));
    assert!(matches!(
        old.accept(gen(1), message("m4", 1), &envelope(), Arc::new(|| true))
            .await,
        Err(StateError::OwnerLost { .. })
    ));
    // The successor goes on from the head: m1, then m2.
    new.start_attempt(gen(2), &started).await.unwrap();
    assert_eq!(new.sent_epoch("hook").await.unwrap(), 1);
    new.settle(gen(2), &done).await.unwrap();
    assert_eq!(
        new.head("hook").await.unwrap().map(|m| m.key),
        Some("m2".into())
    );
    let m5 = accept(&new, gen(2), "m5", 2).await;
    assert!(m5.seq > m2.seq, "places go on across owners");
    assert_eq!(new.leases_with_work().await.unwrap(), ["hook"]);
    let depth = new.depth().await.unwrap();
    assert_eq!(depth["hook"].0, 2);
}

/// An operator's retry of a failed message is superseded by a newer epoch's
/// message waiting or attempted (checked with the lease's row locked), and
/// otherwise goes to the end of the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requeue_on_postgres_keeps_epoch_order() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (_db, url) = pg.new_database();
    let db = PostgresState::connect(&pg_config(&url)).await.unwrap();
    let q = PgQueue::new(db);
    let one = Owner::SINGLE;
    let mut m1 = accept(&q, one, "m1", 1).await;
    m1.status = Status::Failed;
    q.settle(one, &m1).await.unwrap();
    let again = match q.requeue(one, "hook", "m1", 5).await.unwrap() {
        fencegate::queue::Requeued::Done(m) => *m,
        other => panic!("{other:?}"),
    };
    assert!(again.seq > m1.seq);
    assert_eq!(again.status, Status::Pending);
    let mut again = again;
    again.status = Status::Failed;
    q.settle(one, &again).await.unwrap();
    accept(&q, one, "m2", 2).await;
    assert!(matches!(
        q.requeue(one, "hook", "m1", 6).await.unwrap(),
        fencegate::queue::Requeued::Superseded(2)
    ));
    assert_eq!(q.sweep(u64::MAX).await.unwrap(), 1, "failed m1 swept");
    assert!(matches!(
        q.requeue(one, "hook", "m1", 7).await.unwrap(),
        fencegate::queue::Requeued::Gone
    ));
}

const TTL: std::time::Duration = std::time::Duration::from_secs(6);

/// Acceptances of one lease arriving together share transactions (the
/// lease's row is held to the COMMIT): each still gets a place of its own, a
/// key sent twice is one message (the second finds the first, in the same
/// transaction or not), and a pass no longer admitted takes no place. (That
/// they share transactions is measured by the `queued-pg` bench, not here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acceptances_of_one_lease_arriving_together_each_get_their_own_place() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (_db, url) = pg.new_database();
    let q = Arc::new(PgQueue::new(
        PostgresState::connect(&pg_config(&url)).await.unwrap(),
    ));
    let one = Owner::SINGLE;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..(3 * fencegate::queue::postgres::BATCH) {
        let q = q.clone();
        // Every 7th is sent twice; every 10th is aborted before its place.
        let key = format!("k{}", if i % 7 == 6 { i - 1 } else { i });
        let admitted = i % 10 != 9;
        tasks.spawn(async move {
            let r = q
                .accept(
                    one,
                    message(&key, 1),
                    &envelope(),
                    Arc::new(move || admitted),
                )
                .await
                .unwrap();
            (key, admitted, r)
        });
    }
    let mut new = std::collections::BTreeMap::new();
    let mut found = Vec::new();
    let mut aborted = 0;
    while let Some(r) = tasks.join_next().await {
        match r.unwrap() {
            (key, true, Accepted::New(m)) => assert!(new.insert(key, m.seq).is_none()),
            (key, _, Accepted::Exists(m)) => found.push((key, m.seq)),
            (_, false, Accepted::Aborted) => aborted += 1,
            other => panic!("{other:?}"),
        }
    }
    let mut places: Vec<u64> = new.values().copied().collect();
    places.sort_unstable();
    places.dedup();
    assert_eq!(places.len(), new.len(), "one place per message");
    for (key, seq) in &found {
        assert_eq!(
            new.get(key),
            Some(seq),
            "{key}: the message its first sending made"
        );
    }
    assert!(aborted > 0);
    // The queue holds exactly the placed messages, in place order.
    let front = q.front("hook", 10_000).await.unwrap();
    assert_eq!(front.len(), new.len());
    assert!(front.windows(2).all(|w| w[0].seq < w[1].seq));
}

/// The check a takeover and a reload make (SPEC §11): a direct route on a
/// lease with messages that may still be sent (pending, delivering, failed),
/// or a queued route holding such messages under another lease, on either
/// side of its own in the index; delivered messages do not count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_takeover_check_finds_only_messages_that_may_still_be_sent() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (_db, url) = pg.new_database();
    let q = PgQueue::new(PostgresState::connect(&pg_config(&url)).await.unwrap());
    let one = Owner::SINGLE;
    let on = |key: &str, lease: &str| Message {
        lease: lease.into(),
        ..message(key, 1)
    };
    let put = |m: Message| {
        let q = &q;
        async move {
            match q
                .accept(one, m, &envelope(), Arc::new(|| true))
                .await
                .unwrap()
            {
                Accepted::New(m) => m,
                other => panic!("{other:?}"),
            }
        }
    };
    put(on("m-hook", "hook")).await;
    let mut failed = put(on("m-a", "a")).await;
    failed.status = Status::Failed;
    q.settle(one, &failed).await.unwrap();
    put(on("m-z", "z")).await;
    let mut done = put(on("m-d", "d")).await;
    done.status = Status::Delivered;
    q.settle(one, &done).await.unwrap();

    let found = |v: &[(&str, &str)]| {
        v.iter()
            .map(|(r, l)| (r.to_string(), l.to_string()))
            .collect::<std::collections::BTreeSet<_>>()
    };
    assert_eq!(
        q.holding_for(&[("hook", "hook", true)]).await.unwrap(),
        found(&[("hook", "a"), ("hook", "z")]),
        "the route's messages under other leases, below and above its own"
    );
    assert_eq!(
        q.holding_for(&[("direct", "d", false)]).await.unwrap(),
        found(&[]),
        "a delivered message holds nothing back"
    );
    assert_eq!(
        q.holding_for(&[("direct", "a", false), ("other", "hook", true)])
            .await
            .unwrap(),
        found(&[("hook", "a")]),
        "a failed message may be retried by an operator"
    );
    assert_eq!(
        q.holding_for(&[("hook", "elsewhere", false)])
            .await
            .unwrap(),
        found(&[("hook", "a")]),
        "a direct route under the name of a route holding messages, on any lease"
    );
    // Thousands of routes: one statement per kind, not one per route (third
    // review: 6,000 routes outlasted `[state] timeout_ms` and fencegate did
    // not start).
    let names: Vec<(String, String)> = (0..6000)
        .map(|i| (format!("r{i}"), format!("l{i}")))
        .collect();
    let mut many: Vec<(&str, &str, bool)> = names
        .iter()
        .enumerate()
        .map(|(i, (r, l))| (r.as_str(), l.as_str(), i % 2 == 0))
        .collect();
    many.push(("direct", "z", false));
    many.push(("hook", "hook", true));
    assert_eq!(
        q.holding_for(&many).await.unwrap(),
        found(&[("hook", "z"), ("hook", "a")]),
    );
}

/// SPEC §10.2: a row unchanged for `gate_ttl + grace` is free. An owner
/// stopped in the middle of a queue acceptance (paused, cut off) must not
/// keep it from its successor: the acceptance holds no lock on the owner row
/// while it waits or stalls (that lock is taken last, before the COMMIT), and
/// the server ends a transaction left idle, releasing the lease's row too.
/// (Reviewed: the successor's take waited for as long as the owner was
/// stopped.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_stopped_mid_acceptance_keeps_neither_its_shard_nor_the_lease() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (db, url) = pg.new_database();
    let relay = Relay::start(pg.port).await;
    let a_db = PostgresState::connect(&StateConfig {
        timeout_ms: 2_000,
        ..pg_config(&relay.url(&db))
    })
    .await
    .unwrap();
    let b_db = PostgresState::connect(&StateConfig {
        timeout_ms: 5_000,
        ..pg_config(&url)
    })
    .await
    .unwrap();
    let gen1 = a_db
        .take_shard(3, None, "fg-a", "http://a", TTL)
        .await
        .unwrap()
        .unwrap();
    let a_owner = Owner {
        shard: 3,
        generation: gen1,
    };
    a_db.claim_shard(a_owner).await.unwrap();
    let (a, b) = (PgQueue::new(a_db.clone()), PgQueue::new(b_db.clone()));
    accept(&a, a_owner, "m0", 1).await;
    // Another acceptance of the lease holds its row: A's waits behind it.
    let (other, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    other
        .batch_execute(
            "BEGIN; SELECT 1 FROM fencegate_queue_leases WHERE lease = 'hook' FOR UPDATE",
        )
        .await
        .unwrap();
    let accepting = {
        let a = PgQueue::new(a_db.clone());
        tokio::spawn(async move {
            a.accept(a_owner, message("m1", 1), &envelope(), Arc::new(|| true))
                .await
        })
    };
    eventually("A's acceptance waits for the lease's row", || async {
        pg.psql(
            &db,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND wait_event_type = 'Lock'",
        ) == "1"
    })
    .await;
    // A stops: nothing more of it goes either way. The lease's row goes to
    // A's transaction, which then idles, holding it.
    relay.hold_requests(true);
    relay.hold_replies(true);
    other.batch_execute("COMMIT").await.unwrap();
    // B takes the row at once: A holds no lock on it.
    let row = b_db
        .owner_rows()
        .await
        .unwrap()
        .into_iter()
        .find(|r| r.shard == 3)
        .unwrap();
    let gen2 = b_db
        .take_shard(
            3,
            Some(RowVersion {
                generation: row.generation,
                renewals: row.renewals,
            }),
            "fg-b",
            "http://b",
            TTL,
        )
        .await
        .expect("the take does not wait for the stopped owner")
        .expect("taken");
    let b_owner = Owner {
        shard: 3,
        generation: gen2,
    };
    b_db.claim_shard(b_owner).await.unwrap();
    // B accepts on the same lease once the server has ended A's idle
    // transaction (half of A's timeout_ms), long before A wakes.
    let m2 = accept(&b, b_owner, "m2", 2).await;
    relay.hold_requests(false);
    relay.hold_replies(false);
    assert!(accepting.await.unwrap().is_err(), "A's acceptance failed");
    assert!(b.get("hook", "m1").await.unwrap().is_none());
    assert!(m2.seq > 0);
    assert_eq!(
        b.head("hook").await.unwrap().map(|m| m.key),
        Some("m0".into())
    );
}

/// The owner's renewals go through while a queued lease is busy: acceptances
/// waiting for the lease's row hold no lock on the owner row, so they cannot
/// starve the renewal that updates it (SPEC §10.2: an owner that cannot renew
/// self-fences). (Reviewed: with four or more acceptances at once on one
/// lease, renewals timed out.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_go_through_while_a_queued_lease_is_busy() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (_db, url) = pg.new_database();
    let db = PostgresState::connect(&StateConfig {
        timeout_ms: 2_000,
        ..pg_config(&url)
    })
    .await
    .unwrap();
    let generation = db
        .take_shard(0, None, "fg-a", "http://a", TTL)
        .await
        .unwrap()
        .unwrap();
    let owner = Owner {
        shard: 0,
        generation,
    };
    db.claim_shard(owner).await.unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = tokio::task::JoinSet::new();
    for w in 0..8 {
        let (q, stop) = (PgQueue::new(db.clone()), stop.clone());
        workers.spawn(async move {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                n += 1;
                let m = message(&format!("w{w}-{n}"), 1);
                q.accept(owner, m, &envelope(), Arc::new(|| true))
                    .await
                    .unwrap();
            }
            n
        });
    }
    // Renewals for a while under that load: each must go through within the
    // state's timeout.
    for _ in 0..20 {
        db.renew_shards("fg-a", &[owner], TTL, std::time::Duration::ZERO)
            .await
            .expect("a renewal under a busy queued lease");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let accepted: u64 = workers.join_all().await.into_iter().sum();
    assert!(accepted > 8, "the lease was busy: {accepted} acceptances");
}

/// An acceptance whose COMMIT lands after `[state] timeout_ms` (a slow disk,
/// a synchronous standby; here a deferred trigger that sleeps at COMMIT, 8×
/// the timeout): the worker is answered 503, the message is committed anyway
/// — and its lease's deliverer, which looked before the COMMIT landed and
/// retired, is started by the queue's once-a-second look for leases with
/// messages and no deliverer: the message is delivered without another
/// request of its lease (second review, F1: before, it waited for the lease's
/// next acceptance; third review: wakes at fixed delays after the 503 missed
/// a COMMIT later than them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acceptance_committed_after_its_503_is_delivered_without_another_request() {
    skip_without_postgres!();
    let leases = tempfile::tempdir().unwrap();
    let origin = Origin::start().await;
    let (db_name, db) = PgServer::shared().new_database();
    let route = format!(
        "[[route]]\nname = \"hook\"\npath_prefix = \"/hook/\"\nupstream = \"{}\"\n\
         lease = \"hook\"\ntimeout_ms = 3000\ndelivery = \"queued\"\n",
        origin.url("/v1/")
    );
    let fg = Fencegate::start_with_server(
        "",
        &format!(
            "{}{}{route}",
            dir_store_toml(leases.path()),
            state_toml(&db, "timeout_ms = 500")
        ),
        &[],
    );
    let epochs = dir_epochs(leases.path());
    let w = acquire(
        &epochs,
        "hook",
        "worker-1",
        std::time::Duration::from_secs(120),
    )
    .await;
    let first = send(keyed(&fg, "/hook/events", &w, "m1", "one")).await;
    assert_eq!(
        first.status,
        202,
        "{}",
        String::from_utf8_lossy(&first.body)
    );
    origin.wait_until("m1", |log| log.len() == 1).await;
    PgServer::shared().psql(
        &db_name,
        "CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN IF NEW.key = 'late' THEN PERFORM pg_sleep(4); END IF; RETURN NULL; END $$; \
         CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON fencegate_queue \
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit();",
    );
    let late = send(keyed(&fg, "/hook/events", &w, "late", "two")).await;
    assert_eq!(late.status, 503, "{}", String::from_utf8_lossy(&late.body));
    origin
        .wait_until("the late message", |log| log.len() == 2)
        .await;
    let log = origin.log();
    assert_eq!(&log[1].body[..], b"two");
}
