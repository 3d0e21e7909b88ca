//! SPEC §10 "Identity and generations" and §11 "A route's history": a name or
//! an old copy of state is never taken for identity. The audit's repros
//! (issue 49), as a careful operator and an unlucky one would meet them, each
//! asserted at the recording destination:
//!
//! - a route's history follows its name across two reloads and a restart, in
//!   both directions (direct → queued, queued → direct);
//! - a copied `data_dir` that takes the guard over, and a restored backup of
//!   one, never send a queued message of an older epoch after a newer one, and
//!   repeat a message only as a counted unknown outcome;
//! - a copy of a `data_dir` started under another prefix refuses to start;
//! - (PostgreSQL) a database reached by another environment's connection
//!   string is not claimed by it, whether its set-up row was deleted or it
//!   predates set-up rows; a database restored from a dump is fenced as a
//!   restored `data_dir` is.
//!
//! A build without this rule fails them: the two reloads were accepted and a
//! retry was delivered again (both directions); the copy and the restore sent
//! their epoch-1 messages after the epoch-2 one; the other prefix started and
//! delivered the copy's message; staging started on production's database.

use std::path::Path;
use std::time::Duration;

use crate::support::relay::Relay;
use crate::support::*;
use fencegate::lease::acquire::Holding;

const ADMIN: &str = "identity-admin";

/// `[store]` on a `dir` lease store with a short gate lease (a copy takes the
/// guard over soon after its original stops), under `prefix`.
fn store_toml(path: &Path, prefix: &str) -> String {
    format!(
        "{}gate_ttl = \"6s\"\nself_fence_margin = \"2s\"\n",
        dir_store_toml(path).replace(
            &format!("prefix = \"{PREFIX}\""),
            &format!("prefix = \"{prefix}\"")
        )
    )
}

fn server_toml() -> String {
    format!("admin_token = \"{ADMIN}\"")
}

/// A route `name` on lease `lease` to `upstream`, queued or direct.
fn route(name: &str, lease: &str, upstream: &str, queued: bool) -> String {
    let queue = if queued {
        "delivery = \"queued\"\nretry = { schedule = [\"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\"] }\n"
    } else {
        ""
    };
    format!(
        "[[route]]\nname = \"{name}\"\npath_prefix = \"/{name}/\"\nupstream = \"{upstream}\"\nlease = \"{lease}\"\ntimeout_ms = 3000\n{queue}\n"
    )
}

