//! SPEC §9 `[state] schema` and §10 "One database, one set-up": a PostgreSQL
//! database (or a schema in it) keeps the marks, dedup records and shard rows
//! of one set-up — one lease store and prefix. Two environments (staging and
//! production, each its own prefix and its own cluster, one database and one
//! peer token between them) must not merge: the second refuses to start unless
//! it has a schema of its own, and then each keeps its own marks and records.
//! Every test asserts what the destination received.
//!
//! A build without the set-up record fails them: the second set-up started
//! beside the first and split the shard rows with it; `schema` was an unknown
//! key (exit 2 for every configuration that set it); a changed record was not
//! looked at.

use std::time::Duration;

use crate::support::postgres::PgServer;
use crate::support::*;
use fencegate::lease::acquire::Holding;
use fencegate::lease::Epochs;
use http::Request;

macro_rules! skip_without_postgres {
    () => {
        if !$crate::support::postgres::available_or_skip() {
            return;
        }
    };
}

/// One token for both environments, as one secret store would hand it out.
const PEER_TOKEN: &str = "one-secret-store-token-0123456789";
const ADMIN_TOKEN: &str = "admin-token-of-the-test";

/// One environment: its prefix in the shared bucket, and how its state is
/// configured.
struct Env {
    prefix: &'static str,
    /// `[state] schema`, when it has one.
    schema: Option<&'static str>,
    /// A cluster member's id, or `None` for a single instance.
    cluster: Option<&'static str>,
}

/// An S3 test server's endpoint in a store section: `s3`'s, or `other`'s.
fn on(store: String, s3: &S3Server, other: Option<&S3Server>) -> String {
    match other {
        Some(o) => store.replace(&s3.endpoint, &o.endpoint),
        None => store,
    }
}

const STAGING: Env = Env {
    prefix: "staging/",
    schema: None,
    cluster: Some("fg-staging"),
};
const PROD: Env = Env {
    prefix: "prod/",
    schema: None,
    cluster: Some("fg-prod"),
};

impl Env {
    /// The config after `[server]`: store, state, cluster, one keyed route
    /// `/pay/` on lease `pay` (`port`: the member's proxy listener).
    fn toml(&self, s3: &S3Server, db: &str, origin: &Origin, port: u16) -> String {
        let store = s3.store_toml(200).replace(
            &format!("prefix = \"{PREFIX}\""),
            &format!("prefix = \"{}\"", self.prefix),
        );
        let schema = self
            .schema
            .map_or(String::new(), |s| format!("schema = \"{s}\"\n"));
        let cluster = self.cluster.map_or(String::new(), |id| {
            format!(
                "[cluster]\ninstance_id = \"{id}\"\nadvertise = \"http://127.0.0.1:{port}\"\nshards = 2\npeer_token = \"{PEER_TOKEN}\"\n\n"
            )
        });
        format!(
            "{store}gate_ttl = \"6s\"\nself_fence_margin = \"2s\"\n{}{cluster}{}",
            state_toml(db, &schema),
            route_toml("pay", "pay", origin, "")
        )
    }

    /// [`Env::toml`] for a fencegate on another S3 server holding a bucket of
    /// the same name.
    fn toml_on(&self, s3: &S3Server, other: &S3Server, db: &str, origin: &Origin) -> String {
        on(self.toml(s3, db, origin, free_port()), s3, Some(other))
    }

    fn start(&self, s3: &S3Server, db: &str, origin: &Origin) -> Fencegate {
        let port = free_port();
        Fencegate::start_listening(
            &format!("127.0.0.1:{port}"),
            "",
            &self.toml(s3, db, origin, port),
            &[("FENCEGATE_ADMIN_TOKEN", ADMIN_TOKEN)],
        )
    }

    async fn epochs(&self, s3: &S3Server) -> Epochs {
        Epochs::new(s3.store().await, self.prefix)
    }
}

/// Ready, and (a cluster member alone in its cluster) serving every shard.
async fn ready(fg: &Fencegate) {
    eventually("the instance is ready and serves", || async {
        let cluster = fg.admin_json("/v1/cluster").await;
        let serves = cluster["shard_map"]
            .as_array()
            .is_none_or(|m| m.iter().all(|s| s["served_here"] == true));
        serves && fg.admin_json("/readyz").await["status"] == "ready"
    })
    .await;
}

