//! The PostgreSQL backend's batched claims and outcomes (group commit, issue
//! 27): the claims and outcomes of concurrent requests go to the database
//! together as one statement — an `INSERT … SELECT … FROM unnest(…)` for the
//! claims and an `UPDATE`/`DELETE … FROM unnest(…)` for the outcomes — so one
//! round trip, one transaction and one commit for the batch.
//!
//! Every rule of the one-row statements holds per row:
//! - the owner generation: the batch share-locks the owner rows of its shards
//!   first, in shard order (a takeover's update waits for the batch to commit,
//!   and a batch never holds a row lock while it waits for one), and each row
//!   is written only when no newer generation holds its shard;
//! - a claim inserts only a key that has no record (`ON CONFLICT DO NOTHING`);
//!   the existing record of a key that conflicts comes back in the same round
//!   trip, so the caller answers from it, or takes it over by the exact version
//!   read (one row, one statement, as before: expiry and `resend` are rare);
//! - an outcome is written only over the caller's own `in_flight` record: same
//!   owner generation, same claim (a random number each claim stores);
//! - a row that matches nothing never fails the others: it comes back
//!   unmatched, and its caller looks at why.
//!
//! A batch whose outcome is unknown (the connection dropped or the timeout ran
//! out after it was sent) fails every request in it — nothing is forwarded —
//! and is settled in the background while the database is away: the claims are
//! deleted (by their claim numbers: none was forwarded, so the keys are free
//! again rather than blocked), the outcomes written again (by claim number,
//! over the record still in flight). A batch the database refused (an error it
//! reported), or that found no connection, changed nothing: its claims are
//! free; its outcomes are written again all the same (a key would otherwise
//! stay in flight until a restart).

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Object, ObjectId, Pool};
use tokio::sync::oneshot;
use tokio_postgres::Row;

use super::error::describe;
use super::fenced::owners_for_share;
use crate::state::{Record, RecordKey};

/// What the workers share with the backend.
#[derive(Clone)]
pub(super) struct Db {
    pub pool: Pool,
    pub timeout: Duration,
    pub healthy: Arc<AtomicBool>,
    /// Statements that committed (each its own transaction).
    pub commits: Arc<AtomicU64>,
    /// Records written by those commits.
    pub records: Arc<AtomicU64>,
    /// The server process of each pooled connection, once asked.
    pub backends: Arc<std::sync::Mutex<std::collections::HashMap<ObjectId, Backend>>>,
}

impl Db {
    fn committed(&self, records: usize) {
        self.commits.fetch_add(1, Ordering::Relaxed);
        self.records
            .fetch_add(u64::try_from(records).unwrap_or(0), Ordering::Relaxed);
    }
}

/// Why a batch failed.
#[derive(Debug, Clone)]
pub(super) enum BatchError {
    /// The database reported an error: the statement changed nothing.
    Refused(String),
    /// It may or may not have committed (settled in the background).
    Unknown(String),
}

/// A request's claim of a key it believes free.
pub(super) struct ClaimItem {
    pub key: RecordKey,
    pub shard: i32,
    pub generation: i64,
    pub fingerprint: Vec<u8>,
    pub epoch: i64,
    pub created_ms: i64,
    pub method: Option<String>,
    pub path: Option<String>,
    /// The claim's number, kept in the record while it is in flight.
    pub claim: i64,
    pub reply: oneshot::Sender<Result<Claimed, BatchError>>,
}

/// How a claim in a batch came out.
pub(super) enum Claimed {
    /// The key is ours, in flight, durable.
    Yes,
    /// Not claimed: the key's record as the statement saw it (none when it was
    /// inserted by a batch that committed meanwhile), and the shard's stored
    /// owner generation (to tell a lost shard).
    No {
        existing: Option<Record>,
        owner: Option<i64>,
    },
}

/// How a claimed key ends, as a batch writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Op {
    Done = 1,
    InDoubt = 2,
    Delete = 3,
}

