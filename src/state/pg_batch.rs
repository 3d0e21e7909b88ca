//! The PostgreSQL backend's batched claims and outcomes (group commit, issue
//! 27): the claims of concurrent requests go to the database as one
//! `INSERT … SELECT … FROM unnest(…)` and their outcomes as one
//! `UPDATE`/`DELETE … FROM unnest(…)`, each a single statement, so one
//! transaction and one commit for the batch.
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

use deadpool_postgres::Pool;
use tokio::sync::oneshot;
use tokio_postgres::Row;

use super::{Record, RecordKey};

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

/// The columns a claim batch reads back of a conflicting key's record, in
/// [`super::postgres`]'s `RECORD_COLUMNS` order, from result column 3.
const CLAIM_BATCH: &str = "/* fencegate: claims */ WITH owners AS MATERIALIZED ( \
       SELECT shard, generation FROM fencegate_owners WHERE shard = ANY($1::int4[]) \
       ORDER BY shard FOR SHARE), \
     input AS ( \
       SELECT * FROM unnest($2::int4[], $3::text[], $4::text[], $5::int4[], $6::bytea[], \
         $7::int8[], $8::int8[], $9::int8[], $10::text[], $11::text[], $12::int8[]) \
         AS t(i, route, key, shard, fp, epoch, gen, created, method, path, claim)), \
     allowed AS MATERIALIZED ( \
       SELECT input.*, (SELECT o.generation FROM owners o WHERE o.shard = input.shard) AS owner \
       FROM input), \
     ins AS ( \
       INSERT INTO fencegate_dedup (route, key, shard, state, fingerprint, epoch, \
         owner_generation, created_ms, updated_ms, method, path, claim) \
       SELECT route, key, shard, 0, fp, epoch, gen, created, created, method, path, claim \
       FROM allowed WHERE COALESCE(owner, 0) <= gen ORDER BY route, key \
       ON CONFLICT (route, key) DO NOTHING RETURNING route, key) \
     SELECT a.i, ins.key IS NOT NULL, a.owner, \
       d.state, d.fingerprint, d.epoch, d.created_ms, d.updated_ms, d.status, \
       d.header_names, d.header_values, d.body, d.method, d.path, d.headers \
     FROM allowed a \
     LEFT JOIN ins ON ins.route = a.route AND ins.key = a.key \
     LEFT JOIN fencegate_dedup d ON ins.key IS NULL AND d.route = a.route AND d.key = a.key";

/// Outcomes: the rows written come back by index.
const OUTCOME_BATCH: &str = "/* fencegate: outcomes */ WITH owners AS MATERIALIZED ( \
       SELECT shard, generation FROM fencegate_owners WHERE shard = ANY($1::int4[]) \
       ORDER BY shard FOR SHARE), \
     input AS ( \
       SELECT * FROM unnest($2::int4[], $3::text[], $4::text[], $5::int4[], $6::int8[], \
         $7::int2[], $8::int8[], $9::int8[], $10::int2[], $11::bytea[], $12::bytea[]) \
         AS t(i, route, key, shard, gen, op, claim, updated, status, headers, body)), \
     ok AS MATERIALIZED ( \
       SELECT * FROM input \
       WHERE COALESCE((SELECT o.generation FROM owners o WHERE o.shard = input.shard), 0) <= gen), \
     del AS ( \
       DELETE FROM fencegate_dedup d USING ok \
       WHERE ok.op = 3 AND d.route = ok.route AND d.key = ok.key AND d.state = 0 \
         AND d.owner_generation = ok.gen AND (ok.claim IS NULL OR d.claim = ok.claim) \
       RETURNING ok.i), \
     upd AS ( \
       UPDATE fencegate_dedup d SET state = ok.op, updated_ms = ok.updated, status = ok.status, \
         headers = ok.headers, header_names = NULL, header_values = NULL, body = ok.body \
       FROM ok \
       WHERE ok.op IN (1, 2) AND d.route = ok.route AND d.key = ok.key AND d.state = 0 \
         AND d.owner_generation = ok.gen AND (ok.claim IS NULL OR d.claim = ok.claim) \
       RETURNING ok.i) \
     SELECT i FROM del UNION ALL SELECT i FROM upd";

/// Frees claims that were never forwarded (their batch's outcome was unknown,
/// or their request was gone when the answer came): by claim number, so only
/// that claim's record, in flight or turned in doubt by a successor's recovery.
const RELEASE_CLAIMS: &str = "DELETE FROM fencegate_dedup d \
     USING unnest($1::text[], $2::text[], $3::int8[]) AS u(route, key, claim) \
     WHERE d.route = u.route AND d.key = u.key AND d.claim = u.claim AND d.state IN (0, 2) \
     RETURNING 1";

/// How often, and for how long, a batch whose outcome was unknown is settled.
const SETTLE_EVERY: Duration = Duration::from_secs(1);
const SETTLE_TRIES: usize = 600;