async fn wait_log(fg: &Fencegate, line: &str, n: usize) {
    for _ in 0..800 {
        if fg.stderr().matches(line).count() >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("{n} × {line:?}: {}", fg.stderr());
}

async fn delivery(fg: &Fencegate, route: &str, key: &str) -> serde_json::Value {
    send(
        http::Request::get(fg.admin_url(&format!("/v1/deliveries/{route}/{key}")))
            .body(http_body_util::Full::default())
            .unwrap(),
    )
    .await
    .json()
}

async fn wait_status(fg: &Fencegate, route: &str, key: &str, want: &str) -> serde_json::Value {
    for _ in 0..800 {
        let v = delivery(fg, route, key).await;
        if v["status"] == want {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!(
        "{route}/{key} never {want}: {}\n{}",
        delivery(fg, route, key).await,
        fg.stderr()
    );
}

async fn admin_post(fg: &Fencegate, path: &str) -> Reply {
    send(
        http::Request::post(fg.admin_url(path))
            .header("authorization", format!("Bearer {ADMIN}"))
            .body(http_body_util::Full::default())
            .unwrap(),
    )
    .await
}

/// Waits until `route`/`key` has had an attempt.
async fn attempted(fg: &Fencegate, route: &str, key: &str) {
    for _ in 0..800 {
        if delivery(fg, route, key).await["attempts"].as_u64() >= Some(1) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!(
        "{route}/{key} never attempted: {}",
        delivery(fg, route, key).await
    );
}

/// Waits until `route`/`key` is settled (delivered, failed or dropped).
async fn settled(fg: &Fencegate, route: &str, key: &str) {
    for _ in 0..800 {
        let v = delivery(fg, route, key).await;
        if matches!(
            v["status"].as_str(),
            Some("delivered" | "failed" | "dropped")
        ) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!(
        "{route}/{key} never settled: {}",
        delivery(fg, route, key).await
    );
}

/// The bodies the origin received, in arrival order.
fn arrived(origin: &Origin) -> Vec<String> {
    origin
        .log()
        .iter()
        .map(|a| String::from_utf8_lossy(&a.body).into_owned())
        .collect()
}

fn accepted(r: &Reply) {
    assert_eq!(r.status, 202, "body: {}", String::from_utf8_lossy(&r.body));
}

/// A consistent copy of a running instance's `data_dir`: the process frozen
/// (SIGSTOP: what it wrote is in the page cache, as a volume snapshot or a
/// crash would find it), copied, resumed.
fn snapshot(fg: &Fencegate, to: &Path) {
    freeze(fg.pid());
    copy_dir(&state_dir(fg), to);
    let ok = std::process::Command::new("kill")
        .args(["-CONT", &fg.pid().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
}

/// `fg`'s config after its `[server]` section: another instance's, alike.
fn after_server(fg: &Fencegate) -> String {
    let text = std::fs::read_to_string(&fg.config).unwrap();
    text.split_once("\n\n").unwrap().1.to_owned()
}

fn copy_dir(from: &Path, to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    let ok = std::process::Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()
        .unwrap()
        .success();
    assert!(ok, "cp -a {} {}", from.display(), to.display());
}

/// A route's history through two reloads and a restart: route `r` starts
/// as `was_queued` says, delivers key k1, is removed by a reload, comes back
/// as the other kind by a second reload (refused, saying `why`), and by a
/// restart (exit 2, saying it again); back as it was, the worker's retry of
/// k1 is answered from its record. The destination gets k1 once.
async fn history_follows_the_name(was_queued: bool, why: &str) {
    let leases = tempfile::tempdir().unwrap();
    let origin = Origin::start().await;
    let up = origin.url("/v1/");
    let was = route("r", "r", &up, was_queued);
    let other = route("r", "r", &up, !was_queued);
    let filler = route("z", "other", &up, false);
    let mut fg = Fencegate::start_with_server(
        &server_toml(),
        &format!("{}{was}{filler}", store_toml(leases.path(), PREFIX)),
        &[],
    );
    let epochs = dir_epochs(leases.path());
    let w = acquire(&epochs, "r", "worker", Duration::from_secs(120)).await;
    let k1 = |fg: &Fencegate| keyed(fg, "/r/charge", &w, "k1", "one");
    let first = send(k1(&fg)).await;
    if was_queued {
        accepted(&first);
        wait_status(&fg, "r", "k1", "delivered").await;
    } else {
        assert_eq!(first.status, 200);
    }
    // Reload 1: the route goes. Reload 2: it comes back as the other kind.
    fg.edit_config(|t| t.replace(&was, ""));
    fg.hup();
    wait_log(&fg, "config reloaded", 1).await;
    fg.edit_config(|t| format!("{t}{other}"));
    fg.hup();
    wait_log(&fg, "config reload refused", 1).await;
    assert!(fg.stderr().contains(why), "{}", fg.stderr());
    send(k1(&fg)).await.assert_error(404, "route_not_found");
    // A restart with that config: exit 2, saying why.
    fg.kill9();
    assert!(fg.spawn(None).is_err());
    assert_eq!(fg.last_exit.and_then(|s| s.code()), Some(2));
    assert!(fg.stderr().matches(why).count() >= 2, "{}", fg.stderr());
    // Back as it was: the retry is answered from the record.
    fg.edit_config(|t| t.replace(&other, &was));
    fg.spawn(None).expect("the first config starts again");
    let replay = send(k1(&fg)).await;
    assert_eq!(replay.status, 200);
    assert_eq!(replay.headers["x-fencegate-replayed"], "true");
    assert_eq!(arrived(&origin), ["one"]);
}

/// Direct → removed → queued: refused while the name keeps dedup records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_routes_history_keeps_it_from_becoming_queued() {
    history_follows_the_name(
        false,
        "route \"r\" is queued, and the state keeps dedup records of a direct route of that name",
    )
    .await;
}

/// Queued → removed → direct: refused while the name keeps messages (a
/// delivered one is kept for `[dedup] ttl`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_routes_history_keeps_it_from_becoming_direct() {
    history_follows_the_name(
        true,
        "route \"r\" is direct, and the state keeps queued messages under its name",
    )
    .await;
}

/// A sled instance with queued route `hook` (lease `hook`) and `tick` (lease
/// `tick`), both through `relay` (refusing: the receiver is down), and a
/// worker on each lease.
struct Down {
    leases: tempfile::TempDir,
    origin: Origin,
    relay: Relay,
    fg: Fencegate,
    epochs: fencegate::lease::Epochs,
    hook: Holding,
    tick: Holding,
}

impl Down {
    async fn start() -> Down {
        Down::start_on("").await
    }

    /// [`Down::start`] with a `[state]` section.
    async fn start_on(state: &str) -> Down {
        let leases = tempfile::tempdir().unwrap();
        let origin = Origin::start().await;
        let relay = Relay::start(origin.addr.port()).await;
        relay.refuse(true);
        let up = format!("http://127.0.0.1:{}/v1/", relay.addr.port());
        let fg = Fencegate::start_with_server(
            &server_toml(),
            &format!(
                "{}{state}{}{}",
                store_toml(leases.path(), PREFIX),
                route("hook", "hook", &up, true),
                route("tick", "tick", &up, true)
                    .replace("schedule = [\"200ms\"", "schedule = [\"1h\"")
            ),
            &[],
        );
        let epochs = dir_epochs(leases.path());
        let hook = acquire(&epochs, "hook", "worker-a", Duration::from_secs(120)).await;
        let tick = acquire(&epochs, "tick", "worker-t", Duration::from_secs(120)).await;
        Down {
            leases,
            origin,
            relay,
            fg,
            epochs,
            hook,
            tick,
        }
    }

    /// Accepts m1, m2 on `hook` and t1 on `tick` at their first epochs while
    /// the receiver is down; snapshots the data_dir into `copy`; brings the
    /// receiver back (m1, m2, t1 delivered); then a new epoch of `hook` sends
    /// m3. Returns the new holder.
    async fn run_past(&mut self, copy: &Path) -> Holding {
        self.run_past_with(|fg| snapshot(fg, copy)).await
    }

    /// [`Down::run_past`], the backup taken by `backup`.
    async fn run_past_with(&mut self, backup: impl FnOnce(&Fencegate)) -> Holding {
        let fg = &self.fg;
        accepted(&send(keyed(fg, "/hook/e", &self.hook, "m1", "m1")).await);
        accepted(&send(keyed(fg, "/hook/e", &self.hook, "m2", "m2")).await);
        accepted(&send(keyed(fg, "/tick/e", &self.tick, "t1", "t1")).await);
        attempted(fg, "hook", "m1").await;
        // t1's one attempt (cut by the relay: an unknown outcome) is over;
        // its next is an hour away.
        let mut t1 = delivery(fg, "tick", "t1").await;
        for _ in 0..800 {
            if t1["status"] == "pending" && t1["attempts"] == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
            t1 = delivery(fg, "tick", "t1").await;
        }
        assert_eq!(t1["unknown_outcomes"], 1, "{t1}");
        backup(fg);
        self.relay.refuse(false);
        wait_status(fg, "hook", "m2", "delivered").await;
        let retry = admin_post(fg, "/v1/deliveries/tick/t1/retry").await;
        assert_eq!(
            retry.status,
            200,
            "{}",
            String::from_utf8_lossy(&retry.body)
        );
        wait_status(fg, "tick", "t1", "delivered").await;
        let b = force_next_epoch(&self.epochs, "hook", "worker-b", Duration::from_secs(120)).await;
        accepted(&send(keyed(fg, "/hook/e", &b, "m3", "m3")).await);
        wait_status(fg, "hook", "m3", "delivered").await;
        let got = arrived(&self.origin);
        let hook: Vec<&String> = got.iter().filter(|b| b.starts_with('m')).collect();
        assert_eq!(hook, ["m1", "m2", "m3"], "before the copy is used");
        assert_eq!(got.iter().filter(|b| *b == "t1").count(), 1, "{got:?}");
        b
    }
}

/// What a fenced copy must show: m1 and m2 (epoch 1 of `hook`, whose epoch 2
/// was sent since the copy) failed unsent, a retry of them refused as
/// superseded; t1 (its lease's latest epoch) sent again counted as an unknown
/// outcome; nothing of an older epoch after a newer one at the destination.
async fn fenced_copy_holds(fg: &Fencegate, origin: &Origin) {
    // Settled first, whichever way: the destination is judged before the
    // copy's own account of it.
    for k in ["m1", "m2"] {
        settled(fg, "hook", k).await;
    }
    let got = arrived(origin);
    let m3 = got.iter().position(|b| b == "m3").unwrap();
    assert!(
        !got[m3..].iter().any(|b| b == "m1" || b == "m2"),
        "an epoch-1 message after the epoch-2 one: {got:?}"
    );
    assert_eq!(got.iter().filter(|b| *b == "m1").count(), 1, "{got:?}");
    for k in ["m1", "m2"] {
        let v = wait_status(fg, "hook", k, "failed").await;
        assert!(
            v["last_error"]
                .as_str()
                .is_some_and(|e| e.contains("restored from an older copy")),
            "{v}"
        );
    }
    admin_post(fg, "/v1/deliveries/hook/m1/retry")
        .await
        .assert_error(409, "delivery_superseded");
    // t1 was delivered after the copy (pending in it, its next attempt an
    // hour away): sent again at once, and counted.
    let t1 = wait_status(fg, "tick", "t1", "delivered").await;
    assert_eq!(t1["unknown_outcomes"].as_u64(), Some(2), "{t1}");
    wait_log(fg, "restored or copied state fenced", 1).await;
}

/// Issue 49, repro 2: a copy of the data_dir taken while A ran takes the
/// guard over once A is gone (kill -9: A's process is provably gone, so the
/// copy — same instance id, same gate key — takes it at once, as a restart
/// in place would). It is a copy all the same: its gate objects' generation
/// is behind theirs, and it sends nothing A's later deliveries overtook.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copied_data_dir_that_takes_the_guard_over_is_fenced() {
    let mut d = Down::start().await;
    let copies = tempfile::tempdir().unwrap();
    let copy = copies.path().join("state");
    d.run_past(&copy).await;
    d.fg.kill9();
    let mut b = Fencegate::unstarted("127.0.0.1:0", &server_toml(), &after_server(&d.fg), &[]);
    copy_dir(&copy, &state_dir(&b));
    b.spawn(None).expect("the copy starts");
    fenced_copy_holds(&b, &d.origin).await;
    // A second start of the copy, fenced already, fences nothing again.
    let fenced = b
        .stderr()
        .matches("restored or copied state fenced")
        .count();
    b.kill9();
    b.spawn(None).expect("the copy starts again");
    accepted(&send(keyed(&b, "/tick/e", &d.tick, "t2", "t2")).await);
    wait_status(&b, "tick", "t2", "delivered").await;
    assert_eq!(
        b.stderr()
            .matches("restored or copied state fenced")
            .count(),
        fenced
    );
    assert_eq!(delivery(&b, "tick", "t2").await["unknown_outcomes"], 0);
    drop(d.leases);
}

/// Issue 49, repro 4 (sled): the instance's own backup, restored in place
/// after a graceful stop — it takes its released guard back at once — is
/// older than its gate objects and is fenced before it sends anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_backup_of_a_data_dir_is_fenced() {
    let mut d = Down::start().await;
    let backups = tempfile::tempdir().unwrap();
    let backup = backups.path().join("state");
    d.run_past(&backup).await;
    assert!(d.fg.terminate().success());
    copy_dir(&backup, &state_dir(&d.fg));
    d.fg.spawn(None).expect("the restored instance starts");
    fenced_copy_holds(&d.fg, &d.origin).await;
}

/// Issue 49, repro 5: a copy of production's data_dir started by staging,
/// under its own prefix (its guard free), refuses to start: the data_dir
/// belongs to production's set-up. Nothing of production's is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_of_a_data_dir_under_another_prefix_refuses_to_start() {
    let d = Down::start().await;
    let copies = tempfile::tempdir().unwrap();
    let copy = copies.path().join("state");
    accepted(&send(keyed(&d.fg, "/hook/e", &d.hook, "m1", "m1")).await);
    snapshot(&d.fg, &copy);
    let staging =
        after_server(&d.fg).replace(&format!("prefix = \"{PREFIX}\""), "prefix = \"staging/\"");
    let mut s = Fencegate::unstarted("127.0.0.1:0", &server_toml(), &staging, &[]);
    copy_dir(&copy, &state_dir(&s));
    d.relay.refuse(false);
    let err = s
        .spawn(None)
        .expect_err("staging started on production's data_dir");
    assert_eq!(s.last_exit.and_then(|c| c.code()), Some(2));
    assert!(
        err.contains("belongs to another fencegate set-up") && err.contains("\"fencegate/\""),
        "{err}"
    );
    wait_status(&d.fg, "hook", "m1", "delivered").await;
    assert_eq!(arrived(&d.origin), ["m1"]);
}

macro_rules! skip_without_postgres {
    () => {
        if !$crate::support::postgres::available_or_skip() {
            return;
        }
    };
}

/// One environment's instance on `toml` forwards `key` on lease `pay` for a
/// worker of `epochs`, then stops (SIGTERM): the instance and the worker.
async fn serve_once(
    toml: &str,
    epochs: &fencegate::lease::Epochs,
    key: &str,
    body: &str,
) -> (Fencegate, Holding) {
    let mut fg = Fencegate::start_with_server(&server_toml(), toml, &[]);
    let w = acquire(epochs, "pay", "worker", Duration::from_secs(120)).await;
    assert_eq!(send(keyed(&fg, "/pay/c", &w, key, body)).await.status, 200);
    assert!(fg.terminate().success());
    (fg, w)
}

/// Issue 49, repro 1: staging and production reach *their own* database by
/// one connection string (here: a database renamed away, another created
/// under its name — as two networks' DNS would do). Production's set-up row
/// is deleted (the documented step before a peer-token change), then its
/// database is taken back to a schema from before set-up rows and ids. Staging,
/// restarted unchanged, is refused both times: its gate objects name its own
/// database's id, and a database without one is named by none. Production
/// takes its own back — by its gate objects after the deleted row, by
/// `--claim-state` after the older schema — and a retry of its key is
/// answered from its record, never delivered twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_environments_connection_string_does_not_claim_a_database() {
    skip_without_postgres!();
    let pg = postgres::PgServer::shared();
    let (name, url) = pg.new_database();
    let leases = tempfile::tempdir().unwrap();
    let origin = Origin::start().await;
    let up = origin.url("/v1/");
    let env = |prefix: &str| {
        format!(
            "{}{}{}",
            store_toml(leases.path(), prefix),
            state_toml(&url, ""),
            route("pay", "pay", &up, false)
        )
    };
    let store = dir_epochs(leases.path()).store().clone();
    let epochs = |prefix: &str| fencegate::lease::Epochs::new(store.clone(), prefix);
    let (mut staging, _) =
        serve_once(&env("staging/"), &epochs("staging/"), "s-1", "staging").await;
    pg.psql(
        "postgres",
        &format!("ALTER DATABASE {name} RENAME TO {name}_staging"),
    );
    pg.psql("postgres", &format!("CREATE DATABASE {name}"));

    let (mut prod, wp) = serve_once(&env("prod/"), &epochs("prod/"), "order-1", "prod").await;
    pg.psql(&name, "DELETE FROM fencegate_set_up");
    let err = staging
        .spawn(None)
        .expect_err("staging claimed production's database");
    assert_eq!(staging.last_exit.and_then(|c| c.code()), Some(2));
    assert!(err.contains("names this database's id"), "{err}");
    prod.spawn(None)
        .expect("production takes its own database back");
    let replay = send(keyed(&prod, "/pay/c", &wp, "order-1", "prod")).await;
    assert_eq!(replay.status, 200);
    assert_eq!(replay.headers["x-fencegate-replayed"], "true");
    assert!(prod.terminate().success());

    // An older schema: no set-up row, no id.
    pg.psql(
        &name,
        &(crate::support::postgres::UNDO_SCHEMA_13.to_owned()
            + "DROP TABLE fencegate_set_up; DROP TABLE fencegate_identity; \
         DROP TABLE fencegate_queue; DROP TABLE fencegate_queue_leases; \
         DROP TABLE fencegate_queue_paused; DROP TABLE fencegate_queue_jobs; \
         UPDATE fencegate_schema SET version = 7"),
    );
    staging
        .spawn(None)
        .expect_err("staging claimed an older production database");
    assert_eq!(staging.last_exit.and_then(|c| c.code()), Some(2));
    let err = prod
        .spawn(None)
        .expect_err("nothing names a database without an id");
    assert_eq!(prod.last_exit.and_then(|c| c.code()), Some(2));
    assert!(err.contains("--claim-state"), "says the way out: {err}");
    prod.set_args(&["--claim-state"]);
    prod.spawn(None).expect("--claim-state");
    let replay = send(keyed(&prod, "/pay/c", &wp, "order-1", "prod")).await;
    assert_eq!(replay.headers["x-fencegate-replayed"], "true");
    assert_eq!(arrived(&origin), ["staging", "prod"]);
}

/// Issue 49, repro 4 on PostgreSQL: the database of a single instance is
/// dumped while it runs (a nightly backup), more is delivered across an epoch
/// raise, the instance stops and the dump is restored. The restored state is
/// older than its gate objects: fenced as a restored data_dir is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_restored_from_a_dump_is_fenced() {
    skip_without_postgres!();
    let pg = postgres::PgServer::shared();
    let (name, url) = pg.new_database();
    let mut d = Down::start_on(&state_toml(&url, "")).await;
    let mut dump = Vec::new();
    d.run_past_with(|_| dump = pg.dump(&name)).await;
    assert!(d.fg.terminate().success());
    pg.restore(&name, &dump);
    d.fg.spawn(None).expect("the restored instance starts");
    fenced_copy_holds(&d.fg, &d.origin).await;
}