/// A request's outcome.
pub(super) struct OutcomeItem {
    pub key: RecordKey,
    pub shard: i32,
    pub generation: i64,
    pub op: Op,
    /// The claim's number (`None` only for a claim this process did not make).
    pub claim: Option<i64>,
    pub updated_ms: i64,
    pub status: Option<i16>,
    pub headers: Option<Vec<u8>>,
    pub body: Option<Vec<u8>>,
    /// Whether the row matched: `false` when the record is no longer this
    /// claim's (or a newer owner holds the shard).
    pub reply: Option<oneshot::Sender<Result<bool, BatchError>>>,
}

/// One statement for a batch of claims and outcomes together: one round trip,
/// one transaction, one commit for both (issue 27: as two statements, the
/// commits per request at 64 workers were twice what one can be).
///
/// Claims: each inserts its key only where no record is (`ON CONFLICT DO
/// NOTHING`) and no newer generation holds its shard; the record of a key that
/// conflicts comes back (from result column 4, in [`super::postgres`]'s
/// `RECORD_COLUMNS` order).
///
/// Outcomes: each is written over its record only while it is still this
/// claim's in-flight record under this generation; the rows written come back
/// by index. Each row's record is found by its primary key alone and then
/// written by `ctid` with the conditions checked on the row itself: with
/// `state = 0` in the lookup the planner prefers scanning the partial in-flight
/// index (every in-flight record of the shard, and the dead entries of every
/// outcome since the last vacuum) to one key lookup per row.
///
/// Every lookup of a key is a `LATERAL` subquery with `LIMIT 1` (the key is
/// the primary key): it cannot be flattened into a join, so it is always one
/// index lookup per row. As a plain join, the generic plan (built once per
/// connection, `plan_cache_mode = force_generic_plan`) was chosen while the
/// table was empty — a hash join over a sequential scan — and kept as the
/// table grew: each batch read the whole table (the load bench's PostgreSQL
/// CPU per request grew round after round).
///
/// A claim and an outcome of one key in one batch (a worker's retry of a key
/// still in flight) see the statement's one snapshot: the claim conflicts with
/// the record in flight and answers from it, as if it had come just before the
/// outcome.
///
/// The comment names what the batch carries (`claims` when it has any), so
/// that an operator — and a test — can tell a claim waiting on a lock.
macro_rules! write_batch {
    ($what:literal) => {
        concat!(
            "/* fencegate: ",
            $what,
            " */ WITH owners AS MATERIALIZED (",
            owners_for_share!(),
            "), \
     claim_input AS ( \
       SELECT * FROM unnest($2::int4[], $3::text[], $4::text[], $5::int4[], $6::bytea[], \
         $7::int8[], $8::int8[], $9::int8[], $10::text[], $11::text[], $12::int8[]) \
         AS t(i, route, key, shard, fp, epoch, gen, created, method, path, claim)), \
     allowed AS MATERIALIZED ( \
       SELECT c.*, (SELECT o.generation FROM owners o WHERE o.shard = c.shard) AS owner \
       FROM claim_input c), \
     ins AS ( \
       INSERT INTO fencegate_dedup (route, key, shard, state, fingerprint, epoch, \
         owner_generation, created_ms, updated_ms, method, path, claim) \
       SELECT route, key, shard, 0, fp, epoch, gen, created, created, method, path, claim \
       FROM allowed WHERE COALESCE(owner, 0) <= gen ORDER BY route, key \
       ON CONFLICT (route, key) DO NOTHING RETURNING route, key), \
     outcome_input AS ( \
       SELECT * FROM unnest($13::int4[], $14::text[], $15::text[], $16::int4[], $17::int8[], \
         $18::int2[], $19::int8[], $20::int8[], $21::int2[], $22::bytea[], $23::bytea[]) \
         AS t(i, route, key, shard, gen, op, claim, updated, status, headers, body)), \
     target AS MATERIALIZED ( \
       SELECT u.*, d.tid FROM outcome_input u \
       CROSS JOIN LATERAL (SELECT d.ctid AS tid FROM fencegate_dedup d \
         WHERE d.route = u.route AND d.key = u.key LIMIT 1) d \
       WHERE COALESCE((SELECT o.generation FROM owners o WHERE o.shard = u.shard), 0) \
         <= u.gen), \
     del AS ( \
       DELETE FROM fencegate_dedup d USING target t \
       WHERE t.op = 3 AND d.ctid = t.tid AND d.state = 0 AND d.owner_generation = t.gen \
         AND (t.claim IS NULL OR d.claim = t.claim) \
       RETURNING t.i), \
     upd AS ( \
       UPDATE fencegate_dedup d SET state = t.op, updated_ms = t.updated, status = t.status, \
         headers = t.headers, header_names = NULL, header_values = NULL, body = t.body \
       FROM target t \
       WHERE t.op IN (1, 2) AND d.ctid = t.tid AND d.state = 0 AND d.owner_generation = t.gen \
         AND (t.claim IS NULL OR d.claim = t.claim) \
       RETURNING t.i) \
     SELECT 0::int2, a.i, ins.key IS NOT NULL, a.owner, \
       d.state, d.fingerprint, d.epoch, d.created_ms, d.updated_ms, d.status, \
       d.header_names, d.header_values, d.body, d.method, d.path, d.headers \
     FROM allowed a \
     LEFT JOIN ins ON ins.route = a.route AND ins.key = a.key \
     LEFT JOIN LATERAL (SELECT * FROM fencegate_dedup d \
       WHERE ins.key IS NULL AND d.route = a.route AND d.key = a.key LIMIT 1) d ON true \
     UNION ALL SELECT 1::int2, m.i, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, \
       NULL, NULL, NULL, NULL, NULL \
     FROM (SELECT i FROM del UNION ALL SELECT i FROM upd) m"
        )
    };
}

