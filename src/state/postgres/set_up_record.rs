//! One database, one set-up (SPEC §10): the record that says which set-up —
//! which lease store and prefix — a database (or a `[state] schema` in it)
//! belongs to.
//!
//! Marks, dedup records and shard rows are keyed by lease, (route, key) and
//! shard, never by set-up: two set-ups in one database would share one
//! high-water mark per lease name (one environment's epochs refusing the
//! other's holder), answer one's retry with the other's stored response, and
//! split one set of shard rows between two clusters. The S3 anchor (§10) keeps
//! two set-ups off one prefix; this record keeps two prefixes off one database.
//!
//! The first instance to start records its set-up (a random id, the store and
//! prefix, its mode; a cluster seals it with its peer token, as it seals gate
//! objects). Every later instance reads it before writing anything: another
//! store or prefix, or a seal made with another peer token, refuses start-up
//! (exit 2). A running instance reads it again every quarter of `gate_ttl`;
//! a record that is gone or is no longer the one it started on stops all
//! forwarding until it is ([`PostgresState::watch_set_up`]). That look is
//! periodic: a record replaced by hand is noticed within one interval, and
//! requests forwarded before that are not undone.

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{PostgresState, StateError};
use crate::config::Config;
use crate::lease::LeaseStore;
use crate::set_up::{create_store_id, push_field, set_up_key, store_id, GateKey};

/// This instance's set-up, as a record names it.
#[derive(Clone, Debug)]
pub struct OurSetUp {
    /// `s3://{bucket}`, or `dir:{path}`.
    store: String,
    prefix: String,
    mode: &'static str,
    /// A cluster member's instance id; for a single instance its listener.
    recorded_by: String,
    /// Where deliveries are kept, as gate objects name it
    /// ([`crate::set_up::state_of`]).
    state: String,
    /// A cluster's seal; a single instance has no secret its successor shares
    /// (its `gate-key` lives in its own `data_dir`) and seals nothing.
    key: Option<GateKey>,
}

impl OurSetUp {
    /// The set-up `cfg` describes ([`crate::set_up::store_name`]).
    pub fn of(cfg: &Config, state: &str) -> OurSetUp {
        let store = crate::set_up::store_name(cfg);
        let (mode, recorded_by, key) = match &cfg.cluster {
            Some(c) => (
                "cluster",
                c.instance_id.clone(),
                Some(GateKey::for_set_up_record(
                    &c.resolved_peer_token().unwrap_or_default(),
                )),
            ),
            None => (
                "single",
                format!("a single instance listening on {}", cfg.server.listen),
                None,
            ),
        };
        OurSetUp {
            store,
            prefix: cfg.store.prefix.clone(),
            mode,
            recorded_by,
            state: state.to_owned(),
            key,
        }
    }

    /// The seal of a record with these fields (`None` for a single instance).
    fn seal(&self, id: &str, mode: &str) -> Option<String> {
        let key = self.key.as_ref()?;
        Some(hex::encode(key.tag_of(&message(
            id,
            &self.store,
            &self.prefix,
            mode,
        ))))
    }

    /// What `rec` is to this instance.
    fn judge(&self, rec: &SetUpRecord) -> Verdict {
        if rec.store != self.store || rec.prefix != self.prefix {
            return Verdict::Foreign(format!(
                "it holds the state of {rec}, and this instance's lease store is {} with prefix {:?}",
                self.store, self.prefix
            ));
        }
        match (&self.key, &rec.mac) {
            // A single instance has nothing to check a seal with, and a
            // single instance's record has none: the store's id binds either
            // to its store (`hold_for`). Never sealed afterwards: a member
            // whose start is refused later (a wrong peer token) must not have
            // rewritten the record first.
            (None, _) | (Some(_), None) => Verdict::Ours,
            (Some(key), Some(mac)) => {
                let m = message(&rec.id, &rec.store, &rec.prefix, &rec.mode);
                if key.verifies_message(&m, mac) {
                    Verdict::Ours
                } else {
                    Verdict::Foreign(format!(
                        "it holds the state of {rec}, sealed with another peer token than this instance's: another cluster on the same lease store and prefix, or this cluster's peer_token changed (then, with every instance stopped, delete the row of fencegate_set_up and start again)"
                    ))
                }
            }
        }
    }
}

