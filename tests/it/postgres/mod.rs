//! SPEC §6, §9, §10: marks and dedup records in a real PostgreSQL — the database
//! frozen, killed and cut off under load, two owners of one shard, the schema at
//! start-up, and what `check-config` and `serve` say about `[state]`.
//!
//! The lease store is the `dir` store (no Python needed); each test that needs
//! PostgreSQL skips, saying why, where none is installed. Tests that freeze or
//! kill the database start a server of their own ([`PgServer::start`]); the
//! others take a fresh database on the shared one.
//!
//! Crashes of fencegate itself on PostgreSQL are `dedup::crash_on_each_durable_
//! boundary_is_at_most_once::postgres`. The group commit under faults is
//! [`group_commit`], claims and outcomes in one statement
//! [`combined_statement`], a database upgraded while in use [`upgrade`].

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fencegate::config::{StateConfig, StateKind};
use fencegate::epoch::{Epoch, LeaseName};
use fencegate::lease::acquire::Holding;
use fencegate::lease::Epochs;
use fencegate::state::postgres::PostgresState;
use fencegate::state::{
    Begun, End, Generation, Owner, Record, RecordKey, Resolution, Resolved, State, StateError,
    StateStore, StoredResponse, TakeOver,
};

use crate::support::postgres::{KeyHold, PgServer};
use crate::support::relay::Relay;
use crate::support::*;

macro_rules! skip_without_postgres {
    () => {
        if !$crate::support::postgres::available_or_skip() {
            return;
        }
    };
}

mod combined_statement;
mod group_commit;
mod queue;
mod upgrade;

// ---------------------------------------------------------------------------
// A fencegate process on PostgreSQL

/// fencegate on the `dir` lease store and PostgreSQL at `url`, with three routes
/// to one recording origin: `pay` (dedup on content), and the fencing-only `feed`
/// and `jobs` (`derive_key = "none"`), each on a lease of its own name.
pub(crate) struct Rig {
    _leases: tempfile::TempDir,
    pub(crate) epochs: Epochs,
    pub(crate) origin: Origin,
    pub(crate) fg: Fencegate,
}

pub(crate) async fn rig(url: &str, state_extra: &str) -> Rig {
    let leases = tempfile::tempdir().unwrap();
    let origin = Origin::start().await;
    let fg = Fencegate::start(&format!(
        "{}{}[dedup]\nsweep_interval = \"1h\"\n\n{}{}{}",
        dir_store_toml(leases.path()),
        state_toml(url, state_extra),
        route_toml("pay", "pay", &origin, ""),
        route_toml("feed", "feed", &origin, "derive_key = \"none\"\n"),
        route_toml("jobs", "jobs", &origin, "derive_key = \"none\"\n"),
    ));
    Rig {
        epochs: dir_epochs(leases.path()),
        _leases: leases,
        origin,
        fg,
    }
}

impl Rig {
    pub(crate) async fn hold(&self, lease: &str) -> Holding {
        acquire(&self.epochs, lease, "worker", Duration::from_secs(300)).await
    }

    /// How many times the origin received dedup key `key`.
    pub(crate) fn arrivals_of(&self, key: &str) -> usize {
        self.origin
            .log()
            .iter()
            .filter(|a| a.header("idempotency-key").as_deref() == Some(key))
            .count()
    }

    /// Arrivals per dedup key.
    pub(crate) fn arrivals_by_key(&self) -> HashMap<String, usize> {
        let mut m = HashMap::new();
        for a in self.origin.log() {
            if let Some(k) = a.header("idempotency-key") {
                *m.entry(k).or_default() += 1;
            }
        }
        m
    }
}

/// A request's answer, as a worker sees it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Answer {
    /// The upstream's answer, forwarded now.
    Forwarded(u16),
    /// A stored answer (`X-Fencegate-Replayed: true`).
    Replayed(u16),
    /// fencegate's own error (SPEC §7).
    Refused(u16, String),
    /// No answer at all.
    Broken(String),
}

pub(crate) fn answer(r: Result<Reply, String>) -> Answer {
    match r {
        Err(e) => Answer::Broken(e),
        Ok(r) => match r.error_code() {
            Some(code) => {
                r.assert_error(r.status.as_u16(), &code);
                if r.status == 503 {
                    assert!(
                        r.headers.contains_key("retry-after"),
                        "503 {code} without Retry-After"
                    );
                }
                Answer::Refused(r.status.as_u16(), code)
            }
            None if r.headers.contains_key("x-fencegate-replayed") => {
                Answer::Replayed(r.status.as_u16())
            }
            None => Answer::Forwarded(r.status.as_u16()),
        },
    }
}

pub(crate) fn refused(code: &str) -> Answer {
    let status = match code {
        "store_unavailable" => 503,
        _ => 409,
    };
    Answer::Refused(status, code.to_owned())
}

pub(crate) async fn keyed_answer(fg: &Fencegate, h: &Holding, key: &str) -> Answer {
    answer(
        try_send(keyed(
            fg,
            &format!("/pay/{key}"),
            h,
            key,
            &format!("pay {key}"),
        ))
        .await,
    )
}

/// Sends fencing-only requests on `feed` one after another until `stop`; returns
/// (when it was sent, when answered, the answer) for each.
fn fencing_stream(
    fg: &Fencegate,
    h: &Holding,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<(Instant, Instant, Answer)>> {
    let (url, epoch, token) = (fg.url("/feed/tick"), h.epoch.get(), h.token.clone());
    tokio::spawn(async move {
        let mut out = Vec::new();
        while !stop.load(Ordering::SeqCst) {
            let t0 = Instant::now();
            let r = try_send(worker_req(&url, epoch, &token).body(body("tick")).unwrap()).await;
            out.push((t0, Instant::now(), answer(r)));
        }
        out
    })
}

pub(crate) fn tally<'a>(answers: impl IntoIterator<Item = &'a Answer>) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for a in answers {
        let k = match a {
            Answer::Broken(_) => "broken".to_owned(),
            other => format!("{other:?}"),
        };
        *m.entry(k).or_default() += 1;
    }
    m
}

/// The state of `key` in the database, read by psql past fencegate: "0"
/// in_flight, "1" done, "2" in_doubt, "" absent.
pub(crate) fn db_state(pg: &PgServer, db: &str, key: &str) -> String {
    pg.psql(
        db,
        &format!("SELECT state FROM fencegate_dedup WHERE route = 'pay' AND key = '{key}'"),
    )
}

