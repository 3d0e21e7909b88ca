//! The shared backend: marks and dedup records in PostgreSQL (SPEC §10), which
//! several instances can share.
//!
//! Every transition is one conditional statement, never a read-then-write: a new
//! key is claimed with `INSERT … ON CONFLICT DO NOTHING RETURNING`, an outcome is
//! written only over the caller's own `in_flight` record, a mark only rises. Every
//! write also carries the writer's [`Owner`] and matches no row when
//! `fencegate_owners` holds a newer generation for the shard — so an instance that
//! lost a shard cannot change its state ([`StateError::OwnerLost`]). The write
//! share-locks the shard's owner row while it checks, and a takeover updates that
//! row, so the two serialize: a write of the old generation commits before the
//! takeover's [`StateStore::recover`] looks, or fails (see [`fenced`]).
//!
//! Durability is PostgreSQL's commit: each statement commits on its own
//! (autocommit), and `synchronous_commit` must be on (checked at start-up).
//! Claims and outcomes — two statements per request — go in batches
//! ([`batch`]): the claims of concurrent requests are one statement
//! and one commit, their outcomes another. The rest (marks, take-overs,
//! operators' actions) are one statement each. Statements are prepared once per
//! connection; every call is bounded by `[state] timeout_ms`.
//!
//! A statement whose outcome is unknown (the connection dropped after it was
//! sent) is an error the request sees (503, nothing forwarded) — and is settled
//! afterwards, so that a retry is never forwarded silently and no key stays
//! blocked: a batch's claims are freed, its outcomes written again; a take-over
//! of an existing record is marked `in_doubt`.

mod batch;
mod error;
pub(crate) mod fenced;
mod identity;
mod ownership;
mod record;
pub mod schema;
pub mod set_up_record;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio::sync::oneshot;

use super::gather::Gather;
use super::{
    Begun, CommitStats, End, Generation, LeaseMarks, ListCursor, Listing, Owner, Record, RecordKey,
    Resolution, Resolved, State, StateError, StateStore, StoredResponse, TakeOver,
};
use crate::config::StateConfig;
use crate::epoch::{Epoch, LeaseName};
use batch::{BatchError, ClaimItem, Claimed, Db, Op, OutcomeItem, Write};
use record::{record_of, state_code, RECORD_COLUMNS};
use schema::{epoch_from_sql, epoch_to_sql};

/// The state in PostgreSQL: several instances share it (SPEC §10.2), each write fenced
/// by its [`Owner`].
pub struct PostgresState {
    pool: Pool,
    timeout: Duration,
    healthy: Arc<AtomicBool>,
    commits: Arc<AtomicU64>,
    records: Arc<AtomicU64>,
    /// Claims and outcomes, sent together: one statement, one commit.
    writes: Gather<Write>,
    /// The claim number of each key this process holds in flight (claimed,
    /// outcome not yet written): an outcome is written only over that claim.
    /// A leaf lock, held for an insert or a remove.
    held: Mutex<HashMap<RecordKey, i64>>,
    /// The set-up record this instance started on (SPEC §10: one database,
    /// one set-up); unset when the state was opened without one (tests,
    /// benches).
    set_up: std::sync::OnceLock<set_up_record::Held>,
    /// Why forwarding stopped: the record is no longer this set-up's.
    set_up_problem: Mutex<Option<String>>,
    /// Whether `set_up_problem` is set (read on every request).
    foreign: AtomicBool,
    /// `[state] schema`, as configured.
    config_schema: Option<String>,
    /// The schema in use ([`PostgresState::schema`]).
    schema: String,
}

/// Batches in flight at once: one forming while one is sent, as the sled
/// flusher does.
const BATCH_WORKERS: usize = 1;
/// The most rows in one batch statement.
const BATCH_MAX: usize = 256;

use fenced::owner_ok;

/// The `method` and `path` columns (NULL for a record without them).
fn request_columns(r: &Record) -> (Option<String>, Option<String>) {
    r.request
        .as_ref()
        .map(|q| (q.method.clone(), q.path.clone()))
        .unzip()
}

/// A claim's number: random, so that settling one claim never touches another
/// claim of the same key.
fn new_claim() -> i64 {
    i64::from_be_bytes(crate::entropy::u64().to_be_bytes())
}