/// A worker's keyed POST of `payload` under `key`.
async fn keyed_post(fg: &Fencegate, w: &Holding, key: &str, payload: &str) -> Reply {
    send(keyed(fg, "/pay/x", w, key, payload)).await
}

/// An S3 test server, a recording origin and a fresh database: what two
/// environments share.
struct World {
    s3: S3Server,
    origin: Origin,
    db_name: String,
    db: String,
}

impl World {
    async fn new() -> World {
        let (db_name, db) = PgServer::shared().new_database();
        World {
            s3: S3Server::start(),
            origin: Origin::start().await,
            db_name,
            db,
        }
    }

    /// `env` started on this world's database (`url`: another connection
    /// string) and ready.
    async fn start(&self, env: &Env) -> Fencegate {
        let fg = env.start(&self.s3, &self.db, &self.origin);
        ready(&fg).await;
        fg
    }

    /// A worker of `env` holding `pay` (epoch 1).
    async fn worker(&self, env: &Env) -> Holding {
        acquire(
            &env.epochs(&self.s3).await,
            "pay",
            "w",
            Duration::from_secs(60),
        )
        .await
    }

    /// `env` started, and `payload` delivered through it under `key`: the
    /// instance, the worker and the answer.
    async fn delivered(&self, env: &Env, key: &str, payload: &str) -> (Fencegate, Holding, Reply) {
        let fg = self.start(env).await;
        let w = self.worker(env).await;
        let first = keyed_post(&fg, &w, key, payload).await;
        assert_eq!(first.status, 200, "{:?}", first.body);
        (fg, w, first)
    }
}