/// Polls `cond` (a blocking check, e.g. psql) every 10 ms for up to 20 s.
pub(crate) async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !tokio::task::block_in_place(&mut cond) {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// ---------------------------------------------------------------------------
// 2. The database frozen (SIGSTOP) under load

/// The whole database stopped (postmaster and backends, SIGSTOP): requests that
/// need a state write — a new dedup key, a mark raise — get 503
/// `store_unavailable` with `Retry-After` within about `[state] timeout_ms` and
/// reach nothing; a fencing-only route at a mark already raised keeps flowing.
/// After SIGCONT everything works and no key reaches the origin twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_frozen_refuses_state_writes_while_fencing_flows() {
    skip_without_postgres!();
    const TIMEOUT_MS: u64 = 500;
    let pg = PgServer::start();
    let (_db, url) = pg.new_database();
    let r = rig(&url, &format!("timeout_ms = {TIMEOUT_MS}")).await;
    let (pay, feed, jobs) = (
        r.hold("pay").await,
        r.hold("feed").await,
        r.hold("jobs").await,
    );
    // Marks raised on pay and feed, one key done; jobs' mark is still zero.
    assert_eq!(
        keyed_answer(&r.fg, &pay, "before").await,
        Answer::Forwarded(200)
    );
    assert_eq!(post(&r.fg, "/feed/warm", &feed, "warm").await.status, 200);

    let stop = Arc::new(AtomicBool::new(false));
    let stream = fencing_stream(&r.fg, &feed, stop.clone());
    pg.pause();
    let paused_at = Instant::now();
    // Eight new keys at once, and the first request on jobs (a raise from 0).
    let writes: Vec<_> = (0..8)
        .map(|i| {
            let key = format!("frozen-{i}");
            let req = keyed(
                &r.fg,
                &format!("/pay/{key}"),
                &pay,
                &key,
                &format!("pay {key}"),
            );
            (key, timed(req))
        })
        .collect();
    let raise = timed(jobs_first(&r.fg, &jobs));
    let mut answers = Vec::new();
    for (key, task) in writes {
        let (a, took) = task.await.unwrap();
        answers.push((key, a, took));
    }
    let writes = answers;
    let (raise, raise_took) = raise.await.unwrap();
    let frozen_for = paused_at.elapsed();
    let arrivals_while_frozen = r.origin.log();
    pg.resume();
    let resumed_at = Instant::now();

    let bound = Duration::from_millis(2 * TIMEOUT_MS + 1000);
    let took: Vec<_> = writes.iter().map(|(_, _, d)| d.as_millis()).collect();
    eprintln!(
        "frozen database: new keys answered in {took:?} ms, the raise in {} ms (timeout_ms {TIMEOUT_MS})",
        raise_took.as_millis()
    );
    for (key, a, d) in &writes {
        assert_eq!(a, &refused("store_unavailable"), "{key}");
        assert!(*d <= bound, "{key}: refused after {d:?}, over {bound:?}");
    }
    assert_eq!(
        raise,
        refused("store_unavailable"),
        "a raise needs the database"
    );
    assert!(
        raise_took <= bound,
        "the raise was refused after {raise_took:?}"
    );
    assert!(
        !arrivals_while_frozen
            .iter()
            .any(|a| a.path.starts_with("/v1/frozen") || a.path == "/v1/first"),
        "nothing is forwarded for a refused write"
    );

    // The fencing-only stream, while the database was frozen: every answer 200,
    // and the origin has them.
    stop.store(true, Ordering::SeqCst);
    let ticks = stream.await.unwrap();
    let during: Vec<_> = ticks
        .iter()
        .filter(|(t0, t1, _)| *t0 >= paused_at && *t1 <= resumed_at)
        .collect();
    eprintln!(
        "frozen database: {} fencing-only requests answered during {frozen_for:?}: {:?}",
        during.len(),
        tally(during.iter().map(|(_, _, a)| a))
    );
    assert!(
        during.len() >= 5,
        "the fencing-only route kept flowing: {} answers in {frozen_for:?}",
        during.len()
    );
    assert!(
        ticks.iter().all(|(_, _, a)| *a == Answer::Forwarded(200)),
        "{:?}",
        tally(ticks.iter().map(|(_, _, a)| a))
    );
    let ticks_at_origin = r
        .origin
        .log()
        .iter()
        .filter(|a| a.path == "/v1/tick")
        .count();
    assert_eq!(ticks_at_origin, ticks.len());

    // The operator sees it in the metrics (SPEC §10.2: state-store errors): the
    // refused claims and the refused raise, as the database being away.
    let errors =
        |op: &str| format!("fencegate_state_errors_total{{op=\"{op}\",kind=\"unavailable\"}}");
    let begins = r.fg.metric_sum(&errors("begin")).await;
    let raises = r.fg.metric_sum(&errors("raise_mark")).await;
    assert!(begins >= 8.0, "{begins}");
    assert!(raises >= 1.0, "{raises}");

    // Thawed: new keys and raises work again.
    assert_eq!(
        keyed_answer(&r.fg, &pay, "after").await,
        Answer::Forwarded(200)
    );
    let (first, _) = timed(jobs_first(&r.fg, &jobs)).await.unwrap();
    assert_eq!(first, Answer::Forwarded(200));
    assert_eq!(
        keyed_answer(&r.fg, &pay, "before").await,
        Answer::Replayed(200)
    );
    // A refused key's retry: forwarded if its claim never reached the database;
    // refused (409) if the claim, sent before the freeze was noticed, committed
    // after SIGCONT — never forwarded a second time.
    let mut retries = Vec::new();
    for (key, _, _) in &writes {
        let a = keyed_answer(&r.fg, &pay, key).await;
        assert!(
            a == Answer::Forwarded(200)
                || a == refused("dedup_in_flight")
                || a == refused("dedup_in_doubt"),
            "{key}: {a:?}"
        );
        retries.push(a);
    }
    eprintln!(
        "frozen database: retries of the refused keys after SIGCONT: {:?}",
        tally(&retries)
    );
    // A claim that committed after its request was refused stays in flight
    // until the background settle of its statement frees it (it was never
    // forwarded), or, if the restart comes first, the restart makes it in doubt
    // for an operator to resolve. Either way it reaches the origin at most once
    // (below).
    let mut r = r;
    r.fg.restart();
    for ((key, _, _), before) in writes.iter().zip(&retries) {
        let a = keyed_answer(&r.fg, &pay, key).await;
        match before {
            Answer::Forwarded(_) => assert_eq!(a, Answer::Replayed(200), "{key}"),
            _ => assert!(
                a == refused("dedup_in_doubt") || a == Answer::Forwarded(200),
                "{key}: {a:?}"
            ),
        }
    }
    for (key, n) in r.arrivals_by_key() {
        assert_eq!(n, 1, "{key} reached the origin {n} times");
    }
}

/// Sends `req` on a task of its own: its answer and how long it took.
pub(crate) fn timed(
    req: http::Request<http_body_util::Full<bytes::Bytes>>,
) -> tokio::task::JoinHandle<(Answer, Duration)> {
    tokio::spawn(async move {
        let t0 = Instant::now();
        let a = answer(try_send(req).await);
        (a, t0.elapsed())
    })
}

/// The first request on `jobs`: its mark must be raised from zero.
fn jobs_first(fg: &Fencegate, jobs: &Holding) -> http::Request<http_body_util::Full<bytes::Bytes>> {
    worker_req(&fg.url("/jobs/first"), jobs.epoch.get(), &jobs.token)
        .body(body("first"))
        .unwrap()
}

// ---------------------------------------------------------------------------
// 3. The database killed (kill -9) and restarted under load

/// Workers sending new keys one after another on `pay` until `stop`: each key's
/// first answer, in order.
fn keyed_load(
    fg: &Fencegate,
    h: &Holding,
    worker: usize,
    stop: Arc<AtomicBool>,
    log: Arc<Mutex<Vec<(String, Answer)>>>,
) -> tokio::task::JoinHandle<()> {
    let (fg_url, epoch, token) = (fg.url(""), h.epoch.get(), h.token.clone());
    tokio::spawn(async move {
        let mut n = 0;
        while !stop.load(Ordering::SeqCst) {
            let key = format!("load-{worker}-{n}");
            n += 1;
            let req = worker_req(&format!("{fg_url}/pay/{key}"), epoch, &token)
                .header("idempotency-key", &key)
                .body(body(&format!("pay {key}")))
                .unwrap();
            let a = answer(try_send(req).await);
            log.lock().unwrap().push((key, a));
        }
    })
}

/// kill -9 of every PostgreSQL process under load, then a restart (crash
/// recovery): while it is down requests that need a state write get 503 and the
/// fencing-only route flows; afterwards new keys work, a key that was `done`
/// before the crash is still replayed, and no key reached the origin twice — nor
/// went missing after a 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_killed_and_restarted_under_load() {
    skip_without_postgres!();
    let pg = PgServer::start();
    let (_db, url) = pg.new_database();
    let r = rig(&url, "timeout_ms = 500").await;
    let (pay, feed) = (r.hold("pay").await, r.hold("feed").await);
    assert_eq!(
        keyed_answer(&r.fg, &pay, "kept-done").await,
        Answer::Forwarded(200)
    );
    assert_eq!(post(&r.fg, "/feed/warm", &feed, "warm").await.status, 200);

    let stop = Arc::new(AtomicBool::new(false));
    let log = Arc::new(Mutex::new(Vec::new()));
    let workers: Vec<_> = (0..4)
        .map(|w| keyed_load(&r.fg, &pay, w, stop.clone(), log.clone()))
        .collect();
    let stream = fencing_stream(&r.fg, &feed, stop.clone());
    let count = |want: &Answer| {
        log.lock()
            .unwrap()
            .iter()
            .filter(|(_, a)| a == want)
            .count()
    };
    eventually("20 keys forwarded before the crash", || async {
        count(&Answer::Forwarded(200)) >= 20
    })
    .await;
    pg.kill9();
    let killed_at = Instant::now();
    let seen = log.lock().unwrap().len();
    eventually("20 keys refused while the database is down", || async {
        log.lock().unwrap()[seen..]
            .iter()
            .filter(|(_, a)| *a == refused("store_unavailable"))
            .count()
            >= 20
    })
    .await;
    let down_for = killed_at.elapsed();
    let restarted_at = Instant::now();
    pg.restart();
    let up_at = Instant::now();
    let seen = log.lock().unwrap().len();
    eventually("keys forwarded again after the restart", || async {
        log.lock().unwrap()[seen..]
            .iter()
            .filter(|(_, a)| *a == Answer::Forwarded(200))
            .count()
            >= 20
    })
    .await;
    let recovered_in = up_at.elapsed();
    stop.store(true, Ordering::SeqCst);
    for w in workers {
        w.await.unwrap();
    }
    let ticks = stream.await.unwrap();
    let log = std::mem::take(&mut *log.lock().unwrap());
    eprintln!(
        "killed database: {} keys: {:?}; down {down_for:?} (restart took {:?}), forwarding again {recovered_in:?} after",
        log.len(),
        tally(log.iter().map(|(_, a)| a)),
        up_at - restarted_at,
    );

    // The fencing-only route flowed while the database was down.
    let while_down: Vec<_> = ticks
        .iter()
        .filter(|(t0, t1, _)| *t0 >= killed_at && *t1 <= up_at)
        .map(|(_, _, a)| a)
        .collect();
    eprintln!(
        "killed database: fencing-only while down: {:?}",
        tally(while_down.iter().copied())
    );
    assert!(
        while_down.len() >= 5,
        "{} fencing-only answers",
        while_down.len()
    );
    assert!(
        ticks.iter().all(|(_, _, a)| *a == Answer::Forwarded(200)),
        "{:?}",
        tally(ticks.iter().map(|(_, _, a)| a))
    );

    // Every first answer is one of: forwarded, refused before forwarding (503),
    // or 409 for a key whose claim committed just before the crash.
    let arrived = r.arrivals_by_key();
    for (key, a) in &log {
        let n = arrived.get(key).copied().unwrap_or(0);
        match a {
            Answer::Forwarded(200) => assert_eq!(n, 1, "{key}: answered 200"),
            Answer::Refused(503, code) if code == "store_unavailable" => {
                assert_eq!(n, 0, "{key}: refused, yet forwarded")
            }
            other => panic!("{key}: unexpected first answer {other:?}"),
        }
    }
    // Retries after the recovery: a replay, the first forward of a refused key,
    // or a 409 for a key the crash left in flight — each key at most once.
    let mut retries = Vec::new();
    for (key, first) in &log {
        let a = keyed_answer(&r.fg, &pay, key).await;
        let ok = match first {
            Answer::Forwarded(200) => {
                a == Answer::Replayed(200)
                    || a == refused("dedup_in_flight")
                    || a == refused("dedup_in_doubt")
            }
            _ => {
                a == Answer::Forwarded(200)
                    || a == refused("dedup_in_flight")
                    || a == refused("dedup_in_doubt")
            }
        };
        assert!(ok, "{key}: first {first:?}, retry {a:?}");
        retries.push(a);
    }
    eprintln!("killed database: retries: {:?}", tally(&retries));
    assert_eq!(
        keyed_answer(&r.fg, &pay, "kept-done").await,
        Answer::Replayed(200)
    );
    for (key, n) in r.arrivals_by_key() {
        assert_eq!(n, 1, "{key} reached the origin {n} times");
    }
}