/// A batch with claims (and perhaps outcomes).
const CLAIMS_BATCH: &str = write_batch!("claims");
/// A batch of outcomes alone.
const OUTCOMES_BATCH: &str = write_batch!("outcomes");

/// Frees claims that were never forwarded (their batch's outcome was unknown,
/// or their request was gone when the answer came): by claim number, so only
/// that claim's record, while it is in flight, and — like every write of an
/// owner — only while no newer generation holds its shard (a successor's
/// recovery has made it in doubt: an operator's to resolve).
const RELEASE_CLAIMS: &str = concat!(
    "/* fencegate: release */ WITH owners AS MATERIALIZED (",
    owners_for_share!(),
    "), \
     u AS ( \
       SELECT * FROM unnest($2::text[], $3::text[], $4::int4[], $5::int8[], $6::int8[]) \
         AS t(route, key, shard, gen, claim) \
       WHERE COALESCE((SELECT o.generation FROM owners o WHERE o.shard = t.shard), 0) <= t.gen) \
     DELETE FROM fencegate_dedup d USING u \
     WHERE d.route = u.route AND d.key = u.key AND d.claim = u.claim AND d.state = 0 \
       AND d.owner_generation = u.gen \
     RETURNING 1"
);

/// How often, and for how long, a batch whose outcome was unknown is settled.
const SETTLE_EVERY: Duration = Duration::from_secs(1);
const SETTLE_TRIES: usize = 600;

/// A statement the database refused because of a conflict with another
/// transaction (deadlock, serialization) is tried again at once, this often.
const RETRIES: usize = 3;

/// A failed statement: why, and whether to send it again at once.
fn classify(e: &tokio_postgres::Error) -> (BatchError, bool) {
    match e.code().map(|c| c.code()) {
        // 40003 (statement completion unknown) says what it says: a pooler
        // in between may send it about a statement that committed.
        Some("40003") => (BatchError::Unknown(describe(e)), false),
        // Data, integrity, syntax or access, transaction state, rollback: the
        // server refused the statement, and autocommit rolled it back. A
        // conflict with another transaction (deadlock, serialization: class
        // 40) is worth sending again.
        Some(code)
            if ["22", "23", "25", "40", "42"]
                .iter()
                .any(|class| code.starts_with(class)) =>
        {
            (BatchError::Refused(describe(e)), code.starts_with("40"))
        }
        // Anything else (a dropped connection, an administrator's shutdown, a
        // server error) may have come after the commit.
        _ => (BatchError::Unknown(describe(e)), false),
    }
}

