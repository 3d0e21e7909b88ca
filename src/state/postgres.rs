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
//! takeover's [`StateStore::recover`] looks, or fails (see `OWNER_OK`).
//!
//! Durability is PostgreSQL's commit: each statement commits on its own
//! (autocommit), and `synchronous_commit` must be on (checked at start-up).
//! Concurrent commits share WAL flushes inside the server, so requests use the
//! pool's connections side by side. Statements are prepared once per connection;
//! every call is bounded by `[state] timeout_ms`.
//!
//! A statement whose outcome is unknown (the connection dropped after it was
//! sent) is an error the request sees (503, nothing forwarded) — and the key it
//! may have claimed or finished is then marked `in_doubt` if it can be, so that a
//! retry is never forwarded silently.

mod ownership;

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::Row;

use super::schema::{self, epoch_from_sql, epoch_to_sql};
use super::{
    Begun, CommitStats, End, LeaseMarks, ListCursor, Listing, Owner, Record, RecordKey,
    RequestLine, Resolution, Resolved, State, StateError, StateStore, StoredResponse, TakeOver,
};
use crate::config::StateConfig;
use crate::epoch::{Epoch, LeaseName};

/// The state in PostgreSQL: several instances share it (SPEC §10.2), each write fenced
/// by its [`Owner`].
pub struct PostgresState {
    pool: Pool,
    timeout: Duration,
    healthy: AtomicBool,
    commits: AtomicU64,
}

/// No newer generation holds the shard (`$SHARD`, `$GEN` are the writer's), and
/// the shard's owner row stays share-locked until the write commits.
///
/// The lock is what makes the check hold at commit and not only at the
/// statement's start: under READ COMMITTED a check alone reads the statement's
/// snapshot, so a deposed owner's claim could pass it, commit after the
/// successor's [`StateStore::recover`] had looked, and leave its key in flight
/// under the old generation — refused (409) until the next takeover, and not
/// resolvable (issue 25). [`StateStore::claim_shard`] updates the row, which
/// waits for every share lock: a write either commits before the takeover (and
/// `recover` sees it) or waits for it and then sees the new generation. The
/// locked read is a scalar subquery whose only condition is the shard, so the
/// row is locked whatever its generation (a filter on the generation inside it
/// would skip the lock exactly when the write goes ahead). No row (a single
/// instance, or a shard never claimed): nothing to lock, nothing newer.
const OWNER_OK: &str = "COALESCE((SELECT o.generation FROM fencegate_owners o \
     WHERE o.shard = $SHARD FOR SHARE), 0) <= $GEN";

fn owner_ok(shard: usize, generation: usize) -> String {
    OWNER_OK
        .replace("$SHARD", &format!("${shard}"))
        .replace("$GEN", &format!("${generation}"))
}

fn state_code(s: State) -> i16 {
    match s {
        State::InFlight => 0,
        State::Done => 1,
        State::InDoubt => 2,
    }
}

fn state_of(code: i16) -> Option<State> {
    match code {
        0 => Some(State::InFlight),
        1 => Some(State::Done),
        2 => Some(State::InDoubt),
        _ => None,
    }
}

const RECORD_COLUMNS: &str =
    "state, fingerprint, epoch, created_ms, updated_ms, status, header_names, header_values, body, method, path";

fn record_of(row: &Row) -> Option<Record> {
    let fingerprint: Vec<u8> = row.get(1);
    let status: Option<i16> = row.get(5);
    let names: Option<Vec<String>> = row.get(6);
    let values: Option<Vec<Vec<u8>>> = row.get(7);
    let body: Option<Vec<u8>> = row.get(8);
    let method: Option<String> = row.get(9);
    let path: Option<String> = row.get(10);
    let state = state_of(row.get(0))?;
    Some(Record {
        state,
        fingerprint: fingerprint.try_into().ok()?,
        epoch: Epoch::new(epoch_from_sql(row.get(2))),
        created_ms: u64::try_from(row.get::<_, i64>(3)).ok()?,
        updated_ms: u64::try_from(row.get::<_, i64>(4)).ok()?,
        response: status.map(|s| StoredResponse {
            status: u16::try_from(s).unwrap_or(0),
            headers: names
                .unwrap_or_default()
                .into_iter()
                .zip(values.unwrap_or_default())
                .collect(),
            body: body.map(Bytes::from),
        }),
        request: method
            .zip(path)
            .map(|(method, path)| RequestLine { method, path }),
    })
}

/// The `method` and `path` columns (NULL for a record without them).
fn request_columns(r: &Record) -> (Option<String>, Option<String>) {
    r.request
        .as_ref()
        .map(|q| (q.method.clone(), q.path.clone()))
        .unzip()
}