// ---------------------------------------------------------------------------
// 4. Connections dropped around COMMIT (a relay between fencegate and PostgreSQL)

/// fencegate whose state connections go through a [`Relay`]; the test reads the
/// database past it with psql. The statement timeout is long, so that what ends
/// a statement is the test's cut, never the clock.
async fn relayed_rig() -> (&'static PgServer, String, Relay, Rig, Holding) {
    let pg = PgServer::shared();
    let (db, _) = pg.new_database();
    let relay = Relay::start(pg.port).await;
    let r = rig(&relay.url(&db), "timeout_ms = 10000").await;
    let pay = r.hold("pay").await;
    assert_eq!(
        keyed_answer(&r.fg, &pay, "warm").await,
        Answer::Forwarded(200)
    );
    warm_pool(&r, &pay, "warm", true).await;
    (pg, db, relay, r, pay)
}

/// Several pooled connections open before a test holds every reply: a
/// background read (the set-up record's, every gate_ttl / 4) that takes one
/// while replies are held pins it, and a request that then needed a new one
/// would wait for a handshake the relay holds too. Again after a cut: the
/// connections it closed (the batch writers' too) are opened anew first —
/// then a request may find its connection just closed (`strict`: all 200).
async fn warm_pool(r: &Rig, pay: &Holding, tag: &str, strict: bool) {
    let warm: Vec<_> = (0..32)
        .map(|i| {
            let key = format!("{tag}-{i}");
            timed(keyed(&r.fg, &format!("/pay/{key}"), pay, &key, "warm"))
        })
        .collect();
    for w in warm {
        let answer = w.await.unwrap().0;
        if strict {
            assert_eq!(answer, Answer::Forwarded(200));
        }
    }
}

fn held_keyed(
    fg: &Fencegate,
    h: &Holding,
    key: &str,
) -> tokio::task::JoinHandle<(Answer, Duration)> {
    let mut req = keyed(fg, &format!("/pay/{key}"), h, key, &format!("pay {key}"));
    req.headers_mut()
        .insert("x-test-hold", key.parse().unwrap());
    timed(req)
}

/// The claim (`INSERT … in_flight`) commits, and the connection drops before its
/// acknowledgement reaches fencegate: the request is refused (503), nothing is
/// forwarded, and a retry gets 409 while the claim is unsettled. Then fencegate
/// frees the claim (it was never forwarded), and the retry is forwarded once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_dropped_after_the_claim_commits() {
    skip_without_postgres!();
    let (pg, db, relay, r, pay) = relayed_rig().await;
    // The claim must reach the database while its replies are held. Rarely a
    // background read (the set-up record's) takes the pool's idle connection
    // first and pins it, and the request finds no connection at all (its new
    // one's handshake is held too): nothing was claimed, so it is tried again
    // under another key.
    let mut tries = 0;
    let (key, pending) = loop {
        tries += 1;
        let key = format!("claim-ack-lost-{tries}");
        relay.hold_replies(true);
        let pending = timed(keyed(
            &r.fg,
            &format!("/pay/{key}"),
            &pay,
            &key,
            &format!("pay {key}"),
        ));
        until("the claim committed, or the request answered", || {
            db_state(pg, &db, &key) == "0" || pending.is_finished()
        })
        .await;
        if db_state(pg, &db, &key) == "0" {
            break (key, pending);
        }
        relay.cut();
        let _ = pending.await;
        assert_eq!(r.arrivals_of(&key), 0);
        assert!(tries < 6, "the claim never reached the database");
        // The cut closed every connection: open them again, replies flowing.
        relay.hold_replies(false);
        warm_pool(&r, &pay, &format!("rewarm-{tries}"), false).await;
    };
    let key = key.as_str();
    relay.cut();
    let (a, _) = pending.await.unwrap();
    assert_eq!(a, refused("store_unavailable"));
    assert_eq!(r.arrivals_of(key), 0, "a refused claim is not forwarded");
    // Settled in the background: the claim is deleted by its number.
    until("the unforwarded claim is freed", || {
        db_state(pg, &db, key).is_empty()
    })
    .await;
    let retry = keyed_answer(&r.fg, &pay, key).await;
    assert_eq!(retry, Answer::Forwarded(200));
    assert_eq!(r.arrivals_of(key), 1, "the key reaches the origin once");
    assert_eq!(keyed_answer(&r.fg, &pay, key).await, Answer::Replayed(200));
    assert_eq!(r.arrivals_of(key), 1);
}

/// The upstream answered and `done` commits, and the connection drops before
/// fencegate hears so: the worker gets the upstream's answer, and a retry is a
/// replay — the key reaches the origin once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_dropped_after_done_commits() {
    skip_without_postgres!();
    let (pg, db, relay, r, pay) = relayed_rig().await;
    let key = "done-ack-lost";
    let before = r.origin.count();
    let pending = held_keyed(&r.fg, &pay, key);
    r.origin.wait_for(before + 1).await;
    assert_eq!(db_state(pg, &db, key), "0");
    relay.hold_replies(true);
    r.origin.release(key);
    // Rarely the outcome's write finds no connection while replies are held
    // (a background read pinned the idle one): the request is then answered
    // without it, and `done` is written again in the background after the cut.
    until("done committed, or the request answered", || {
        db_state(pg, &db, key) == "1" || pending.is_finished()
    })
    .await;
    relay.cut();
    let (a, _) = pending.await.unwrap();
    assert_eq!(a, Answer::Forwarded(200), "the upstream's answer stands");
    until("done committed", || db_state(pg, &db, key) == "1").await;
    assert_eq!(keyed_answer(&r.fg, &pay, key).await, Answer::Replayed(200));
    assert_eq!(r.arrivals_of(key), 1);
}

/// The upstream answered, and the connection drops while `done` is still in the
/// relay, before the database saw it: the worker gets the upstream's answer, a
/// retry meanwhile gets 409, and fencegate writes `done` again on a new
/// connection — then a retry is a replay. The key reaches the origin once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_dropped_before_done_reaches_the_database() {
    skip_without_postgres!();
    let (pg, db, relay, r, pay) = relayed_rig().await;
    let key = "done-unsent";
    let before = r.origin.count();
    let pending = held_keyed(&r.fg, &pay, key);
    r.origin.wait_for(before + 1).await;
    relay.hold_requests(true);
    r.origin.release(key);
    until("the done statement is held in the relay", || {
        relay.held_requests() > 0
    })
    .await;
    assert_eq!(
        db_state(pg, &db, key),
        "0",
        "done has not reached the database"
    );
    relay.cut();
    let (a, _) = pending.await.unwrap();
    assert_eq!(a, Answer::Forwarded(200), "the upstream's answer stands");
    let retry = keyed_answer(&r.fg, &pay, key).await;
    assert!(
        retry == refused("dedup_in_flight") || retry == Answer::Replayed(200),
        "a retry while done is unsettled: {retry:?}"
    );
    until("done is written again", || db_state(pg, &db, key) == "1").await;
    assert_eq!(keyed_answer(&r.fg, &pay, key).await, Answer::Replayed(200));
    assert_eq!(r.arrivals_of(key), 1);
}

/// kill -9 while a claim batch is at the database, sent but not committed (the
/// test's own transaction holds the key): the database finishes the statement
/// without its client. Whether the claim committed or not, the key reaches the
/// origin at most once after the restart: in flight at restart → in doubt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_while_a_claim_batch_waits_at_the_database() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (db, url) = pg.new_database();
    let mut r = rig(&url, "").await;
    let pay = r.hold("pay").await;
    assert_eq!(
        keyed_answer(&r.fg, &pay, "warm").await,
        Answer::Forwarded(200)
    );
    let key = "claim-uncommitted";
    let holder = KeyHold::start(&url, "pay", 0, key).await;
    let pending = timed(keyed(
        &r.fg,
        &format!("/pay/{key}"),
        &pay,
        key,
        &format!("pay {key}"),
    ));
    until("the claim batch waits at the database", || {
        pg.waits_on_a_lock(&db, "/* fencegate: claims */")
    })
    .await;
    r.fg.kill9();
    let (a, _) = pending.await.unwrap();
    assert!(matches!(a, Answer::Broken(_)), "killed mid-request: {a:?}");
    holder.release().await;
    until("the orphaned statement has finished", || {
        !pg.waits_on_a_lock(&db, "/* fencegate: claims */")
    })
    .await;
    let state = db_state(pg, &db, key);
    eprintln!("a claim batch orphaned by kill -9: the record is {state:?}");
    r.fg.spawn(None).unwrap();
    let retry = keyed_answer(&r.fg, &pay, key).await;
    match state.as_str() {
        "0" => assert_eq!(retry, refused("dedup_in_doubt")),
        "" => assert_eq!(retry, Answer::Forwarded(200)),
        other => panic!("record state {other:?}"),
    }
    assert!(r.arrivals_of(key) <= 1);
}

