//! SPEC §11 queued delivery on PostgreSQL (`fencegate_queue`), in a cluster
//! (§10) and on one instance, asserted at the recording origin:
//!
//! - a worker's message sent to any member is relayed to the lease's shard
//!   owner, written to PostgreSQL and answered 202; its status reads the same
//!   on every member;
//! - a takeover after kill -9 of the owner resumes the lease's queue from its
//!   head, in order: the attempt that was out is sent again (an unknown
//!   outcome, same `webhook-id`), then the rest, each once;
//! - a deposed owner (SIGSTOP past its tenure) sends nothing more when it
//!   wakes, and nothing of an older epoch reaches the destination after a
//!   newer one; the answer to the attempt it had out, read when it wakes,
//!   changes nothing (its writes are fenced by the new owner's generation:
//!   without that fence m1 went back into the queue and reached the
//!   destination again after m3 of a newer epoch);
//! - one instance on PostgreSQL delivers, and loses nothing to kill -9 with
//!   a message pending, or at any durable boundary of a message.
//!
//! Each member's route names the member in an upstream header (`x-via`), so
//! the origin's log says who sent each attempt. Gate leases as in the cluster
//! tests: 6 s, self-fence margin 2 s, grace 500 ms.

use std::time::{Duration, Instant};

use bytes::Bytes;
use fencegate::lease::acquire::Holding;
use http::Request;
use http_body_util::Full;

use crate::support::members::{serves, wait_serves};
use crate::support::postgres::PgServer;
use crate::support::relay::Relay;
use crate::support::*;

macro_rules! skip_without_postgres {
    () => {
        if !$crate::support::postgres::available_or_skip() {
            return;
        }
    };
}

const ADMIN: &str = "queue-admin";
const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const PEER_TOKEN: &str = "queued-cluster-peer-token-0123456789";
/// `gate_ttl` and `self_fence_margin` of every member.
const GATE: (&str, &str) = ("6s", "2s");
/// Long enough for a takeover (gate_ttl + grace after the last renewal seen,
/// plus a look period) with room on a loaded two-core machine.
const TAKEOVER: Duration = Duration::from_secs(25);

/// The queued route `hook` on lease `hook` (signed: every attempt carries a
/// `webhook-id`), to `upstream`, with `headers` (TOML inline-table entries)
/// set on every attempt.
fn hook_route(upstream: &str, headers: &str, extra: &str) -> String {
    format!(
        "[[route]]\nname = \"hook\"\npath_prefix = \"/hook/\"\nupstream = \"{upstream}\"\nlease = \"hook\"\ntimeout_ms = 30000\ndrain_timeout_ms = 1000\ndelivery = \"queued\"\nsigning_secrets = [\"{SECRET}\"]\nupstream_headers = {{ {headers} }}\n{extra}\n"
    )
}

/// A 1-shard cluster's lease store, database and origin; members are started
/// by the test, each with its own route to the origin.
struct Cluster {
    s3: S3Server,
    db: String,
    db_name: String,
    origin: Origin,
}

impl Cluster {
    async fn start() -> Cluster {
        let s3 = S3Server::start();
        let origin = Origin::start().await;
        let (db_name, db) = PgServer::shared().new_database();
        Cluster {
            s3,
            db,
            db_name,
            origin,
        }
    }

    /// Member `id`: its route to `upstream`, naming it in `x-via`, with
    /// `headers` more (TOML inline-table entries, each followed by ", ").
    fn member(&self, id: &str, upstream: &str, headers: &str, route_extra: &str) -> Fencegate {
        self.member_with(
            id,
            &hook_route(upstream, &format!("{headers}x-via = \"{id}\""), route_extra),
        )
    }

    /// Member `id` with `routes` (TOML).
    fn member_with(&self, id: &str, routes: &str) -> Fencegate {
        self.member_gated(id, routes, GATE)
    }

    /// Member `id` with `routes` and (`gate_ttl`, `self_fence_margin`).
    fn member_gated(&self, id: &str, routes: &str, gate: (&str, &str)) -> Fencegate {
        let port = free_port();
        let toml = format!(
            "{}gate_ttl = \"{}\"\nself_fence_margin = \"{}\"\n{}[cluster]\ninstance_id = \"{id}\"\nadvertise = \"http://127.0.0.1:{port}\"\nshards = 1\npeer_token = \"{PEER_TOKEN}\"\n\n{}",
            self.s3
                .store_toml(200)
                .replace("timeout_ms = 1500", "timeout_ms = 1000"),
            gate.0,
            gate.1,
            state_toml(&self.db, ""),
            routes,
        );
        Fencegate::start_listening(
            &format!("127.0.0.1:{port}"),
            &format!("admin_token = \"{ADMIN}\""),
            &toml,
            &[],
        )
    }

    /// `a` started first and owning the shard, then `b` seeing `a` as its owner.
    async fn two(&self, a: (&str, &str, &str), b: (&str, &str, &str)) -> (Fencegate, Fencegate) {
        let fa = self.member("fg-a", a.0, a.1, a.2);
        assert!(
            wait_serves(&fa, 0, TAKEOVER).await.is_some(),
            "fg-a never served the shard: {}",
            fa.stderr()
        );
        let fb = self.member("fg-b", b.0, b.1, b.2);
        eventually("fg-b sees fg-a own the shard", || async {
            owner_seen_by(&fb).await.as_deref() == Some("fg-a")
        })
        .await;
        (fa, fb)
    }

    async fn worker(&self) -> Holding {
        acquire(
            &self.s3.epochs().await,
            "hook",
            "worker-1",
            Duration::from_secs(120),
        )
        .await
    }