/// The sealed fields, each length-prefixed as a gate object's are.
fn message(id: &str, store: &str, prefix: &str, mode: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(128);
    for f in [id, store, prefix, mode] {
        push_field(&mut out, Some(f));
    }
    out
}

/// The row of `fencegate_set_up`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetUpRecord {
    /// Random, made by the instance that wrote the record.
    pub id: String,
    /// `s3://{bucket}` or `dir:{path}`.
    pub store: String,
    /// The lease store prefix.
    pub prefix: String,
    /// `single` or `cluster`.
    pub mode: String,
    /// Who wrote it.
    pub recorded_by: String,
    /// When, on the database's clock (shown only).
    pub recorded_at: String,
    /// A cluster's seal (hex HMAC-SHA256), or none.
    pub mac: Option<String>,
}

impl fmt::Display for SetUpRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "set-up {} (lease store {}, prefix {:?}, {}, recorded by {} at {})",
            self.id, self.store, self.prefix, self.mode, self.recorded_by, self.recorded_at
        )
    }
}

/// What a record is to an instance.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Ours,
    /// Another set-up's, and why.
    Foreign(String),
}

/// A database found free for this set-up, or recorded as its
/// ([`PostgresState::check_set_up`]): what [`PostgresState::hold_set_up`] records.
#[derive(Debug)]
pub struct MayHold {
    ours: OurSetUp,
    /// The set-up id the lease store kept when checked (read once).
    in_store: Option<String>,
}

/// The record an instance started on, and what its last look found.
#[derive(Debug)]
pub(super) struct Held {
    ours: OurSetUp,
    id: String,
    /// Where the record lives, for messages: `schema "public"`.
    place: String,
}

const SELECT: &str = "SELECT id, store, prefix, mode, recorded_by, \
     to_char(recorded_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'), mac \
     FROM fencegate_set_up";

fn record_of(row: &tokio_postgres::Row) -> SetUpRecord {
    SetUpRecord {
        id: row.get(0),
        store: row.get(1),
        prefix: row.get(2),
        mode: row.get(3),
        recorded_by: row.get(4),
        recorded_at: row.get(5),
        mac: row.get(6),
    }
}

impl PostgresState {
    /// The record in the database, if any.
    async fn read_set_up(&self) -> Result<Option<SetUpRecord>, StateError> {
        let row = self
            .with("reading the set-up record", |c| async move {
                let st = c.prepare_cached(SELECT).await?;
                c.query_opt(&st, &[]).await
            })
            .await?;
        Ok(row.as_ref().map(record_of))
    }

    /// Start-up, first step, before this instance takes its place in the
    /// lease store (the guard, or a cluster's checks) and before anything is
    /// written to the database (not even a migration): whether the database
    /// may be this set-up's — recorded as `ours`, or not recorded and holding
    /// no record another set-up may have written — or the refusal that names
    /// the set-up that holds it ([`StateError::OtherSetUp`], exit 2). Its gate
    /// objects are read before this start writes one of its own.
    ///
    /// `database_id`: the id the database holds, if any (read before this
    /// check; made after it). A database holding records and no set-up
    /// record is claimed only when a gate object of this set-up names *its
    /// id* — a connection string names no database, and one without an id
    /// (from before ids) can be named by nothing — or with `claim` (the
    /// operator's `--claim-state`).
    pub async fn check_set_up(
        &self,
        ours: OurSetUp,
        store: &Arc<dyn LeaseStore>,
        database_id: Option<&str>,
        claim: bool,
    ) -> Result<MayHold, StateError> {
        // The row first, the store's id after: a record is written only once
        // the store keeps its id (`hold_set_up`), so a record read here has
        // its id in the store by the time the store is read — read the other
        // way round, an instance starting beside the one recording took its
        // own set-up for another (found by three instances starting at once).
        let rec = self.read_set_up_if_any().await?;
        let in_store = store_id(store, &ours.prefix).await?;
        match rec {
            Some(rec) => self.verify(&ours, &rec, in_store.as_deref())?,
            None => {
                let named = match database_id {
                    Some(_) => {
                        crate::set_up::named_by_gate_objects(store, &ours.prefix, &ours.state)
                            .await?
                    }
                    None => false,
                };
                if self.holds_records().await? && !named {
                    if claim {
                        tracing::warn!(
                            state = %ours.state,
                            "--claim-state: this database's records, which no set-up record or gate object attributes to this set-up, are claimed for it"
                        );
                    } else {
                        return Err(self.refusal(format!(
                            "it holds marks, dedup records or shard rows but no set-up record (written by a build before schema 8, or the record was deleted), and no recent gate object of this lease store ({}, prefix {:?}) names this database's id ({}): they may be another set-up's, reached by the same connection string. Start the set-up that wrote them first (it records itself); if they are this set-up's (an upgrade from a build before database ids), start once with `fencegate serve --claim-state`",
                            ours.store,
                            ours.prefix,
                            database_id.unwrap_or("none: the database predates ids")
                        )));
                    }
                }
            }
        }
        Ok(MayHold { ours, in_store })
    }