/// The claim batch is held in the relay and the connection drops before the
/// database saw it: 503, nothing forwarded; the claim never landed (and the
/// settling delete finds nothing), so a retry is forwarded — once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_dropped_before_the_claim_reaches_the_database() {
    skip_without_postgres!();
    let (pg, db, relay, r, pay) = relayed_rig().await;
    let key = "claim-unsent";
    relay.hold_requests(true);
    let pending = timed(keyed(
        &r.fg,
        &format!("/pay/{key}"),
        &pay,
        key,
        &format!("pay {key}"),
    ));
    until("the claim is held in the relay", || {
        relay.held_requests() > 0
    })
    .await;
    relay.cut();
    relay.hold_requests(false);
    let (a, _) = pending.await.unwrap();
    assert_eq!(a, refused("store_unavailable"));
    assert_eq!(db_state(pg, &db, key), "", "the claim never landed");
    assert_eq!(r.arrivals_of(key), 0);
    let mut retry = keyed_answer(&r.fg, &pay, key).await;
    // The pool's connections were all cut: the first retry may meet one.
    if retry == refused("store_unavailable") {
        retry = keyed_answer(&r.fg, &pay, key).await;
    }
    assert_eq!(retry, Answer::Forwarded(200));
    assert_eq!(r.arrivals_of(key), 1, "the key reaches the origin once");
}

/// Not deterministic by design: rounds of concurrent new keys, each round's
/// state connections cut at a random moment (0–40 ms in: before, during or after
/// claims, forwards and `done`s). Whatever each request saw, a retry never
/// reaches the origin a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_cut_at_random_moments_never_repeat_a_delivery() {
    skip_without_postgres!();
    use rand::Rng;
    let (_pg, _db, relay, r, pay) = relayed_rig().await;
    let mut firsts = Vec::new();
    for round in 0..25 {
        let tasks: Vec<_> = (0..6)
            .map(|i| {
                let key = format!("cut-{round}-{i}");
                let req = keyed(
                    &r.fg,
                    &format!("/pay/{key}"),
                    &pay,
                    &key,
                    &format!("pay {key}"),
                );
                (key, timed(req))
            })
            .collect();
        let jitter = rand::thread_rng().gen_range(0..40);
        // Fault injection at a random instant, not a wait for a condition.
        tokio::time::sleep(Duration::from_millis(jitter)).await;
        relay.cut();
        for (key, t) in tasks {
            firsts.push((key, t.await.unwrap().0));
        }
    }
    let mut retries = Vec::new();
    for (key, _) in &firsts {
        retries.push(keyed_answer(&r.fg, &pay, key).await);
    }
    eprintln!(
        "random cuts: {} keys; first answers {:?}; retries {:?}; {} relay connections",
        firsts.len(),
        tally(firsts.iter().map(|(_, a)| a)),
        tally(&retries),
        relay.accepted()
    );
    let arrived = r.arrivals_by_key();
    for ((key, first), retry) in firsts.iter().zip(&retries) {
        let n = arrived.get(key).copied().unwrap_or(0);
        assert!(
            n <= 1,
            "{key} reached the origin {n} times: {first:?}, then {retry:?}"
        );
        if let Answer::Refused(503, _) = first {
            // Refused before forwarding: the retry may be its first forward.
            assert!(
                *retry == Answer::Forwarded(200)
                    || *retry == refused("dedup_in_flight")
                    || *retry == refused("dedup_in_doubt")
                    || *retry == refused("store_unavailable"),
                "{key}: {retry:?}"
            );
        } else {
            assert_eq!(*first, Answer::Forwarded(200), "{key}");
            // The retry too may meet a cut connection: refused before
            // anything is forwarded (the origin count above is the rule).
            assert!(
                *retry == Answer::Replayed(200)
                    || *retry == refused("dedup_in_flight")
                    || *retry == refused("dedup_in_doubt")
                    || *retry == refused("store_unavailable"),
                "{key}: {retry:?}"
            );
        }
    }
}

// ---------------------------------------------------------------------------
// 5. Two owners of one shard (library level: two pools, two "instances")

pub(crate) fn pg_config(url: &str) -> StateConfig {
    StateConfig {
        kind: StateKind::Postgres,
        url: Some(url.to_owned()),
        ..StateConfig::default()
    }
}

/// A pool on `url` whose writes wait up to `timeout_ms` for the database's
/// answer.
async fn connect_waiting(url: &str, timeout_ms: u64) -> Arc<PostgresState> {
    PostgresState::connect(&StateConfig {
        timeout_ms,
        ..pg_config(url)
    })
    .await
    .unwrap()
}

pub(crate) fn rkey(key: &str) -> RecordKey {
    RecordKey {
        route: "pay".into(),
        key: key.into(),
    }
}

pub(crate) fn claim(fp: u8, now: u64) -> Record {
    Record {
        state: State::InFlight,
        fingerprint: [fp; 32],
        epoch: Epoch::new(1),
        created_ms: now,
        updated_ms: now,
        response: None,
        request: None,
    }
}

pub(crate) fn ended(fp: u8, now: u64, state: State) -> Record {
    Record {
        state,
        updated_ms: now + 1,
        response: (state == State::Done).then(|| StoredResponse {
            status: 201,
            headers: vec![("x-a".into(), b"1".to_vec())],
            body: Some(bytes::Bytes::from_static(b"made")),
        }),
        ..claim(fp, now)
    }
}

/// Claims never take over anything, except where a test says so.
pub(crate) const STRICT: TakeOver = TakeOver {
    in_doubt: false,
    done_before_ms: 0,
};

/// Both tables as text, to compare before and after.
pub(crate) fn dump(pg: &PgServer, db: &str) -> String {
    pg.psql(
        db,
        "SELECT route, key, shard, state, encode(fingerprint, 'hex'), epoch, owner_generation, \
           created_ms, updated_ms, status, header_names, body FROM fencegate_dedup ORDER BY 1, 2",
    ) + "\n--\n"
        + &pg.psql(
            db,
            "SELECT lease, shard, mark, drained, owner_generation FROM fencegate_marks ORDER BY 1",
        )
}