fn ms(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn shard(o: Owner) -> i32 {
    i32::try_from(o.shard).unwrap_or(i32::MAX)
}

fn generation(o: Owner) -> i64 {
    i64::try_from(o.generation).unwrap_or(i64::MAX)
}

impl PostgresState {
    /// Connects, checks `synchronous_commit`, and creates or migrates the schema.
    pub async fn connect(cfg: &StateConfig) -> Result<Arc<PostgresState>, StateError> {
        let open = |detail: String| StateError::Open {
            path: "[state] url".into(),
            detail,
        };
        let url = cfg.resolved_url().map_err(open)?;
        let mut pg: tokio_postgres::Config = url
            .parse()
            .map_err(|e| open(format!("the connection string does not parse: {e}")))?;
        pg.connect_timeout(cfg.timeout());
        if pg.get_application_name().is_none() {
            pg.application_name("fencegate");
        }
        let tls = crate::forward::tls_config(cfg.ca_file.as_deref()).map_err(open)?;
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
        let state = PostgresState {
            pool,
            timeout: cfg.timeout(),
            healthy: AtomicBool::new(true),
            commits: AtomicU64::new(0),
        };
        let mut client = state
            .pool
            .get()
            .await
            .map_err(|e| open(format!("cannot reach the database: {e}")))?;
        let sync: String = client
            .query_one("SHOW synchronous_commit", &[])
            .await
            .map_err(|e| open(e.to_string()))?
            .get(0);
        if sync == "off" {
            return Err(open(
                "synchronous_commit is off: a committed dedup record could be lost in a crash and a delivery repeated; set synchronous_commit = on for fencegate's role or database".into(),
            ));
        }
        let found = tokio::time::timeout(cfg.timeout() * 5, schema::migrate(&mut client))
            .await
            .map_err(|_| open("the schema migration timed out".into()))??;
        if found < schema::VERSION {
            tracing::info!(
                from = found,
                to = schema::VERSION,
                "PostgreSQL schema migrated"
            );
        }
        drop(client);
        Ok(Arc::new(state))
    }

    /// Runs `f` with a pooled connection, bounded by the timeout; records health.
    async fn with<T, F, Fut>(&self, what: &'static str, f: F) -> Result<T, StateError>
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
                .map_err(|e| StateError::Write(format!("{what}: {e}")))
        };
        let res = match tokio::time::timeout(self.timeout, run).await {
            Ok(r) => r,
            Err(_) => Err(StateError::Write(format!(
                "{what}: no answer from the database within {} ms",
                self.timeout.as_millis()
            ))),
        };
        self.healthy.store(res.is_ok(), Ordering::Relaxed);
        res
    }

    /// Counts a committed write (each statement is its own commit).
    fn committed(&self) {
        self.commits.fetch_add(1, Ordering::Relaxed);
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
                match u64::try_from(stored) {
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
    /// the shard): whether it did. After an error the claim may have landed: it
    /// is marked in doubt if it can be.
    async fn insert_claim(
        &self,
        owner: Owner,
        key: &RecordKey,
        fresh: &Record,
    ) -> Result<bool, StateError> {
        let insert = format!(
            "INSERT INTO fencegate_dedup \
               (route, key, shard, state, fingerprint, epoch, owner_generation, created_ms, updated_ms, method, path) \
             SELECT $1, $2, $3, 0, $4, $5, $6, $7, $7, $8, $9 WHERE {} \
             ON CONFLICT (route, key) DO NOTHING RETURNING 1",
            owner_ok(3, 6)
        );
        let (route, k) = (key.route.clone(), key.key.clone());
        let fp = fresh.fingerprint.to_vec();
        let (epoch, created) = (epoch_to_sql(fresh.epoch.get()), ms(fresh.created_ms));
        let (method, path) = request_columns(fresh);
        let claimed = self
            .with("claiming a key", |c| async move {
                let st = c.prepare_cached(&insert).await?;
                c.query_opt(
                    &st,
                    &[
                        &route,
                        &k,
                        &shard(owner),
                        &fp,
                        &epoch,
                        &generation(owner),
                        &created,
                        &method,
                        &path,
                    ],
                )
                .await
            })
            .await;
        match claimed {
            Ok(Some(_)) => {
                self.committed();
                crate::failpoint::hit("dedup_in_flight_flushed");
                Ok(true)
            }
            Ok(None) => Ok(false),
            Err(e) => {
                self.mark_in_doubt(owner, key, fresh.created_ms, fresh.created_ms)
                    .await;
                Err(e)
            }
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
                        stored: owner.generation.saturating_add(1),
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
        if self.insert_claim(owner, key, fresh).await? {
            return Ok(Begun::Claimed);
        }
        // The key exists (or a newer owner holds the shard): look, and take over
        // only the exact version seen.
        for _ in 0..8 {
            let Some(existing) = self.get(key).await? else {
                // Gone since the insert found it (an operator's "not delivered",
                // a freed claim, a sweep), or a newer owner holds the shard.
                let why = StateError::Write(String::new());
                if let e @ StateError::OwnerLost { .. } = self.lost_or(owner, why).await {
                    return Err(e);
                }
                if self.insert_claim(owner, key, fresh).await? {
                    return Ok(Begun::Claimed);
                }
                continue;
            };
            let Some(write) = existing.taken_over_by(fresh, &rules) else {
                return Ok(Begun::Exists(existing));
            };
            let update = format!(
                "UPDATE fencegate_dedup SET state = 0, fingerprint = $3, epoch = $4, \
                   owner_generation = $6, shard = $5, created_ms = $7, updated_ms = $8, \
                   status = NULL, header_names = NULL, header_values = NULL, body = NULL, \
                   method = $12, path = $13 \
                 WHERE route = $1 AND key = $2 AND state = $9 AND updated_ms = $10 \
                   AND fingerprint = $11 AND {}",
                owner_ok(5, 6)
            );
            let (route, k) = (key.route.clone(), key.key.clone());
            let (fp, old_fp) = (write.fingerprint.to_vec(), existing.fingerprint.to_vec());
            let (method, path) = request_columns(&write);
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
                        ],
                    )
                    .await
                })
                .await;
            match n {
                Ok(1) => {
                    self.committed();
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
        let cond = format!(
            "route = $1 AND key = $2 AND state = 0 AND owner_generation = $4 AND {}",
            owner_ok(3, 4)
        );
        let (route, k) = (key.route.clone(), key.key.clone());
        let (sh, gen) = (shard(owner), generation(owner));
        // (created, now) of the record, to mark it in doubt after an uncertain write.
        let mut mine = None;
        let n = match end {
            End::Delete => {
                let sql = format!("DELETE FROM fencegate_dedup WHERE {cond}");
                self.with("freeing a key", |c| async move {
                    let st = c.prepare_cached(&sql).await?;
                    c.execute(&st, &[&route, &k, &sh, &gen]).await
                })
                .await
            }
            End::InDoubt(r) => {
                mine = Some((r.created_ms, r.updated_ms));
                let sql =
                    format!("UPDATE fencegate_dedup SET state = 2, updated_ms = $5 WHERE {cond}");
                self.with("recording an unknown outcome", |c| async move {
                    let st = c.prepare_cached(&sql).await?;
                    c.execute(&st, &[&route, &k, &sh, &gen, &ms(r.updated_ms)])
                        .await
                })
                .await
            }
            End::Done(r) => {
                mine = Some((r.created_ms, r.updated_ms));
                let sql = format!(
                    "UPDATE fencegate_dedup SET state = 1, updated_ms = $5, status = $6, \
                       header_names = $7, header_values = $8, body = $9 WHERE {cond}"
                );
                let resp = r.response.unwrap_or(StoredResponse {
                    status: 0,
                    headers: Vec::new(),
                    body: None,
                });
                let status = i16::try_from(resp.status).unwrap_or(0);
                let (names, values): (Vec<String>, Vec<Vec<u8>>) = resp.headers.into_iter().unzip();
                let body = resp.body.map(|b| b.to_vec());
                let n = self
                    .with("recording a response", |c| async move {
                        let st = c.prepare_cached(&sql).await?;
                        c.execute(
                            &st,
                            &[
                                &route,
                                &k,
                                &sh,
                                &gen,
                                &ms(r.updated_ms),
                                &status,
                                &names,
                                &values,
                                &body,
                            ],
                        )
                        .await
                    })
                    .await;
                if n.is_ok() {
                    crate::failpoint::hit("dedup_done_flushed");
                }
                n
            }
        };
        match n {
            Ok(1) => {
                self.committed();
                Ok(())
            }
            Ok(_) => Err(self
                .lost_or(
                    owner,
                    StateError::Write(
                        "the key's record is no longer this request's in-flight record".into(),
                    ),
                )
                .await),
            Err(e) => {
                // A failed delete (nothing was sent) leaves the key in flight
                // until a restart: only a liveness cost.
                if let Some((created, now)) = mine {
                    self.mark_in_doubt(owner, key, created, now).await;
                }
                Err(e)
            }
        }
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
        let code = state_code(state);
        let (rows, total) = self
            .with("listing records", |c| async move {
                let page = c
                    .prepare_cached(&format!(
                        "SELECT {RECORD_COLUMNS}, route, key FROM fencegate_dedup \
                         WHERE state = $1 AND ($2::text IS NULL OR route = $2) \
                           AND (created_ms, route, key) > ($3, $4, $5) \
                         ORDER BY created_ms, route, key LIMIT $6"
                    ))
                    .await?;
                let count = c
                    .prepare_cached(
                        "SELECT count(*) FROM fencegate_dedup \
                         WHERE state = $1 AND ($2::text IS NULL OR route = $2)",
                    )
                    .await?;
                let rows = c
                    .query(
                        &page,
                        &[&code, &route, &after_ms, &after_route, &after_key, &limit],
                    )
                    .await?;
                let total: i64 = c.query_one(&count, &[&code, &route]).await?.get(0);
                Ok((rows, total))
            })
            .await?;
        let records = rows
            .iter()
            .filter_map(|r| {
                Some((
                    RecordKey {
                        route: r.get(11),
                        key: r.get(12),
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
        const BATCH: i64 = 1000;
        let before = ms(rules.done_before_ms);
        let mut total = 0;
        loop {
            let n = self
                .with("sweeping expired records", |c| async move {
                    let st = c
                        .prepare_cached(
                            "DELETE FROM fencegate_dedup WHERE ctid = ANY(ARRAY(\
                               SELECT ctid FROM fencegate_dedup \
                               WHERE state = 1 AND updated_ms < $1 LIMIT $2))",
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
        // The conflict's row is locked (FOR NO KEY UPDATE) before its WHERE is
        // looked at: this waits for every write holding the owner row share-locked
        // (`OWNER_OK`), so none of the old generation commits after it.
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
        match u64::try_from(stored) {
            Ok(s) if s > owner.generation => Err(StateError::OwnerLost {
                ours: owner,
                stored: s,
            }),
            _ => Ok(()),
        }
    }

    async fn heartbeat(&self, id: &str, ttl: Duration) -> Result<Vec<String>, StateError> {
        let secs = ttl.as_secs_f64();
        let rows = self
            .with("cluster heartbeat", |c| async move {
                let st = c
                    .prepare_cached(
                        "INSERT INTO fencegate_members (instance_id, seen_at) VALUES ($1, now()) \
                         ON CONFLICT (instance_id) DO UPDATE SET seen_at = now()",
                    )
                    .await?;
                c.execute(&st, &[&id]).await?;
                let st = c
                    .prepare_cached(
                        "SELECT instance_id FROM fencegate_members \
                         WHERE seen_at > now() - make_interval(secs => $1) ORDER BY instance_id",
                    )
                    .await?;
                c.query(&st, &[&secs]).await
            })
            .await?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    async fn owner_rows(&self) -> Result<Vec<super::OwnerRow>, StateError> {
        self.rows_of_owners().await
    }

    async fn take_shard(
        &self,
        shard: u32,
        seen: Option<(u64, u64)>,
        id: &str,
        advertise: &str,
        ttl: Duration,
    ) -> Result<Option<u64>, StateError> {
        self.take(shard, seen, id, advertise, ttl).await
    }

    async fn renew_shards(
        &self,
        id: &str,
        held: &[(u32, u64)],
        ttl: Duration,
    ) -> Result<Vec<(u32, u64, u64)>, StateError> {
        self.renew(id, held, ttl).await
    }

    async fn release_shard(
        &self,
        id: &str,
        shard: u32,
        generation: u64,
    ) -> Result<bool, StateError> {
        self.release(id, shard, generation).await
    }

    async fn beat(&self, id: &str) -> Result<Vec<(String, u64)>, StateError> {
        self.count_beat(id).await
    }

    async fn leave(&self, id: &str) -> Result<(), StateError> {
        self.with("leaving the cluster", |c| async move {
            let st = c
                .prepare_cached("DELETE FROM fencegate_members WHERE instance_id = $1")
                .await?;
            c.execute(&st, &[&id]).await
        })
        .await
        .map(drop)
    }

    fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    async fn check(&self) -> Result<(), StateError> {
        self.with("readiness check", |c| async move {
            c.simple_query("SELECT 1").await.map(drop)
        })
        .await
    }

    fn stats(&self) -> CommitStats {
        // Each statement is its own commit; PostgreSQL groups their WAL flushes.
        let n = self.commits.load(Ordering::Relaxed);
        CommitStats {
            batches: n,
            records: n,
        }
    }

    async fn close(&self) -> Result<(), StateError> {
        self.pool.close();
        Ok(())
    }
}