    /// Start-up, second step, once this instance holds its place in the lease
    /// store: migrates the schema and records the set-up if no one has (or
    /// finds it recorded, as [`PostgresState::check_set_up`] did).
    pub async fn hold_set_up(
        &self,
        may: MayHold,
        store: &Arc<dyn LeaseStore>,
    ) -> Result<(), StateError> {
        let MayHold { ours, mut in_store } = may;
        self.migrate().await?;
        // Two rounds at most: a record written by another instance between our
        // read and our insert is read on the second.
        for _ in 0..2 {
            let Some(rec) = self.read_set_up().await? else {
                let id = match &in_store {
                    Some(id) => id.clone(),
                    None => create_store_id(store, &ours.prefix, &ours.recorded_by).await?,
                };
                self.record(&ours, &id).await?;
                in_store = Some(id);
                continue;
            };
            if in_store.is_none() {
                // Recorded by another instance since the check: its id is in
                // the store now (read after the row, as the check reads).
                in_store = store_id(store, &ours.prefix).await?;
            }
            self.verify(&ours, &rec, in_store.as_deref())?;
            let place = format!("schema {:?}", self.schema());
            tracing::info!(set_up = %rec, %place, "the database belongs to this set-up");
            let held = Held {
                ours,
                id: rec.id,
                place,
            };
            // Set once, at start-up; a second call keeps the first.
            let _ = self.set_up.set(held);
            return Ok(());
        }
        Err(StateError::Write(
            "recording the set-up: the record was neither written nor found".into(),
        ))
    }

    /// [`PostgresState::check_set_up`], then [`PostgresState::hold_set_up`].
    pub async fn hold_for(
        &self,
        ours: OurSetUp,
        store: &Arc<dyn LeaseStore>,
    ) -> Result<(), StateError> {
        let id = self.database_id().await?;
        let may = self.check_set_up(ours, store, id.as_deref(), false).await?;
        self.ensure_database_id().await?;
        self.hold_set_up(may, store).await
    }

    /// Whether `rec` is `ours`: its store, prefix and seal, and the id the
    /// store keeps (`in_store`) — another host's `dir` of the same path, or
    /// another S3 service's bucket of the same name, keeps another or none.
    fn verify(
        &self,
        ours: &OurSetUp,
        rec: &SetUpRecord,
        in_store: Option<&str>,
    ) -> Result<(), StateError> {
        if let Verdict::Foreign(why) = ours.judge(rec) {
            return Err(self.refusal(why));
        }
        let key = set_up_key(&ours.prefix);
        match in_store {
            Some(id) if id == rec.id => Ok(()),
            Some(id) => Err(self.refusal(format!(
                "it holds the state of {rec}, and this lease store's {key} names set-up {id}: a store of the same name but not the same store (another host's directory, another S3 service's bucket)"
            ))),
            None => Err(self.refusal(format!(
                "it holds the state of {rec}, whose lease store keeps the set-up's id in {key}, and this lease store has none: a store of the same name but not the same store (another host's directory, another S3 service's bucket), or {key} was deleted"
            ))),
        }
    }

    /// The start-up refusal: why, and the ways out.
    fn refusal(&self, why: String) -> StateError {
        StateError::OtherSetUp(format!(
            "this database (schema {:?}) belongs to another fencegate set-up: {why}. Two set-ups in one database share high-water marks and answer each other's retries: give this one a database of its own, or a [state] schema of its own (docs/postgres.md, \"One database, one set-up\"). If it is this set-up after all, stop every instance and delete the row of {}.fencegate_set_up: this set-up then claims its records again through its gate objects",
            self.schema(),
            self.schema()
        ))
    }