/// The connection a statement whose outcome is unknown went on, and its
/// server process: what settling it must wait for.
pub(super) struct Sent {
    conn: Object,
    backend: Option<Backend>,
}

/// A failed statement.
pub(super) struct Failed {
    pub error: BatchError,
    /// Set when the statement may still commit (its outcome is unknown).
    sent: Option<Sent>,
    retry: bool,
}

impl Failed {
    /// The error alone; a connection still busy with the statement (or
    /// broken) is closed rather than handed back to the pool.
    fn into_error(self) -> BatchError {
        if let Some(sent) = self.sent {
            drop(Object::take(sent.conn));
        }
        self.error
    }

    fn refused(detail: String) -> Failed {
        Failed {
            error: BatchError::Refused(detail),
            sent: None,
            retry: false,
        }
    }
}

/// A server process, as `pg_stat_activity` names it (its pid alone may be
/// reused once it has exited).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Backend {
    pid: i32,
    started_us: i64,
}

const WHO_AM_I: &str = "SELECT pid, (extract(epoch FROM backend_start) * 1000000)::int8 \
     FROM pg_stat_activity WHERE pid = pg_backend_pid()";

/// The server process behind a pooled connection: asked once per connection.
async fn backend_of(db: &Db, conn: &Object) -> Result<Option<Backend>, tokio_postgres::Error> {
    let id = Object::id(conn);
    if let Some(b) = db.backends.lock().ok().and_then(|m| m.get(&id).copied()) {
        return Ok(Some(b));
    }
    let row = conn.query_opt(WHO_AM_I, &[]).await?;
    let backend = row.map(|r| Backend {
        pid: r.get(0),
        started_us: r.get(1),
    });
    if let (Some(b), Ok(mut m)) = (backend, db.backends.lock()) {
        // Connections come and go; their entries are only worth a lookup.
        if m.len() > 1024 {
            m.clear();
        }
        m.insert(id, b);
    }
    Ok(backend)
}

/// Runs one statement with a pooled connection, bounded by the timeout, sent
/// again when the database refused it for a conflict with another transaction.
async fn run(
    db: &Db,
    sql: &'static str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Vec<Row>, Failed> {
    let mut tries = 0;
    loop {
        tries += 1;
        let res = run_once(db, sql, params).await;
        match res {
            Err(f) if f.retry && tries < RETRIES => continue,
            other => {
                db.healthy.store(other.is_ok(), Ordering::Relaxed);
                return other;
            }
        }
    }
}

async fn run_once(
    db: &Db,
    sql: &'static str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Vec<Row>, Failed> {
    let deadline = tokio::time::Instant::now() + db.timeout;
    let late = || {
        format!(
            "no answer from the database within {} ms",
            db.timeout.as_millis()
        )
    };
    // Until the statement itself is sent, a failure changed nothing.
    let conn = match tokio::time::timeout_at(deadline, db.pool.get()).await {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => return Err(Failed::refused(format!("no database connection: {e}"))),
        Err(_) => return Err(Failed::refused(late())),
    };
    let backend = match tokio::time::timeout_at(deadline, backend_of(db, &conn)).await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => return Err(Failed::refused(describe(&e))),
        Err(_) => return Err(Failed::refused(late())),
    };
    let st = match tokio::time::timeout_at(deadline, conn.prepare_cached(sql)).await {
        Ok(Ok(st)) => st,
        Ok(Err(e)) => return Err(Failed::refused(describe(&e))),
        Err(_) => return Err(Failed::refused(late())),
    };
    let answer = tokio::time::timeout_at(deadline, conn.query(&st, params)).await;
    match answer {
        Ok(Ok(rows)) => Ok(rows),
        Ok(Err(e)) => {
            let (error, retry) = classify(&e);
            let sent = matches!(error, BatchError::Unknown(_)).then_some(Sent { conn, backend });
            Err(Failed { error, sent, retry })
        }
        Err(_) => Err(Failed {
            error: BatchError::Unknown(late()),
            sent: Some(Sent { conn, backend }),
            retry: false,
        }),
    }
}