    /// The keys of route `hook` in `fencegate_queue`, sorted.
    fn queued_keys(&self) -> String {
        PgServer::shared().psql(
            &self.db_name,
            "SELECT coalesce(string_agg(key, ',' ORDER BY key), '') FROM fencegate_queue WHERE route = 'hook'",
        )
    }
}

/// The owner of shard 0 as `/v1/cluster` of `fg` shows it.
async fn owner_seen_by(fg: &Fencegate) -> Option<String> {
    fg.admin_json("/v1/cluster").await["shard_map"][0]["owner"]
        .as_str()
        .map(str::to_owned)
}

/// A keyed message of lease `hook` at `h`'s epoch, through `fg`.
fn message(fg: &Fencegate, h: &Holding, key: &str, payload: &str) -> Request<Full<Bytes>> {
    keyed(fg, "/hook/events", h, key, payload)
}

/// SPEC §11's acceptance: 202, queued, its status URL.
fn accepted(r: &Reply, key: &str) {
    assert_eq!(r.status, 202, "{key}: {}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.headers["x-fencegate-delivery"], "queued", "{key}");
    assert_eq!(
        r.headers["location"],
        format!("/.fencegate/deliveries/hook/{key}").as_str()
    );
    assert_eq!(r.json()["dedup_key"], key, "{}", r.json());
}

/// The admin's view of message `key` on `fg`.
async fn status_of(fg: &Fencegate, key: &str) -> serde_json::Value {
    fg.admin_json(&format!("/v1/deliveries/hook/{key}")).await
}

/// Waits (up to `limit`) until `key`'s status on `fg` satisfies `done`.
async fn wait_status_for(
    fg: &Fencegate,
    key: &str,
    limit: Duration,
    done: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + limit;
    loop {
        let v = status_of(fg, key).await;
        if done(&v) {
            return v;
        }
        assert!(Instant::now() < deadline, "{key} after {limit:?}: {v}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

async fn wait_status(
    fg: &Fencegate,
    key: &str,
    done: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    wait_status_for(fg, key, Duration::from_secs(20), done).await
}

/// The worker's view of `key` through `fg`'s status URL (its lease token).
async fn worker_status(fg: &Fencegate, h: &Holding, key: &str) -> Reply {
    send(
        Request::get(fg.url(&format!("/.fencegate/deliveries/hook/{key}")))
            .header("x-lease-token", &h.token)
            .body(Full::default())
            .unwrap(),
    )
    .await
}

/// What the origin received, in arrival order: (webhook-id, sender, body).
fn arrivals(origin: &Origin) -> Vec<(String, String, String)> {
    origin
        .log()
        .iter()
        .map(|a| {
            (
                a.header("webhook-id").unwrap_or_default(),
                a.header("x-via").unwrap_or_default(),
                String::from_utf8_lossy(&a.body).into_owned(),
            )
        })
        .collect()
}

fn t(id: &str, via: &str, body: &str) -> (String, String, String) {
    (id.to_owned(), via.to_owned(), body.to_owned())
}

fn bodies(origin: &Origin) -> Vec<String> {
    arrivals(origin).into_iter().map(|(_, _, b)| b).collect()
}

/// Lines of `fg`'s log containing `line`.
fn logged(fg: &Fencegate, line: &str) -> usize {
    fg.stderr().matches(line).count()
}

/// Waits (up to a takeover's bound) until `fg` has logged `line`.
async fn wait_logged(fg: &Fencegate, line: &str) {
    let deadline = Instant::now() + TAKEOVER;
    while logged(fg, line) == 0 {
        assert!(Instant::now() < deadline, "{line:?}: {}", fg.stderr());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn cont(fg: &Fencegate) {
    assert!(std::process::Command::new("kill")
        .args(["-CONT", &fg.pid().to_string()])
        .status()
        .unwrap()
        .success());
}

/// Takeover mid-queue (SPEC §10, §11): the owner, fg-a, has m1's attempt out
/// (held in a relay before the origin) and m2, m3 waiting behind it when it
/// is killed -9. fg-b takes the shard and resumes the queue: m1 first, again
/// (an unknown outcome, the same `webhook-id`), then m2, m3, each once, in
/// acceptance order — all from fg-b. Messages sent to either member are
/// relayed to the owner, written to `fencegate_queue`, and their status reads
/// the same on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_after_kill_9_resumes_the_queue_in_order() {
    skip_without_python!();
    skip_without_postgres!();
    let c = Cluster::start().await;
    // fg-a reaches the origin through a relay that holds its attempts.
    let relay = Relay::start(c.origin.addr.port()).await;
    let via_relay = format!("http://127.0.0.1:{}/v1/", relay.addr.port());
    let direct = c.origin.url("/v1/");
    let retry = "retry = { schedule = [\"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\"] }";
    let (mut a, b) = c.two((&via_relay, "", retry), (&direct, "", retry)).await;
    relay.hold_requests(true);
    let w = c.worker().await;
    // m1 and m3 through fg-b (relayed to the owner), m2 through fg-a.
    accepted(&send(message(&b, &w, "m1", "one")).await, "m1");
    accepted(&send(message(&a, &w, "m2", "two")).await, "m2");
    accepted(&send(message(&b, &w, "m3", "three")).await, "m3");
    assert_eq!(c.queued_keys(), "m1,m2,m3", "written to PostgreSQL");
    // m1's attempt is out (its bytes held in the relay); m2, m3 wait behind it.
    eventually("m1's attempt in the relay", || async {
        relay.held_requests() > 0
    })
    .await;
    for fg in [&a, &b] {
        wait_status(fg, "m1", |v| v["status"] == "delivering").await;
        for key in ["m2", "m3"] {
            let v = status_of(fg, key).await;
            assert_eq!(v["status"], "pending", "{key}: {v}");
            assert_eq!(v["attempts"], 0, "{key}: {v}");
        }
        // The worker's status URL, on either member, with its token.
        let st = worker_status(fg, &w, "m2").await;
        assert_eq!(st.status, 200, "{}", String::from_utf8_lossy(&st.body));
        assert_eq!(st.json()["status"], "pending");
        assert_eq!(st.json()["lease"], "hook");
    }
    let seqs: Vec<i64> = {
        let mut v = Vec::new();
        for key in ["m1", "m2", "m3"] {
            v.push(status_of(&b, key).await["seq"].as_i64().unwrap());
        }
        v
    };
    assert!(seqs.windows(2).all(|p| p[0] < p[1]), "{seqs:?}");
    assert_eq!(c.origin.count(), 0);

    a.kill9();
    // What fg-a had sent never leaves the relay.
    relay.cut();
    let killed = Instant::now();
    let took = wait_serves(&b, 0, TAKEOVER).await;
    assert!(took.is_some(), "fg-b never took the shard: {}", b.stderr());
    eprintln!(
        "fg-b served the shard {:?} after the kill",
        killed.elapsed()
    );
    c.origin
        .wait_until("m3", |log| {
            log.iter()
                .any(|x| x.header("webhook-id").as_deref() == Some("hook:m3"))
        })
        .await;
    wait_status(&b, "m3", |v| v["status"] == "delivered").await;
    let got = arrivals(&c.origin);
    assert_eq!(
        bodies(&c.origin),
        ["one", "two", "three"],
        "each once, in acceptance order: {got:?}"
    );
    for (id, via, body) in &got {
        assert_eq!(via, "fg-b", "{body} sent by {via}: {got:?}");
        let key = match body.as_str() {
            "one" => "m1",
            "two" => "m2",
            _ => "m3",
        };
        assert_eq!(id, &format!("hook:{key}"), "{got:?}");
    }
    let m1 = wait_status(&b, "m1", |v| v["status"] == "delivered").await;
    assert!(
        m1["unknown_outcomes"].as_u64() >= Some(1),
        "the attempt out at the kill is an unknown outcome: {m1}"
    );
    assert!(m1["attempts"].as_u64() >= Some(2), "{m1}");
    for key in ["m2", "m3"] {
        let v = status_of(&b, key).await;
        assert_eq!(v["status"], "delivered", "{key}: {v}");
        assert_eq!(v["attempts"], 1, "{key}: {v}");
        assert_eq!(v["unknown_outcomes"], 0, "{key}: {v}");
    }
    // A retry of a delivered key, through the survivor: its stored answer.
    let replay = send(message(&b, &w, "m2", "two")).await;
    assert_eq!(
        replay.status,
        200,
        "{}",
        String::from_utf8_lossy(&replay.body)
    );
    assert_eq!(replay.headers["x-fencegate-replayed"], "true");
    assert_eq!(c.origin.count(), 3);
}

/// A deposed owner is fenced (SPEC §10, §11): fg-a owns the shard and m1 is
/// failing there (the destination answers fg-a 503), its retry scheduled.
/// fg-a is frozen (SIGSTOP) past its tenure; fg-b takes the shard, delivers
/// m1 (the destination answers fg-b 200) and then m2 of a newer epoch. When
/// fg-a runs again it sends nothing more — not m1's scheduled retry — and m1
/// never reaches the destination after m2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deposed_owner_sends_nothing_when_it_wakes() {
    skip_without_python!();
    skip_without_postgres!();
    let c = Cluster::start().await;
    let direct = c.origin.url("/v1/");
    // Retries 2 s (±20%) apart: fg-a is frozen between two attempts of m1.
    let retry = "retry = { schedule = [\"2s\", \"2s\", \"2s\", \"2s\", \"2s\", \"2s\"] }";
    let (a, b) = c
        .two(
            (&direct, "x-test-status = \"503\", ", retry),
            (&direct, "", retry),
        )
        .await;
    let w1 = c.worker().await;
    accepted(&send(message(&b, &w1, "m1", "m1 epoch 1")).await, "m1");
    let first = wait_status(&b, "m1", |v| v["status"] == "pending" && v["attempts"] == 1).await;
    assert_eq!(first["last_status"], 503, "{first}");
    let from_a = |origin: &Origin| {
        arrivals(origin)
            .into_iter()
            .filter(|(_, via, _)| via == "fg-a")
            .count()
    };
    assert_eq!(from_a(&c.origin), 1);
    let stopped_before = logged(&a, "stopped serving a shard");
    freeze(a.pid());
    let frozen = Instant::now();
    assert!(
        wait_serves(&b, 0, TAKEOVER).await.is_some(),
        "fg-b never took the shard: {}",
        b.stderr()
    );
    eprintln!(
        "fg-b served the shard {:?} after the freeze",
        frozen.elapsed()
    );
    let m1 = wait_status(&b, "m1", |v| v["status"] == "delivered").await;
    assert_eq!(m1["attempts"], 2, "{m1}");
    assert_eq!(m1["last_status"], 200, "{m1}");
    // A newer epoch's message, accepted by the new owner, delivered after m1.
    let epochs = c.s3.epochs().await;
    let w2 = force_next_epoch(&epochs, "hook", "worker-2", Duration::from_secs(120)).await;
    accepted(&send(message(&b, &w2, "m2", "m2 epoch 2")).await, "m2");
    wait_status(&b, "m2", |v| v["status"] == "delivered").await;
    // The older worker is refused at admission, nothing queued.
    send(message(&b, &w1, "late", "late epoch 1"))
        .await
        .assert_error(409, "epoch_stale");

    let sent_by_a = from_a(&c.origin);
    cont(&a);
    // fg-a learns it lost the shard: it stops serving it, and sees fg-b own it.
    eventually("fg-a stops serving the shard", || async {
        logged(&a, "stopped serving a shard") > stopped_before
    })
    .await;
    eventually("fg-a sees fg-b own the shard", || async {
        !serves(&a, 0).await && owner_seen_by(&a).await.as_deref() == Some("fg-b")
    })
    .await;
    // fg-a runs on as a member: a message sent to it is relayed to fg-b.
    accepted(&send(message(&a, &w2, "m3", "m3 epoch 2")).await, "m3");
    wait_status(&a, "m3", |v| v["status"] == "delivered").await;
    c.origin
        .wait_until("m3", |log| log.iter().any(|x| x.body == "m3 epoch 2"))
        .await;

    let got = arrivals(&c.origin);
    assert_eq!(
        from_a(&c.origin),
        sent_by_a,
        "fg-a sent after it was deposed: {got:?}"
    );
    assert_eq!(
        got,
        [
            t("hook:m1", "fg-a", "m1 epoch 1"),
            t("hook:m1", "fg-b", "m1 epoch 1"),
            t("hook:m2", "fg-b", "m2 epoch 2"),
            t("hook:m3", "fg-b", "m3 epoch 2"),
        ],
        "m1 failed at fg-a, then m1, m2, m3 from fg-b"
    );
    let log = c.origin.log();
    let last_m1 = log.iter().rposition(|x| x.body == "m1 epoch 1").unwrap();
    let first_m2 = log.iter().position(|x| x.body == "m2 epoch 2").unwrap();
    assert!(last_m1 < first_m2, "m1 after m2: {got:?}");
    let m1 = status_of(&a, "m1").await;
    assert_eq!(m1["status"], "delivered", "{m1}");
    assert_eq!(
        m1["attempts"], 2,
        "no attempt of fg-a's after the takeover: {m1}"
    );
}

/// A deposed owner's late outcome is fenced (SPEC §10, §11): fg-a's attempt
/// of m1 is at the destination (held there) when fg-a is frozen past its
/// tenure. fg-b takes the shard, sends m1 again (an unknown outcome), and
/// both attempts are answered 200 while fg-a is still frozen; fg-b delivers
/// m2 behind it and m3 of a newer epoch. When fg-a runs again, with the
/// answer to its old attempt waiting in its socket, nothing it writes lands
/// (m1 stays as fg-b settled it; no message goes back into the queue to be
/// sent again after m3) and it sends nothing more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deposed_owners_late_attempt_outcome_changes_nothing() {
    skip_without_python!();
    skip_without_postgres!();
    let c = Cluster::start().await;
    let direct = c.origin.url("/v1/");
    let retry = "retry = { schedule = [\"200ms\", \"200ms\", \"200ms\", \"200ms\"] }";
    let (a, b) = c.two((&direct, "", retry), (&direct, "", retry)).await;
    let w1 = c.worker().await;
    // m1 is held at the origin on every attempt (the worker's header is kept).
    let mut held = message(&b, &w1, "m1", "m1 epoch 1");
    held.headers_mut()
        .insert("x-test-hold", "m1".parse().unwrap());
    accepted(&send(held).await, "m1");
    accepted(&send(message(&b, &w1, "m2", "m2 epoch 1")).await, "m2");
    c.origin
        .wait_until("fg-a's attempt of m1", |log| {
            log.iter()
                .any(|x| x.header("x-via").as_deref() == Some("fg-a"))
        })
        .await;
    wait_status(&b, "m1", |v| v["status"] == "delivering").await;
    let stopped_before = logged(&a, "stopped serving a shard");
    freeze(a.pid());
    assert!(
        wait_serves(&b, 0, TAKEOVER).await.is_some(),
        "fg-b never took the shard: {}",
        b.stderr()
    );
    c.origin
        .wait_until("fg-b's attempt of m1", |log| {
            log.iter()
                .any(|x| x.header("x-via").as_deref() == Some("fg-b"))
        })
        .await;
    // Both attempts are answered: fg-a's answer waits in its frozen socket.
    c.origin.release("m1");
    let m1 = wait_status(&b, "m1", |v| v["status"] == "delivered").await;
    assert_eq!(m1["attempts"], 2, "{m1}");
    assert_eq!(m1["unknown_outcomes"], 1, "{m1}");
    wait_status(&b, "m2", |v| v["status"] == "delivered").await;
    let epochs = c.s3.epochs().await;
    let w2 = force_next_epoch(&epochs, "hook", "worker-2", Duration::from_secs(120)).await;
    accepted(&send(message(&b, &w2, "m3", "m3 epoch 2")).await, "m3");
    wait_status(&b, "m3", |v| v["status"] == "delivered").await;

    cont(&a);
    eventually("fg-a stops serving the shard", || async {
        logged(&a, "stopped serving a shard") > stopped_before
    })
    .await;
    eventually("fg-a sees fg-b own the shard", || async {
        !serves(&a, 0).await && owner_seen_by(&a).await.as_deref() == Some("fg-b")
    })
    .await;
    accepted(&send(message(&a, &w2, "m4", "m4 epoch 2")).await, "m4");
    wait_status(&a, "m4", |v| v["status"] == "delivered").await;
    c.origin
        .wait_until("m4", |log| log.iter().any(|x| x.body == "m4 epoch 2"))
        .await;

    let got = arrivals(&c.origin);
    assert_eq!(
        got,
        [
            t("hook:m1", "fg-a", "m1 epoch 1"),
            t("hook:m1", "fg-b", "m1 epoch 1"),
            t("hook:m2", "fg-b", "m2 epoch 1"),
            t("hook:m3", "fg-b", "m3 epoch 2"),
            t("hook:m4", "fg-b", "m4 epoch 2"),
        ],
        "fg-a's one attempt, then fg-b's in acceptance order"
    );
    for fg in [&a, &b] {
        let now = status_of(fg, "m1").await;
        for field in ["status", "attempts", "unknown_outcomes", "last_status"] {
            assert_eq!(now[field], m1[field], "fg-a's late write landed: {now}");
        }
    }
    for status in ["pending", "delivering"] {
        let listed = send(
            Request::get(b.admin_url(&format!("/v1/deliveries?route=hook&status={status}")))
                .header("authorization", format!("Bearer {ADMIN}"))
                .body(Full::default())
                .unwrap(),
        )
        .await
        .json();
        assert_eq!(
            listed["total"], 0,
            "a message went back into the queue: {listed}"
        );
    }
}

/// One instance on PostgreSQL (no `[cluster]`), the `dir` lease store.
struct Single {
    _leases: tempfile::TempDir,
    epochs: fencegate::lease::Epochs,
    db_name: String,
    origin: Origin,
    relay: Relay,
    fg: Fencegate,
}

impl Single {
    /// A queued route to the origin through a relay (that the test can make
    /// refuse connections), retries 200 ms apart.
    async fn start() -> Single {
        let leases = tempfile::tempdir().unwrap();
        let origin = Origin::start().await;
        let relay = Relay::start(origin.addr.port()).await;
        let (db_name, db) = PgServer::shared().new_database();
        let retry = format!(
            "retry = {{ schedule = [{}] }}",
            ["\"200ms\""; 10].join(", ")
        );
        let fg = Fencegate::start_with_server(
            &format!("admin_token = \"{ADMIN}\""),
            &format!(
                "{}{}{}",
                dir_store_toml(leases.path()),
                state_toml(&db, ""),
                hook_route(
                    &format!("http://127.0.0.1:{}/v1/", relay.addr.port()),
                    "x-via = \"single\"",
                    &retry
                )
                .replace("timeout_ms = 30000", "timeout_ms = 3000"),
            ),
            &[],
        );
        Single {
            epochs: dir_epochs(leases.path()),
            _leases: leases,
            db_name,
            origin,
            relay,
            fg,
        }
    }

    fn rows(&self) -> String {
        PgServer::shared().psql(
            &self.db_name,
            "SELECT coalesce(string_agg(key, ',' ORDER BY key), '') FROM fencegate_queue WHERE route = 'hook'",
        )
    }
}

/// SPEC §11 on one instance with `[state] kind = "postgres"`: a message is
/// accepted (in `fencegate_queue` before the 202), delivered once, and
/// answered from its stored answer when retried; kill -9 with a message
/// pending (its receiver refusing connections) and another waiting behind it
/// loses neither: after the restart each is delivered once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_instance_on_postgres_delivers_and_survives_kill_9() {
    skip_without_postgres!();
    let mut s = Single::start().await;
    let w = acquire(&s.epochs, "hook", "worker-1", Duration::from_secs(120)).await;
    accepted(&send(message(&s.fg, &w, "m1", "one")).await, "m1");
    assert_eq!(s.rows(), "m1", "written to PostgreSQL before the 202");
    wait_status(&s.fg, "m1", |v| v["status"] == "delivered").await;
    assert_eq!(bodies(&s.origin), ["one"]);
    let replay = send(message(&s.fg, &w, "m1", "one")).await;
    assert_eq!(
        replay.status,
        200,
        "{}",
        String::from_utf8_lossy(&replay.body)
    );
    assert_eq!(replay.headers["x-fencegate-replayed"], "true");

    // The receiver goes away: no new connection, and m1's kept-alive one ends.
    s.relay.refuse(true);
    s.relay.cut();
    accepted(&send(message(&s.fg, &w, "m2", "two")).await, "m2");
    accepted(&send(message(&s.fg, &w, "m3", "three")).await, "m3");
    wait_status(&s.fg, "m2", |v| {
        v["status"] == "pending" && v["attempts"].as_u64() >= Some(1)
    })
    .await;
    assert_eq!(status_of(&s.fg, "m3").await["attempts"], 0);
    s.fg.kill9();
    s.relay.refuse(false);
    s.fg.spawn(None).expect("fencegate did not restart");
    wait_status(&s.fg, "m3", |v| v["status"] == "delivered").await;
    assert_eq!(bodies(&s.origin), ["one", "two", "three"]);
    let ids: Vec<_> = arrivals(&s.origin)
        .into_iter()
        .map(|(id, _, _)| id)
        .collect();
    assert_eq!(ids, ["hook:m1", "hook:m2", "hook:m3"]);
    assert_eq!(s.rows(), "m1,m2,m3");
    // The gauge is read from PostgreSQL in the background (every second).
    eventually("fencegate_queue_depth 0", || async {
        s.fg.series("fencegate_queue_depth{route=\"hook\"}").await == 0.0
    })
    .await;
}

/// kill -9 at each durable boundary of a message (SPEC §11), one instance on
/// PostgreSQL — `queued::kill_9_at_each_boundary_loses_nothing_and_repeats_
/// only_the_unknown` on sled: no accepted message is lost, and one is sent
/// twice only where an attempt's outcome was unknown (counted, with the same
/// `webhook-id`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_at_each_boundary_on_postgres_loses_nothing() {
    skip_without_postgres!();
    let mut s = Single::start().await;
    let w = acquire(&s.epochs, "hook", "worker-1", Duration::from_secs(120)).await;
    accepted(&send(message(&s.fg, &w, "warm", "warm")).await, "warm");
    wait_status(&s.fg, "warm", |v| v["status"] == "delivered").await;
    // (failpoint, does the worker get its 202, arrivals of this message in all,
    // unknown outcomes counted after the restart). `queue_accept_written` is
    // inside the acceptance's transaction, before its COMMIT.
    let cases = [
        ("queue_accept_written", false, 1, 0),
        ("queue_accepted", false, 1, 0),
        ("queue_attempt_started", true, 1, 1),
        ("queue_attempt_answered", true, 2, 1),
        ("queue_delivered", true, 1, 0),
    ];
    for (failpoint, answered, n, unknown) in cases {
        let key = format!("at-{failpoint}");
        let before = s.origin.count();
        s.fg.kill9();
        s.fg.spawn(Some(failpoint)).unwrap();
        let r = try_send(message(&s.fg, &w, &key, &key)).await;
        assert_eq!(r.is_ok(), answered, "{failpoint}: {r:?}");
        if let Ok(r) = &r {
            accepted(r, &key);
        }
        let status = s.fg.wait_exit();
        assert!(!status.success(), "{failpoint}: aborted");
        s.fg.spawn(None).unwrap();
        if !answered {
            let retry = send(message(&s.fg, &w, &key, &key)).await;
            assert!(
                retry.status == 202 || retry.status == 200,
                "{failpoint}: {}",
                String::from_utf8_lossy(&retry.body)
            );
        }
        let v = wait_status(&s.fg, &key, |v| v["status"] == "delivered").await;
        let got: Vec<_> = s.origin.log()[before..]
            .iter()
            .map(|x| x.header("webhook-id").unwrap_or_default())
            .collect();
        assert_eq!(got.len(), n, "{failpoint}: {got:?}");
        assert!(got.iter().all(|i| *i == format!("hook:{key}")), "{got:?}");
        assert_eq!(v["unknown_outcomes"], unknown, "{failpoint}: {v}");
    }
}

/// SPEC §11 across members whose configs differ (a mistake: a cluster's
/// members share their routes): fg-b forwards lease `hook` directly while
/// fg-a queues it. When fg-a dies with m1 waiting, fg-b must not serve the
/// shard — a direct request of a newer epoch would reach the destination
/// before m1 — so it refuses the tenure, saying why, and forwards nothing.
/// (Reviewed: fg-b served it, and m1 reached the origin after the epoch-2
/// request once fg-a was back.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_forwarding_a_queued_lease_directly_refuses_its_shard() {
    skip_without_python!();
    skip_without_postgres!();
    let c = Cluster::start().await;
    let up = c.origin.url("/v1/");
    let mut fa = c.member(
        "fg-a",
        &up,
        "x-test-status = \"503\", ",
        "retry = { schedule = [\"60s\"] }",
    );
    assert!(
        wait_serves(&fa, 0, TAKEOVER).await.is_some(),
        "{}",
        fa.stderr()
    );
    let fb = c.member_with(
        "fg-b",
        &format!(
            "[[route]]\nname = \"hook\"\npath_prefix = \"/hook/\"\nupstream = \"{up}\"\nlease = \"hook\"\ntimeout_ms = 30000\n"
        ),
    );
    eventually("fg-b sees fg-a own the shard", || async {
        owner_seen_by(&fb).await.as_deref() == Some("fg-a")
    })
    .await;
    let w = c.worker().await;
    accepted(&send(message(&fa, &w, "m1", "e1-queued")).await, "m1");
    c.origin
        .wait_until("m1's first attempt", |l| !l.is_empty())
        .await;
    fa.kill9();
    wait_logged(&fb, "would forward lease hook's requests directly").await;
    assert!(!serves(&fb, 0).await, "fg-b serves the shard");
    let w2 = force_next_epoch(
        &c.s3.epochs().await,
        "hook",
        "worker-2",
        Duration::from_secs(120),
    )
    .await;
    send(
        worker_req(&fb.url("/hook/direct"), w2.epoch.get(), &w2.token)
            .body(Full::new(Bytes::from_static(b"e2-direct")))
            .unwrap(),
    )
    .await
    .assert_error(503, "shard_unavailable");
    assert_eq!(bodies(&c.origin), ["e1-queued"]);
}