    /// The record, or `None` when there is none or no table for it yet (a
    /// database of schema 7 or older, or an empty one).
    async fn read_set_up_if_any(&self) -> Result<Option<SetUpRecord>, StateError> {
        if self.table_exists("fencegate_set_up").await? {
            self.read_set_up().await
        } else {
            Ok(None)
        }
    }

    /// Whether fencegate's table `name` exists where its tables are looked up.
    async fn table_exists(&self, name: &'static str) -> Result<bool, StateError> {
        self.with("looking for a table", |c| async move {
            c.query_one("SELECT to_regclass($1) IS NOT NULL", &[&name])
                .await
        })
        .await
        .map(|r| r.get(0))
    }

    /// Writes the record of `ours` under `id`, unless one appeared meanwhile.
    async fn record(&self, ours: &OurSetUp, id: &str) -> Result<(), StateError> {
        self.with("recording the set-up", |c| async move {
            let st = c
                .prepare_cached(
                    "INSERT INTO fencegate_set_up (id, store, prefix, mode, recorded_by, mac) \
                     VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (one) DO NOTHING",
                )
                .await?;
            let mac = ours.seal(id, ours.mode);
            c.execute(
                &st,
                &[
                    &id,
                    &ours.store,
                    &ours.prefix,
                    &ours.mode,
                    &ours.recorded_by,
                    &mac,
                ],
            )
            .await
        })
        .await
        .map(drop)
    }

    /// Whether any mark, dedup record, shard row or queued message is stored
    /// (none in a database fencegate never migrated).
    async fn holds_records(&self) -> Result<bool, StateError> {
        if !self.table_exists("fencegate_marks").await? {
            return Ok(false);
        }
        let queue = if self.table_exists("fencegate_queue").await? {
            " OR EXISTS (SELECT 1 FROM fencegate_queue)"
        } else {
            ""
        };
        let sql = format!(
            "SELECT EXISTS (SELECT 1 FROM fencegate_marks) \
             OR EXISTS (SELECT 1 FROM fencegate_dedup) \
             OR EXISTS (SELECT 1 FROM fencegate_owners){queue}"
        );
        self.with("looking for records", |c| async move {
            c.query_one(sql.as_str(), &[]).await
        })
        .await
        .map(|r| r.get(0))
    }

