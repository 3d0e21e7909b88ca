//! SPEC §9 `[state] schema` and §10 "One database, one set-up": a PostgreSQL
//! database (or a schema in it) keeps the marks, dedup records and shard rows
//! of one set-up — one lease store and prefix. Two environments (staging and
//! production, each its own prefix and its own cluster, one database and one
//! peer token between them) must not merge: the second refuses to start unless
//! it has a schema of its own, and then each keeps its own marks and records.
//! Every test asserts what the destination received.
//!
//! Failing on e862e6d (before the set-up record): the second set-up started
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

async fn ready(fg: &Fencegate) {
    eventually("the instance is ready", || async {
        fg.admin_json("/readyz").await["status"] == "ready"
    })
    .await;
}

/// A worker's keyed POST of `payload` under `key`.
async fn keyed_post(fg: &Fencegate, w: &Holding, key: &str, payload: &str) -> Reply {
    send(keyed(fg, "/pay/x", w, key, payload)).await
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
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let (db_name, db) = PgServer::shared().new_database();
    let staging = STAGING.start(&s3, &db, &origin);
    ready(&staging).await;
    let w = acquire(
        &STAGING.epochs(&s3).await,
        "pay",
        "w",
        Duration::from_secs(60),
    )
    .await;
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
        let (code, stderr) = serve_expecting_exit(&env.toml(&s3, &db, &origin, free_port()));
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
            &db_name,
            "SELECT count(*) FROM fencegate_owners WHERE owner IS DISTINCT FROM 'fg-staging' \
             OR previous_owner IS NOT NULL"
        ),
        "0",
        "production took or shared no shard row"
    );
    assert_eq!(
        pg.psql(
            &db_name,
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
    assert_eq!(bodies(&origin), ["staging-1", "staging-2"]);
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
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let (db_name, db) = PgServer::shared().new_database();
    let staging_env = Env {
        schema: Some("fg_staging"),
        ..STAGING
    };
    let prod_env = Env {
        schema: Some("fg_prod"),
        ..PROD
    };
    let staging = staging_env.start(&s3, &db, &origin);
    let prod = prod_env.start(&s3, &db, &origin);
    ready(&staging).await;
    ready(&prod).await;

    let prod_epochs = prod_env.epochs(&s3).await;
    acquire(&prod_epochs, "pay", "p", Duration::from_secs(60)).await;
    force_next_epoch(&prod_epochs, "pay", "p", Duration::from_secs(60)).await;
    let p = force_next_epoch(&prod_epochs, "pay", "p", Duration::from_secs(60)).await;
    assert_eq!(p.epoch.get(), 3);
    let s = acquire(
        &staging_env.epochs(&s3).await,
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
    assert_eq!(bodies(&origin), ["prod-order-1", "staging-order-1"]);

    let mark = |v: serde_json::Value| v["leases"][0]["high_water_mark"].as_u64();
    assert_eq!(mark(prod.admin_json("/v1/leases").await), Some(3));
    assert_eq!(mark(staging.admin_json("/v1/leases").await), Some(1));
    let pg = PgServer::shared();
    for (schema, id) in [("fg_staging", "fg-staging"), ("fg_prod", "fg-prod")] {
        assert_eq!(
            pg.psql(
                &db_name,
                &format!("SELECT count(*) FROM {schema}.fencegate_dedup")
            ),
            "1"
        );
        assert_eq!(
            pg.psql(
                &db_name,
                &format!("SELECT string_agg(DISTINCT owner, ',') FROM {schema}.fencegate_owners")
            ),
            id
        );
    }
    assert_eq!(
        pg.psql(
            &db_name,
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
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let (db_name, db) = PgServer::shared().new_database();
    let fg = env.start(&s3, &db, &origin);
    ready(&fg).await;
    let w = acquire(&env.epochs(&s3).await, "pay", "w", Duration::from_secs(60)).await;
    assert_eq!(keyed_post(&fg, &w, "k-before", "before").await.status, 200);

    let pg = PgServer::shared();
    pg.psql(
        &db_name,
        "CREATE TABLE kept AS SELECT * FROM fencegate_set_up",
    );
    pg.psql(
        &db_name,
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
        &db_name,
        "DELETE FROM fencegate_set_up; INSERT INTO fencegate_set_up SELECT * FROM kept",
    );
    eventually("the instance serves again", || async {
        keyed_post(&fg, &w, "k-after", "after").await.status == 200
    })
    .await;
    assert_eq!(fg.metric_sum("fencegate_state_set_up_conflict").await, 0.0);
    assert_eq!(bodies(&origin), ["before", "after"]);
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
