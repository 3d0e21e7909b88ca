//! SPEC §6 across a PostgreSQL failover (issue 27, section 2): a primary and a
//! standby made from it (`pg_basebackup`, streaming through a [`Relay`]),
//! fencegate given both hosts (`host=…,… port=P1,P2
//! target_session_attrs=read-write`), keyed load from several workers, the
//! primary killed with `-9` mid-load and the standby promoted (`pg_ctl
//! promote`).
//!
//! With a *synchronous* standby (`synchronous_standby_names`, `synchronous_commit
//! = on`) nothing is lost: no key reaches the origin twice, every key forwarded
//! before the kill is replayed after it, every forwarded key's record is in the
//! promoted database, and the outage is answered with 503 `store_unavailable`
//! and `Retry-After` (or 409 `dedup_in_flight` for a claim whose fate the kill
//! made unknown, until fencegate settles it), never with a forward. With an
//! *asynchronous* standby the same run loses what the standby had not received:
//! the test counts and prints it (a `done` gone, a key delivered twice) and
//! asserts nothing about it — that loss is what docs/postgres.md warns of.
//!
//! A third run has the dead primary's port swallow connection attempts (a
//! machine gone rather than a process): fencegate must still reach the standby
//! within a request's `timeout_ms` (each host gets its share of it).
//!
//! Each run takes 4–25 s (~30 s for the four, one at a time), so all are in the
//! test command; `scripts/failover.sh` runs them alone, one at a time, with
//! their figures printed.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::postgres::{answer, keyed_answer, refused, rig, tally, until, Answer, Rig};
use crate::support::postgres::{available_or_skip, PgServer};
use crate::support::relay::Relay;
use crate::support::*;

/// The standby's name: its `application_name`, its replication slot, and what
/// `synchronous_standby_names` lists.
const STANDBY: &str = "standby1";

/// A worker's pause before sending a refused key again: well under the
/// `Retry-After: 1` it is told, so that the outage is measured finely.
const BACKOFF: Duration = Duration::from_millis(50);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Replication {
    Synchronous,
    Asynchronous,
}

/// One failover run.
struct Plan {
    replication: Replication,
    /// Concurrent workers, each sending its own keys one after another.
    workers: usize,
    /// Keys forwarded before the primary is killed.
    before: usize,
    /// Keys forwarded after the promotion before the load stops.
    after: usize,
    /// Keys forwarded while the standby receives nothing (the relay holds the
    /// primary's WAL) just before the kill: a standby falling behind. Only
    /// meaningful asynchronously (synchronously, nothing commits meanwhile).
    behind: usize,
    /// After the kill the primary's port swallows connection attempts (a
    /// machine gone, not a process: no refusal comes back) rather than refusing
    /// them.
    gone: bool,
}

/// One request and its answer.
struct Sent {
    key: String,
    at: Instant,
    answered: Instant,
    answer: Answer,
}

/// What a run saw.
#[derive(Debug, Default)]
struct Outcome {
    keys: usize,
    requests: usize,
    /// Answers by kind, over the whole run.
    answers: BTreeMap<String, usize>,
    /// 503 `store_unavailable` answers sent after the kill.
    refused_503: usize,
    /// From the kill to the first answer of a key forwarded after it.
    outage: Duration,
    /// `pg_ctl promote`, start to end.
    promote_took: Duration,
    /// From the end of the promotion to that first forward.
    back_after_promote: Duration,
    /// Answers other than forwarded, 503 `store_unavailable` with Retry-After,
    /// or 409 `dedup_in_flight`.
    unexpected: Vec<(String, Answer)>,
    /// Keys forwarded (answered 2xx) before the kill.
    done_before_kill: usize,
    /// Of those, keys whose retry after the failover is not a replay.
    lost_done: Vec<(String, Answer)>,
    /// Keys forwarded after the kill whose retry is not a replay.
    lost_after: Vec<(String, Answer)>,
    /// Keys that reached the origin more than once (after the retries).
    duplicates: Vec<(String, usize)>,
    /// Keys that reached the origin more often than they were answered 2xx
    /// (a forward behind a refusal), before the retries.
    forwarded_on_refusal: Vec<String>,
    /// Keys that reached the origin and have no record in the promoted
    /// database (a forward without a durable claim), before the retries.
    unrecorded: Vec<String>,
    /// Whether every forwarded key's record was `done` in the promoted database
    /// before the retries (outcomes whose batch the kill cut are written again
    /// in the background).
    settled: bool,
    /// Forwarded keys whose record was not `done` when the wait ended: key,
    /// state.
    unsettled: Vec<(String, String)>,
    took: Duration,
}