/// `serve` of `toml` expected to exit: its code and stderr, once another
/// instance's released instance guard is free (SPEC §10: `gate_ttl + grace`
/// after it was written; until then every start is refused for that).
async fn refused_past_the_guard(toml: &str) -> (Option<i32>, String) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (code, stderr) = serve_expecting_exit(toml);
        if !stderr.contains("holds the instance guard") || std::time::Instant::now() > deadline {
            return (code, stderr);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A keyed POST sent again while the instance answers 503 (a restarted
/// member serves its shard once it has taken it again; a retry is safe).
async fn keyed_post_once_served(fg: &Fencegate, w: &Holding, key: &str, payload: &str) -> Reply {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let r = keyed_post(fg, w, key, payload).await;
        if r.status != 503 || std::time::Instant::now() > deadline {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn bodies(origin: &Origin) -> Vec<String> {
    origin
        .log()
        .iter()
        .map(|a| String::from_utf8_lossy(&a.body).into_owned())
        .collect()
}

/// Production, pointed at staging's database by mistake, refuses to start —
/// as a cluster and as a single instance — naming the set-up that holds the
/// database and the way out (a database or a `[state] schema` of its own).
/// It changes nothing there: staging's shard rows stay staging's, no member
/// row of production appears, and staging goes on delivering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_set_up_on_one_database_refuses_to_start_naming_the_first() {
    skip_without_python!();
    skip_without_postgres!();
    let world = World::new().await;
    let (s3, origin, db_name, db) = (&world.s3, &world.origin, &world.db_name, &world.db);
    let staging = world.start(&STAGING).await;
    let w = world.worker(&STAGING).await;
    assert_eq!(
        keyed_post(&staging, &w, "order-1", "staging-1")
            .await
            .status,
        200
    );

    let single = Env {
        cluster: None,
        ..PROD
    };
    for env in [&PROD, &single] {
        let (code, stderr) = serve_expecting_exit(&env.toml(s3, db, origin, free_port()));
        assert_eq!(code, Some(2), "refused as a bad set-up: {stderr}");
        for named in ["staging/", "fg-staging", "[state] schema"] {
            assert!(
                stderr.contains(named),
                "the refusal names {named:?}: {stderr}"
            );
        }
    }
    let pg = PgServer::shared();
    assert_eq!(
        pg.psql(
            db_name,
            "SELECT count(*) FROM fencegate_owners WHERE owner IS DISTINCT FROM 'fg-staging' \
             OR previous_owner IS NOT NULL"
        ),
        "0",
        "production took or shared no shard row"
    );
    assert_eq!(
        pg.psql(
            db_name,
            "SELECT count(*) FROM fencegate_members WHERE instance_id <> 'fg-staging'"
        ),
        "0"
    );
    assert_eq!(
        keyed_post(&staging, &w, "order-2", "staging-2")
            .await
            .status,
        200
    );
    assert_eq!(bodies(origin), ["staging-1", "staging-2"]);
    assert_eq!(
        staging.metric_sum("fencegate_state_set_up_conflict").await,
        0.0
    );
}

/// Staging and production on one database, each in a `[state] schema` of its
/// own: the same (route, key) is delivered once by each, a retry through each
/// is answered from that environment's own record, and a lease of the same
/// name keeps its own high-water mark in each (production at epoch 3 does not
/// refuse staging's holder at epoch 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_ups_in_schemas_of_their_own_deliver_the_same_key_once_each() {
    skip_without_python!();
    skip_without_postgres!();
    let world = World::new().await;
    let (s3, origin, db_name, db) = (&world.s3, &world.origin, &world.db_name, &world.db);
    let staging_env = Env {
        schema: Some("fg_staging"),
        ..STAGING
    };
    let prod_env = Env {
        schema: Some("fg_prod"),
        ..PROD
    };
    let staging = staging_env.start(s3, db, origin);
    let prod = prod_env.start(s3, db, origin);
    ready(&staging).await;
    ready(&prod).await;

    let prod_epochs = prod_env.epochs(s3).await;
    acquire(&prod_epochs, "pay", "p", Duration::from_secs(60)).await;
    force_next_epoch(&prod_epochs, "pay", "p", Duration::from_secs(60)).await;
    let p = force_next_epoch(&prod_epochs, "pay", "p", Duration::from_secs(60)).await;
    assert_eq!(p.epoch.get(), 3);
    let s = acquire(
        &staging_env.epochs(s3).await,
        "pay",
        "s",
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(s.epoch.get(), 1);

    let first_prod = keyed_post(&prod, &p, "order-1", "prod-order-1").await;
    assert_eq!(first_prod.status, 200);
    let first_staging = keyed_post(&staging, &s, "order-1", "staging-order-1").await;
    assert_eq!(
        first_staging.status, 200,
        "staging's holder is judged by staging's mark: {:?}",
        first_staging.body
    );
    // Retries: each answered from its own environment's record.
    let again_prod = keyed_post(&prod, &p, "order-1", "prod-order-1").await;
    let again_staging = keyed_post(&staging, &s, "order-1", "staging-order-1").await;
    assert_eq!(again_prod.body, first_prod.body);
    assert_eq!(again_staging.body, first_staging.body);
    assert_ne!(first_prod.body, first_staging.body);
    assert_eq!(bodies(origin), ["prod-order-1", "staging-order-1"]);

    let mark = |v: serde_json::Value| v["leases"][0]["high_water_mark"].as_u64();
    assert_eq!(mark(prod.admin_json("/v1/leases").await), Some(3));
    assert_eq!(mark(staging.admin_json("/v1/leases").await), Some(1));
    let pg = PgServer::shared();
    for (schema, id) in [("fg_staging", "fg-staging"), ("fg_prod", "fg-prod")] {
        assert_eq!(
            pg.psql(
                db_name,
                &format!("SELECT count(*) FROM {schema}.fencegate_dedup")
            ),
            "1"
        );
        assert_eq!(
            pg.psql(
                db_name,
                &format!("SELECT string_agg(DISTINCT owner, ',') FROM {schema}.fencegate_owners")
            ),
            id
        );
    }
    assert_eq!(
        pg.psql(
            db_name,
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'public' AND tablename LIKE 'fencegate%'"
        ),
        "0",
        "nothing was written outside the two schemas"
    );
}

/// The record of the set-up that holds the database, replaced under a running
/// instance (another set-up's, as if an operator had deleted it and another
/// environment had then started): the instance stops forwarding and says why
/// (`/readyz`, the metric), and serves again once the record is its own again.
async fn a_changed_record_stops_forwarding(env: Env) {
    let world = World::new().await;
    let (origin, db_name) = (&world.origin, &world.db_name);
    let (fg, w, _) = world.delivered(&env, "k-before", "before").await;

    let pg = PgServer::shared();
    pg.psql(
        db_name,
        "CREATE TABLE kept AS SELECT * FROM fencegate_set_up",
    );
    pg.psql(
        db_name,
        "UPDATE fencegate_set_up SET id = 'another-set-up', prefix = 'elsewhere/', \
         recorded_by = 'fg-other', mac = NULL",
    );
    eventually("the instance names the record", || async {
        let r = fg.admin_json("/readyz").await;
        r["status"] == "not_ready" && r.to_string().contains("elsewhere/")
    })
    .await;
    assert_eq!(fg.metric_sum("fencegate_state_set_up_conflict").await, 1.0);
    keyed_post(&fg, &w, "k-during", "during")
        .await
        .assert_error(503, "shard_unavailable");
    // A fencing-only request (no key: nothing written to the database) is
    // stopped too: a GET is neither keyed nor derived.
    let get = send(
        worker_req(&fg.url("/pay/x"), w.epoch.get(), &w.token)
            .method("GET")
            .body(body(""))
            .unwrap(),
    )
    .await;
    get.assert_error(503, "shard_unavailable");
    // Nor does an operator's action write into the other set-up's records.
    let resolve = send(
        Request::post(fg.admin_url("/v1/dedup/pay/k-before/resolve"))
            .header("authorization", format!("Bearer {ADMIN_TOKEN}"))
            .body(body(r#"{"outcome":"not_delivered"}"#))
            .unwrap(),
    )
    .await;
    assert_eq!(resolve.status, 503, "{:?}", resolve.body);

    pg.psql(
        db_name,
        "DELETE FROM fencegate_set_up; INSERT INTO fencegate_set_up SELECT * FROM kept",
    );
    eventually("the instance serves again", || async {
        keyed_post(&fg, &w, "k-after", "after").await.status == 200
    })
    .await;
    assert_eq!(fg.metric_sum("fencegate_state_set_up_conflict").await, 0.0);
    assert_eq!(bodies(origin), ["before", "after"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_record_stops_a_running_cluster_forwarding() {
    skip_without_python!();
    skip_without_postgres!();
    a_changed_record_stops_forwarding(STAGING).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_record_stops_a_running_single_instance_forwarding() {
    skip_without_python!();
    skip_without_postgres!();
    a_changed_record_stops_forwarding(Env {
        cluster: None,
        ..STAGING
    })
    .await;
}

/// Another S3 service holding a bucket of the same name, with the same prefix:
/// the same store by name, not the same store. Its instance is refused (the
/// database's set-up id is not the one its store keeps), before it writes
/// anything; the first goes on delivering. Failed before the set-up's id was
/// kept in the store too: the record compared names only, and two hosts'
/// `dir` stores of one path were taken for one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_of_the_same_name_elsewhere_is_another_set_up() {
    skip_without_python!();
    skip_without_postgres!();
    let world = World::new().await;
    let elsewhere = S3Server::start();
    let (s3, origin, db_name, db) = (&world.s3, &world.origin, &world.db_name, &world.db);
    let staging = world.start(&STAGING).await;
    let single = Env {
        cluster: None,
        ..STAGING
    };
    for env in [&STAGING, &single] {
        let (code, stderr) = serve_expecting_exit(&env.toml_on(s3, &elsewhere, db, origin));
        assert_eq!(code, Some(2), "{stderr}");
        assert!(
            stderr.contains("staging/.set-up") && stderr.contains("[state] schema"),
            "names the store's set-up object and the way out: {stderr}"
        );
    }
    let pg = PgServer::shared();
    assert_eq!(
        pg.psql(
            db_name,
            "SELECT count(*) FROM fencegate_members WHERE instance_id <> 'fg-staging'"
        ),
        "0"
    );
    let w = world.worker(&STAGING).await;
    assert_eq!(keyed_post(&staging, &w, "k", "staging").await.status, 200);
    assert_eq!(bodies(origin), ["staging"]);
}

/// Records already in a database without a set-up row (written by a build
/// before schema 8, or the row deleted) belong to whoever wrote them: another
/// set-up starting first is refused, and the set-up whose gate objects name
/// the database claims them — its retry is answered from its record, not
/// delivered again. Failed when an unrecorded database went to the first
/// instance to start: production claimed staging's marks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_without_a_set_up_row_go_only_to_the_set_up_that_wrote_them() {
    skip_without_python!();
    skip_without_postgres!();
    let world = World::new().await;
    let (s3, origin, db_name, db) = (&world.s3, &world.origin, &world.db_name, &world.db);
    let mut staging = world.start(&STAGING).await;
    let w = world.worker(&STAGING).await;
    let first = keyed_post(&staging, &w, "order-1", "staging-1").await;
    assert_eq!(first.status, 200);
    staging.terminate();
    let pg = PgServer::shared();
    pg.psql(db_name, "DELETE FROM fencegate_set_up");

    let (code, stderr) = serve_expecting_exit(&PROD.toml(s3, db, origin, free_port()));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("no set-up record") && stderr.contains("[state] schema"),
        "{stderr}"
    );
    assert_eq!(
        pg.psql(db_name, "SELECT count(*) FROM fencegate_set_up"),
        "0"
    );

    staging.restart();
    ready(&staging).await;
    let again = keyed_post_once_served(&staging, &w, "order-1", "staging-1").await;
    assert_eq!(again.status, 200, "{:?}", again.body);
    assert_eq!(again.body, first.body, "answered from its own record");
    assert_eq!(bodies(origin), ["staging-1"]);
    assert_eq!(
        pg.psql(db_name, "SELECT prefix FROM fencegate_set_up"),
        "staging/"
    );
}

/// A single instance moved to another schema (another `data_dir` too) keeps
/// its deliveries elsewhere than the instance it takes the guard over from:
/// refused like any other state (exit 2), not taken over as "the same state" —
/// which forwarded a delivered key's retry again when gate objects named the
/// database without its schema. `url` gives the moved
/// instance's connection string from the first's.
async fn moved_to_another_schema(moved_state: impl FnOnce(&str) -> (String, Option<&'static str>)) {
    let world = World::new().await;
    let (s3, origin, db_name, db) = (&world.s3, &world.origin, &world.db_name, &world.db);
    PgServer::shared().psql(db_name, "CREATE SCHEMA fg_moved");
    let before = Env {
        cluster: None,
        ..STAGING
    };
    let mut old = world.start(&before).await;
    let w = world.worker(&before).await;
    assert_eq!(keyed_post(&old, &w, "charge-42", "c").await.status, 200);
    old.terminate();
    let (url, schema) = moved_state(db);
    let moved = Env { schema, ..before };
    // Another instance's released guard is free gate_ttl + grace after it was
    // written (SPEC §10); until then the start is refused for that reason.
    let toml = moved.toml(s3, &url, origin, free_port());
    let (code, stderr) = refused_past_the_guard(&toml).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("keeps its marks and dedup records in")
            && stderr.contains("?schema=fg_moved"),
        "refused as another state: {stderr}"
    );
    assert_eq!(bodies(origin), ["c"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_instance_moved_to_a_schema_is_another_state() {
    skip_without_python!();
    skip_without_postgres!();
    moved_to_another_schema(|db| (db.to_owned(), Some("fg_moved"))).await;
}

/// The same, with the schema chosen by the connection's `search_path` (the
/// url's `options`) rather than `[state] schema`: the state is named by the
/// schema the database says is in use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_instance_moved_by_its_search_path_is_another_state() {
    skip_without_python!();
    skip_without_postgres!();
    moved_to_another_schema(|db| (format!("{db} options='-c search_path=fg_moved'"), None)).await;
}

/// The set-up table dropped under a running instance (as restoring a dump
/// from before schema 8 does) is a record gone: forwarding stops. Failed when
/// a failed read of the record changed nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_set_up_table_stops_a_running_instance() {
    skip_without_python!();
    skip_without_postgres!();
    let world = World::new().await;
    let (fg, w, _) = world.delivered(&STAGING, "k1", "one").await;
    let (origin, db_name) = (&world.origin, &world.db_name);
    PgServer::shared().psql(db_name, "DROP TABLE fencegate_set_up");
    eventually("the instance says the record is gone", || async {
        fg.admin_json("/readyz")
            .await
            .to_string()
            .contains("is gone")
    })
    .await;
    keyed_post(&fg, &w, "k2", "two")
        .await
        .assert_error(503, "shard_unavailable");
    assert_eq!(bodies(origin), ["one"]);
}

/// An instance refused by the legacy rule (a database of schema 7 holding
/// another set-up's records) writes nothing there — not even the migration to
/// schema 8, which an older build running on it would then refuse to start
/// on. Failed when the migration ran before the check.
/// And a set-up whose own database holds records of the same name but another
/// schema is not fooled by equal connection strings: the gate objects name
/// the schema in use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_instance_leaves_an_older_database_as_it_was() {
    skip_without_python!();
    skip_without_postgres!();
    let world = World::new().await;
    let (s3, origin, db_name, db) = (&world.s3, &world.origin, &world.db_name, &world.db);
    let pg = PgServer::shared();
    let staging = Env {
        cluster: None,
        ..STAGING
    };
    let mut s = world.start(&staging).await;
    let w = world.worker(&staging).await;
    let first = keyed_post(&s, &w, "k1", "one").await;
    assert_eq!(first.status, 200);
    s.terminate();
    pg.psql(
        db_name,
        &(crate::support::postgres::UNDO_SCHEMA_13.to_owned()
            + "DROP TABLE fencegate_set_up, fencegate_queue, fencegate_queue_leases, fencegate_queue_paused, fencegate_queue_jobs; UPDATE fencegate_schema SET version = 7"),
    );
    let prod = Env {
        cluster: None,
        ..PROD
    };
    let (code, stderr) = serve_expecting_exit(&prod.toml(s3, db, origin, free_port()));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("no set-up record"), "{stderr}");
    assert_eq!(
        pg.psql(db_name, "SELECT version FROM fencegate_schema"),
        "7"
    );
    assert_eq!(
        pg.psql(
            db_name,
            "SELECT count(*) FROM pg_tables WHERE tablename = 'fencegate_set_up'"
        ),
        "0"
    );
    // Production's own schema of the same database names itself in its gate
    // objects; pointed at staging's schema by mistake it is another state.
    pg.psql(db_name, "CREATE SCHEMA fg_prod");
    let prod_own = format!("{db} options='-c search_path=fg_prod'");
    let mut p =
        Fencegate::start_listening("127.0.0.1:0", "", &prod.toml(s3, &prod_own, origin, 0), &[]);
    ready(&p).await;
    p.terminate();
    s.restart();
    ready(&s).await;
    let again = keyed_post(&s, &w, "k1", "one").await;
    assert_eq!(again.body, first.body, "answered from staging's own record");
    assert_eq!(bodies(origin), ["one"]);
    assert_eq!(
        pg.psql(db_name, "SELECT prefix FROM public.fencegate_set_up"),
        "staging/"
    );
    assert_eq!(
        pg.psql(db_name, "SELECT prefix FROM fg_prod.fencegate_set_up"),
        "prod/"
    );
}

/// While the record names another set-up, the state writes nothing at all —
/// not a mark, a claim, an outcome, a sweep, a shard row nor membership —
/// so that no background task (the sweeper, a drain's note, a graceful
/// leave) changes the other set-up's records; reads still work, and writes
/// resume once the record is this set-up's again. Failed when only forwarding
/// was stopped: the sweeper of a stopped set-up deleted the other's `done`
/// record, and its key was delivered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_record_stops_every_write() {
    use fencegate::epoch::{Epoch, LeaseName};
    use fencegate::state::postgres::set_up_record::OurSetUp;
    use fencegate::state::postgres::PostgresState;
    use fencegate::state::{Owner, OwnershipStore, Record, RecordKey, State, StateStore, TakeOver};

    skip_without_postgres!();
    let pg = PgServer::shared();
    let (db_name, url) = pg.new_database();
    let leases = tempfile::tempdir().unwrap();
    let cfg = fencegate::config::Config::parse(&format!(
        "{}[state]\nkind = \"postgres\"\nurl = \"{url}\"\n[[route]]\nname = \"pay\"\npath_prefix = \"/pay/\"\nupstream = \"http://127.0.0.1:1/\"\nlease = \"pay\"\n",
        dir_store_toml(leases.path())
    ))
    .unwrap();
    let store = dir_epochs(leases.path()).store().clone();
    let db = PostgresState::connect(&cfg.state).await.unwrap();
    let state = fencegate::set_up::state_of(&cfg.state, "", Some(db.schema()), None);
    db.hold_for(OurSetUp::of(&cfg, &state), &store)
        .await
        .unwrap();
    let owner = Owner::SINGLE;
    let lease = LeaseName::parse("pay").unwrap();
    let key = |k: &str| RecordKey {
        route: "pay".into(),
        key: k.into(),
    };
    let fresh = Record {
        state: State::InFlight,
        fingerprint: [1; 32],
        epoch: Epoch::new(1),
        created_ms: 1_000,
        updated_ms: 1_000,
        response: None,
        request: None,
    };
    let strict = TakeOver {
        in_doubt: false,
        done_before_ms: u64::MAX,
    };
    db.raise_mark(owner, &lease, Epoch::new(1)).await.unwrap();
    db.begin(owner, &key("old"), &fresh, strict).await.unwrap();

    pg.psql(
        &db_name,
        "UPDATE fencegate_set_up SET id = 'another-set-up'",
    );
    db.look_at_set_up().await;
    assert!(db.set_up_conflict().is_some());
    let refused = |what: &str, r: Result<(), fencegate::state::StateError>| {
        let e = r.expect_err(what).to_string();
        assert!(e.contains("not written"), "{what}: {e}");
    };
    refused("raise", db.raise_mark(owner, &lease, Epoch::new(2)).await);
    refused("note", db.note_drained(owner, &lease, Epoch::new(1)).await);
    refused(
        "claim",
        db.begin(owner, &key("new"), &fresh, strict).await.map(drop),
    );
    refused(
        "outcome",
        db.finish(owner, &key("old"), fencegate::state::End::Delete)
            .await,
    );
    refused("sweep", db.sweep(strict).await.map(drop));
    refused("recover", db.recover(owner, 2_000).await.map(drop));
    refused("beat", db.beat("fg-a").await.map(drop));
    refused("leave", db.leave("fg-a").await);
    refused(
        "take",
        db.take_shard(0, None, "fg-a", "http://a", Duration::from_secs(6))
            .await
            .map(drop),
    );
    assert_eq!(
        db.marks(&lease).await.unwrap().mark,
        Epoch::new(1),
        "reads work"
    );
    assert_eq!(
        pg.psql(&db_name, "SELECT count(*) FROM fencegate_dedup"),
        "1"
    );
    assert_eq!(
        pg.psql(&db_name, "SELECT count(*) FROM fencegate_members"),
        "0"
    );

    pg.psql(&db_name, "DELETE FROM fencegate_set_up");
    db.look_at_set_up().await;
    assert!(db.set_up_conflict().unwrap().contains("is gone"));
    refused("raise", db.raise_mark(owner, &lease, Epoch::new(2)).await);

    // Back (the id the store keeps): writes resume.
    let id = String::from_utf8(
        store
            .get("fencegate/.set-up")
            .await
            .unwrap()
            .unwrap()
            .body
            .to_vec(),
    )
    .unwrap();
    let id: serde_json::Value = serde_json::from_str(&id).unwrap();
    pg.psql(
        &db_name,
        &format!(
            "INSERT INTO fencegate_set_up (id, store, prefix, mode, recorded_by) VALUES ('{}', 'dir:{}', 'fencegate/', 'single', 'test')",
            id["set_up"].as_str().unwrap(),
            leases.path().display()
        ),
    );
    db.look_at_set_up().await;
    assert_eq!(db.set_up_conflict(), None);
    db.raise_mark(owner, &lease, Epoch::new(2)).await.unwrap();
}