/// A member whose database's set-up record is briefly not its own (SPEC §10:
/// it forwards and sends nothing meanwhile) without its shard's tenure
/// ending: the lease's deliverer waits and goes on once the record is back.
/// (Reviewed: it stopped for good, and m1 stayed pending.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_goes_on_after_a_short_set_up_conflict() {
    skip_without_python!();
    skip_without_postgres!();
    let c = Cluster::start().await;
    // A long gate_ttl: the member renews nothing while the record is not its
    // own, and its tenure must outlast the conflict (a new tenure would start
    // the deliverer again whatever it did).
    let fa = c.member_gated(
        "fg-a",
        &hook_route(
            &c.origin.url("/v1/"),
            "x-test-status = \"503\", x-via = \"fg-a\"",
            "retry = { schedule = [\"1s\", \"1s\", \"1s\", \"1s\", \"1s\", \"1s\", \"1s\", \"1s\", \"1s\", \"1s\"] }",
        ),
        ("30s", "2s"),
    );
    assert!(
        wait_serves(&fa, 0, TAKEOVER).await.is_some(),
        "{}",
        fa.stderr()
    );
    let generation = |v: serde_json::Value| v["shard_map"][0]["generation"].clone();
    let tenure = generation(fa.admin_json("/v1/cluster").await);
    let w = c.worker().await;
    accepted(&send(message(&fa, &w, "m1", "m1")).await, "m1");
    c.origin
        .wait_until("m1's first attempt", |l| !l.is_empty())
        .await;
    let pg = PgServer::shared();
    let id = pg.psql(&c.db_name, "SELECT id FROM fencegate_set_up");
    pg.psql(
        &c.db_name,
        "UPDATE fencegate_set_up SET id = 'ffffffffffffffffffffffffffffffff'",
    );
    wait_logged(&fa, "forwarding stopped").await;
    // Past m1's next attempt while the record is another set-up's: pending,
    // not sent, and its deliverer has looked — or `delivering`, when the
    // conflict landed while an attempt was out and its outcome's write was
    // refused (sent before the conflict; the next attempt counts it
    // unknown).
    wait_status(&fa, "m1", |v| {
        v["status"] == "delivering"
            || v["status"] == "pending"
                && v["next_attempt_at"]
                    .as_str()
                    .and_then(|t| humantime::parse_rfc3339(t).ok())
                    .is_some_and(|t| t + Duration::from_millis(500) < std::time::SystemTime::now())
    })
    .await;
    let stopped = c.origin.count();
    pg.psql(
        &c.db_name,
        &format!("UPDATE fencegate_set_up SET id = '{}'", id.trim()),
    );
    c.origin
        .wait_until("m1 attempted again", |l| l.len() > stopped)
        .await;
    assert_eq!(
        generation(fa.admin_json("/v1/cluster").await),
        tenure,
        "the tenure went on: no takeover restarted the deliverer"
    );
}

