//! Upgrading a PostgreSQL database in use: schema 6 → 7 (the index
//! `fencegate_dedup_by_state` dropped) with live records of every state, and a
//! schema-6 instance running beside the migration. The migrations a first
//! start makes are in the parent module's schema section.

use fencegate::state::postgres::PostgresState;
use fencegate::state::{Begun, Owner, State, StateStore};

use super::{answer, claim, current, keyed_answer, pg_config, rig, rkey, Answer, STRICT};
use crate::support::postgres::PgServer;

/// Schema 6 → 7 with live records of every state: listings, counts, recovery
/// and claims work after the index is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_6_with_live_records_of_every_state_migrates_to_7() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (db, url) = pg.new_database();
    drop(PostgresState::connect(&pg_config(&url)).await.unwrap());
    // Back to what a version-6 database is, with records of each state.
    pg.psql(
        &db,
        &(crate::support::postgres::UNDO_SCHEMA_13.to_owned()
            + "CREATE INDEX fencegate_dedup_by_state ON fencegate_dedup (state, route, key); \
         DROP TABLE fencegate_set_up, fencegate_queue, fencegate_queue_leases, fencegate_queue_paused, fencegate_queue_jobs; UPDATE fencegate_schema SET version = 6; \
         INSERT INTO fencegate_dedup (route, key, shard, state, fingerprint, epoch, \
           owner_generation, created_ms, updated_ms, status, headers, body, claim) \
         SELECT 'pay', 'v6-' || s || '-' || i, 0, s, decode(repeat('01', 32), 'hex'), \
           -9223372036854775807, 0, 1000 + i, 1000 + i, \
           CASE WHEN s = 1 THEN 200 END, NULL, CASE WHEN s = 1 THEN 'ok'::bytea END, \
           CASE WHEN s = 0 THEN i END \
         FROM generate_series(0, 2) s, generate_series(1, 5) i"),
    );
    let s = PostgresState::connect(&pg_config(&url)).await.unwrap();
    assert_eq!(
        pg.psql(&db, "SELECT version FROM fencegate_schema"),
        current()
    );
    assert_eq!(
        pg.psql(
            &db,
            "SELECT count(*) FROM pg_indexes WHERE indexname = 'fencegate_dedup_by_state'"
        ),
        "0"
    );
    let total = |st| {
        let s = s.clone();
        async move { s.list(st, Some("pay"), None, 100).await.unwrap().total }
    };
    assert_eq!(total(State::InFlight).await, 5);
    assert_eq!(total(State::Done).await, 5);
    assert_eq!(total(State::InDoubt).await, 5);
    assert_eq!(s.recover(Owner::SINGLE, 5_000).await.unwrap(), 5);
    assert_eq!(total(State::InDoubt).await, 10);
    assert_eq!(total(State::InFlight).await, 0);
    let page = s.list(State::InDoubt, None, None, 3).await.unwrap();
    assert_eq!(page.records.len(), 3);
    match s
        .begin(Owner::SINGLE, &rkey("v6-1-3"), &claim(1, 9_000), STRICT)
        .await
    {
        Ok(Begun::Exists(r)) => assert_eq!(r.state, State::Done),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        s.begin(Owner::SINGLE, &rkey("v7-new"), &claim(1, 9_000), STRICT)
            .await,
        Ok(Begun::Claimed)
    ));
}

/// A rolling upgrade: a fencegate of schema 6 runs beside the migration to 7,
/// with a request in flight across it. The old instance goes on (the held
/// request answered, new keys forwarded, retries replayed, each key delivered
/// once) and refuses the database when it restarts.
///
/// Run alone, with the older build as the binary under test:
///   FENCEGATE_TEST_BIN=/path/to/fencegate-v6 cargo test --test it -- \
///     postgres::upgrade::a_schema_6_instance_beside_the_migration_to_7_goes_on_then_refuses_to_restart \
///     --include-ignored
/// (a build of the last commit at schema 6: the parent of the first commit that
/// `git log --reverse -G 'VERSION: i32 = 7' -- src/state/schema.rs` lists).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs FENCEGATE_TEST_BIN naming a schema-6 build"]
async fn a_schema_6_instance_beside_the_migration_to_7_goes_on_then_refuses_to_restart() {
    skip_without_postgres!();
    if std::env::var("FENCEGATE_TEST_BIN").is_err() {
        eprintln!("skipped: FENCEGATE_TEST_BIN (a schema-6 build) is not set");
        return;
    }
    let pg = PgServer::shared();
    let (db, url) = pg.new_database();
    let mut r = rig(&url, "").await;
    assert_eq!(
        pg.psql(&db, "SELECT version FROM fencegate_schema"),
        "6",
        "FENCEGATE_TEST_BIN is not a schema-6 build"
    );
    let pay = r.hold("pay").await;
    assert_eq!(
        keyed_answer(&r.fg, &pay, "a8-warm").await,
        Answer::Forwarded(200)
    );
    // A request in flight (held at the origin) across the migration.
    let mut req = crate::support::keyed(&r.fg, "/pay/a8-held", &pay, "a8-held", "pay a8-held");
    req.headers_mut()
        .insert("x-test-hold", "a8-held".parse().unwrap());
    let before = r.origin.count();
    let pending = tokio::spawn(crate::support::try_send(req));
    r.origin.wait_for(before + 1).await;
    // A schema-7 instance starts beside it: the migration drops the index.
    let new = PostgresState::connect(&pg_config(&url)).await.unwrap();
    assert_eq!(
        pg.psql(&db, "SELECT version FROM fencegate_schema"),
        current()
    );
    r.origin.release("a8-held");
    assert_eq!(answer(pending.await.unwrap()), Answer::Forwarded(200));
    // The old instance goes on: new keys, retries replayed.
    assert_eq!(
        keyed_answer(&r.fg, &pay, "a8-after").await,
        Answer::Forwarded(200)
    );
    for k in ["a8-held", "a8-after", "a8-warm"] {
        assert_eq!(
            keyed_answer(&r.fg, &pay, k).await,
            Answer::Replayed(200),
            "{k}"
        );
        assert_eq!(r.arrivals_of(k), 1, "{k}");
    }
    match new
        .begin(Owner::SINGLE, &rkey("a8-held"), &claim(1, 1), STRICT)
        .await
    {
        Ok(Begun::Exists(rec)) => assert_eq!(rec.state, State::Done),
        other => panic!("{other:?}"),
    }
    // The old instance restarts (a crash, a node drain, a rollback of the
    // rollout): it refuses the database.
    r.fg.kill9();
    let again = r.fg.spawn(None);
    eprintln!(
        "the schema-6 build restarted beside schema 7: {}",
        match &again {
            Ok(()) => "started".to_owned(),
            Err(e) => e.lines().last().unwrap_or_default().to_owned(),
        }
    );
    assert!(again.is_err());
}