/// A statement the database refused because of a conflict with another
/// transaction (deadlock, serialization) is tried again at once, this often.
const RETRIES: usize = 3;

/// A database error in words: tokio-postgres displays a server's error as
/// just "db error"; its message and SQLSTATE are what an operator needs.
pub(super) fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} ({})", db.message(), db.code().code()),
        None => e.to_string(),
    }
}

/// A failed statement: why, and whether to send it again at once.
fn classify(e: &tokio_postgres::Error) -> (BatchError, bool) {
    match e.code().map(|c| c.code()) {
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

/// Runs one statement with a pooled connection, bounded by the timeout, sent
/// again when the database refused it for a conflict with another transaction.
async fn run(
    db: &Db,
    sql: &'static str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Vec<Row>, BatchError> {
    let mut tries = 0;
    loop {
        tries += 1;
        let once = async {
            let client = db.pool.get().await.map_err(|e| {
                (
                    BatchError::Refused(format!("no database connection: {e}")),
                    false,
                )
            })?;
            let st = client.prepare_cached(sql).await.map_err(|e| classify(&e))?;
            client.query(&st, params).await.map_err(|e| classify(&e))
        };
        let res = match tokio::time::timeout(db.timeout, once).await {
            Ok(r) => r,
            Err(_) => Err((
                BatchError::Unknown(format!(
                    "no answer from the database within {} ms",
                    db.timeout.as_millis()
                )),
                false,
            )),
        };
        match res {
            Err((_, true)) if tries < RETRIES => continue,
            other => {
                db.healthy.store(other.is_ok(), Ordering::Relaxed);
                return other.map_err(|(e, _)| e);
            }
        }
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

/// Runs a batch of claims (keys unique within it: a key's second claim waits
/// for the next batch) and answers each.
pub(super) async fn claims(db: Db, mut batch: Vec<ClaimItem>) {
    while !batch.is_empty() {
        let mut seen = HashSet::with_capacity(batch.len());
        let (now, later): (Vec<_>, Vec<_>) =
            batch.into_iter().partition(|c| seen.insert(c.key.clone()));
        claim_round(&db, now).await;
        batch = later;
    }
}

async fn claim_round(db: &Db, batch: Vec<ClaimItem>) {
    let n = batch.len();
    let idx: Vec<i32> = (0..n)
        .map(|i| i32::try_from(i).unwrap_or(i32::MAX))
        .collect();
    let routes: Vec<&str> = batch.iter().map(|c| c.key.route.as_str()).collect();
    let keys: Vec<&str> = batch.iter().map(|c| c.key.key.as_str()).collect();
    let shard: Vec<i32> = batch.iter().map(|c| c.shard).collect();
    let fps: Vec<&[u8]> = batch.iter().map(|c| c.fingerprint.as_slice()).collect();
    let epochs: Vec<i64> = batch.iter().map(|c| c.epoch).collect();
    let gens: Vec<i64> = batch.iter().map(|c| c.generation).collect();
    let created: Vec<i64> = batch.iter().map(|c| c.created_ms).collect();
    let methods: Vec<Option<&str>> = batch.iter().map(|c| c.method.as_deref()).collect();
    let paths: Vec<Option<&str>> = batch.iter().map(|c| c.path.as_deref()).collect();
    let claims: Vec<i64> = batch.iter().map(|c| c.claim).collect();
    let locked = shards_of(shard.iter());
    let res = run(
        db,
        CLAIM_BATCH,
        &[
            &locked, &idx, &routes, &keys, &shard, &fps, &epochs, &gens, &created, &methods,
            &paths, &claims,
        ],
    )
    .await;
    crate::failpoint::hit("pg_claim_batch_answered");
    let rows = match res {
        Ok(rows) => rows,
        Err(e) => {
            if matches!(e, BatchError::Unknown(_)) {
                release_in_background(db.clone(), claim_refs(&batch));
            }
            for c in batch {
                let _ = c.reply.send(Err(e.clone()));
            }
            return;
        }
    };
    let mut answers: Vec<Option<Claimed>> = (0..n).map(|_| None).collect();
    let mut inserted = 0;
    for row in &rows {
        let Some(i) = row
            .get::<_, Option<i32>>(0)
            .and_then(|i| usize::try_from(i).ok())
        else {
            continue;
        };
        let Some(slot) = answers.get_mut(i) else {
            continue;
        };
        *slot = Some(if row.get::<_, bool>(1) {
            inserted += 1;
            Claimed::Yes
        } else {
            Claimed::No {
                existing: super::postgres::record_at(row, 3),
                owner: row.get(2),
            }
        });
    }
    if inserted > 0 {
        db.committed(inserted);
        crate::failpoint::hit("dedup_in_flight_flushed");
    }
    // A request that is gone (its worker hung up) did not forward: its claim
    // is freed rather than left in flight until a restart.
    let mut orphans = Vec::new();
    for (c, answer) in batch.into_iter().zip(answers) {
        let answer = answer.unwrap_or(Claimed::No {
            existing: None,
            owner: None,
        });
        let was_claimed = matches!(answer, Claimed::Yes);
        if c.reply.send(Ok(answer)).is_err() && was_claimed {
            orphans.push((c.key, c.claim));
        }
    }
    if !orphans.is_empty() {
        release_in_background(db.clone(), orphans);
    }
}

fn claim_refs(batch: &[ClaimItem]) -> Vec<(RecordKey, i64)> {
    batch.iter().map(|c| (c.key.clone(), c.claim)).collect()
}

/// Deletes never-forwarded claims, trying until the database answers.
fn release_in_background(db: Db, claims: Vec<(RecordKey, i64)>) {
    tokio::spawn(async move {
        let routes: Vec<String> = claims.iter().map(|(k, _)| k.route.clone()).collect();
        let keys: Vec<String> = claims.iter().map(|(k, _)| k.key.clone()).collect();
        let ids: Vec<i64> = claims.iter().map(|(_, c)| *c).collect();
        for attempt in 0..SETTLE_TRIES {
            if attempt > 0 {
                tokio::time::sleep(SETTLE_EVERY).await;
            }
            if let Ok(rows) = run(&db, RELEASE_CLAIMS, &[&routes, &keys, &ids]).await {
                if !rows.is_empty() {
                    db.committed(rows.len());
                }
                tracing::info!(
                    claims = ids.len(),
                    freed = rows.len(),
                    "claims that were never forwarded are settled"
                );
                return;
            }
        }
        tracing::error!(
            claims = ids.len(),
            "gave up settling claims that were never forwarded; they stay until a restart or an operator resolves them"
        );
    });
}

/// Runs a batch of outcomes (one per claimed key) and answers each.
pub(super) async fn outcomes(db: Db, batch: Vec<OutcomeItem>) {
    let res = outcome_round(&db, &batch).await;
    crate::failpoint::hit("pg_outcome_batch_answered");
    match res {
        Ok(matched) => {
            let n = matched.iter().filter(|m| **m).count();
            if n > 0 {
                db.committed(n);
                if batch.iter().any(|o| o.op == Op::Done) {
                    crate::failpoint::hit("dedup_done_flushed");
                }
            }
            for (o, m) in batch.into_iter().zip(matched) {
                if let Some(reply) = o.reply {
                    let _ = reply.send(Ok(m));
                }
            }
        }
        Err(e) => {
            let mut again = Vec::with_capacity(batch.len());
            for mut o in batch {
                if let Some(reply) = o.reply.take() {
                    let _ = reply.send(Err(e.clone()));
                }
                again.push(o);
            }
            // Written again whatever the failure: an outcome matches only its
            // own claim still in flight, so a second write changes nothing
            // else — and a batch that never reached a database (no connection
            // while a standby is being promoted) would otherwise leave its keys
            // in flight, refused (409), until a restart.
            write_again_in_background(db, again, &e);
        }
    }
}

async fn outcome_round(db: &Db, batch: &[OutcomeItem]) -> Result<Vec<bool>, BatchError> {
    let n = batch.len();
    let idx: Vec<i32> = (0..n)
        .map(|i| i32::try_from(i).unwrap_or(i32::MAX))
        .collect();
    let routes: Vec<&str> = batch.iter().map(|o| o.key.route.as_str()).collect();
    let keys: Vec<&str> = batch.iter().map(|o| o.key.key.as_str()).collect();
    let shard: Vec<i32> = batch.iter().map(|o| o.shard).collect();
    let gens: Vec<i64> = batch.iter().map(|o| o.generation).collect();
    let ops: Vec<i16> = batch.iter().map(|o| o.op as i16).collect();
    let claims: Vec<Option<i64>> = batch.iter().map(|o| o.claim).collect();
    let updated: Vec<i64> = batch.iter().map(|o| o.updated_ms).collect();
    let status: Vec<Option<i16>> = batch.iter().map(|o| o.status).collect();
    let headers: Vec<Option<&[u8]>> = batch.iter().map(|o| o.headers.as_deref()).collect();
    let bodies: Vec<Option<&[u8]>> = batch.iter().map(|o| o.body.as_deref()).collect();
    let locked = shards_of(shard.iter());
    let rows = run(
        db,
        OUTCOME_BATCH,
        &[
            &locked, &idx, &routes, &keys, &shard, &gens, &ops, &claims, &updated, &status,
            &headers, &bodies,
        ],
    )
    .await?;
    let mut matched = vec![false; n];
    for row in &rows {
        if let Some(m) = row
            .get::<_, Option<i32>>(0)
            .and_then(|i| usize::try_from(i).ok())
            .and_then(|i| matched.get_mut(i))
        {
            *m = true;
        }
    }
    Ok(matched)
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