/// SPEC §10, identity and generations, in a cluster (issue 49, repro 4): the
/// cluster's database is dumped while m1, m2 (epoch 1) wait for a receiver
/// that is down; the receiver comes back, m1, m2 and then m3 (epoch 2) are
/// delivered; every member stops and the dump is restored. Whichever member
/// takes the shard resumes from the restored head — and finds the database
/// older than the anchor's objects (their generation was raised before each
/// create, and before m3's first attempt): m1 and m2 are failed unsent,
/// nothing of epoch 1 reaches the destination after m3. (Without the fence
/// the restored queue sent m1 and m2 again after m3.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clusters_database_restored_from_a_dump_is_fenced() {
    skip_without_python!();
    skip_without_postgres!();
    let c = Cluster::start().await;
    let relay = Relay::start(c.origin.addr.port()).await;
    relay.refuse(true);
    let up = format!("http://127.0.0.1:{}/v1/", relay.addr.port());
    let retry = "retry = { schedule = [\"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\"] }";
    let (mut a, mut b) = c.two((&up, "", retry), (&up, "", retry)).await;
    let w = c.worker().await;
    accepted(&send(message(&b, &w, "m1", "m1")).await, "m1");
    accepted(&send(message(&a, &w, "m2", "m2")).await, "m2");
    wait_status(&a, "m1", |v| v["attempts"].as_u64() >= Some(1)).await;
    let dump = PgServer::shared().dump(&c.db_name);
    relay.refuse(false);
    wait_status(&a, "m2", |v| v["status"] == "delivered").await;
    let epochs = c.s3.epochs().await;
    let w2 = force_next_epoch(&epochs, "hook", "worker-2", Duration::from_secs(120)).await;
    accepted(&send(message(&b, &w2, "m3", "m3")).await, "m3");
    wait_status(&a, "m3", |v| v["status"] == "delivered").await;
    assert_eq!(bodies(&c.origin), ["m1", "m2", "m3"]);
    assert!(b.terminate().success());
    assert!(a.terminate().success());
    PgServer::shared().restore(&c.db_name, &dump);
    a.spawn(None).expect("fg-a starts on the restored database");
    b.spawn(None).expect("fg-b starts on the restored database");
    for key in ["m1", "m2"] {
        let v = wait_status_for(&a, key, TAKEOVER, |v| {
            matches!(v["status"].as_str(), Some("delivered" | "failed"))
        })
        .await;
        let got = bodies(&c.origin);
        assert_eq!(got, ["m1", "m2", "m3"], "an epoch-1 message after m3");
        assert_eq!(v["status"], "failed", "{v}");
        assert!(
            v["last_error"]
                .as_str()
                .is_some_and(|e| e.contains("restored from an older copy")),
            "{v}"
        );
    }
    // The fence is logged once its mark is written, after its messages.
    let fenced = || {
        logged(&a, "restored or copied state fenced")
            + logged(&b, "restored or copied state fenced")
    };
    eventually("the fence logged", || async { fenced() > 0 }).await;
    assert_eq!(fenced(), 1, "one member fenced lease hook, once");
}