/// The distinct shards of a batch, for the owner rows it locks.
fn shards_of<'a>(shards: impl Iterator<Item = &'a i32>) -> Vec<i32> {
    let mut v: Vec<i32> = shards
        .copied()
        .collect::<HashSet<_>>()
        .into_iter()
        .collect();
    v.sort_unstable();
    v
}

/// A write a request hands to the batch writer.
pub(super) enum Write {
    Claim(ClaimItem),
    Outcome(OutcomeItem),
}

/// Runs a batch of writes, its claims and outcomes in one statement, and
/// answers each. Keys are unique among a statement's claims: a key's second
/// claim goes in a round of its own after the first.
pub(super) async fn writes(db: Db, batch: Vec<Write>) {
    let mut claims = Vec::new();
    let mut outcomes = Vec::new();
    for w in batch {
        match w {
            Write::Claim(c) => claims.push(c),
            Write::Outcome(o) => outcomes.push(o),
        }
    }
    loop {
        let mut seen = HashSet::with_capacity(claims.len());
        let (now, later): (Vec<_>, Vec<_>) =
            claims.into_iter().partition(|c| seen.insert(c.key.clone()));
        round(&db, now, std::mem::take(&mut outcomes)).await;
        if later.is_empty() {
            break;
        }
        claims = later;
    }
}

/// A statement's answer: how each claim came out, and whether each outcome
/// was written.
struct Answer {
    claims: Vec<Option<Claimed>>,
    matched: Vec<bool>,
}

impl Answer {
    /// Records the statement wrote: claims inserted, and outcomes written.
    fn written(&self) -> (usize, usize) {
        let inserted = self
            .claims
            .iter()
            .filter(|c| matches!(c, Some(Claimed::Yes)))
            .count();
        (inserted, self.matched.iter().filter(|m| **m).count())
    }
}

fn indexes(n: usize) -> Vec<i32> {
    (0..n)
        .map(|i| i32::try_from(i).unwrap_or(i32::MAX))
        .collect()
}