/// An instance that held shard 5 under generation 1 keeps a pool open after the
/// shard passed to generation 2 (`fencegate_owners`): every write of the old one
/// fails with `OwnerLost` and changes nothing; the new one works, takes over the
/// old one's in-flight record at recovery, and may resolve its in-doubt ones.
/// Shard 6, still under generation 1, is not affected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_owner_changes_nothing_the_newer_one_owns() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (db, url) = pg.new_database();
    let old = PostgresState::connect(&pg_config(&url)).await.unwrap();
    let new = PostgresState::connect(&pg_config(&url)).await.unwrap();
    let a = Owner {
        shard: 5,
        generation: Generation::new(1),
    };
    let b = Owner {
        shard: 5,
        generation: Generation::new(2),
    };
    let elsewhere = Owner {
        shard: 6,
        generation: Generation::new(1),
    };
    pg.psql(
        &db,
        "INSERT INTO fencegate_owners (shard, generation) VALUES (5, 1), (6, 1)",
    );
    let lease = LeaseName::parse("billing").unwrap();
    let now = 1_000;

    // Under generation 1: a mark, a key in flight, two in doubt, one done.
    old.raise_mark(a, &lease, Epoch::new(5)).await.unwrap();
    old.note_drained(a, &lease, Epoch::new(5)).await.unwrap();
    for (k, fp) in [
        ("flying", 1),
        ("doubtful", 2),
        ("resendable", 3),
        ("finished", 4),
    ] {
        let begun = old
            .begin(a, &rkey(k), &claim(fp, now), STRICT)
            .await
            .unwrap();
        assert!(matches!(begun, Begun::Claimed), "{k}: {begun:?}");
    }
    for (k, fp) in [("doubtful", 2), ("resendable", 3)] {
        let end = End::InDoubt(ended(fp, now, State::InDoubt));
        old.finish(a, &rkey(k), end).await.unwrap();
    }
    let done = End::Done(ended(4, now, State::Done));
    old.finish(a, &rkey("finished"), done).await.unwrap();

    // The shard passes to generation 2.
    pg.psql(
        &db,
        "UPDATE fencegate_owners SET generation = 2 WHERE shard = 5",
    );
    let before = dump(pg, &db);

    // Generation 1's every write on shard 5: OwnerLost, nothing changed. Collected,
    // so that one wrong answer does not hide the others.
    let mut wrong = Vec::new();
    let mut check = |what: &str, r: Result<String, StateError>| match r {
        Err(StateError::OwnerLost { ours, stored })
            if ours == a && stored == Generation::new(2) => {}
        other => wrong.push(format!("{what}: {other:?}")),
    };
    let flying = rkey("flying");
    for end in [
        End::Done(ended(1, now, State::Done)),
        End::InDoubt(ended(1, now, State::InDoubt)),
        End::Delete,
    ] {
        let what = format!("finish {end:?}");
        check(
            &what,
            old.finish(a, &flying, end).await.map(|()| "ok".into()),
        );
    }
    check(
        "raise_mark",
        old.raise_mark(a, &lease, Epoch::new(9))
            .await
            .map(|()| "ok".into()),
    );
    check(
        "begin of a new key",
        old.begin(a, &rkey("fresh"), &claim(9, now), STRICT)
            .await
            .map(|b| format!("{b:?}")),
    );
    // Claims that would take over a record: refused (which error, see
    // `an_older_owner_taking_over_a_key_is_told_owner_lost`).
    for (k, fp, rules) in takeovers() {
        let r = old.begin(a, &rkey(k), &claim(fp, now + 5), rules).await;
        assert!(r.is_err(), "generation 1 took over {k}: {r:?}");
    }
    for how in [Resolution::Delivered, Resolution::NotDelivered] {
        check(
            &format!("resolve {how:?}"),
            old.resolve(a, &rkey("doubtful"), how, now + 5)
                .await
                .map(|r| format!("{r:?}")),
        );
    }
    // Not in the trait's contract to fail, but it must not write either.
    let _ = old.note_drained(a, &lease, Epoch::new(9)).await;
    let _ = old.recover(a, now + 5).await;
    assert_eq!(
        dump(pg, &db),
        before,
        "generation 1 changed shard 5's state"
    );

    // Generation 1 still owns shard 6.
    let other = LeaseName::parse("other").unwrap();
    old.raise_mark(elsewhere, &other, Epoch::new(3))
        .await
        .unwrap();
    assert_eq!(new.marks(&other).await.unwrap().mark, Epoch::new(3));

    // Generation 2 works, and takes the old owner's in-flight record as in doubt.
    new.raise_mark(b, &lease, Epoch::new(9)).await.unwrap();
    assert_eq!(new.marks(&lease).await.unwrap().mark, Epoch::new(9));
    let begun = new
        .begin(b, &rkey("fresh"), &claim(9, now), STRICT)
        .await
        .unwrap();
    assert!(matches!(begun, Begun::Claimed), "{begun:?}");
    new.finish(b, &rkey("fresh"), End::Done(ended(9, now, State::Done)))
        .await
        .unwrap();
    assert_eq!(
        new.get(&rkey("fresh")).await.unwrap().map(|r| r.state),
        Some(State::Done)
    );
    let not_its_claim = new
        .finish(b, &flying, End::Done(ended(1, now, State::Done)))
        .await;
    assert!(
        matches!(not_its_claim, Err(StateError::Write(_))),
        "generation 2 finishing generation 1's claim: {not_its_claim:?}"
    );
    assert_eq!(new.recover(b, now + 10).await.unwrap(), 1);
    assert_eq!(
        new.get(&flying).await.unwrap().map(|r| r.state),
        Some(State::InDoubt)
    );
    assert_eq!(
        new.resolve(b, &rkey("doubtful"), Resolution::Delivered, now + 10)
            .await
            .unwrap(),
        Resolved::Done
    );
    // And generation 1 cannot touch what generation 2 wrote.
    let mut late = Vec::new();
    match old.raise_mark(a, &lease, Epoch::new(12)).await {
        Err(StateError::OwnerLost { .. }) => {}
        other => late.push(format!("raise_mark after generation 2 raised: {other:?}")),
    }
    assert_eq!(new.marks(&lease).await.unwrap().mark, Epoch::new(9));
    assert!(
        wrong.is_empty() && late.is_empty(),
        "generation 1's writes after losing shard 5 were not all OwnerLost:\n{}",
        wrong
            .iter()
            .chain(&late)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// Claims that may take over an existing record: an in-doubt key under
/// `in_doubt = "resend"`, and a `done` key past its retention.
fn takeovers() -> [(&'static str, u8, TakeOver); 2] {
    [
        (
            "resendable",
            3,
            TakeOver {
                in_doubt: true,
                done_before_ms: 0,
            },
        ),
        (
            "finished",
            4,
            TakeOver {
                in_doubt: false,
                done_before_ms: u64::MAX,
            },
        ),
    ]
}

/// A claim of the old owner that would take over a record (a resent in-doubt
/// key, an expired `done` one) is refused like its other writes: `OwnerLost`
/// (the trait's contract for a write under an older generation), at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_owner_taking_over_a_key_is_told_owner_lost() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (db, url) = pg.new_database();
    let old = PostgresState::connect(&pg_config(&url)).await.unwrap();
    let a = Owner {
        shard: 5,
        generation: Generation::new(1),
    };
    pg.psql(
        &db,
        "INSERT INTO fencegate_owners (shard, generation) VALUES (5, 1)",
    );
    let now = 1_000;
    for (k, fp, _) in takeovers() {
        let begun = old
            .begin(a, &rkey(k), &claim(fp, now), STRICT)
            .await
            .unwrap();
        assert!(matches!(begun, Begun::Claimed), "{k}: {begun:?}");
    }
    old.finish(
        a,
        &rkey("resendable"),
        End::InDoubt(ended(3, now, State::InDoubt)),
    )
    .await
    .unwrap();
    old.finish(a, &rkey("finished"), End::Done(ended(4, now, State::Done)))
        .await
        .unwrap();
    pg.psql(
        &db,
        "UPDATE fencegate_owners SET generation = 2 WHERE shard = 5",
    );
    let before = dump(pg, &db);
    let mut wrong = Vec::new();
    for (k, fp, rules) in takeovers() {
        let t0 = Instant::now();
        let r = old.begin(a, &rkey(k), &claim(fp, now + 5), rules).await;
        eprintln!("old owner taking over {k}: {r:?} after {:?}", t0.elapsed());
        if !matches!(r, Err(StateError::OwnerLost { stored, .. }) if stored == Generation::new(2)) {
            wrong.push(format!("{k}: {r:?}"));
        }
    }
    assert_eq!(
        dump(pg, &db),
        before,
        "generation 1 changed shard 5's state"
    );
    assert!(wrong.is_empty(), "not OwnerLost: {wrong:?}");
}

/// One batch (issue 27) in which one key has a `done` record, one is in a
/// shard a newer owner took, and the rest are new — and with them two
/// outcomes, one of a key still this owner's and one of a key in the shard it
/// lost: each row gets its own answer — the record, `OwnerLost`, claimed,
/// written, refused — and the batch is one statement, one commit. A claim the
/// test's own transaction holds at the database keeps the first batch in
/// flight, so that the mix queues and goes as the next one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_batch_with_a_conflict_a_lost_shard_and_new_keys() {
    skip_without_postgres!();
    use std::future::Future;
    use std::pin::Pin;
    use std::task::Poll;
    let pg = PgServer::shared();
    let (db, url) = pg.new_database();
    let st = PostgresState::connect(&pg_config(&url)).await.unwrap();
    let other = PostgresState::connect(&pg_config(&url)).await.unwrap();
    let (five, six) = (
        |generation| Owner {
            shard: 5,
            generation: Generation::new(generation),
        },
        |generation| Owner {
            shard: 6,
            generation: Generation::new(generation),
        },
    );
    st.claim_shard(five(1)).await.unwrap();
    st.claim_shard(six(1)).await.unwrap();
    let now = 1_000;
    let done = rkey("answered");
    assert!(matches!(
        st.begin(six(1), &done, &claim(1, now), STRICT).await,
        Ok(Begun::Claimed)
    ));
    st.finish(six(1), &done, End::Done(ended(1, now, State::Done)))
        .await
        .unwrap();
    let (finishing, stale) = (rkey("finishing"), rkey("stale"));
    for (owner, key) in [(six(1), &finishing), (five(1), &stale)] {
        assert!(matches!(
            st.begin(owner, key, &claim(4, now), STRICT).await,
            Ok(Begun::Claimed)
        ));
    }
    other.claim_shard(five(2)).await.unwrap();

    let holder = KeyHold::start(&url, "pay", 6, "plug").await;
    let plug = {
        let st = st.clone();
        tokio::spawn(async move {
            st.begin(six(1), &rkey("plug"), &claim(9, now), STRICT)
                .await
        })
    };
    until("the first batch waits at the database", || {
        pg.waits_on_a_lock(&db, "/* fencegate: claims */")
    })
    .await;
    let before = st.stats();
    type Begin = Pin<Box<dyn Future<Output = Result<Begun, StateError>> + Send>>;
    let mut mix: Vec<(String, Begin)> = Vec::new();
    let mut add = |k: &str, owner: Owner, fp: u8| {
        let (st, key) = (st.clone(), rkey(k));
        let f: Begin =
            Box::pin(async move { st.begin(owner, &key, &claim(fp, now + 1), STRICT).await });
        mix.push((k.to_owned(), f));
    };
    add("answered", six(1), 1);
    add("lost", five(1), 2);
    for k in ["new-1", "new-2", "new-3", "new-4"] {
        add(k, six(1), 3);
    }
    type Finish = Pin<Box<dyn Future<Output = Result<(), StateError>> + Send>>;
    let mut ends: Vec<(&str, Finish)> = Vec::new();
    for (name, owner, key) in [
        ("finishing", six(1), &finishing),
        ("stale", five(1), &stale),
    ] {
        let (st, key) = (st.clone(), key.clone());
        let end = End::Done(ended(4, now + 1, State::Done));
        ends.push((
            name,
            Box::pin(async move { st.finish(owner, &key, end).await }),
        ));
    }
    // One poll each: every claim and outcome is queued behind the batch in
    // flight.
    std::future::poll_fn(|cx| {
        for (k, f) in &mut mix {
            assert!(
                f.as_mut().poll(cx).is_pending(),
                "{k} answered before its batch ran"
            );
        }
        for (k, f) in &mut ends {
            assert!(
                f.as_mut().poll(cx).is_pending(),
                "{k}'s outcome answered before its batch ran"
            );
        }
        Poll::Ready(())
    })
    .await;
    holder.release().await;
    assert!(matches!(plug.await.unwrap(), Ok(Begun::Claimed)));
    let mut got = BTreeMap::new();
    for (k, f) in mix {
        got.insert(k, f.await);
    }
    let mut finished = BTreeMap::new();
    for (k, f) in ends {
        finished.insert(k, f.await);
    }
    let after = st.stats();
    assert!(finished["finishing"].is_ok(), "{:?}", finished["finishing"]);
    assert_eq!(
        db_state(pg, &db, "finishing"),
        "1",
        "the outcome is written"
    );
    assert!(
        matches!(finished["stale"], Err(StateError::OwnerLost { .. })),
        "{:?}",
        finished["stale"]
    );
    assert_ne!(
        db_state(pg, &db, "stale"),
        "1",
        "nothing written in a lost shard"
    );
    assert!(
        matches!(&got["answered"], Ok(Begun::Exists(r)) if r.state == State::Done),
        "{:?}",
        got["answered"]
    );
    assert!(
        matches!(got["lost"], Err(StateError::OwnerLost { stored, .. }) if stored == Generation::new(2)),
        "{:?}",
        got["lost"]
    );
    for k in ["new-1", "new-2", "new-3", "new-4"] {
        assert!(matches!(got[k], Ok(Begun::Claimed)), "{k}: {:?}", got[k]);
        assert_eq!(db_state(pg, &db, k), "0");
    }
    assert_eq!(
        db_state(pg, &db, "lost"),
        "",
        "nothing written in a lost shard"
    );
    assert_eq!(db_state(pg, &db, "answered"), "1");
    assert_eq!(
        (
            after.batches - before.batches,
            after.records - before.records
        ),
        (2, 6),
        "the plug's batch, then the mix as one statement writing four claims and an outcome"
    );
}