/// Found by review (F1): a dump restored into a database of another name —
/// as a managed service's snapshot restore gives a new endpoint — is the same
/// database by its id, and fenced as one restored in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_restored_under_another_name_is_fenced() {
    skip_without_postgres!();
    let pg = postgres::PgServer::shared();
    let (name, url) = pg.new_database();
    let mut d = Down::start_on(&state_toml(&url, "")).await;
    let mut dump = Vec::new();
    d.run_past_with(|_| dump = pg.dump(&name)).await;
    assert!(d.fg.terminate().success());
    let restored = format!("{name}_restored");
    pg.psql("postgres", &format!("CREATE DATABASE {restored}"));
    pg.restore(&restored, &dump);
    let moved = pg.url(&restored);
    d.fg.edit_config(|t| t.replace(&url, &moved));
    d.fg.spawn(None).expect("the restored instance starts");
    fenced_copy_holds(&d.fg, &d.origin).await;
}

/// Found by review (F2): a backup restored without its `gate-key` no longer
/// recognises its own gate objects; once its old gate lease has ended it
/// takes the guard (its instance id is the same), and — objects naming its
/// state count sealed or not — is still found to be a copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_data_dir_without_its_gate_key_is_fenced() {
    let mut d = Down::start().await;
    let backups = tempfile::tempdir().unwrap();
    let backup = backups.path().join("state");
    d.run_past(&backup).await;
    assert!(d.fg.terminate().success());
    copy_dir(&backup, &state_dir(&d.fg));
    std::fs::remove_file(state_dir(&d.fg).join("gate-key")).unwrap();
    spawn_when_free(&mut d.fg).await;
    fenced_copy_holds(&d.fg, &d.origin).await;
}