/// Sends one batch statement and reads its answer.
async fn send(db: &Db, claims: &[ClaimItem], outcomes: &[OutcomeItem]) -> Result<Answer, Failed> {
    let c_idx = indexes(claims.len());
    let c_routes: Vec<&str> = claims.iter().map(|c| c.key.route.as_str()).collect();
    let c_keys: Vec<&str> = claims.iter().map(|c| c.key.key.as_str()).collect();
    let c_shards: Vec<i32> = claims.iter().map(|c| c.shard).collect();
    let fps: Vec<&[u8]> = claims.iter().map(|c| c.fingerprint.as_slice()).collect();
    let epochs: Vec<i64> = claims.iter().map(|c| c.epoch).collect();
    let c_gens: Vec<i64> = claims.iter().map(|c| c.generation).collect();
    let created: Vec<i64> = claims.iter().map(|c| c.created_ms).collect();
    let methods: Vec<Option<&str>> = claims.iter().map(|c| c.method.as_deref()).collect();
    let paths: Vec<Option<&str>> = claims.iter().map(|c| c.path.as_deref()).collect();
    let c_ids: Vec<i64> = claims.iter().map(|c| c.claim).collect();
    let o_idx = indexes(outcomes.len());
    let o_routes: Vec<&str> = outcomes.iter().map(|o| o.key.route.as_str()).collect();
    let o_keys: Vec<&str> = outcomes.iter().map(|o| o.key.key.as_str()).collect();
    let o_shards: Vec<i32> = outcomes.iter().map(|o| o.shard).collect();
    let o_gens: Vec<i64> = outcomes.iter().map(|o| o.generation).collect();
    let ops: Vec<i16> = outcomes.iter().map(|o| o.op as i16).collect();
    let o_ids: Vec<Option<i64>> = outcomes.iter().map(|o| o.claim).collect();
    let updated: Vec<i64> = outcomes.iter().map(|o| o.updated_ms).collect();
    let status: Vec<Option<i16>> = outcomes.iter().map(|o| o.status).collect();
    let headers: Vec<Option<&[u8]>> = outcomes.iter().map(|o| o.headers.as_deref()).collect();
    let bodies: Vec<Option<&[u8]>> = outcomes.iter().map(|o| o.body.as_deref()).collect();
    let locked = shards_of(c_shards.iter().chain(o_shards.iter()));
    let sql = if claims.is_empty() {
        OUTCOMES_BATCH
    } else {
        CLAIMS_BATCH
    };
    let rows = run(
        db,
        sql,
        &[
            &locked, &c_idx, &c_routes, &c_keys, &c_shards, &fps, &epochs, &c_gens, &created,
            &methods, &paths, &c_ids, &o_idx, &o_routes, &o_keys, &o_shards, &o_gens, &ops, &o_ids,
            &updated, &status, &headers, &bodies,
        ],
    )
    .await?;
    let mut answer = Answer {
        claims: (0..claims.len()).map(|_| None).collect(),
        matched: vec![false; outcomes.len()],
    };
    for row in &rows {
        let Some(i) = row
            .get::<_, Option<i32>>(1)
            .and_then(|i| usize::try_from(i).ok())
        else {
            continue;
        };
        if row.get::<_, i16>(0) == 1 {
            if let Some(m) = answer.matched.get_mut(i) {
                *m = true;
            }
            continue;
        }
        let Some(slot) = answer.claims.get_mut(i) else {
            continue;
        };
        *slot = Some(if row.get::<_, Option<bool>>(2) == Some(true) {
            Claimed::Yes
        } else {
            Claimed::No {
                existing: super::record::record_at(row, 4),
                owner: row.get(3),
            }
        });
    }
    Ok(answer)
}

/// Runs one statement of claims and outcomes and answers each request.
async fn round(db: &Db, claims: Vec<ClaimItem>, outcomes: Vec<OutcomeItem>) {
    let res = send(db, &claims, &outcomes).await;
    if !claims.is_empty() {
        crate::failpoint::hit("pg_claim_batch_answered");
    }
    if !outcomes.is_empty() {
        crate::failpoint::hit("pg_outcome_batch_answered");
    }
    let answer = match res {
        Ok(answer) => answer,
        Err(failed) => {
            let error = failed.error.clone();
            if !claims.is_empty() && matches!(error, BatchError::Unknown(_)) {
                release_in_background(db.clone(), releases(&claims), failed.sent);
            } else {
                failed.into_error();
            }
            for c in claims {
                let _ = c.reply.send(Err(error.clone()));
            }
            failed_outcomes(db, outcomes, &error);
            return;
        }
    };
    let (inserted, outcomes_written) = answer.written();
    let written = inserted + outcomes_written;
    if written > 0 {
        db.committed(written);
    }
    if inserted > 0 {
        crate::failpoint::hit("dedup_in_flight_flushed");
    }
    if outcomes
        .iter()
        .zip(&answer.matched)
        .any(|(o, m)| *m && o.op == Op::Done)
    {
        crate::failpoint::hit("dedup_done_flushed");
    }
    answer_claims(db, claims, answer.claims);
    for (o, m) in outcomes.into_iter().zip(answer.matched) {
        if let Some(reply) = o.reply {
            let _ = reply.send(Ok(m));
        }
    }
}