/// Found by review (F4): members that disagree on a route's kind (fg-a
/// direct, fg-b queued: a config mistake) both start while the route has no
/// records. A key is done directly on fg-a; fg-a dies; fg-b, whose route
/// would queue a retry of that key, does not take the shard (a route's
/// history follows its name at a takeover too): the retry is refused, never
/// delivered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_whose_route_kind_contradicts_its_history_does_not_take_the_shard() {
    skip_without_python!();
    skip_without_postgres!();
    let c = Cluster::start().await;
    let up = c.origin.url("/v1/");
    let route = |queued: bool| {
        let q = if queued {
            "delivery = \"queued\"\n"
        } else {
            ""
        };
        format!(
            "[[route]]\nname = \"hook\"\npath_prefix = \"/hook/\"\nupstream = \"{up}\"\nlease = \"hook\"\ntimeout_ms = 3000\n{q}\n"
        )
    };
    let mut a = c.member_with("fg-a", &route(false));
    assert!(
        wait_serves(&a, 0, TAKEOVER).await.is_some(),
        "{}",
        a.stderr()
    );
    let b = c.member_with("fg-b", &route(true));
    let w = c.worker().await;
    assert_eq!(send(message(&a, &w, "k1", "one")).await.status, 200);
    a.kill9();
    eventually("fg-b refuses the shard for the route's history", || async {
        logged(&b, "dedup records of a direct route of that name") > 0
    })
    .await;
    let retry = send(message(&b, &w, "k1", "one")).await;
    retry.assert_error(503, "shard_unavailable");
    assert_eq!(bodies(&c.origin), ["one"]);
}