impl PostgresState {
    /// Hands `write` to the batch writer and waits for its `answer`; each
    /// failure is said as `what` failing (503, nothing forwarded).
    async fn written<T>(
        &self,
        what: &str,
        write: Write,
        answer: oneshot::Receiver<Result<T, BatchError>>,
    ) -> Result<T, StateError> {
        if self.writes.submit(write).is_err() {
            return Err(StateError::Write(format!(
                "{what}: the database writer has stopped"
            )));
        }
        answer
            .await
            .map_err(|_| StateError::Write(format!("{what}: the batch was lost")))?
            .map_err(|e| batch_error(what, &e))
    }
}

/// A batch's failure as the request sees it (503, nothing forwarded).
fn batch_error(what: &str, e: &BatchError) -> StateError {
    match e {
        BatchError::Refused(d) => StateError::Write(format!("{what}: {d}")),
        BatchError::Unknown(d) => StateError::Write(format!(
            "{what}: {d} (the outcome is unknown; it is settled in the background)"
        )),
    }
}

fn ms(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn shard(o: Owner) -> i32 {
    i32::try_from(o.shard).unwrap_or(i32::MAX)
}

fn generation(o: Owner) -> i64 {
    i64::try_from(o.generation.get()).unwrap_or(i64::MAX)
}

impl PostgresState {
    /// Connects, checks `synchronous_commit`, and creates or migrates the schema.
    pub async fn connect(cfg: &StateConfig) -> Result<Arc<PostgresState>, StateError> {
        let state = PostgresState::open(cfg).await?;
        state.migrate().await?;
        Ok(state)
    }

    /// Creates or migrates the schema (in `[state] schema` when set).
    pub async fn migrate(&self) -> Result<(), StateError> {
        let open = |detail: String| StateError::Open {
            path: "[state] url".into(),
            detail,
        };
        let mut client = self
            .pool
            .get()
            .await
            .map_err(|e| open(format!("cannot reach the database: {e}")))?;
        let found = tokio::time::timeout(
            self.timeout * 5,
            schema::migrate(&mut client, self.config_schema.as_deref()),
        )
        .await
        .map_err(|_| open("the schema migration timed out".into()))??;
        if found < schema::VERSION {
            tracing::info!(
                from = found,
                to = schema::VERSION,
                "PostgreSQL schema migrated"
            );
        }
        Ok(())
    }

    /// The schema fencegate's tables are in: `[state] schema`, else the first
    /// of the connection's `search_path` (normally `public`).
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// `[state] timeout_ms`: every call's bound.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Connects and checks `synchronous_commit`, writing nothing: the schema
    /// is migrated by [`PostgresState::migrate`] (at start-up, once the
    /// database is known to be this set-up's: [`PostgresState::hold_for`]).
    pub async fn open(cfg: &StateConfig) -> Result<Arc<PostgresState>, StateError> {
        let open = |detail: String| StateError::Open {
            path: "[state] url".into(),
            detail,
        };
        let url = cfg.resolved_url().map_err(open)?;
        let mut pg: tokio_postgres::Config = url
            .parse()
            .map_err(|e| open(format!("the connection string does not parse: {e}")))?;
        // Each host gets its share of the timeout: with several hosts (a
        // primary and its standbys, `target_session_attrs=read-write`) a host
        // that swallows connection attempts — a machine gone, not a process
        // refusing — must not use up a request's whole `timeout_ms`, or the
        // hosts after it (the promoted standby) are never tried.
        let hosts = u32::try_from(pg.get_hosts().len().max(1)).unwrap_or(u32::MAX);
        pg.connect_timeout(cfg.timeout() / hosts);
        // Every statement fencegate sends is prepared once per connection and
        // fits one plan whatever its parameters; planning the batch statements
        // anew for each call (PostgreSQL's default for the first executions and
        // whenever it judges the custom plan cheaper) costs more CPU than
        // running them.
        let mut ours = "-c plan_cache_mode=force_generic_plan".to_owned();
        // `[state] schema`: every table, every statement, every migration of
        // this set-up in its own schema (named without quoting: the config
        // allows only lowercase letters, digits and '_').
        if let Some(schema) = &cfg.schema {
            ours.push_str(&format!(" -c search_path={schema}"));
        }
        let options = match pg.get_options() {
            Some(o) if !o.is_empty() => format!("{o} {ours}"),
            _ => ours,
        };
        pg.options(&options);
        if pg.get_application_name().is_none() {
            pg.application_name("fencegate");
        }
        let tls = crate::forward::tls_config(cfg.ca_file.as_deref(), None).map_err(open)?;
        let tls = tokio_postgres_rustls::MakeRustlsConnect::new(tls);
        let manager = Manager::from_config(
            pg,
            tls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(cfg.pool_size)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(cfg.timeout()))
            .create_timeout(Some(cfg.timeout()))
            .recycle_timeout(Some(cfg.timeout()))
            .build()
            .map_err(|e| open(e.to_string()))?;
        let db = Db {
            pool: pool.clone(),
            timeout: cfg.timeout(),
            healthy: Arc::new(AtomicBool::new(true)),
            commits: Arc::new(AtomicU64::new(0)),
            records: Arc::new(AtomicU64::new(0)),
            backends: Arc::default(),
        };
        let state = PostgresState {
            pool,
            timeout: cfg.timeout(),
            healthy: Arc::clone(&db.healthy),
            commits: Arc::clone(&db.commits),
            records: Arc::clone(&db.records),
            writes: Gather::start(BATCH_WORKERS, BATCH_MAX, {
                let db = db.clone();
                move |batch| batch::writes(db.clone(), batch)
            }),
            held: Mutex::new(HashMap::new()),
            set_up: std::sync::OnceLock::new(),
            set_up_problem: Mutex::new(None),
            foreign: AtomicBool::new(false),
            config_schema: cfg.schema.clone(),
            schema: cfg.schema.clone().unwrap_or_default(),
        };
        let client = state
            .pool
            .get()
            .await
            .map_err(|e| open(format!("cannot reach the database: {e}")))?;
        let sync: String = client
            .query_one("SHOW synchronous_commit", &[])
            .await
            .map_err(|e| open(error::describe(&e)))?
            .get(0);
        if sync == "off" {
            return Err(open(
                "synchronous_commit is off: a committed dedup record could be lost in a crash and a delivery repeated; set synchronous_commit = on for fencegate's role or database".into(),
            ));
        }
        let mut state = state;
        if state.config_schema.is_none() {
            // Where unqualified tables are created: the first schema of the
            // search_path that exists (the role's, the url's `options`, or
            // `public`).
            state.schema = client
                .query_one("SELECT COALESCE(current_schema(), 'public')", &[])
                .await
                .map_err(|e| open(error::describe(&e)))?
                .get(0);
        }
        drop(client);
        Ok(Arc::new(state))
    }

    /// Runs `f` with a pooled connection, bounded by the timeout; records health.
    pub(crate) async fn with<T, F, Fut>(&self, what: &'static str, f: F) -> Result<T, StateError>
    where
        F: FnOnce(deadpool_postgres::Object) -> Fut,
        Fut: Future<Output = Result<T, tokio_postgres::Error>>,
    {
        self.with_timeout(what, self.timeout, f).await
    }

    /// [`PostgresState::with`], waiting up to `timeout` for the answer.
    pub(crate) async fn with_timeout<T, F, Fut>(
        &self,
        what: &'static str,
        timeout: Duration,
        f: F,
    ) -> Result<T, StateError>
    where
        F: FnOnce(deadpool_postgres::Object) -> Fut,
        Fut: Future<Output = Result<T, tokio_postgres::Error>>,
    {
        let run = async {
            let client =
                self.pool.get().await.map_err(|e| {
                    StateError::Write(format!("{what}: no database connection: {e}"))
                })?;
            f(client)
                .await
                .map_err(|e| StateError::Write(format!("{what}: {}", error::describe(&e))))
        };
        let res = match tokio::time::timeout(timeout, run).await {
            Ok(r) => r,
            Err(_) => Err(StateError::Write(format!(
                "{what}: no answer from the database within {} ms",
                timeout.as_millis()
            ))),
        };
        self.healthy.store(res.is_ok(), Ordering::Relaxed);
        res
    }

    /// Every write starts here: none while the database's set-up record
    /// names another set-up (SPEC §10) — not a mark, a claim, an outcome, a
    /// sweep, an operator's resolution nor a shard row.
    pub(crate) fn writable(&self) -> Result<(), StateError> {
        match self.set_up_problem() {
            None => Ok(()),
            Some(p) => Err(StateError::Write(format!("not written: {p}"))),
        }
    }

    /// Counts a committed one-record statement.
    fn committed(&self) {
        self.commits.fetch_add(1, Ordering::Relaxed);
        self.records.fetch_add(1, Ordering::Relaxed);
    }

    /// Notes the claim number of a key this process now holds in flight.
    fn hold(&self, key: &RecordKey, claim: i64) {
        if let Ok(mut held) = self.held.lock() {
            held.insert(key.clone(), claim);
        }
    }

    /// The claim number of a key held in flight, no longer held.
    fn unhold(&self, key: &RecordKey) -> Option<i64> {
        self.held.lock().ok().and_then(|mut held| held.remove(key))
    }

    /// After a write matched no row: a newer owner generation, or `other`.
    async fn lost_or(&self, owner: Owner, other: StateError) -> StateError {
        let newer = self
            .with("owner check", |c| async move {
                let st = c
                    .prepare_cached("SELECT generation FROM fencegate_owners WHERE shard = $1")
                    .await?;
                c.query_opt(&st, &[&shard(owner)]).await
            })
            .await;
        match newer {
            Ok(Some(row)) => {
                let stored: i64 = row.get(0);
                match u64::try_from(stored).map(Generation::new) {
                    Ok(stored) if stored > owner.generation => StateError::OwnerLost {
                        ours: owner,
                        stored,
                    },
                    _ => other,
                }
            }
            _ => other,
        }
    }

    /// Claims `key` with `fresh` if it has no record (and no newer owner holds
    /// the shard), in the next claim batch: claimed, or the record that stood
    /// in the way (`None`: one that appeared meanwhile; read it). After an error
    /// nothing is forwarded, and the batch frees whatever it may have claimed.
    async fn claim(
        &self,
        owner: Owner,
        key: &RecordKey,
        fresh: &Record,
    ) -> Result<Result<(), Option<Record>>, StateError> {
        let (method, path) = request_columns(fresh);
        let claim = new_claim();
        let (reply, answer) = oneshot::channel();
        let item = ClaimItem {
            key: key.clone(),
            shard: shard(owner),
            generation: generation(owner),
            fingerprint: fresh.fingerprint.to_vec(),
            epoch: epoch_to_sql(fresh.epoch.get()),
            created_ms: ms(fresh.created_ms),
            method,
            path,
            claim,
            reply,
        };
        let answer = self
            .written("claiming a key", Write::Claim(item), answer)
            .await?;
        match answer {
            Claimed::Yes => {
                self.hold(key, claim);
                Ok(Ok(()))
            }
            Claimed::No {
                existing,
                owner: stored,
            } => match stored.and_then(|g| u64::try_from(g).ok().map(Generation::new)) {
                Some(stored) if stored > owner.generation => Err(StateError::OwnerLost {
                    ours: owner,
                    stored,
                }),
                _ => Ok(Err(existing)),
            },
        }
    }

    /// Best effort after a write whose outcome is unknown: this request's own
    /// `in_flight` record (the one created at `created_ms`, if the write did land
    /// or never changed it) becomes `in_doubt`, so a retry is refused rather than
    /// forwarded.
    async fn mark_in_doubt(&self, owner: Owner, key: &RecordKey, created_ms: u64, now_ms: u64) {
        let sql = format!(
            "UPDATE fencegate_dedup SET state = 2, updated_ms = $3 \
             WHERE route = $1 AND key = $2 AND state = 0 AND owner_generation = $5 \
               AND created_ms = $6 AND {}",
            owner_ok(4, 5)
        );
        let attempt = move |pool: Pool, sql: String, route: String, k: String| async move {
            let c = pool.get().await.map_err(|e| e.to_string())?;
            let st = c.prepare_cached(&sql).await.map_err(|e| e.to_string())?;
            c.execute(
                &st,
                &[
                    &route,
                    &k,
                    &ms(now_ms),
                    &shard(owner),
                    &generation(owner),
                    &ms(created_ms),
                ],
            )
            .await
            .map_err(|e| e.to_string())
        };
        let (route, k) = (key.route.clone(), key.key.clone());
        let first = tokio::time::timeout(
            self.timeout,
            attempt(self.pool.clone(), sql.clone(), route.clone(), k.clone()),
        )
        .await;
        if matches!(first, Ok(Ok(_))) {
            return;
        }
        // The database is away: keep trying in the background, so that the key is
        // listed (and resolvable) as in doubt once it answers again, instead of
        // staying in flight until a restart.
        tracing::warn!(
            route,
            key = k,
            "could not mark a key in doubt after an uncertain write; retrying in the background"
        );
        let (pool, timeout) = (self.pool.clone(), self.timeout);
        tokio::spawn(async move {
            for _ in 0..600 {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let once = attempt(pool.clone(), sql.clone(), route.clone(), k.clone());
                if let Ok(Ok(_)) = tokio::time::timeout(timeout, once).await {
                    tracing::info!(route, key = k, "key marked in doubt");
                    return;
                }
            }
            tracing::error!(route, key = k, "gave up marking a key in doubt; it stays in flight until a restart makes it in doubt");
        });
    }
}

#[async_trait]
impl StateStore for PostgresState {
    async fn marks(&self, lease: &LeaseName) -> Result<LeaseMarks, StateError> {
        let l = lease.as_str().to_owned();
        let row = self
            .with("reading a mark", |c| async move {
                let st = c
                    .prepare_cached("SELECT mark, drained FROM fencegate_marks WHERE lease = $1")
                    .await?;
                c.query_opt(&st, &[&l]).await
            })
            .await?;
        Ok(row.map_or(LeaseMarks::default(), |r| {
            let mark = Epoch::new(epoch_from_sql(r.get(0)));
            LeaseMarks {
                mark,
                drained: Epoch::new(epoch_from_sql(r.get(1))).min(mark),
            }
        }))
    }

    async fn raise_mark(
        &self,
        owner: Owner,
        lease: &LeaseName,
        epoch: Epoch,
    ) -> Result<(), StateError> {
        self.writable()?;
        let sql = format!(
            "INSERT INTO fencegate_marks AS m (lease, shard, mark, drained, owner_generation) \
             SELECT $1, $2, $3, $5, $4 WHERE {} \
             ON CONFLICT (lease) DO UPDATE SET mark = GREATEST(m.mark, EXCLUDED.mark), \
                 owner_generation = EXCLUDED.owner_generation \
             WHERE m.owner_generation <= EXCLUDED.owner_generation \
             RETURNING 1",
            owner_ok(2, 4)
        );
        let l = lease.as_str().to_owned();
        let row = self
            .with("raising a mark", |c| async move {
                let st = c.prepare_cached(&sql).await?;
                c.query_opt(
                    &st,
                    &[
                        &l,
                        &shard(owner),
                        &epoch_to_sql(epoch.get()),
                        &generation(owner),
                        &epoch_to_sql(0),
                    ],
                )
                .await
            })
            .await?;
        match row {
            Some(_) => {
                self.committed();
                crate::failpoint::hit("mark_flushed");
                Ok(())
            }
            None => Err(self
                .lost_or(
                    owner,
                    StateError::OwnerLost {
                        ours: owner,
                        stored: owner.generation.next(),
                    },
                )
                .await),
        }
    }

    async fn note_drained(
        &self,
        owner: Owner,
        lease: &LeaseName,
        epoch: Epoch,
    ) -> Result<(), StateError> {
        self.writable()?;
        let sql = format!(
            "UPDATE fencegate_marks SET drained = GREATEST(drained, $2) \
             WHERE lease = $1 AND owner_generation <= $4 AND {}",
            owner_ok(3, 4)
        );
        let l = lease.as_str().to_owned();
        self.with("recording a drain", |c| async move {
            let st = c.prepare_cached(&sql).await?;
            c.execute(
                &st,
                &[
                    &l,
                    &epoch_to_sql(epoch.get()),
                    &shard(owner),
                    &generation(owner),
                ],
            )
            .await
        })
        .await
        .map(|_| self.committed())
    }

    async fn begin(
        &self,
        owner: Owner,
        key: &RecordKey,
        fresh: &Record,
        rules: TakeOver,
    ) -> Result<Begun, StateError> {
        self.writable()?;
        for _ in 0..8 {
            // The key exists (or a newer owner holds the shard): take it over
            // only by the exact version seen.
            let existing = match self.claim(owner, key, fresh).await? {
                Ok(()) => return Ok(Begun::Claimed),
                Err(Some(existing)) => existing,
                // Inserted by a batch that committed while ours ran: read it.
                Err(None) => match self.get(key).await? {
                    Some(existing) => existing,
                    // Gone again (an operator's "not delivered", a freed claim,
                    // a sweep): claim again.
                    None => continue,
                },
            };
            let Some(write) = existing.taken_over_by(fresh, &rules) else {
                return Ok(Begun::Exists(existing));
            };
            let update = format!(
                "UPDATE fencegate_dedup SET state = 0, fingerprint = $3, epoch = $4, \
                   owner_generation = $6, shard = $5, created_ms = $7, updated_ms = $8, \
                   status = NULL, header_names = NULL, header_values = NULL, body = NULL, \
                   headers = NULL, method = $12, path = $13, claim = $14 \
                 WHERE route = $1 AND key = $2 AND state = $9 AND updated_ms = $10 \
                   AND fingerprint = $11 AND {}",
                owner_ok(5, 6)
            );
            let (route, k) = (key.route.clone(), key.key.clone());
            let (fp, old_fp) = (write.fingerprint.to_vec(), existing.fingerprint.to_vec());
            let (method, path) = request_columns(&write);
            let claim = new_claim();
            let n = self
                .with("taking over a key", |c| async move {
                    let st = c.prepare_cached(&update).await?;
                    c.execute(
                        &st,
                        &[
                            &route,
                            &k,
                            &fp,
                            &epoch_to_sql(write.epoch.get()),
                            &shard(owner),
                            &generation(owner),
                            &ms(write.created_ms),
                            &ms(write.updated_ms),
                            &state_code(existing.state),
                            &ms(existing.updated_ms),
                            &old_fp,
                            &method,
                            &path,
                            &claim,
                        ],
                    )
                    .await
                })
                .await;
            match n {
                Ok(1) => {
                    self.committed();
                    self.hold(key, claim);
                    crate::failpoint::hit("dedup_in_flight_flushed");
                    return Ok(Begun::Claimed);
                }
                Ok(_) => {
                    // Matched nothing: a newer owner holds the shard, or the record
                    // changed under us (then look again).
                    let why = StateError::Write(String::new());
                    if let e @ StateError::OwnerLost { .. } = self.lost_or(owner, why).await {
                        return Err(e);
                    }
                }
                Err(e) => {
                    self.mark_in_doubt(owner, key, write.created_ms, write.updated_ms)
                        .await;
                    return Err(e);
                }
            }
        }
        Err(StateError::Write(
            "the key kept changing while claiming it; retry".into(),
        ))
    }

    async fn finish(&self, owner: Owner, key: &RecordKey, end: End) -> Result<(), StateError> {
        self.writable()?;
        let (op, updated, response) = match end {
            // A failed delete (nothing was sent) leaves the key in flight
            // until it is written again: only a liveness cost.
            End::Delete => (Op::Delete, 0, None),
            End::InDoubt(r) => (Op::InDoubt, r.updated_ms, None),
            End::Done(r) => (
                Op::Done,
                r.updated_ms,
                Some(r.response.unwrap_or(StoredResponse {
                    status: 0,
                    headers: Vec::new(),
                    body: None,
                })),
            ),
        };
        let (reply, answer) = oneshot::channel();
        let item = OutcomeItem {
            key: key.clone(),
            shard: shard(owner),
            generation: generation(owner),
            op,
            claim: self.unhold(key),
            updated_ms: ms(updated),
            status: response
                .as_ref()
                .map(|r| i16::try_from(r.status).unwrap_or(0)),
            headers: response
                .as_ref()
                .map(|r| super::codec::encode_headers(&r.headers)),
            body: response.and_then(|r| r.body).map(|b| b.to_vec()),
            reply: Some(reply),
        };
        let matched = self
            .written("recording an outcome", Write::Outcome(item), answer)
            .await?;
        if matched {
            return Ok(());
        }
        Err(self
            .lost_or(
                owner,
                StateError::Write(
                    "the key's record is no longer this request's in-flight record".into(),
                ),
            )
            .await)
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StateError> {
        let (route, k) = (key.route.clone(), key.key.clone());
        let row = self
            .with("reading a record", |c| async move {
                let st = c
                    .prepare_cached(&format!(
                        "SELECT {RECORD_COLUMNS} FROM fencegate_dedup WHERE route = $1 AND key = $2"
                    ))
                    .await?;
                c.query_opt(&st, &[&route, &k]).await
            })
            .await?;
        Ok(row.as_ref().and_then(record_of))
    }

    async fn resolve(
        &self,
        owner: Owner,
        key: &RecordKey,
        how: Resolution,
        now_ms: u64,
    ) -> Result<Resolved, StateError> {
        self.writable()?;
        let cond = format!(
            "route = $1 AND key = $2 AND state = 2 AND {}",
            owner_ok(3, 4)
        );
        let sql = match how {
            Resolution::NotDelivered => format!("DELETE FROM fencegate_dedup WHERE {cond}"),
            // `updated_ms`: the record's retention starts now (`Record::delivered`).
            Resolution::Delivered => format!(
                "UPDATE fencegate_dedup SET state = 1, updated_ms = $5, status = NULL, \
                   header_names = NULL, header_values = NULL, body = NULL WHERE {cond}"
            ),
        };
        let (route, k) = (key.route.clone(), key.key.clone());
        let (sh, gen) = (shard(owner), generation(owner));
        let n = self
            .with("resolving a key", |c| async move {
                let st = c.prepare_cached(&sql).await?;
                match how {
                    Resolution::NotDelivered => c.execute(&st, &[&route, &k, &sh, &gen]).await,
                    Resolution::Delivered => {
                        c.execute(&st, &[&route, &k, &sh, &gen, &ms(now_ms)]).await
                    }
                }
            })
            .await?;
        if n == 1 {
            self.committed();
            return Ok(match how {
                Resolution::Delivered => Resolved::Done,
                Resolution::NotDelivered => Resolved::Deleted,
            });
        }
        match self.get(key).await? {
            None => Ok(Resolved::Missing),
            Some(r) if r.state != State::InDoubt => Ok(Resolved::NotInDoubt(r.state)),
            Some(_) => Err(self
                .lost_or(owner, StateError::Write("the record changed; retry".into()))
                .await),
        }
    }

    async fn list(
        &self,
        state: State,
        route: Option<&str>,
        after: Option<&ListCursor>,
        limit: usize,
    ) -> Result<Listing, StateError> {
        let route = route.map(str::to_owned);
        let (after_ms, after_route, after_key) = after
            .map_or((-1, String::new(), String::new()), |a| {
                (ms(a.created_ms), a.key.route.clone(), a.key.key.clone())
            });
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        // The state is written into the statement, not passed: each state's
        // index is partial, and a generic plan for `state = $1` could use none.
        let code = state_code(state);
        let (rows, total) = self
            .with("listing records", |c| async move {
                let page = c
                    .prepare_cached(&format!(
                        "SELECT {RECORD_COLUMNS}, route, key FROM fencegate_dedup \
                         WHERE state = {code} AND ($1::text IS NULL OR route = $1) \
                           AND (created_ms, route, key) > ($2, $3, $4) \
                         ORDER BY created_ms, route, key LIMIT $5"
                    ))
                    .await?;
                let count = c
                    .prepare_cached(&format!(
                        "SELECT count(*) FROM fencegate_dedup \
                         WHERE state = {code} AND ($1::text IS NULL OR route = $1)"
                    ))
                    .await?;
                let rows = c
                    .query(
                        &page,
                        &[&route, &after_ms, &after_route, &after_key, &limit],
                    )
                    .await?;
                let total: i64 = c.query_one(&count, &[&route]).await?.get(0);
                Ok((rows, total))
            })
            .await?;
        let records = rows
            .iter()
            .filter_map(|r| {
                Some((
                    RecordKey {
                        route: r.get(12),
                        key: r.get(13),
                    },
                    record_of(r)?,
                ))
            })
            .collect();
        Ok(Listing {
            records,
            total: u64::try_from(total).unwrap_or(0),
        })
    }

    async fn sweep(&self, rules: TakeOver) -> Result<usize, StateError> {
        self.writable()?;
        const BATCH: i64 = 1000;
        let before = ms(rules.done_before_ms);
        let mut total = 0;
        loop {
            let n = self
                .with("sweeping expired records", |c| async move {
                    let st = c
                        .prepare_cached(
                            // Through the done index, by claim time (the
                            // order steers a generic plan to it): a record
                            // done before the cut-off was claimed before it
                            // (schema 13). Where a clock stepped back between
                            // claim and outcome (or an operator resolved on a
                            // member whose clock is behind the claimant's),
                            // `updated_ms` is the earlier: such a record is
                            // no longer answered from (`Record::expired` reads
                            // `updated_ms`) but stays, listed as done, until
                            // its claim time passes the cut-off — never swept
                            // sooner than before.
                            "DELETE FROM fencegate_dedup WHERE ctid = ANY(ARRAY(\
                               SELECT ctid FROM fencegate_dedup \
                               WHERE state = 1 AND created_ms < $1 AND updated_ms < $1 \
                               ORDER BY created_ms LIMIT $2))",
                        )
                        .await?;
                    c.execute(&st, &[&before, &BATCH]).await
                })
                .await?;
            self.committed();
            total += usize::try_from(n).unwrap_or(0);
            if n < BATCH as u64 {
                return Ok(total);
            }
        }
    }

    async fn recover(&self, owner: Owner, now_ms: u64) -> Result<usize, StateError> {
        self.writable()?;
        let single = owner == Owner::SINGLE;
        let n = self
            .with("recovering in-flight records", |c| async move {
                let st = c
                    .prepare_cached(
                        "UPDATE fencegate_dedup SET state = 2, updated_ms = $3 \
                         WHERE state = 0 AND shard = $1 AND (owner_generation < $2 OR $4)",
                    )
                    .await?;
                c.execute(
                    &st,
                    &[&shard(owner), &generation(owner), &ms(now_ms), &single],
                )
                .await
            })
            .await?;
        self.committed();
        Ok(usize::try_from(n).unwrap_or(usize::MAX))
    }

    async fn claim_shard(&self, owner: Owner) -> Result<(), StateError> {
        self.writable()?;
        // The conflict's row is locked (FOR NO KEY UPDATE) before its WHERE is
        // looked at: this waits for every write holding the owner row share-locked
        // (`fenced::owner_ok`), so none of the old generation commits after it.
        let (sh, gen) = (shard(owner), generation(owner));
        let stored: i64 = self
            .with("claiming a shard", |c| async move {
                let st = c
                    .prepare_cached(
                        "INSERT INTO fencegate_owners AS o (shard, generation) VALUES ($1, $2) \
                         ON CONFLICT (shard) DO UPDATE SET generation = EXCLUDED.generation \
                         WHERE o.generation < EXCLUDED.generation \
                         RETURNING generation",
                    )
                    .await?;
                match c.query_opt(&st, &[&sh, &gen]).await? {
                    Some(row) => Ok(row.get(0)),
                    None => {
                        let st = c
                            .prepare_cached(
                                "SELECT generation FROM fencegate_owners WHERE shard = $1",
                            )
                            .await?;
                        Ok(c.query_one(&st, &[&sh]).await?.get(0))
                    }
                }
            })
            .await?;
        self.committed();
        match u64::try_from(stored).map(Generation::new) {
            Ok(s) if s > owner.generation => Err(StateError::OwnerLost {
                ours: owner,
                stored: s,
            }),
            _ => Ok(()),
        }
    }

    fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    fn set_up_conflict(&self) -> Option<String> {
        self.set_up_problem()
    }

    async fn check(&self) -> Result<(), StateError> {
        self.with("readiness check", |c| async move {
            c.simple_query("SELECT 1").await.map(drop)
        })
        .await
    }

    fn stats(&self) -> CommitStats {
        // Each statement is its own commit; a batch writes several records.
        CommitStats {
            batches: self.commits.load(Ordering::Relaxed),
            records: self.records.load(Ordering::Relaxed),
        }
    }

    async fn close(&self) -> Result<(), StateError> {
        self.pool.close();
        Ok(())
    }
}