    /// While running: reads the record every `every`
    /// ([`PostgresState::look_at_set_up`]).
    pub async fn watch_set_up(&self, every: Duration, stop: CancellationToken) {
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = ticks.tick() => {}
            }
            self.look_at_set_up().await;
        }
    }

    /// Reads the record once: one that is gone or not the one this instance
    /// started on stops all forwarding
    /// ([`crate::state::StateStore::set_up_conflict`]) and every write, until
    /// it is again. A failed read changes nothing (the database's health says
    /// that); before [`PostgresState::hold_for`], nothing is looked at.
    pub async fn look_at_set_up(&self) {
        let Some(held) = self.set_up.get() else {
            return;
        };
        let found = match self.read_set_up().await {
            Ok(found) => found,
            // The table dropped (or a dump from before schema 8 restored):
            // as gone as a deleted row. Any other failure changes nothing.
            Err(_) if matches!(self.table_exists("fencegate_set_up").await, Ok(false)) => None,
            Err(_) => return,
        };
        let problem = match &found {
            None => Some(format!(
                "the record of the set-up this database belongs to ({}, fencegate_set_up) is gone; this instance started on set-up {}: it forwards nothing until the record is back (or it is restarted)",
                held.place, held.id
            )),
            Some(rec) => match held.ours.judge(rec) {
                Verdict::Foreign(why) => Some(format!(
                    "the database ({}) now belongs to another set-up: {why}; this instance forwards nothing until the record is its set-up's again",
                    held.place
                )),
                Verdict::Ours if rec.id != held.id => Some(format!(
                    "the database's set-up record ({}) was replaced: it names {rec}, and this instance started on set-up {}; it forwards nothing until the record is back (or it is restarted)",
                    held.place, held.id
                )),
                Verdict::Ours => None,
            },
        };
        self.note_set_up_problem(problem);
    }

    fn note_set_up_problem(&self, now: Option<String>) {
        let mut slot = self
            .set_up_problem
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match (&*slot, &now) {
            (None, Some(p)) => tracing::error!(problem = %p, "forwarding stopped"),
            (Some(_), None) => {
                tracing::warn!("the database's set-up record is this set-up's again: serving again")
            }
            _ => {}
        }
        self.foreign.store(now.is_some(), Ordering::SeqCst);
        *slot = now;
    }

    /// Why this instance forwards nothing, if its database's record says it
    /// belongs to another set-up.
    pub(super) fn set_up_problem(&self) -> Option<String> {
        if !self.foreign.load(Ordering::SeqCst) {
            return None;
        }
        self.set_up_problem
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(prefix: &str, cluster: Option<&str>) -> Config {
        let cluster = cluster.map_or(String::new(), |token| {
            format!(
                "[cluster]\ninstance_id = \"fg-a\"\nadvertise = \"http://10.0.0.1:8080\"\npeer_token = \"{token}\"\n"
            )
        });
        Config::parse(&format!(
            "[store]\nkind = \"s3\"\nbucket = \"b\"\nprefix = \"{prefix}\"\n[state]\nkind = \"postgres\"\nurl = \"postgres://fg@127.0.0.1/fg\"\n{cluster}[[route]]\nname = \"r\"\npath_prefix = \"/r/\"\nupstream = \"http://127.0.0.1:1/\"\nlease = \"l\"\n"
        ))
        .unwrap()
    }

    fn record_by(ours: &OurSetUp, id: &str) -> SetUpRecord {
        SetUpRecord {
            id: id.into(),
            store: ours.store.clone(),
            prefix: ours.prefix.clone(),
            mode: ours.mode.into(),
            recorded_by: ours.recorded_by.clone(),
            recorded_at: "2026-12-04T00:00:00Z".into(),
            mac: ours.seal(id, ours.mode),
        }
    }

    const TOKEN: &str = "0123456789abcdef0123";
    const STATE: &str = "postgres://127.0.0.1:5432/fg";

    /// The store and prefix decide; a cluster also needs its own seal; a
    /// single instance takes a cluster's record of its store and prefix (the
    /// anchor keeps the two apart while either runs).
    #[test]
    fn a_record_is_ours_only_for_our_store_prefix_and_seal() {
        let staging = OurSetUp::of(&cfg("staging/", Some(TOKEN)), STATE);
        let prod = OurSetUp::of(&cfg("prod/", Some(TOKEN)), STATE);
        let rec = record_by(&staging, "id1");
        assert_eq!(staging.judge(&rec), Verdict::Ours);
        let Verdict::Foreign(why) = prod.judge(&rec) else {
            panic!("another prefix's record taken")
        };
        assert!(
            why.contains("\"staging/\"") && why.contains("fg-a"),
            "{why}"
        );

        let other_token = OurSetUp::of(&cfg("staging/", Some("another-token-0123456789")), STATE);
        assert!(matches!(other_token.judge(&rec), Verdict::Foreign(w) if w.contains("peer token")));
        // Every sealed field counts: a record edited by hand does not verify.
        for edit in [
            |r: &mut SetUpRecord| r.id.push('x'),
            |r: &mut SetUpRecord| r.mode = "single".into(),
            |r: &mut SetUpRecord| r.mac = Some("00".repeat(32)),
            |r: &mut SetUpRecord| r.mac = Some("not hex".into()),
        ] {
            let mut r = rec.clone();
            edit(&mut r);
            assert!(matches!(staging.judge(&r), Verdict::Foreign(_)), "{r:?}");
        }
        let single = OurSetUp::of(&cfg("staging/", None), STATE);
        assert_eq!(single.judge(&rec), Verdict::Ours);
        let unsealed = record_by(&single, "id2");
        assert_eq!(unsealed.mac, None);
        assert_eq!(staging.judge(&unsealed), Verdict::Ours);
        assert!(matches!(
            OurSetUp::of(&cfg("prod/", None), STATE).judge(&unsealed),
            Verdict::Foreign(_)
        ));
    }
}