/// Issue 25, point 6 (SPEC §10.2, liveness): a deposed owner's claim either
/// commits before the successor's takeover turns older generations' in-flight
/// records in doubt, or fails on the new generation — never commits after it,
/// which left the key in flight under the old generation (409 to every retry,
/// and no operator could resolve it) until the next takeover.
///
/// Generation 1 reaches the database through a relay the test controls, its
/// successor (generation 2) directly. (a) The claim held in the relay, before
/// the database, across the takeover: it fails (`OwnerLost`) and the key is
/// free. (b) The claim at the database past its owner check, waiting across the
/// takeover — on a row of the same key the test's own transaction holds, as a
/// slow commit would keep it there: the takeover waits for the claim, so the
/// claim's record is turned in doubt and resolvable. (A relay cannot hold a
/// claim there: a claim is one autocommitted statement, its check and its
/// commit both inside the server.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deposed_owners_claim_never_outlives_the_takeover_in_flight() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (db, url) = pg.new_database();
    let relay = Relay::start(pg.port).await;
    let relayed = StateConfig {
        timeout_ms: 30_000,
        ..pg_config(&relay.url(&db))
    };
    let old = PostgresState::connect(&relayed).await.unwrap();
    let new = PostgresState::connect(&StateConfig {
        timeout_ms: 30_000,
        ..pg_config(&url)
    })
    .await
    .unwrap();
    let (five, six) = (
        |generation| Owner {
            shard: 5,
            generation: Generation::new(generation),
        },
        |generation| Owner {
            shard: 6,
            generation: Generation::new(generation),
        },
    );
    old.claim_shard(five(1)).await.unwrap();
    old.claim_shard(six(1)).await.unwrap();
    let now = 1_000;

    // (a) Shard 5: the claim's statement held in the relay across the takeover.
    let key = rkey("held-in-relay");
    relay.hold_requests(true);
    let claim_a = {
        let (old, key) = (old.clone(), key.clone());
        tokio::spawn(async move { old.begin(five(1), &key, &claim(1, now), STRICT).await })
    };
    until("the claim is held in the relay", || {
        relay.held_requests() > 0
    })
    .await;
    new.claim_shard(five(2)).await.unwrap();
    assert_eq!(new.recover(five(2), now + 1).await.unwrap(), 0);
    relay.hold_requests(false);
    let r = claim_a.await.unwrap();
    assert!(
        matches!(r, Err(StateError::OwnerLost { stored, .. }) if stored == Generation::new(2)),
        "a claim that reached the database after the takeover: {r:?}"
    );
    assert_eq!(new.get(&key).await.unwrap(), None, "the key is free");
    let begun = new.begin(five(2), &key, &claim(1, now + 2), STRICT).await;
    assert!(matches!(begun, Ok(Begun::Claimed)), "{begun:?}");

    // (b) Shard 6: the claim waits at the database, past its owner check, across
    // the takeover.
    let key = rkey("waits-at-the-database");
    let holder = KeyHold::start(&url, "pay", 6, &key.key).await;
    let claim_b = {
        let (old, key) = (old.clone(), key.clone());
        tokio::spawn(async move { old.begin(six(1), &key, &claim(2, now), STRICT).await })
    };
    until("the claim waits at the database", || {
        pg.waits_on_a_lock(&db, "/* fencegate: claims */")
    })
    .await;
    let takeover = {
        let new = new.clone();
        tokio::spawn(async move {
            new.claim_shard(six(2)).await?;
            new.recover(six(2), now + 10).await
        })
    };
    until("the takeover is done, or waits for the claim", || {
        takeover.is_finished() || pg.waits_on_a_lock(&db, "INSERT INTO fencegate_owners")
    })
    .await;
    let takeover_waited = !takeover.is_finished();
    holder.release().await;
    let claimed = claim_b.await.unwrap();
    let recovered = takeover.await.unwrap();
    let record = new.get(&key).await.unwrap();
    eprintln!(
        "claim across a takeover: the takeover waited: {takeover_waited}; claim {claimed:?}; \
         recovered {recovered:?}; record {:?}",
        record.as_ref().map(|r| r.state)
    );
    match claimed {
        // Committed before the takeover's recovery: in doubt, and resolvable.
        Ok(Begun::Claimed) => {
            assert_eq!(
                record.map(|r| r.state),
                Some(State::InDoubt),
                "the deposed owner's claim is left in flight"
            );
            assert_eq!(recovered.ok(), Some(1));
            let resolved = new
                .resolve(six(2), &key, Resolution::NotDelivered, now + 20)
                .await;
            assert_eq!(resolved.ok(), Some(Resolved::Deleted));
        }
        // Failed on the new generation: the key is free.
        Err(StateError::OwnerLost { stored, .. }) if stored == Generation::new(2) => {
            assert_eq!(record, None)
        }
        other => panic!("the deposed owner's claim: {other:?}"),
    }
    let begun = new.begin(six(2), &key, &claim(2, now + 30), STRICT).await;
    assert!(matches!(begun, Ok(Begun::Claimed)), "{begun:?}");
}

// ---------------------------------------------------------------------------
// 6. The schema at start-up

fn schema_version(pg: &PgServer, db: &str) -> String {
    pg.psql(
        db,
        "SELECT string_agg(version::text, ',') FROM fencegate_schema",
    )
}

fn current() -> String {
    fencegate::state::schema::VERSION.to_string()
}

/// A database of schema 1 (records without method and path) is migrated in
/// place: its records read as before, with no request line, and new ones keep
/// theirs; listings work on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_1_records_survive_the_migration_to_2() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (db, url) = pg.new_database();
    let first = PostgresState::connect(&pg_config(&url)).await.unwrap();
    first.close().await.unwrap();
    drop(first);
    // Back to schema 1, with a record written by a build of that schema.
    pg.psql(
        &db,
        "DROP INDEX fencegate_dedup_done_by_claim_time; DROP TABLE fencegate_members; \
         DROP INDEX fencegate_dedup_in_doubt_by_age; \
         CREATE INDEX fencegate_dedup_done_by_age ON fencegate_dedup (created_ms) WHERE state = 1; \
         ALTER TABLE fencegate_dedup DROP COLUMN method, DROP COLUMN path; \
         ALTER TABLE fencegate_dedup DROP COLUMN claim, DROP COLUMN headers; \
         ALTER TABLE fencegate_owners DROP COLUMN owner, DROP COLUMN advertise, \
           DROP COLUMN renewals, DROP COLUMN expires_at, DROP COLUMN renewed_at, \
           DROP COLUMN taken_at, DROP COLUMN previous_owner, DROP COLUMN previous_renewed_at, \
           DROP COLUMN ttl_ms, DROP COLUMN released_generation; \
         DROP TRIGGER fencegate_owners_kept ON fencegate_owners; \
         DROP TRIGGER fencegate_owners_not_truncated ON fencegate_owners; \
         DROP FUNCTION fencegate_owners_kept(); \
         DROP TABLE fencegate_set_up, fencegate_queue, fencegate_queue_leases, fencegate_queue_paused, fencegate_queue_jobs; UPDATE fencegate_schema SET version = 1; \
         INSERT INTO fencegate_dedup (route, key, shard, state, fingerprint, epoch, \
           owner_generation, created_ms, updated_ms) \
         VALUES ('pay', 'old', 0, 2, decode(repeat('07', 32), 'hex'), \
           (3 # (1::bigint << 63)), 0, 1000, 2000)",
    );
    assert_eq!(schema_version(pg, &db), "1");
    let st = PostgresState::connect(&pg_config(&url)).await.unwrap();
    assert_eq!(schema_version(pg, &db), current());
    let old = st.get(&rkey("old")).await.unwrap().expect("the old record");
    assert_eq!(
        (old.state, old.epoch.get(), old.created_ms),
        (State::InDoubt, 3, 1000)
    );
    assert_eq!(old.request, None);
    let mut fresh = claim(1, 500);
    fresh.request = Some(fencegate::dedup::RequestLine::new("PUT", "/pay/new?x=1"));
    st.begin(Owner::SINGLE, &rkey("new"), &fresh, STRICT)
        .await
        .unwrap();
    let back = st.get(&rkey("new")).await.unwrap().unwrap();
    assert_eq!(back.request, fresh.request);
    st.finish(
        Owner::SINGLE,
        &rkey("new"),
        End::InDoubt(ended(1, 600, State::InDoubt)),
    )
    .await
    .unwrap();
    let listed = st.list(State::InDoubt, None, None, 10).await.unwrap();
    let keys: Vec<&str> = listed.records.iter().map(|(k, _)| k.key.as_str()).collect();
    assert_eq!(keys, ["new", "old"], "oldest first");
    assert_eq!(listed.total, 2);
    assert_eq!(
        listed.records[0]
            .1
            .request
            .as_ref()
            .map(|q| q.path.as_str()),
        Some("/pay/new"),
        "the in-doubt record keeps the request line of its claim"
    );
}

/// The indexes on `fencegate_dedup`, by name.
fn dedup_indexes(pg: &PgServer, db: &str) -> String {
    pg.psql(
        db,
        "SELECT string_agg(indexname, ',' ORDER BY indexname) FROM pg_indexes \
         WHERE tablename = 'fencegate_dedup'",
    )
}