/// Answers each claim of a statement that committed.
fn answer_claims(db: &Db, claims: Vec<ClaimItem>, answers: Vec<Option<Claimed>>) {
    // A request that is gone (its worker hung up) did not forward: its claim
    // is freed rather than left in flight until a restart.
    let mut orphans = Vec::new();
    for (c, answer) in claims.into_iter().zip(answers) {
        let answer = answer.unwrap_or(Claimed::No {
            existing: None,
            owner: None,
        });
        let was_claimed = matches!(answer, Claimed::Yes);
        if was_claimed {
            let release = Release::of(&c);
            if c.reply.send(Ok(answer)).is_err() {
                orphans.push(release);
            }
        } else {
            let _ = c.reply.send(Ok(answer));
        }
    }
    if !orphans.is_empty() {
        // Committed: nothing to wait for.
        release_in_background(db.clone(), orphans, None);
    }
}

/// A claim to free: it was never forwarded.
struct Release {
    key: RecordKey,
    shard: i32,
    generation: i64,
    claim: i64,
}

impl Release {
    fn of(c: &ClaimItem) -> Release {
        Release {
            key: c.key.clone(),
            shard: c.shard,
            generation: c.generation,
            claim: c.claim,
        }
    }
}

fn releases(batch: &[ClaimItem]) -> Vec<Release> {
    batch.iter().map(Release::of).collect()
}

/// How long settling waits for the statement it settles to end on its own
/// connection (it may wait on a lock at the database).
const SETTLE_BEHIND: Duration = Duration::from_secs(600);

/// Waits until the statement of an uncertain batch can no longer commit: on its
/// own connection, a statement sent after it runs after it ends; when that
/// connection is gone, until its server process has ended (a server finishes —
/// and commits — a statement whose client is gone). Whether that happened in
/// time, and the release sent behind it, if it was.
async fn after_it_ended(db: &Db, sent: Sent, release: &Released<'_>) -> Option<u64> {
    let Sent { conn, backend } = sent;
    let behind = tokio::time::timeout(SETTLE_BEHIND, release.on(&conn)).await;
    match behind {
        Ok(Ok(n)) => return Some(n),
        // Never hand back a connection still busy with it, or broken.
        _ => drop(Object::take(conn)),
    }
    let backend = backend?;
    for _ in 0..SETTLE_TRIES {
        let gone = async {
            let c = db.pool.get().await.ok()?;
            let row = c
                .query_opt(
                    "SELECT 1 FROM pg_stat_activity WHERE pid = $1 \
                       AND (extract(epoch FROM backend_start) * 1000000)::int8 = $2",
                    &[&backend.pid, &backend.started_us],
                )
                .await
                .ok()?;
            Some(row.is_none())
        };
        if let Ok(Some(true)) = tokio::time::timeout(db.timeout, gone).await {
            return None;
        }
        tokio::time::sleep(SETTLE_EVERY).await;
    }
    None
}

/// The release statement's parameters.
struct Released<'a> {
    locked: Vec<i32>,
    routes: Vec<&'a str>,
    keys: Vec<&'a str>,
    shards: Vec<i32>,
    gens: Vec<i64>,
    ids: Vec<i64>,
}

