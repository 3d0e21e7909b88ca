//! The queue's records in PostgreSQL (SPEC §11 in a cluster, or a single
//! instance on PostgreSQL): `fencegate_queue` (a row per message, its request
//! kept once) and `fencegate_queue_leases` (per lease, the next place and the
//! newest epoch of which a message was sent).
//!
//! Every write is one transaction that, last before its COMMIT, share-locks the
//! shard's owner row and checks that no newer generation holds it (as dedup
//! writes do, [`crate::state::postgres`]): a takeover's `claim_shard` updates
//! that row, so a write of the deposed owner either commits before the
//! takeover — and the successor reads it — or fails with
//! [`StateError::OwnerLost`]; its attempt is then never started. Acceptances,
//! attempts and an operator's requeue lock the lease's row of
//! `fencegate_queue_leases` first: places of one lease are taken one at a
//! time, in the order the rows are locked.
//!
//! Why the owner row last, and why a transaction may not idle: a renewal
//! updates that row and must never wait long behind queue writes. Taken first,
//! every acceptance waiting for its lease's row would hold the share lock
//! meanwhile, and a busy lease would starve the owner's renewals until it
//! self-fenced; and an owner stalled mid-transaction (paused, cut off) would
//! keep the row from its successor for as long as its session lived. So locks
//! are taken lease row → message row → owner row, the owner row held only for
//! the last statement and the COMMIT, and each transaction sets
//! `idle_in_transaction_session_timeout` (half of `[state] timeout_ms`): a
//! stalled writer's session is ended, and its locks released, by the server.
//!
//! A write runs in a task of its own: a request that goes away (a client
//! disconnecting, a pass aborted) does not cut a transaction halfway, whose
//! outcome would then be unknown.
//!
//! Acceptances of one lease are combined: the lease's row is held from the
//! place taken to the COMMIT, so one transaction at a time could accept only
//! one message per commit. Requests that arrive while their lease's
//! transaction runs wait and go together in the next one (up to
//! [`BATCH`], and 4 MiB of requests: a batch shares one `[state]
//! timeout_ms`), each asked whether it is still admitted once the row is held,
//! in the order they arrived: the rules above apply to every message of the
//! batch as they did to one.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use deadpool_postgres::Object;
use tokio_postgres::Transaction;

use super::message::{Accepted, Envelope, Listing, Message, Requeued, Status};
use crate::state::gather::ByKey;
use crate::state::postgres::schema::{epoch_from_sql, epoch_to_sql};
use crate::state::postgres::PostgresState;
use crate::state::{Owner, StateError};

/// The queue in PostgreSQL.
#[derive(Clone)]
pub struct PgQueue {
    db: Arc<PostgresState>,
    /// Per lease and owner, the acceptances waiting for the lease's next
    /// transaction (group commit, one transaction of a lease at a time).
    accepting: Arc<ByKey<(String, Owner), Waiting>>,
}

/// Whether a pass is still admitted (asked once its lease's row is held).
type Admitted = Arc<dyn Fn() -> bool + Send + Sync>;

/// At most this many acceptances of a lease share a transaction.
pub const BATCH: usize = 64;

/// At most this many bytes of requests share a transaction (past its first).
const BATCH_BYTES: usize = 4 << 20;

/// An acceptance waiting for its lease's transaction.
struct Waiting {
    msg: Message,
    request: Vec<u8>,
    admitted: Admitted,
    answer: tokio::sync::oneshot::Sender<Result<Accepted, StateError>>,
}