/// Found by the second review (R2-3): one raise of the database's generation
/// fails (a trigger refuses exactly one UPDATE) after fg-a's anchor create,
/// so for a while the anchor's latest object names the database's own
/// generation. fg-b, started then, must not take the healthy database for a
/// restored one: the failed raise is tried again within a quarter second,
/// and a starting member confirms a finding after two `[state]` timeouts.
/// m1 (epoch 1, behind a down receiver while epoch 2 is the latest) is
/// delivered by fg-b, never failed unsent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_failed_raise_does_not_make_a_starting_member_fence_a_healthy_queue() {
    skip_without_python!();
    skip_without_postgres!();
    let c = Cluster::start().await;
    let relay = Relay::start(c.origin.addr.port()).await;
    relay.refuse(true);
    let up = format!("http://127.0.0.1:{}/v1/", relay.addr.port());
    let retry = format!(
        "retry = {{ schedule = [\"200ms\"{}] }}",
        ", \"5s\"".repeat(19)
    );
    let member = |id: &str| {
        c.member_gated(
            id,
            &hook_route(&up, &format!("x-via = \"{id}\""), &retry),
            ("20s", "4s"),
        )
    };
    let mut a = member("fg-a");
    assert!(
        wait_serves(&a, 0, TAKEOVER).await.is_some(),
        "{}",
        a.stderr()
    );
    let w = c.worker().await;
    accepted(&send(message(&a, &w, "m1", "m1")).await, "m1");
    let epochs = c.s3.epochs().await;
    force_next_epoch(&epochs, "hook", "worker-2", Duration::from_secs(300)).await;
    // Exactly one raise fails.
    PgServer::shared().refuse_raises(&c.db_name, "nextval('refused_raises') = 1");
    eventually("fg-a's raise after an anchor create fails once", || async {
        logged(&a, "could not raise the state's generation") > 0
    })
    .await;
    let b = member("fg-b");
    assert!(a.terminate().success());
    assert!(
        wait_serves(&b, 0, TAKEOVER).await.is_some(),
        "{}",
        b.stderr()
    );
    relay.refuse(false);
    let m1 = wait_status_for(&b, "m1", TAKEOVER, |v| {
        matches!(v["status"].as_str(), Some("delivered" | "failed"))
    })
    .await;
    assert_eq!(m1["status"], "delivered", "a healthy queue fenced: {m1}");
    assert_eq!(
        logged(&b, "this state is older than its own gate objects"),
        0
    );
}