/// Workers each sending new keys on `pay` until `stop`: a key refused with 503
/// (or 409 `dedup_in_flight`) is sent again after [`BACKOFF`], as a worker
/// would; every answer is logged.
fn load(
    r: &Rig,
    h: &fencegate::lease::acquire::Holding,
    plan: &Plan,
    stop: &Arc<AtomicBool>,
    log: &Arc<Mutex<Vec<Sent>>>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..plan.workers)
        .map(|w| {
            let (url, epoch, token) = (r.fg.url(""), h.epoch.get(), h.token.clone());
            let (stop, log) = (stop.clone(), log.clone());
            tokio::spawn(async move {
                let mut n = 0;
                'keys: while !stop.load(Ordering::SeqCst) {
                    let key = format!("fo-{w}-{n}");
                    n += 1;
                    loop {
                        let at = Instant::now();
                        let req = worker_req(&format!("{url}/pay/{key}"), epoch, &token)
                            .header("idempotency-key", &key)
                            .body(body(&format!("pay {key}")))
                            .unwrap();
                        let a = answer(try_send(req).await);
                        let again =
                            a == refused("store_unavailable") || a == refused("dedup_in_flight");
                        log.lock().unwrap().push(Sent {
                            key: key.clone(),
                            at,
                            answered: Instant::now(),
                            answer: a,
                        });
                        if !again {
                            break;
                        }
                        if stop.load(Ordering::SeqCst) {
                            break 'keys;
                        }
                        tokio::time::sleep(BACKOFF).await;
                    }
                }
            })
        })
        .collect()
}

/// A listener on 127.0.0.1:`port` that never accepts, its queue filled: the
/// kernel drops further SYNs, so a connection attempt hangs until its own
/// timeout, as towards a machine that is gone.
fn swallow(port: u16) -> (tokio::net::TcpListener, Vec<std::net::TcpStream>) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_reuseaddr(true).unwrap();
    socket
        .bind(std::net::SocketAddr::from(([127, 0, 0, 1], port)))
        .unwrap();
    let listener = socket.listen(0).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut queued = Vec::new();
    for _ in 0..8 {
        match std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
            Ok(c) => queued.push(c),
            Err(_) => return (listener, queued),
        }
    }
    panic!("the listener's queue never filled");
}