/// Schema 3 → 4 (issue 25, point 3): a `done` record expires a TTL after it
/// became done (`updated_ms`), and the sweep's index follows. A schema-3 database
/// keeps its records; one an operator resolved late (created long before it was
/// resolved) is swept a TTL after its resolution, not after its creation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_3_migrates_to_4_and_sweeps_by_the_time_a_record_became_done() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (db, url) = pg.new_database();
    let first = PostgresState::connect(&pg_config(&url)).await.unwrap();
    first.close().await.unwrap();
    drop(first);
    let now_indexes = dedup_indexes(pg, &db);
    // Back to schema 3, with a record resolved as delivered 10 s after its claim.
    pg.psql(
        &db,
        "DROP INDEX fencegate_dedup_done_by_claim_time, fencegate_dedup_in_doubt_by_age; \
         CREATE INDEX fencegate_dedup_by_state_age ON fencegate_dedup (state, created_ms, route, key); \
         CREATE INDEX fencegate_dedup_done_by_age ON fencegate_dedup (created_ms) WHERE state = 1; \
         ALTER TABLE fencegate_dedup DROP COLUMN claim, DROP COLUMN headers; \
         ALTER TABLE fencegate_owners DROP COLUMN owner, DROP COLUMN advertise, \
           DROP COLUMN renewals, DROP COLUMN expires_at, DROP COLUMN renewed_at, \
           DROP COLUMN taken_at, DROP COLUMN previous_owner, DROP COLUMN previous_renewed_at, \
           DROP COLUMN ttl_ms, DROP COLUMN released_generation; \
         DROP TRIGGER fencegate_owners_kept ON fencegate_owners; \
         DROP TRIGGER fencegate_owners_not_truncated ON fencegate_owners; \
         DROP FUNCTION fencegate_owners_kept(); \
         ALTER TABLE fencegate_members DROP COLUMN beats; \
         DROP TABLE fencegate_set_up, fencegate_queue, fencegate_queue_leases, fencegate_queue_paused, fencegate_queue_jobs; UPDATE fencegate_schema SET version = 3; \
         INSERT INTO fencegate_dedup (route, key, shard, state, fingerprint, epoch, \
           owner_generation, created_ms, updated_ms) \
         VALUES ('pay', 'late', 0, 1, decode(repeat('07', 32), 'hex'), \
           (3 # (1::bigint << 63)), 0, 1000, 11000)",
    );
    assert!(dedup_indexes(pg, &db).contains("fencegate_dedup_done_by_age"));
    let st = PostgresState::connect(&pg_config(&url)).await.unwrap();
    assert_eq!(schema_version(pg, &db), current());
    assert_eq!(
        dedup_indexes(pg, &db),
        now_indexes,
        "the indexes of a new database"
    );
    assert!(
        !now_indexes.contains("fencegate_dedup_done_by_age"),
        "{now_indexes}"
    );
    let kept = st.get(&rkey("late")).await.unwrap().expect("the record");
    assert_eq!(
        (kept.state, kept.created_ms, kept.updated_ms),
        (State::Done, 1000, 11000)
    );
    // ttl 8 s: expired at 19 s, not at 9 s.
    let by = |done_before_ms| TakeOver {
        in_doubt: false,
        done_before_ms,
    };
    assert_eq!(st.sweep(by(11_000 + 1 - 8_000)).await.unwrap(), 0);
    assert_eq!(st.sweep(by(11_000)).await.unwrap(), 0);
    assert!(st.get(&rkey("late")).await.unwrap().is_some());
    assert_eq!(st.sweep(by(11_001)).await.unwrap(), 1);
    assert_eq!(st.get(&rkey("late")).await.unwrap(), None);
}

/// Schema 12 → 13 (issue 51): each state's lookups by a partial index of its
/// own. A schema-12 database with records of every state on two routes keeps
/// them: each state's listing (all routes, one route, page by page) and count
/// are what they were, and a done record is swept a TTL after it became done —
/// not sooner, also where its outcome's time is before its claim's (a clock
/// stepped back): then it waits for its claim's time too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_12_migrates_to_13_with_listings_and_the_sweep_as_they_were() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (db, url) = pg.new_database();
    drop(PostgresState::connect(&pg_config(&url)).await.unwrap());
    pg.psql(
        &db,
        &(crate::support::postgres::UNDO_SCHEMA_13.to_owned()
            + "UPDATE fencegate_schema SET version = 12; \
         INSERT INTO fencegate_dedup (route, key, shard, state, fingerprint, epoch, \
           owner_generation, created_ms, updated_ms, status, body, claim) \
         SELECT r, 'k-' || s || '-' || i, 0, s, decode(repeat('01', 32), 'hex'), \
           -9223372036854775807, 0, 1000 + i, 2000 + i, \
           CASE WHEN s = 1 THEN 200 END, CASE WHEN s = 1 THEN 'ok'::bytea END, \
           CASE WHEN s = 0 THEN i END \
         FROM generate_series(0, 2) s, generate_series(1, 6) i, \
           (VALUES ('pay'), ('refund')) v(r); \
         INSERT INTO fencegate_dedup (route, key, shard, state, fingerprint, epoch, \
           owner_generation, created_ms, updated_ms, status, body) \
         VALUES ('pay', 'stepped-back', 0, 1, decode(repeat('01', 32), 'hex'), \
           -9223372036854775807, 0, 50000, 1500, 200, 'ok'::bytea)"),
    );
    let s = PostgresState::connect(&pg_config(&url)).await.unwrap();
    assert_eq!(schema_version(pg, &db), current());
    let idx = dedup_indexes(pg, &db);
    assert!(!idx.contains("by_state_age"), "{idx}");
    assert!(idx.contains("fencegate_dedup_done_by_claim_time"), "{idx}");
    for (state, all, pay) in [
        (State::InFlight, 12, 6),
        (State::Done, 13, 7),
        (State::InDoubt, 12, 6),
    ] {
        assert_eq!(s.list(state, None, None, 100).await.unwrap().total, all);
        assert_eq!(
            s.list(state, Some("pay"), None, 100).await.unwrap().total,
            pay
        );
        // Page by page, oldest first, each record once.
        let mut seen = Vec::new();
        let mut after = None;
        loop {
            let page = s.list(state, None, after.as_ref(), 5).await.unwrap();
            let Some((last_key, last)) = page.records.last().cloned() else {
                break;
            };
            seen.extend(page.records.iter().map(|(k, r)| (r.created_ms, k.clone())));
            after = Some(fencegate::state::ListCursor {
                created_ms: last.created_ms,
                key: last_key,
            });
        }
        let mut sorted = seen.clone();
        sorted.sort_by(|a, b| (a.0, &a.1.route, &a.1.key).cmp(&(b.0, &b.1.route, &b.1.key)));
        sorted.dedup();
        assert_eq!(seen, sorted, "{state:?}: oldest first, each once");
        assert_eq!(seen.len() as u64, all);
    }
    let by = |done_before_ms| TakeOver {
        in_doubt: false,
        done_before_ms,
    };
    // Done at 2001..2006 on each route: none before 2001; those done before
    // 2004 at 2004 (three a route); the stepped-back record (done at 1500,
    // claimed at 50000) waits for its claim's time.
    assert_eq!(s.sweep(by(2_001)).await.unwrap(), 0);
    assert_eq!(s.sweep(by(2_004)).await.unwrap(), 6);
    assert!(s.get(&rkey("stepped-back")).await.unwrap().is_some());
    assert_eq!(s.sweep(by(50_000)).await.unwrap(), 6);
    assert!(s.get(&rkey("stepped-back")).await.unwrap().is_some());
    assert_eq!(s.sweep(by(50_001)).await.unwrap(), 1);
    assert_eq!(s.get(&rkey("stepped-back")).await.unwrap(), None);
    // Nothing in flight or in doubt was swept.
    assert_eq!(
        s.list(State::InFlight, None, None, 1).await.unwrap().total,
        12
    );
    assert_eq!(
        s.list(State::InDoubt, None, None, 1).await.unwrap().total,
        12
    );
}

fn fencegate_tables(pg: &PgServer, db: &str) -> String {
    pg.psql(
        db,
        "SELECT string_agg(tablename, ',' ORDER BY tablename) FROM pg_tables \
         WHERE tablename LIKE 'fencegate\\_%'",
    )
}

/// An empty database gets the schema (the current version); a second start changes
/// nothing and keeps the data; three instances starting at once on an empty
/// database all succeed, with one schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_is_created_once_and_kept() {
    skip_without_postgres!();
    let pg = PgServer::shared();
    let (db, url) = pg.new_database();
    assert_eq!(fencegate_tables(pg, &db), "");
    let first = PostgresState::connect(&pg_config(&url)).await.unwrap();
    assert_eq!(schema_version(pg, &db), current());
    assert_eq!(
        fencegate_tables(pg, &db),
        "fencegate_dedup,fencegate_marks,fencegate_members,fencegate_owners,fencegate_queue,fencegate_queue_jobs,fencegate_queue_leases,fencegate_queue_paused,fencegate_schema,fencegate_set_up"
    );
    let lease = LeaseName::parse("billing").unwrap();
    first
        .raise_mark(Owner::SINGLE, &lease, Epoch::new(7))
        .await
        .unwrap();
    let begun = first
        .begin(Owner::SINGLE, &rkey("kept"), &claim(1, 10), STRICT)
        .await
        .unwrap();
    assert!(matches!(begun, Begun::Claimed));
    first.close().await.unwrap();
    drop(first);

    let second = PostgresState::connect(&pg_config(&url)).await.unwrap();
    assert_eq!(schema_version(pg, &db), current());
    assert_eq!(second.marks(&lease).await.unwrap().mark, Epoch::new(7));
    assert_eq!(
        second.get(&rkey("kept")).await.unwrap(),
        Some(claim(1, 10)),
        "the second start kept the data"
    );

    let (db3, url3) = pg.new_database();
    let cfg = pg_config(&url3);
    let (x, y, z) = tokio::join!(
        PostgresState::connect(&cfg),
        PostgresState::connect(&cfg),
        PostgresState::connect(&cfg)
    );
    for (i, r) in [x, y, z].into_iter().enumerate() {
        assert!(r.is_ok(), "instance {i}: {:?}", r.err());
    }
    assert_eq!(schema_version(pg, &db3), current());
    assert_eq!(
        fencegate_tables(pg, &db3),
        "fencegate_dedup,fencegate_marks,fencegate_members,fencegate_owners,fencegate_queue,fencegate_queue_jobs,fencegate_queue_leases,fencegate_queue_paused,fencegate_schema,fencegate_set_up"
    );
}