/// A pause posted to a member that does not serve the lease (SPEC §11): the
/// owner reads it within a second and sends nothing of the paused route,
/// while the other lease's messages go on; kill -9 of the owner, and its
/// successor keeps the pause (it is in the database, not in a member); a
/// resume posted to the successor delivers what waited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_holds_across_a_takeover() {
    skip_without_python!();
    skip_without_postgres!();
    let c = Cluster::start().await;
    let upstream = c.origin.url("/v1/");
    let routes = format!(
        "{}[[route]]\nname = \"other\"\npath_prefix = \"/other/\"\nupstream = \"{upstream}\"\nlease = \"other\"\ndelivery = \"queued\"\n",
        hook_route(&upstream, "", "")
    );
    let mut a = c.member_with("fg-a", &routes);
    assert!(
        wait_serves(&a, 0, TAKEOVER).await.is_some(),
        "{}",
        a.stderr()
    );
    let b = c.member_with("fg-b", &routes);
    eventually("fg-b sees fg-a own the shard", || async {
        owner_seen_by(&b).await.as_deref() == Some("fg-a")
    })
    .await;
    let w = c.worker().await;
    let other = acquire(
        &c.s3.epochs().await,
        "other",
        "worker-2",
        Duration::from_secs(120),
    )
    .await;
    let pause = send(
        Request::post(b.admin_url("/v1/routes/hook/pause"))
            .header("authorization", format!("Bearer {ADMIN}"))
            .body(Full::default())
            .unwrap(),
    )
    .await;
    assert_eq!(
        pause.status,
        200,
        "{}",
        String::from_utf8_lossy(&pause.body)
    );
    eventually("the owner reads the pause", || async {
        a.admin_json("/v1/routes").await["routes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["route"] == "hook" && r["paused"]["route"].is_string())
    })
    .await;
    accepted(&send(message(&a, &w, "m1", "one")).await, "m1");
    assert_eq!(
        send(keyed(&a, "/other/e", &other, "o1", "o1")).await.status,
        202
    );
    c.origin
        .wait_until("o1", |log| log.iter().any(|x| x.body == "o1"))
        .await;
    assert_eq!(bodies(&c.origin), ["o1"]);
    // Settled before the kill (else its successor rightly sends it again).
    eventually("o1 written delivered", || async {
        a.admin_json("/v1/deliveries/other/o1").await["status"] == "delivered"
    })
    .await;

    a.kill9();
    assert!(
        wait_serves(&b, 0, TAKEOVER).await.is_some(),
        "{}",
        b.stderr()
    );
    assert_eq!(
        send(keyed(&b, "/other/e", &other, "o2", "o2")).await.status,
        202
    );
    c.origin
        .wait_until("o2", |log| log.iter().any(|x| x.body == "o2"))
        .await;
    assert_eq!(bodies(&c.origin), ["o1", "o2"], "m1 waits, paused");
    assert_eq!(status_of(&b, "m1").await["status"], "pending");

    let resume = send(
        Request::post(b.admin_url("/v1/routes/hook/resume"))
            .header("authorization", format!("Bearer {ADMIN}"))
            .body(Full::default())
            .unwrap(),
    )
    .await;
    assert_eq!(resume.status, 200);
    wait_status(&b, "m1", |v| v["status"] == "delivered").await;
    assert_eq!(bodies(&c.origin), ["o1", "o2", "one"]);
}