/// Polls `cond` every 10 ms until it holds (true) or `limit` has passed (false).
async fn within(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if tokio::task::block_in_place(&mut cond) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The dedup records of `pay` in a database: key → state ("0" in flight, "1"
/// done, "2" in doubt).
fn records(pg: &PgServer, db: &str) -> HashMap<String, String> {
    pg.psql(
        db,
        "SELECT key || ' ' || state FROM fencegate_dedup WHERE route = 'pay'",
    )
    .lines()
    .filter_map(|l| l.split_once(' '))
    .map(|(k, s)| (k.to_owned(), s.to_owned()))
    .collect()
}

/// Runs `plan`: the pair, fencegate on both hosts, the load, the kill, the
/// promotion, then the checks (returned, not asserted: the caller decides).
async fn failover(plan: Plan) -> Outcome {
    let t0 = Instant::now();
    let primary = PgServer::start();
    let (db, _) = primary.new_database();
    let relay = Relay::start(primary.port).await;
    let standby = primary.standby(STANDBY, relay.addr.port());
    let want = match plan.replication {
        Replication::Synchronous => {
            primary.psql(
                "postgres",
                &format!("ALTER SYSTEM SET synchronous_standby_names = '{STANDBY}'"),
            );
            primary.psql("postgres", "SELECT pg_reload_conf()");
            "sync"
        }
        Replication::Asynchronous => "async",
    };
    until(&format!("the standby streams ({want})"), || {
        primary.psql(
            "postgres",
            &format!(
                "SELECT sync_state FROM pg_stat_replication WHERE application_name = '{STANDBY}' AND state = 'streaming'"
            ),
        ) == want
    })
    .await;
    let url = format!(
        "host=127.0.0.1,127.0.0.1 port={},{} user=fg dbname={db} sslmode=disable \
         target_session_attrs=read-write",
        primary.port, standby.port
    );
    let r = rig(&url, "timeout_ms = 1000").await;
    let pay = r.hold("pay").await;
    assert_eq!(
        keyed_answer(&r.fg, &pay, "warm").await,
        Answer::Forwarded(200)
    );

    let stop = Arc::new(AtomicBool::new(false));
    let log: Arc<Mutex<Vec<Sent>>> = Arc::new(Mutex::new(Vec::new()));
    let workers = load(&r, &pay, &plan, &stop, &log);
    let forwarded_since = |since: Instant| {
        log.lock()
            .unwrap()
            .iter()
            .filter(|s| s.at >= since && s.answer == Answer::Forwarded(200))
            .count()
    };
    let started = Instant::now();
    until("keys forwarded before the kill", || {
        forwarded_since(started) >= plan.before
    })
    .await;
    if plan.behind > 0 {
        // The standby falls behind: it receives none of the WAL from here on.
        relay.hold_replies(true);
        let held_at = Instant::now();
        until("keys forwarded while the standby is behind", || {
            forwarded_since(held_at) >= plan.behind
        })
        .await;
    }
    primary.kill9();
    let killed_at = Instant::now();
    let _swallow = plan.gone.then(|| swallow(primary.port));
    // What the standby had not received is gone with the primary.
    relay.cut();
    let refused_since = |since: Instant| {
        log.lock()
            .unwrap()
            .iter()
            .filter(|s| s.at >= since && s.answer == refused("store_unavailable"))
            .count()
    };
    until("every worker refused while there is no primary", || {
        refused_since(killed_at) >= plan.workers
    })
    .await;
    let promoting_at = Instant::now();
    standby.promote();
    let promoted_at = Instant::now();
    until("keys forwarded after the promotion", || {
        forwarded_since(promoted_at) >= plan.after
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    for w in workers {
        w.await.unwrap();
    }
    let log = std::mem::take(&mut *log.lock().unwrap());

    let mut out = Outcome {
        requests: log.len(),
        answers: tally(log.iter().map(|s| &s.answer)),
        refused_503: log
            .iter()
            .filter(|s| s.at >= killed_at && s.answer == refused("store_unavailable"))
            .count(),
        promote_took: promoted_at - promoting_at,
        ..Outcome::default()
    };
    let first_back = log
        .iter()
        .filter(|s| s.at >= killed_at && s.answer == Answer::Forwarded(200))
        .map(|s| s.answered)
        .min()
        .expect("a key forwarded after the promotion");
    out.outage = first_back - killed_at;
    out.back_after_promote = first_back.saturating_duration_since(promoted_at);

    // Per key: its 2xx answers, and whether the first came before the kill.
    let mut forwarded: BTreeMap<&str, (usize, bool)> = BTreeMap::new();
    for s in &log {
        let e = forwarded.entry(&s.key).or_default();
        match &s.answer {
            Answer::Forwarded(200) => {
                e.0 += 1;
                e.1 |= s.answered < killed_at;
            }
            a if *a == refused("store_unavailable") || *a == refused("dedup_in_flight") => {}
            other => out.unexpected.push((s.key.clone(), other.clone())),
        }
    }
    out.keys = forwarded.len();
    let arrived = r.arrivals_by_key();
    for (key, (n, _)) in &forwarded {
        if arrived.get(*key).copied().unwrap_or(0) > *n {
            out.forwarded_on_refusal.push((*key).to_owned());
        }
    }
    // Every key the origin received has a record in the promoted database.
    let stored = records(&standby, &db);
    out.unrecorded = arrived
        .keys()
        .filter(|k| k.starts_with("fo-") && !stored.contains_key(*k))
        .cloned()
        .collect();
    // Outcomes whose batch the kill cut are written again by fencegate, over
    // their claim, once the promoted standby answers.
    let delivered: Vec<&str> = forwarded
        .iter()
        .filter(|(_, (n, _))| *n > 0)
        .map(|(k, _)| *k)
        .collect();
    // An asynchronous standby may have lost claims for good: a shorter look.
    let settle = match plan.replication {
        Replication::Synchronous => Duration::from_secs(15),
        Replication::Asynchronous => Duration::from_secs(5),
    };
    out.settled = within(settle, || {
        let stored = records(&standby, &db);
        delivered
            .iter()
            .all(|k| stored.get(*k).map(String::as_str) == Some("1"))
    })
    .await;
    let stored = records(&standby, &db);
    out.unsettled = delivered
        .iter()
        .filter(|k| stored.get(**k).map(String::as_str) != Some("1"))
        .map(|k| ((*k).to_owned(), stored.get(*k).cloned().unwrap_or_default()))
        .collect();

    // Every key answered 2xx is answered from its record now: before the kill,
    // and after it.
    for (key, (n, before)) in &forwarded {
        if *n == 0 {
            continue;
        }
        let a = keyed_answer(&r.fg, &pay, key).await;
        if *before {
            out.done_before_kill += 1;
        }
        if a != Answer::Replayed(200) {
            let lost = ((*key).to_owned(), a);
            if *before {
                out.lost_done.push(lost);
            } else {
                out.lost_after.push(lost);
            }
        }
    }
    let mut duplicates: Vec<_> = r
        .arrivals_by_key()
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .collect();
    duplicates.sort();
    out.duplicates = duplicates;
    out.took = t0.elapsed();
    let lossless = plan.replication == Replication::Synchronous;
    if lossless && (!out.unsettled.is_empty() || !out.lost_after.is_empty()) {
        // What fencegate said about its writes.
        for l in r.fg.stderr().lines().filter(|l| !l.contains("INFO")) {
            eprintln!("fencegate: {l}");
        }
    }
    eprintln!(
        "failover ({:?}, {} workers): {} keys, {} requests {:?}; 503s after the kill: {}; \
         outage {:?} (promote took {:?}, forwarding {:?} after it); done before the kill: {}, \
         lost: {}; forwarded after the kill, not replayed: {}; duplicates: {}; \
         forwarded behind a refusal: {}; forwarded without a record: {}; settled: {}; run {:?}",
        plan.replication,
        plan.workers,
        out.keys,
        out.requests,
        out.answers,
        out.refused_503,
        out.outage,
        out.promote_took,
        out.back_after_promote,
        out.done_before_kill,
        out.lost_done.len(),
        out.lost_after.len(),
        out.duplicates.len(),
        out.forwarded_on_refusal.len(),
        out.unrecorded.len(),
        out.settled,
        out.took,
    );
    out
}

/// What a synchronous standby promises: nothing lost, nothing twice, the
/// outage refused.
fn assert_lossless(out: &Outcome) {
    assert!(
        out.unexpected.is_empty(),
        "unexpected answers: {:?}",
        out.unexpected
    );
    assert!(out.refused_503 > 0, "the outage was answered with 503s");
    assert!(
        out.forwarded_on_refusal.is_empty(),
        "forwarded behind a refusal: {:?}",
        out.forwarded_on_refusal
    );
    assert!(
        out.unrecorded.is_empty(),
        "forwarded without a durable record: {:?}",
        out.unrecorded
    );
    assert!(
        out.settled,
        "every forwarded key's record became done; not: {:?}",
        out.unsettled
    );
    assert!(out.done_before_kill > 0);
    assert!(
        out.lost_done.is_empty(),
        "done records lost: {:?}",
        out.lost_done
    );
    assert!(
        out.lost_after.is_empty(),
        "not replayed: {:?}",
        out.lost_after
    );
    assert!(
        out.duplicates.is_empty(),
        "delivered twice: {:?}",
        out.duplicates
    );
}

/// A synchronous standby: nothing lost, nothing twice, the outage refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_to_a_synchronous_standby_loses_nothing() {
    if !available_or_skip() {
        return;
    }
    let out = failover(Plan {
        replication: Replication::Synchronous,
        workers: 16,
        before: 400,
        after: 200,
        behind: 0,
        gone: false,
    })
    .await;
    assert_lossless(&out);
}

/// The same, the primary's machine gone rather than its process: connection
/// attempts to it hang instead of being refused. fencegate must still reach
/// the standby within a request's `timeout_ms`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_from_a_primary_that_swallows_connections() {
    if !available_or_skip() {
        return;
    }
    let out = failover(Plan {
        replication: Replication::Synchronous,
        workers: 16,
        before: 200,
        after: 100,
        behind: 0,
        gone: true,
    })
    .await;
    assert_lossless(&out);
}

/// The same run with an asynchronous standby, twice: once in step with the
/// primary (what it had not received at the kill is lost), once after it fell
/// behind for 100 keys. The loss the README warns of, counted and printed, not
/// asserted. Still asserted: the outage is refused, and nothing is forwarded
/// behind a refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_to_an_asynchronous_standby_loses_what_it_had_not_received() {
    if !available_or_skip() {
        return;
    }
    for behind in [0, 100] {
        let out = failover(Plan {
            replication: Replication::Asynchronous,
            workers: 16,
            before: 400,
            after: 200,
            behind,
            gone: false,
        })
        .await;
        assert!(out.unexpected.is_empty(), "{:?}", out.unexpected);
        assert!(out.refused_503 > 0);
        assert!(out.forwarded_on_refusal.is_empty());
        eprintln!(
            "asynchronous standby, {behind} keys behind: of {} keys done before the kill, {} \
             lost their done (retries: {:?}); {} keys reached the origin twice; {} forwarded \
             keys have no record on the promoted standby",
            out.done_before_kill,
            out.lost_done.len(),
            tally(out.lost_done.iter().map(|(_, a)| a)),
            out.duplicates.len(),
            out.unrecorded.len(),
        );
    }
}