/// Writes a config (server on port 0, the `dir` store, one route, then `state`)
/// into `dir`; returns its path.
fn write_config(dir: &Path, state: &str) -> std::path::PathBuf {
    let leases = dir.join("leases");
    std::fs::create_dir_all(&leases).unwrap();
    let config = dir.join("fencegate.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\ndata_dir = \"{}\"\n\n{}{state}\n\
             [[route]]\nname = \"pay\"\npath_prefix = \"/pay/\"\nupstream = \"http://127.0.0.1:9/\"\nlease = \"pay\"\ntimeout_ms = 3000\n",
            dir.join("state").display(),
            dir_store_toml(&leases),
        ),
    )
    .unwrap();
    config
}

/// Runs `fencegate serve` with `state` and expects it to exit before listening:
/// its exit status, its stderr, and how long it took.
fn serve_refused(state: &str, env: &[(&str, &str)]) -> (ExitStatus, String, Duration) {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), state);
    let stderr_path = dir.path().join("stderr");
    let t0 = Instant::now();
    let mut child = Command::new(bin())
        .args(["serve", "--config"])
        .arg(&config)
        .current_dir(dir.path())
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx.recv_timeout(Duration::from_secs(60)).unwrap_or_default();
    if !line.trim().is_empty() {
        let _ = child.kill();
        let _ = child.wait();
        panic!("fencegate started instead of refusing: {line}");
    }
    let status = child.wait().unwrap();
    let took = t0.elapsed();
    (
        status,
        std::fs::read_to_string(&stderr_path).unwrap_or_default(),
        took,
    )
}

/// The reason `serve` gave: its one `fencegate: ` line on stderr.
fn reason(stderr: &str) -> String {
    let lines: Vec<_> = stderr
        .lines()
        .filter(|l| l.starts_with("fencegate: "))
        .collect();
    assert_eq!(lines.len(), 1, "one reason line in:\n{stderr}");
    lines[0].to_owned()
}

/// Start-up refusals, each exit 2 with a one-line reason: a schema newer than
/// the build, `synchronous_commit = off`, an unreachable database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_refuses_what_it_cannot_trust_with_exit_2() {
    skip_without_postgres!();
    let pg = PgServer::shared();

    let (db, url) = pg.new_database();
    PostgresState::connect(&pg_config(&url)).await.unwrap();
    pg.psql(&db, "UPDATE fencegate_schema SET version = 99");
    let (status, stderr, _) = serve_refused(&state_toml(&url, ""), &[]);
    let why = reason(&stderr);
    eprintln!("newer schema: {status}: {why}");
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(why.contains("newer") && why.contains("99"), "{why}");
    assert_eq!(
        schema_version(pg, &db),
        "99",
        "a newer schema is left alone"
    );

    let (db, url) = pg.new_database();
    pg.psql(
        "postgres",
        &format!("ALTER DATABASE {db} SET synchronous_commit = off"),
    );
    let refused = PostgresState::connect(&pg_config(&url)).await.err();
    assert!(
        refused
            .as_ref()
            .is_some_and(|e| e.to_string().contains("synchronous_commit")),
        "{refused:?}"
    );
    let (status, stderr, _) = serve_refused(&state_toml(&url, ""), &[]);
    let why = reason(&stderr);
    eprintln!("synchronous_commit off: {status}: {why}");
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(why.contains("synchronous_commit"), "{why}");

    // A port nothing listens on.
    let port = crate::support::free_port();
    let url = format!("postgres://fg:hunter2-secret@127.0.0.1:{port}/nowhere?sslmode=disable");
    let (status, stderr, took) = serve_refused(&state_toml(&url, "timeout_ms = 500"), &[]);
    let why = reason(&stderr);
    eprintln!("unreachable database: {status} after {took:?}: {why}");
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(why.contains("[state]") && why.contains("reach"), "{why}");
    assert!(!stderr.contains("hunter2"), "the password leaked: {stderr}");
    assert!(took < Duration::from_secs(10), "{took:?}");
}

// ---------------------------------------------------------------------------
// 7. check-config and the [state] section

fn check_config(state: &str, env: &[(&str, &str)]) -> (ExitStatus, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), state);
    let out = Command::new(bin())
        .args(["check-config", "--config"])
        .arg(&config)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `check-config` shows neither the url nor its password (written out or read
/// from the environment), and refuses a `[state]` section it cannot use, naming
/// the key. Needs no database.
#[test]
fn check_config_hides_the_url_and_validates_the_state_section() {
    const SECRET: &str = "hunter2-secret";
    let url = format!("postgres://fencegate:{SECRET}@db.internal:5432/fencegate?sslmode=require");
    let (status, out, err) = check_config(&state_toml(&url, "pool_size = 4"), &[]);
    assert!(status.success(), "{out}{err}");
    assert!(out.contains("url hidden"), "{out}");
    for leak in [SECRET, "db.internal", "postgres://"] {
        assert!(
            !out.contains(leak) && !err.contains(leak),
            "{leak}: {out}{err}"
        );
    }

    let env = [("FG_TEST_DATABASE_URL", url.as_str())];
    let (status, out, err) = check_config(&state_toml("${FG_TEST_DATABASE_URL}", ""), &env);
    assert!(status.success(), "{out}{err}");
    assert!(!out.contains(SECRET) && !err.contains(SECRET), "{out}{err}");

    let mut wrong = Vec::new();
    for (what, state, names) in [
        (
            "kind postgres without url",
            "[state]\nkind = \"postgres\"\n".to_owned(),
            "[state]|url",
        ),
        (
            "url from an unset variable",
            state_toml("${FG_TEST_UNSET_DATABASE_URL}", ""),
            "FG_TEST_UNSET_DATABASE_URL",
        ),
        (
            "pool_size 0",
            state_toml(&url, "pool_size = 0"),
            "[state] pool_size",
        ),
        (
            "timeout_ms 0",
            state_toml(&url, "timeout_ms = 0"),
            "[state] timeout_ms",
        ),
        (
            "a url on sled",
            format!("[state]\nkind = \"sled\"\nurl = \"{url}\"\n"),
            "[state] url",
        ),
        (
            "an unknown key",
            state_toml(&url, "password = \"x\""),
            "password",
        ),
        (
            "an unknown kind",
            "[state]\nkind = \"mysql\"\n".to_owned(),
            "mysql",
        ),
        (
            "a missing ca_file",
            state_toml(&url, "ca_file = \"/nonexistent/ca.pem\""),
            "ca_file",
        ),
    ] {
        let (status, out, err) = check_config(&state, &[]);
        let said = format!("{out}{err}");
        if status.code() != Some(2) || !names.split('|').all(|n| err.contains(n)) {
            wrong.push(format!("{what}: exit {status}, said: {said}"));
        }
        if said.contains(SECRET) {
            wrong.push(format!("{what}: the password leaked: {said}"));
        }
    }
    assert!(wrong.is_empty(), "\n{}", wrong.join("\n---\n"));
}

/// A `[state] url` line that does not parse: the TOML parser's error quotes the
/// offending line, and with it the url and its password. `check-config` (and
/// `serve`, which loads the config the same way) must say where, not what.
#[test]
fn a_url_line_that_does_not_parse_is_not_quoted() {
    const SECRET: &str = "hunter2-secret";
    let url = format!("postgres://fencegate:{SECRET}@db.internal:5432/fencegate");
    let state = format!("[state]\nkind = \"postgres\"\nurl = \"{url}\" trailing\n");
    let (status, out, err) = check_config(&state, &[]);
    assert_eq!(status.code(), Some(2), "{out}{err}");
    assert!(err.contains("line"), "says where: {err}");
    assert!(
        !out.contains(SECRET) && !err.contains(SECRET),
        "the password leaked: {out}{err}"
    );
}

/// SPEC §10.1 beside "Identity and generations": the state's generation is
/// raised after each renewal of the instance guard, but never waited for by
/// it. The database frozen for longer than `gate_ttl` (its `timeout_ms` 10 s,
/// the guard's window 8 s): fencing-only requests at a raised mark keep being
/// forwarded the whole time. (A renewal that waited for its raise was held
/// back a whole `timeout_ms`, and the instance fenced itself: 503
/// `shard_unavailable`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_database_never_holds_the_guards_renewals_back() {
    skip_without_postgres!();
    let pg = PgServer::start();
    let (_db, url) = pg.new_database();
    let r = rig(&url, "timeout_ms = 10000").await;
    let feed = r.hold("feed").await;
    assert_eq!(post(&r.fg, "/feed/warm", &feed, "warm").await.status, 200);
    let stop = Arc::new(AtomicBool::new(false));
    let stream = fencing_stream(&r.fg, &feed, stop.clone());
    pg.pause();
    tokio::time::sleep(Duration::from_secs(12)).await;
    pg.resume();
    stop.store(true, Ordering::SeqCst);
    let ticks = stream.await.unwrap();
    let answers: Vec<&Answer> = ticks.iter().map(|(_, _, a)| a).collect();
    assert!(ticks.len() > 10, "{}", ticks.len());
    assert!(
        answers.iter().all(|a| **a == Answer::Forwarded(200)),
        "{:?}\n{}",
        tally(answers.iter().copied()),
        r.fg.stderr()
    );
}