impl<'a> Released<'a> {
    fn new(claims: &'a [Release]) -> Released<'a> {
        let shards: Vec<i32> = claims.iter().map(|c| c.shard).collect();
        Released {
            locked: shards_of(shards.iter()),
            routes: claims.iter().map(|c| c.key.route.as_str()).collect(),
            keys: claims.iter().map(|c| c.key.key.as_str()).collect(),
            shards,
            gens: claims.iter().map(|c| c.generation).collect(),
            ids: claims.iter().map(|c| c.claim).collect(),
        }
    }

    /// Sends the release on `conn`; the records it deleted.
    async fn on(&self, conn: &Object) -> Result<u64, tokio_postgres::Error> {
        let st = conn.prepare_cached(RELEASE_CLAIMS).await?;
        let rows = conn
            .query(
                &st,
                &[
                    &self.locked,
                    &self.routes,
                    &self.keys,
                    &self.shards,
                    &self.gens,
                    &self.ids,
                ],
            )
            .await?;
        Ok(u64::try_from(rows.len()).unwrap_or(0))
    }
}

/// Deletes never-forwarded claims once their statement can no longer commit
/// (`sent`: the uncertain batch's connection), trying until the database
/// answers.
fn release_in_background(db: Db, claims: Vec<Release>, sent: Option<Sent>) {
    tokio::spawn(async move {
        let release = Released::new(&claims);
        let done = match sent {
            Some(sent) => after_it_ended(&db, sent, &release).await,
            None => None,
        };
        let freed = match done {
            Some(n) => Some(n),
            None => {
                let mut freed = None;
                for attempt in 0..SETTLE_TRIES {
                    if attempt > 0 {
                        tokio::time::sleep(SETTLE_EVERY).await;
                    }
                    let once = async {
                        let conn = db.pool.get().await.ok()?;
                        release.on(&conn).await.ok()
                    };
                    if let Ok(Some(n)) = tokio::time::timeout(db.timeout, once).await {
                        freed = Some(n);
                        break;
                    }
                }
                freed
            }
        };
        match freed {
            Some(n) => {
                if n > 0 {
                    db.committed(usize::try_from(n).unwrap_or(0));
                }
                tracing::info!(
                    claims = claims.len(),
                    freed = n,
                    "claims that were never forwarded are settled"
                );
            }
            None => tracing::error!(
                claims = claims.len(),
                "gave up settling claims that were never forwarded; they stay in flight until a restart makes them in doubt"
            ),
        }
    });
}

/// Answers the outcomes of a failed statement with its error and writes them
/// again in the background, whatever the failure: an outcome matches only its
/// own claim still in flight, so a second write changes nothing else — and a
/// batch that never reached a database (no connection while a standby is being
/// promoted) would otherwise leave its keys in flight, refused (409), until a
/// restart.
fn failed_outcomes(db: &Db, outcomes: Vec<OutcomeItem>, error: &BatchError) {
    if outcomes.is_empty() {
        return;
    }
    let mut again = Vec::with_capacity(outcomes.len());
    for mut o in outcomes {
        if let Some(reply) = o.reply.take() {
            let _ = reply.send(Err(error.clone()));
        }
        again.push(o);
    }
    write_again_in_background(db.clone(), again, error);
}

/// Writes outcomes alone (a statement without claims).
async fn outcome_round(db: &Db, batch: &[OutcomeItem]) -> Result<Vec<bool>, BatchError> {
    send(db, &[], batch)
        .await
        .map(|a| a.matched)
        .map_err(Failed::into_error)
}

/// Writes outcomes whose batch failed (its fate unknown, or refused) again,
/// until the database answers: each only over its own claim still in flight,
/// so one that did land matches nothing the second time.
fn write_again_in_background(db: Db, batch: Vec<OutcomeItem>, why: &BatchError) {
    match why {
        BatchError::Unknown(_) => tracing::warn!(
            outcomes = batch.len(),
            "the outcome of a batch is unknown; writing it again in the background"
        ),
        BatchError::Refused(detail) => tracing::warn!(
            outcomes = batch.len(),
            detail = %detail,
            "the outcomes of a batch were not written; writing them again in the background"
        ),
    }
    tokio::spawn(async move {
        for _ in 0..SETTLE_TRIES {
            tokio::time::sleep(SETTLE_EVERY).await;
            if let Ok(matched) = outcome_round(&db, &batch).await {
                let n = matched.iter().filter(|m| **m).count();
                if n > 0 {
                    db.committed(n);
                }
                tracing::info!(
                    outcomes = batch.len(),
                    written = n,
                    "outcomes of an uncertain batch are settled"
                );
                return;
            }
        }
        tracing::error!(
            outcomes = batch.len(),
            "gave up writing outcomes of an uncertain batch; their keys stay in flight until a restart makes them in doubt"
        );
    });
}