fn i64_of(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn decode(raw: &str) -> Result<Message, StateError> {
    serde_json::from_str(raw).map_err(|e| StateError::Write(format!("a queued message: {e}")))
}

fn encode(m: &Message) -> String {
    serde_json::to_string(m).unwrap_or_default()
}

/// Why a write did not go: not an error of the database.
enum Refused {
    /// A newer generation holds the shard.
    Lost(crate::state::Generation),
    /// The message's row is unreadable, or gone.
    Unreadable(&'static str),
}

type TxResult<T> = Result<Result<T, Refused>, tokio_postgres::Error>;

/// The owner check ([`crate::state::postgres::fenced::owner_holds`]), as a
/// refusal of this module's transactions.
async fn owner_holds(tx: &Transaction<'_>, owner: Owner) -> TxResult<()> {
    Ok(crate::state::postgres::fenced::owner_holds(tx, owner)
        .await?
        .map_err(Refused::Lost))
}

/// Writes `m`'s row (its status, place and record) under `owner`.
async fn update(
    tx: &Transaction<'_>,
    owner: Owner,
    m: &Message,
    settled: bool,
) -> Result<u64, tokio_postgres::Error> {
    let n = tx
        .execute(
            // A delivered or dropped message is never sent again (only a
            // failed one may be retried): its request goes, as on sled.
            "UPDATE fencegate_queue SET seq = $3, status = $4, settled = $5, updated_ms = $6, \
             owner_generation = $7, message = $8, \
             request = CASE WHEN $4 IN ('delivered', 'dropped') THEN ''::bytea ELSE request END \
             WHERE route = $1 AND key = $2",
            &[
                &m.route,
                &m.key,
                &i64_of(m.seq),
                &m.status.as_str(),
                &settled,
                &i64_of(m.updated_ms),
                &i64_of(owner.generation.get()),
                &encode(m),
            ],
        )
        .await?;
    Ok(n)
}

/// Takes the lease's next place, its row locked until the transaction ends.
async fn next_place(tx: &Transaction<'_>, lease: &str) -> Result<u64, tokio_postgres::Error> {
    places(tx, lease, 1).await
}

/// Takes the lease's next `n` places (the first returned), its row locked
/// until the transaction ends. Places left unused are gaps: harmless, the
/// order is the places'.
async fn places(tx: &Transaction<'_>, lease: &str, n: usize) -> Result<u64, tokio_postgres::Error> {
    let n = i64::try_from(n).unwrap_or(i64::MAX);
    let row = tx
        .query_one(
            "INSERT INTO fencegate_queue_leases AS l (lease, next_seq) VALUES ($1, $2) \
             ON CONFLICT (lease) DO UPDATE SET next_seq = l.next_seq + $2 \
             RETURNING next_seq - $2",
            &[&lease, &n],
        )
        .await?;
    Ok(u64::try_from(row.get::<_, i64>(0)).unwrap_or(0))
}

/// A batch's new messages, column by column: one `INSERT … SELECT FROM
/// unnest(…)` writes them all.
#[derive(Default)]
struct NewRows {
    route: Vec<String>,
    key: Vec<String>,
    lease: Vec<String>,
    shard: Vec<i32>,
    seq: Vec<i64>,
    epoch: Vec<i64>,
    status: Vec<&'static str>,
    accepted_ms: Vec<i64>,
    updated_ms: Vec<i64>,
    generation: Vec<i64>,
    message: Vec<String>,
    request: Vec<Vec<u8>>,
}

impl NewRows {
    fn push(&mut self, owner: Owner, m: &Message, request: Vec<u8>) {
        self.route.push(m.route.clone());
        self.key.push(m.key.clone());
        self.lease.push(m.lease.clone());
        self.shard
            .push(i32::try_from(owner.shard).unwrap_or(i32::MAX));
        self.seq.push(i64_of(m.seq));
        self.epoch.push(epoch_to_sql(m.epoch));
        self.status.push(m.status.as_str());
        self.accepted_ms.push(i64_of(m.accepted_ms));
        self.updated_ms.push(i64_of(m.updated_ms));
        self.generation.push(i64_of(owner.generation.get()));
        self.message.push(encode(m));
        self.request.push(request);
    }

    async fn insert(&self, tx: &Transaction<'_>) -> Result<(), tokio_postgres::Error> {
        if self.route.is_empty() {
            return Ok(());
        }
        tx.execute(
            "INSERT INTO fencegate_queue (route, key, lease, shard, seq, epoch, status, \
             settled, accepted_ms, updated_ms, owner_generation, message, request) \
             SELECT route, key, lease, shard, seq, epoch, status, false, accepted_ms, \
             updated_ms, owner_generation, message, request FROM unnest($1::text[], \
             $2::text[], $3::text[], $4::int4[], $5::int8[], $6::int8[], $7::text[], \
             $8::int8[], $9::int8[], $10::int8[], $11::text[], $12::bytea[]) AS n(route, \
             key, lease, shard, seq, epoch, status, accepted_ms, updated_ms, \
             owner_generation, message, request)",
            &[
                &self.route,
                &self.key,
                &self.lease,
                &self.shard,
                &self.seq,
                &self.epoch,
                &self.status,
                &self.accepted_ms,
                &self.updated_ms,
                &self.generation,
                &self.message,
                &self.request,
            ],
        )
        .await
        .map(|_| ())
    }
}

impl PgQueue {
    /// The queue in `db`'s database (its tables are created by the schema
    /// migration).
    pub fn new(db: Arc<PostgresState>) -> PgQueue {
        PgQueue {
            db,
            accepting: Arc::new(ByKey::new(PgQueue::batch_len)),
        }
    }

    /// Runs `f` in one transaction of its own task; if it comes to a value,
    /// `owner`'s check (the owner row share-locked until the COMMIT) and the
    /// COMMIT follow.
    async fn write<T, F>(&self, what: &'static str, owner: Owner, f: F) -> Result<T, StateError>
    where
        T: Send + 'static,
        F: for<'a> FnOnce(
                &'a Transaction<'a>,
            ) -> std::pin::Pin<
                Box<dyn std::future::Future<Output = TxResult<T>> + Send + 'a>,
            > + Send
            + 'static,
    {
        self.db.writable()?;
        let db = self.db.clone();
        let idle = format!(
            "SET LOCAL idle_in_transaction_session_timeout = {}",
            (self.db.timeout().as_millis() / 2).max(100)
        );
        let task = tokio::spawn(async move {
            db.with(what, move |mut c: Object| async move {
                let tx = c.transaction().await?;
                tx.batch_execute(&idle).await?;
                let out = f(&tx).await?;
                if out.is_err() {
                    return Ok(out);
                }
                if let Err(r) = owner_holds(&tx, owner).await? {
                    return Ok(Err(r));
                }
                tx.commit().await?;
                Ok(out)
            })
            .await
        });
        let out = task
            .await
            .map_err(|e| StateError::Write(format!("{what}: {e}")))??;
        out.map_err(|r| match r {
            Refused::Lost(stored) => StateError::OwnerLost {
                ours: owner,
                stored,
            },
            Refused::Unreadable(what) => StateError::Write(format!(
                "{what}: {}",
                "a queued message is unreadable or gone"
            )),
        })
    }

    /// See [`super::store::QueueStore::accept`]: the place is taken with the
    /// lease's row locked, and `admitted` asked once it is. Goes with the
    /// acceptances of its lease that wait beside it (the module's doc).
    pub async fn accept(
        &self,
        owner: Owner,
        msg: Message,
        envelope: &Envelope,
        admitted: Admitted,
    ) -> Result<Accepted, StateError> {
        self.db.writable()?;
        let (answer, answered) = tokio::sync::oneshot::channel();
        let key = (msg.lease.clone(), owner);
        let waiting = Waiting {
            msg,
            request: envelope.encode(),
            admitted,
            answer,
        };
        let q = self.clone();
        self.accepting.submit(key, waiting, move |key, batch| {
            let q = q.clone();
            async move { q.run_batch(key.1, batch).await }
        });
        answered.await.map_err(|_| {
            StateError::Write("queue accept: its transaction ended unanswered".into())
        })?
    }

    /// How many of a lease's waiting acceptances share its next transaction:
    /// up to BATCH, and past the first at most BATCH_BYTES of requests (a
    /// batch shares one `[state] timeout_ms`).
    fn batch_len(waiting: &[Waiting]) -> usize {
        let mut bytes = 0;
        waiting
            .iter()
            .take(BATCH)
            .take_while(|w| {
                bytes += w.request.len();
                bytes <= BATCH_BYTES
            })
            .count()
    }

    /// Runs one batch of a lease's acceptances and answers each.
    async fn run_batch(&self, owner: Owner, batch: Vec<Waiting>) {
        let mut answers = Vec::with_capacity(batch.len());
        let mut items = Vec::with_capacity(batch.len());
        for w in batch {
            answers.push(w.answer);
            items.push((w.msg, w.request, w.admitted));
        }
        match self.accept_batch(owner, items).await {
            Ok(outcomes) => {
                for (answer, outcome) in answers.into_iter().zip(outcomes) {
                    let _ = answer.send(outcome);
                }
            }
            Err(e) => {
                for answer in answers {
                    let _ = answer.send(Err(e.clone()));
                }
            }
        }
    }

    /// One transaction for acceptances of one lease, in arrival order: each
    /// message is new (placed), found (its key has one: a worker's retry, or
    /// an earlier one of the batch), or aborted (no place taken). Three
    /// statements whatever the batch's size: the places (the lease's row
    /// locked), the keys already there, the new messages.
    async fn accept_batch(
        &self,
        owner: Owner,
        items: Vec<(Message, Vec<u8>, Admitted)>,
    ) -> Result<Vec<Result<Accepted, StateError>>, StateError> {
        self.write("queue accept", owner, move |tx| {
            Box::pin(async move {
                let Some(lease) = items.first().map(|i| i.0.lease.clone()) else {
                    return Ok(Ok(Vec::new()));
                };
                let mut place = places(tx, &lease, items.len()).await?;
                let (routes, keys): (Vec<&str>, Vec<&str>) = items
                    .iter()
                    .map(|(m, _, _)| (m.route.as_str(), m.key.as_str()))
                    .unzip();
                let mut found: HashMap<(String, String), String> = tx
                    .query(
                        "SELECT q.route, q.key, q.message FROM fencegate_queue q \
                         JOIN unnest($1::text[], $2::text[]) AS k(route, key) \
                         ON q.route = k.route AND q.key = k.key",
                        &[&routes, &keys],
                    )
                    .await?
                    .into_iter()
                    .map(|r| ((r.get(0), r.get(1)), r.get(2)))
                    .collect();
                let mut placed: HashMap<(String, String), Message> = HashMap::new();
                let mut new = NewRows::default();
                let mut out = Vec::with_capacity(items.len());
                for (mut msg, request, admitted) in items {
                    let id = (msg.route.clone(), msg.key.clone());
                    if let Some(m) = placed.get(&id) {
                        out.push(Ok(Accepted::Exists(m.clone())));
                        continue;
                    }
                    if let Some(old) = found.remove(&id) {
                        let old = decode(&old);
                        if let Ok(m) = &old {
                            // The same key again in this batch finds it too.
                            placed.insert(id, m.clone());
                        }
                        out.push(old.map(Accepted::Exists));
                        continue;
                    }
                    if !admitted() {
                        out.push(Ok(Accepted::Aborted));
                        continue;
                    }
                    msg.seq = place;
                    place += 1;
                    new.push(owner, &msg, request);
                    placed.insert(id, msg.clone());
                    out.push(Ok(Accepted::New(msg)));
                }
                new.insert(tx).await?;
                // Written, not committed: a crash here loses the messages
                // before their 202, never after.
                crate::failpoint::hit("queue_accept_written");
                Ok(Ok(out))
            })
        })
        .await
    }

    /// The message of `route`, `key`, if there is one.
    pub async fn get(&self, route: &str, key: &str) -> Result<Option<Message>, StateError> {
        let (route, key) = (route.to_owned(), key.to_owned());
        let raw = self
            .db
            .with("queue read", |c| async move {
                c.query_opt(
                    "SELECT message FROM fencegate_queue WHERE route = $1 AND key = $2",
                    &[&route, &key],
                )
                .await
                .map(|r| r.map(|r| r.get::<_, String>(0)))
            })
            .await?;
        raw.map(|r| decode(&r)).transpose()
    }

    /// The request of `route`, `key`.
    pub async fn envelope(&self, route: &str, key: &str) -> Result<Option<Envelope>, StateError> {
        let (route, key) = (route.to_owned(), key.to_owned());
        let raw = self
            .db
            .with("queue read", |c| async move {
                c.query_opt(
                    "SELECT request FROM fencegate_queue WHERE route = $1 AND key = $2",
                    &[&route, &key],
                )
                .await
                .map(|r| r.map(|r| r.get::<_, Vec<u8>>(0)))
            })
            .await?;
        match raw {
            // None kept: delivered or dropped.
            None => Ok(None),
            Some(v) if v.is_empty() => Ok(None),
            Some(v) => Envelope::decode(&v)
                .map(Some)
                .ok_or_else(|| StateError::Write("a queued request is unreadable".into())),
        }
    }

    /// Up to `max` messages of `lease` not settled, in place order.
    async fn first(&self, lease: &str, max: i64) -> Result<Vec<Message>, StateError> {
        let lease = lease.to_owned();
        let rows = self
            .db
            .with("queue read", |c| async move {
                c.query(
                    "SELECT message FROM fencegate_queue WHERE lease = $1 AND NOT settled \
                     ORDER BY seq LIMIT $2",
                    &[&lease, &max],
                )
                .await
            })
            .await?;
        rows.iter().map(|r| decode(r.get(0))).collect()
    }

    /// The first message of `lease` not settled, if any.
    pub async fn head(&self, lease: &str) -> Result<Option<Message>, StateError> {
        Ok(self.first(lease, 1).await?.into_iter().next())
    }

    /// Up to `max` messages at the front of `lease`'s queue with its head's
    /// epoch.
    pub async fn front(&self, lease: &str, max: usize) -> Result<Vec<Message>, StateError> {
        let all = self.first(lease, i64_of(max as u64)).await?;
        let epoch = all.first().map(|m| m.epoch);
        Ok(all
            .into_iter()
            .take_while(|m| Some(m.epoch) == epoch)
            .collect())
    }

    /// Leases with messages not settled.
    pub async fn leases_with_work(&self) -> Result<Vec<String>, StateError> {
        let rows = self
            .db
            .with("queue read", |c| async move {
                // A skip over the order index, a probe per lease: read once a
                // second, whatever the backlog.
                c.query(
                    "WITH RECURSIVE l AS ( \
                     (SELECT lease FROM fencegate_queue WHERE NOT settled ORDER BY lease LIMIT 1) \
                     UNION ALL \
                     SELECT (SELECT q.lease FROM fencegate_queue q WHERE NOT q.settled \
                     AND q.lease > l.lease ORDER BY q.lease LIMIT 1) FROM l WHERE l.lease IS NOT NULL) \
                     SELECT lease FROM l WHERE lease IS NOT NULL",
                    &[],
                )
                .await
            })
            .await?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    /// Among `routes` (name, lease, queued), the (route, lease) pairs of
    /// messages that may still be sent which [`crate::queue::conflict`] looks
    /// for: any on the lease of a direct route or under its name, and any of
    /// a queued route under another lease. Three statements whatever the
    /// number of routes, each a few index reads per route (schema 10's
    /// partial indexes), not a pass over the table: a takeover waits for it.
    pub async fn holding_for(
        &self,
        routes: &[(&str, &str, bool)],
    ) -> Result<BTreeSet<(String, String)>, StateError> {
        // Direct routes: their leases and names; queued: (name, lease).
        let (mut direct, mut direct_names) = (Vec::new(), Vec::new());
        let (mut names, mut leases) = (Vec::new(), Vec::new());
        for &(name, lease, queued) in routes {
            let (n, l) = if queued {
                (&mut names, &mut leases)
            } else {
                (&mut direct_names, &mut direct)
            };
            n.push(name.to_owned());
            l.push(lease.to_owned());
        }
        let rows = self
            .db
            .with("queue read", |c| async move {
                // `ORDER BY` as the indexes are: without it the planner may
                // scan the table expecting a match early, and read every row
                // when there is none.
                let mut out = c
                    .query(
                        "SELECT h.route, h.lease FROM unnest($1::text[]) AS d(lease) \
                         CROSS JOIN LATERAL (SELECT route, lease FROM fencegate_queue q \
                         WHERE q.lease = d.lease AND q.status IN ('pending', 'delivering', 'failed') \
                         ORDER BY q.route LIMIT 1) h",
                        &[&direct],
                    )
                    .await?;
                // A direct route's own name, under any lease.
                out.extend(
                    c.query(
                        "SELECT h.route, h.lease FROM unnest($1::text[]) AS d(route) \
                         CROSS JOIN LATERAL (SELECT route, lease FROM fencegate_queue q \
                         WHERE q.route = d.route AND q.status IN ('pending', 'delivering', 'failed') \
                         ORDER BY q.lease LIMIT 1) h",
                        &[&direct_names],
                    )
                    .await?,
                );
                // Another lease, on either side of the route's own: two
                // ranges of the (route, lease) index.
                out.extend(
                    c.query(
                        "SELECT h.route, h.lease FROM unnest($1::text[], $2::text[]) AS r(route, lease) \
                         CROSS JOIN LATERAL ( \
                         (SELECT route, lease FROM fencegate_queue q WHERE q.route = r.route \
                         AND q.lease < r.lease AND q.status IN ('pending', 'delivering', 'failed') \
                         ORDER BY q.lease DESC LIMIT 1) UNION ALL \
                         (SELECT route, lease FROM fencegate_queue q WHERE q.route = r.route \
                         AND q.lease > r.lease AND q.status IN ('pending', 'delivering', 'failed') \
                         ORDER BY q.lease LIMIT 1)) h",
                        &[&names, &leases],
                    )
                    .await?,
                );
                Ok(out)
            })
            .await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    /// [`super::store::QueueStore::other_kind`]: one statement, an index
    /// probe per route (both tables' keys start with the route).
    pub async fn other_kind(
        &self,
        routes: &[(&str, bool)],
    ) -> Result<Option<(String, bool)>, StateError> {
        let (queued, direct): (Vec<_>, Vec<_>) = routes.iter().partition(|(_, q)| *q);
        let queued: Vec<String> = queued.iter().map(|(n, _)| (*n).to_owned()).collect();
        let direct: Vec<String> = direct.iter().map(|(n, _)| (*n).to_owned()).collect();
        let row = self
            .db
            .with("queue read", |c| async move {
                c.query_opt(
                    "(SELECT d.route, false FROM unnest($1::text[]) AS d(route) \
                     WHERE EXISTS (SELECT 1 FROM fencegate_queue q WHERE q.route = d.route) LIMIT 1) \
                     UNION ALL \
                     (SELECT d.route, true FROM unnest($2::text[]) AS d(route) \
                     WHERE EXISTS (SELECT 1 FROM fencegate_dedup x WHERE x.route = d.route) LIMIT 1) \
                     LIMIT 1",
                    &[&direct, &queued],
                )
                .await
            })
            .await?;
        Ok(row.map(|r| (r.get(0), r.get(1))))
    }

    /// Per route, messages not settled and the acceptance time of the oldest
    /// lease head among them.
    pub async fn depth(&self) -> Result<HashMap<String, (u64, u64)>, StateError> {
        let rows = self
            .db
            .with("queue read", |c| async move {
                c.query(
                    "WITH heads AS (SELECT DISTINCT ON (lease) lease, accepted_ms \
                     FROM fencegate_queue WHERE NOT settled ORDER BY lease, seq) \
                     SELECT q.route, count(*), min(h.accepted_ms) \
                     FROM fencegate_queue q JOIN heads h ON h.lease = q.lease \
                     WHERE NOT q.settled GROUP BY q.route",
                    &[],
                )
                .await
            })
            .await?;
        Ok(rows
            .iter()
            .map(|r| {
                let n: i64 = r.get(1);
                let oldest: i64 = r.get(2);
                (
                    r.get(0),
                    (
                        u64::try_from(n).unwrap_or(0),
                        u64::try_from(oldest).unwrap_or(0),
                    ),
                )
            })
            .collect())
    }

    /// Writes a message's attempt as started, its epoch the newest of its
    /// lease that may have been sent. Committed on return; refused
    /// ([`StateError::OwnerLost`]) when a newer owner holds the shard.
    pub async fn start_attempt(&self, owner: Owner, msg: &Message) -> Result<(), StateError> {
        let m = msg.clone();
        self.write("queue attempt", owner, move |tx| {
            Box::pin(async move {
                tx.execute(
                    "INSERT INTO fencegate_queue_leases AS l (lease, next_seq, sent_epoch) \
                     VALUES ($1, 0, $2) ON CONFLICT (lease) DO UPDATE \
                     SET sent_epoch = GREATEST(COALESCE(l.sent_epoch, $2), $2)",
                    &[&m.lease, &epoch_to_sql(m.epoch)],
                )
                .await?;
                if update(tx, owner, &m, false).await? != 1 {
                    // Swept meanwhile: not sent.
                    return Ok(Err(Refused::Unreadable("queue attempt")));
                }
                Ok(Ok(()))
            })
        })
        .await
    }

    /// [`super::store::QueueStore::restore_fenced`].
    pub async fn restore_fenced(&self, lease: &str) -> Result<u64, StateError> {
        let lease = lease.to_owned();
        let row = self
            .db
            .with("queue read", |c| async move {
                c.query_opt(
                    "SELECT restore_fenced FROM fencegate_queue_leases WHERE lease = $1",
                    &[&lease],
                )
                .await
            })
            .await?;
        Ok(row.map_or(0, |r| u64::try_from(r.get::<_, i64>(0)).unwrap_or(0)))
    }

    /// [`super::store::QueueStore::mark_restore_fenced`].
    pub async fn mark_restore_fenced(
        &self,
        owner: Owner,
        lease: &str,
        r: u64,
    ) -> Result<(), StateError> {
        let lease = lease.to_owned();
        let r = i64::try_from(r).unwrap_or(i64::MAX);
        self.write("queue fence", owner, move |tx| {
            Box::pin(async move {
                tx.execute(
                    "INSERT INTO fencegate_queue_leases AS l (lease, next_seq, restore_fenced) \
                     VALUES ($1, 0, $2) ON CONFLICT (lease) DO UPDATE \
                     SET restore_fenced = GREATEST(l.restore_fenced, $2)",
                    &[&lease, &r],
                )
                .await?;
                Ok(Ok(()))
            })
        })
        .await
    }

    /// [`super::store::QueueStore::put_job`].
    pub async fn put_job(&self, job: &super::job::Job) -> Result<(), StateError> {
        let id = job.id.clone();
        let json = serde_json::to_string(job).map_err(|e| StateError::Write(e.to_string()))?;
        self.db
            .with("queue job", |c| async move {
                c.execute(
                    "INSERT INTO fencegate_queue_jobs (id, job) VALUES ($1, $2)",
                    &[&id, &json],
                )
                .await
            })
            .await?;
        Ok(())
    }

    /// [`super::store::QueueStore::jobs`].
    pub async fn jobs(&self) -> Result<Vec<super::job::Job>, StateError> {
        let rows = self
            .db
            .with("queue read", |c| async move {
                c.query("SELECT job FROM fencegate_queue_jobs", &[]).await
            })
            .await?;
        let mut out: Vec<super::job::Job> = rows
            .iter()
            .filter_map(|r| serde_json::from_str(r.get::<_, &str>(0)).ok())
            .collect();
        super::job::newest_first(&mut out);
        Ok(out)
    }

    /// [`super::store::QueueStore::job_progress`]: read, changed and written
    /// in one transaction, the row locked (members may both progress a job).
    pub async fn job_progress(
        &self,
        id: &str,
        delta: &super::job::JobDelta,
    ) -> Result<Option<super::job::Job>, StateError> {
        let (id, delta) = (id.to_owned(), delta.clone());
        let job = self
            .db
            .with("queue job", |c| async move {
                let mut c = c;
                let tx = c.transaction().await?;
                let Some(row) = tx
                    .query_opt(
                        "SELECT job FROM fencegate_queue_jobs WHERE id = $1 FOR UPDATE",
                        &[&id],
                    )
                    .await?
                else {
                    return Ok(None);
                };
                let Ok(mut job) = serde_json::from_str::<super::job::Job>(row.get::<_, &str>(0))
                else {
                    return Ok(None);
                };
                job.apply(&delta);
                let json = serde_json::to_string(&job).unwrap_or_default();
                tx.execute(
                    "UPDATE fencegate_queue_jobs SET job = $2 WHERE id = $1",
                    &[&id, &json],
                )
                .await?;
                tx.commit().await?;
                Ok(Some(job))
            })
            .await?;
        Ok(job)
    }

    /// [`super::store::QueueStore::paused`].
    pub async fn paused(&self) -> Result<super::pause::Paused, StateError> {
        let rows = self
            .db
            .with("queue read", |c| async move {
                c.query(
                    "SELECT kind, name, since_ms FROM fencegate_queue_paused",
                    &[],
                )
                .await
            })
            .await?;
        let mut out = super::pause::Paused::default();
        for r in rows {
            let (kind, name): (String, String) = (r.get(0), r.get(1));
            if let Some(p) = super::pause::Pausable::of(&kind, &name) {
                out.0
                    .insert(p, u64::try_from(r.get::<_, i64>(2)).unwrap_or(0));
            }
        }
        Ok(out)
    }

    /// [`super::store::QueueStore::set_paused`].
    pub async fn set_paused(
        &self,
        what: &super::pause::Pausable,
        since_ms: Option<u64>,
    ) -> Result<(), StateError> {
        let (kind, name) = (what.kind(), what.name().to_owned());
        self.db
            .with("queue pause", |c| async move {
                match since_ms {
                    Some(ms) => {
                        let ms = i64::try_from(ms).unwrap_or(i64::MAX);
                        c.execute(
                            "INSERT INTO fencegate_queue_paused (kind, name, since_ms) \
                             VALUES ($1, $2, $3) ON CONFLICT (kind, name) DO NOTHING",
                            &[&kind, &name, &ms],
                        )
                        .await
                    }
                    None => {
                        c.execute(
                            "DELETE FROM fencegate_queue_paused WHERE kind = $1 AND name = $2",
                            &[&kind, &name],
                        )
                        .await
                    }
                }
            })
            .await?;
        Ok(())
    }

    /// [`super::store::QueueStore::raise_sent`].
    pub async fn raise_sent(
        &self,
        owner: Owner,
        lease: &str,
        epoch: u64,
    ) -> Result<(), StateError> {
        let lease = lease.to_owned();
        self.write("queue fence", owner, move |tx| {
            Box::pin(async move {
                tx.execute(
                    "INSERT INTO fencegate_queue_leases AS l (lease, next_seq, sent_epoch) \
                     VALUES ($1, 0, $2) ON CONFLICT (lease) DO UPDATE \
                     SET sent_epoch = GREATEST(COALESCE(l.sent_epoch, $2), $2)",
                    &[&lease, &epoch_to_sql(epoch)],
                )
                .await?;
                Ok(Ok(()))
            })
        })
        .await
    }

    /// Writes a message that stays in its queue (a retry scheduled).
    pub async fn put(&self, owner: Owner, msg: &Message) -> Result<(), StateError> {
        let m = msg.clone();
        self.write("queue write", owner, move |tx| {
            Box::pin(async move {
                update(tx, owner, &m, false).await?;
                Ok(Ok(()))
            })
        })
        .await
    }

    /// Writes a settled message: out of its queue.
    pub async fn settle(&self, owner: Owner, msg: &Message) -> Result<(), StateError> {
        let m = msg.clone();
        self.write("queue settle", owner, move |tx| {
            Box::pin(async move {
                update(tx, owner, &m, true).await?;
                Ok(Ok(()))
            })
        })
        .await
    }

    /// Puts a failed message back at the end of its lease's queue unless a
    /// newer epoch's message of its lease was sent or waits — checked with the
    /// lease's row locked, as acceptances take places.
    pub async fn requeue(
        &self,
        owner: Owner,
        route: &str,
        key: &str,
        now_ms: u64,
    ) -> Result<Requeued, StateError> {
        let (route, key) = (route.to_owned(), key.to_owned());
        self.write("queue requeue", owner, move |tx| {
            Box::pin(async move {
                // Its lease first (the lock order), then the message, locked
                // and read again.
                let Some(lease) = tx
                    .query_opt(
                        "SELECT lease FROM fencegate_queue WHERE route = $1 AND key = $2",
                        &[&route, &key],
                    )
                    .await?
                    .map(|r| r.get::<_, String>(0))
                else {
                    return Ok(Ok(Requeued::Gone));
                };
                let place = next_place(tx, &lease).await?;
                let Some(row) = tx
                    .query_opt(
                        "SELECT message FROM fencegate_queue WHERE route = $1 AND key = $2 \
                         FOR UPDATE",
                        &[&route, &key],
                    )
                    .await?
                else {
                    return Ok(Ok(Requeued::Gone));
                };
                let Ok(mut msg) = decode(row.get(0)) else {
                    return Ok(Err(Refused::Unreadable("queue requeue")));
                };
                if msg.status != Status::Failed {
                    return Ok(Ok(Requeued::NotFailed(msg.status)));
                }
                let sent: Option<i64> = tx
                    .query_one(
                        "SELECT sent_epoch FROM fencegate_queue_leases WHERE lease = $1",
                        &[&msg.lease],
                    )
                    .await?
                    .get(0);
                let waiting: Option<i64> = tx
                    .query_opt(
                        "SELECT epoch FROM fencegate_queue WHERE lease = $1 AND NOT settled \
                         ORDER BY seq DESC LIMIT 1",
                        &[&msg.lease],
                    )
                    .await?
                    .map(|r| r.get(0));
                let newest = sent
                    .map(epoch_from_sql)
                    .unwrap_or(0)
                    .max(waiting.map(epoch_from_sql).unwrap_or(0));
                if newest > msg.epoch {
                    // Committed with a gap in the places: harmless, places
                    // only order.
                    return Ok(Ok(Requeued::Superseded(newest)));
                }
                msg.seq = place;
                msg.status = Status::Pending;
                msg.next_attempt_ms = now_ms;
                msg.updated_ms = now_ms;
                msg.last_error = None;
                update(tx, owner, &msg, false).await?;
                Ok(Ok(Requeued::Done(Box::new(msg))))
            })
        })
        .await
    }

    /// The newest epoch of `lease` of which a message was sent (0: none).
    pub async fn sent_epoch(&self, lease: &str) -> Result<u64, StateError> {
        let lease = lease.to_owned();
        let v = self
            .db
            .with("queue read", |c| async move {
                c.query_opt(
                    "SELECT sent_epoch FROM fencegate_queue_leases WHERE lease = $1",
                    &[&lease],
                )
                .await
                .map(|r| r.and_then(|r| r.get::<_, Option<i64>>(0)))
            })
            .await?;
        Ok(v.map(epoch_from_sql).unwrap_or(0))
    }

    /// Up to `limit` messages matching, in key order; and how many match.
    /// [`super::store::QueueStore::list`]: ordered by route then key as
    /// bytes (`COLLATE "C"`), as sled's tree is.
    pub async fn list(&self, l: &Listing) -> Result<(Vec<Message>, u64), StateError> {
        let (route, lease) = (l.route.clone(), l.lease.clone());
        let status = l.status.map(|s| s.as_str().to_owned());
        let (since, until) = (l.since_ms.map(i64_of), l.until_ms.map(i64_of));
        let (after_route, after_key) = l.after.clone().unzip();
        let limit = i64_of(l.limit as u64);
        // A column name from an enum, never from input.
        let at = match l.by {
            super::message::ListedBy::Accepted => "accepted_ms",
            super::message::ListedBy::Updated => "updated_ms",
        };
        let (rows, total) = self
            .db
            .with("queue list", |c| async move {
                let cond = format!(
                    "($1::text IS NULL OR route = $1) AND ($2::text IS NULL OR lease = $2) \
                     AND ($3::text IS NULL OR status = $3) \
                     AND ($4::bigint IS NULL OR {at} >= $4) AND ($5::bigint IS NULL OR {at} < $5)"
                );
                let rows = c
                    .query(
                        &format!(
                            "SELECT message FROM fencegate_queue WHERE {cond} \
                             AND ($6::text IS NULL OR route COLLATE \"C\" > $6 \
                                  OR (route = $6 AND key COLLATE \"C\" > $7)) \
                             ORDER BY route COLLATE \"C\", key COLLATE \"C\" LIMIT $8"
                        ),
                        &[
                            &route,
                            &lease,
                            &status,
                            &since,
                            &until,
                            &after_route,
                            &after_key,
                            &limit,
                        ],
                    )
                    .await?;
                let total: i64 = c
                    .query_one(
                        &format!("SELECT count(*) FROM fencegate_queue WHERE {cond}"),
                        &[&route, &lease, &status, &since, &until],
                    )
                    .await?
                    .get(0);
                Ok((rows, total))
            })
            .await?;
        let out = rows
            .iter()
            .map(|r| decode(r.get(0)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((out, u64::try_from(total).unwrap_or(0)))
    }

    /// Removes settled messages last changed before `before_ms`; how many.
    /// Not a write of any shard's state (what it removes no attempt reads),
    /// so not conditioned on an owner.
    pub async fn sweep(&self, before_ms: u64) -> Result<usize, StateError> {
        self.db.writable()?;
        let before = i64_of(before_ms);
        let n = self
            .db
            .with("queue sweep", |c| async move {
                let n = c
                    .execute(
                        "DELETE FROM fencegate_queue WHERE settled AND updated_ms < $1",
                        &[&before],
                    )
                    .await?;
                // Finished bulk jobs are kept as long as settled messages.
                c.execute(
                    "DELETE FROM fencegate_queue_jobs WHERE (job::jsonb ->> 'finished')::boolean \
                     AND (job::jsonb ->> 'updated_ms')::bigint < $1",
                    &[&before],
                )
                .await?;
                Ok(n)
            })
            .await?;
        Ok(usize::try_from(n).unwrap_or(usize::MAX))
    }
}