/// Found by review (F3): while the state's generation cannot be raised, a
/// lease's first message of a newer epoch is not sent (the checkpoint before
/// it needs the raise after its gate object); once it can, it is — and a
/// dump taken meanwhile, restored after the original dies, is fenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_epoch_waits_for_a_raised_generation() {
    skip_without_postgres!();
    let pg = postgres::PgServer::shared();
    let (name, url) = pg.new_database();
    let mut d = Down::start_on(&state_toml(&url, "")).await;
    let fg = &d.fg;
    accepted(&send(keyed(fg, "/hook/e", &d.hook, "m1", "m1")).await);
    accepted(&send(keyed(fg, "/hook/e", &d.hook, "m2", "m2")).await);
    attempted(fg, "hook", "m1").await;
    pg.refuse_raises(&name, "true");
    let dump = pg.dump(&name);
    d.relay.refuse(false);
    wait_status(fg, "hook", "m2", "delivered").await;
    let b = force_next_epoch(&d.epochs, "hook", "worker-b", Duration::from_secs(120)).await;
    accepted(&send(keyed(fg, "/hook/e", &b, "m3", "m3")).await);
    wait_log(
        fg,
        "the gate object before a newer epoch's first message could not be written",
        2,
    )
    .await;
    assert_eq!(arrived(&d.origin), ["m1", "m2"], "m3 waits for the raise");
    pg.allow_raises(&name);
    wait_status(fg, "hook", "m3", "delivered").await;
    d.fg.kill9();
    pg.restore(&name, &dump);
    pg.allow_raises(&name);
    d.fg.spawn(None).expect("the restored instance starts");
    for k in ["m1", "m2"] {
        settled(&d.fg, "hook", k).await;
    }
    assert_eq!(arrived(&d.origin), ["m1", "m2", "m3"]);
    for k in ["m1", "m2"] {
        wait_status(&d.fg, "hook", k, "failed").await;
    }
}

/// Starts `fg` again and again while it exits 2 (a gate lease it may not
/// take yet), for up to a minute.
async fn spawn_when_free(fg: &mut Fencegate) {
    let t0 = std::time::Instant::now();
    while let Err(e) = fg.spawn(None) {
        assert_eq!(fg.last_exit.and_then(|c| c.code()), Some(2), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(60), "never started: {e}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Found by the second review (R2-2): the database of a single instance is
/// dumped, the instance goes on (m1, m2, then m3 of a newer epoch) and
/// stops; another data_dir then runs on the same database long enough to
/// write every one of the latest 16 gate objects; the dump is restored and
/// the first data_dir starts again. The other data_dir's objects name the
/// same database and carry its raised generation: the restore is found
/// (they count, sealed by another key or not).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_is_found_through_another_data_dirs_gate_objects() {
    skip_without_postgres!();
    let pg = postgres::PgServer::shared();
    let (name, url) = pg.new_database();
    let mut d = Down::start_on(&state_toml(&url, "")).await;
    let mut dump = Vec::new();
    d.run_past_with(|_| dump = pg.dump(&name)).await;
    assert!(d.fg.terminate().success());
    let mut y = Fencegate::unstarted("127.0.0.1:0", &server_toml(), &after_server(&d.fg), &[]);
    spawn_when_free(&mut y).await;
    for _ in 0..9 {
        assert!(y.terminate().success());
        spawn_when_free(&mut y).await;
    }
    assert!(y.terminate().success());
    pg.restore(&name, &dump);
    spawn_when_free(&mut d.fg).await;
    fenced_copy_holds(&d.fg, &d.origin).await;
}

/// Found by the second review (R2-1): while the instance's raises fail (a
/// trigger refuses every raise that records no restore), its latest gate
/// object names the database's own generation. A second instance started
/// then (a fresh data_dir) is refused (exit 2, the guard held) and records
/// nothing: a restore is looked for only once the guard is held. Its
/// holder, restarted, fences nothing, and m1 of epoch 1, waiting behind the
/// down receiver while epoch 2 is the latest, is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_instance_records_no_restore() {
    skip_without_postgres!();
    let pg = postgres::PgServer::shared();
    let (name, url) = pg.new_database();
    let mut d = Down::start_on(&state_toml(&url, "")).await;
    accepted(&send(keyed(&d.fg, "/hook/e", &d.hook, "m1", "m1")).await);
    attempted(&d.fg, "hook", "m1").await;
    force_next_epoch(&d.epochs, "hook", "worker-b", Duration::from_secs(120)).await;
    // Raises fail; recording a restore (a second instance's) would not.
    pg.refuse_raises(&name, "NEW.restored = OLD.restored");
    wait_log(&d.fg, "could not raise the state's generation", 1).await;
    let mut b = Fencegate::unstarted("127.0.0.1:0", &server_toml(), &after_server(&d.fg), &[]);
    b.spawn(None)
        .expect_err("a second instance beside a live one");
    assert_eq!(b.last_exit.and_then(|c| c.code()), Some(2));
    assert_eq!(
        pg.psql(&name, "SELECT restored FROM fencegate_identity"),
        "0",
        "{}",
        b.stderr()
    );
    pg.allow_raises(&name);
    assert!(d.fg.terminate().success());
    d.relay.refuse(false);
    d.fg.spawn(None).expect("the holder starts again");
    wait_status(&d.fg, "hook", "m1", "delivered").await;
    assert!(!d.fg.stderr().contains("restored or copied state fenced"));
}

/// Found by the third review (R3-A): the same data_dir (the same instance
/// id) started on another state — a sled instance moved onto PostgreSQL, or
/// a mistyped url — is another state: its guard refuses to take over from
/// itself without `--takeover-may-duplicate`, and the retry of a key done on
/// the old state is never forwarded again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_instance_on_another_state_takes_over_only_when_told() {
    skip_without_postgres!();
    let (_, url) = postgres::PgServer::shared().new_database();
    let leases = tempfile::tempdir().unwrap();
    let origin = Origin::start().await;
    let up = origin.url("/v1/");
    let mut fg = Fencegate::start_with_server(
        &server_toml(),
        &format!(
            "{}{}",
            store_toml(leases.path(), PREFIX),
            route("pay", "pay", &up, false)
        ),
        &[],
    );
    let w = acquire(
        &dir_epochs(leases.path()),
        "pay",
        "worker",
        Duration::from_secs(120),
    )
    .await;
    let k = |fg: &Fencegate| keyed(fg, "/pay/c", &w, "order-1", "one");
    assert_eq!(send(k(&fg)).await.status, 200);
    assert!(fg.terminate().success());
    fg.edit_config(|t| t.replace("[store]", &format!("{}[store]", state_toml(&url, ""))));
    let err = fg
        .spawn(None)
        .expect_err("another state taken over without the flag");
    assert_eq!(fg.last_exit.and_then(|c| c.code()), Some(2));
    assert!(
        err.contains("--takeover-may-duplicate") && err.contains("sled:"),
        "{err}"
    );
    fg.edit_config(|t| t.replace(&state_toml(&url, ""), ""));
    fg.spawn(None).expect("back on its own state");
    let replay = send(k(&fg)).await;
    assert_eq!(replay.headers["x-fencegate-replayed"], "true");
    assert_eq!(arrived(&origin), ["one"]);
}

/// Found by the third review (R3-C): a data_dir's backup is restored after
/// another instance (a fresh data_dir, let in with `--takeover-may-duplicate`)
/// wrote more than 16 gate objects on top of the original's: the restored
/// state's own objects are looked for further back, and it is fenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_is_found_behind_another_states_gate_objects() {
    let mut d = Down::start().await;
    let backups = tempfile::tempdir().unwrap();
    let backup = backups.path().join("state");
    d.run_past(&backup).await;
    assert!(d.fg.terminate().success());
    let mut b = Fencegate::unstarted_with_args(
        "127.0.0.1:0",
        &server_toml(),
        &after_server(&d.fg),
        &[],
        &["--takeover-may-duplicate"],
    );
    spawn_when_free(&mut b).await;
    for _ in 0..9 {
        assert!(b.terminate().success());
        spawn_when_free(&mut b).await;
    }
    assert!(b.terminate().success());
    copy_dir(&backup, &state_dir(&d.fg));
    d.fg.set_args(&["--takeover-may-duplicate"]);
    spawn_when_free(&mut d.fg).await;
    fenced_copy_holds(&d.fg, &d.origin).await;
}
