//! The database's own id and the state's generation (SPEC §10, "Identity and
//! generations"; [`crate::state::identity`]): one row of
//! `fencegate_identity`, written once beside the schema, before this
//! instance's first gate object names it — so it is made outside the
//! versioned migrations, which wait until the instance holds its place.

use async_trait::async_trait;

use super::{error, PostgresState, StateError};
use crate::state::identity::{Generations, Recorded};

/// `pg_advisory_xact_lock` key of the identity's creation ("fgident" + 1).
const LOCK_KEY: i64 = 0x6667_6964_656e_7401;

impl PostgresState {
    /// The database's id, if it has one (read only: a database of an older
    /// build, or a fresh one, has none).
    pub async fn database_id(&self) -> Result<Option<String>, StateError> {
        let exists: bool = self
            .with("looking for the database's id", |c| async move {
                c.query_one("SELECT to_regclass('fencegate_identity') IS NOT NULL", &[])
                    .await
            })
            .await?
            .get(0);
        if !exists {
            return Ok(None);
        }
        Ok(self
            .with("reading the database's id", |c| async move {
                c.query_opt("SELECT database_id FROM fencegate_identity", &[])
                    .await
            })
            .await?
            .map(|r| r.get(0)))
    }

    /// The database's id, made (128 random bits) when it has none. Called
    /// once the database was found free for this set-up, or its own
    /// ([`PostgresState::check_set_up`]); several instances starting at once
    /// read the one that was written.
    pub async fn ensure_database_id(&self) -> Result<String, StateError> {
        let err = |e: tokio_postgres::Error| {
            StateError::Write(format!("the database's id: {}", error::describe(&e)))
        };
        let mut client = self
            .pool
            .get()
            .await
            .map_err(|e| StateError::Write(format!("the database's id: no connection: {e}")))?;
        let tx = client.transaction().await.map_err(err)?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&LOCK_KEY])
            .await
            .map_err(err)?;
        if let Some(schema) = &self.config_schema {
            super::schema::ensure_schema(&tx, schema)
                .await
                .map_err(err)?;
        }
        tx.batch_execute(
            "CREATE TABLE IF NOT EXISTS fencegate_identity (
                one boolean PRIMARY KEY DEFAULT true CHECK (one),
                database_id text NOT NULL,
                generation bigint NOT NULL DEFAULT 0,
                restored bigint NOT NULL DEFAULT 0,
                created_at timestamptz NOT NULL DEFAULT now()
            )",
        )
        .await
        .map_err(err)?;
        let fresh = crate::set_up::new_id();
        tx.execute(
            "INSERT INTO fencegate_identity (database_id) VALUES ($1) ON CONFLICT (one) DO NOTHING",
            &[&fresh],
        )
        .await
        .map_err(err)?;
        let id: String = tx
            .query_one("SELECT database_id FROM fencegate_identity", &[])
            .await
            .map_err(err)?
            .get(0);
        tx.commit().await.map_err(err)?;
        Ok(id)
    }
}

#[async_trait]
impl Generations for PostgresState {
    async fn recorded(&self) -> Result<Recorded, StateError> {
        let row = self
            .with("reading the state's generation", |c| async move {
                c.query_opt("SELECT generation, restored FROM fencegate_identity", &[])
                    .await
            })
            .await?;
        Ok(row.map_or(Recorded::default(), |r| recorded_of(&r)))
    }

    async fn advance(&self, seen: u64, found: bool) -> Result<Recorded, StateError> {
        let seen = i64::try_from(seen).unwrap_or(i64::MAX - 1);
        // One statement: members starting together each raise it, and a
        // restore two of them found is recorded once.
        let row = self
            .with("raising the state's generation", |c| async move {
                c.query_one(
                    "UPDATE fencegate_identity SET generation = GREATEST(generation, $1) + 1, \
                     restored = CASE WHEN $2 AND restored <= $1 \
                     THEN GREATEST(generation, $1) + 1 ELSE restored END \
                     RETURNING generation, restored",
                    &[&seen, &found],
                )
                .await
            })
            .await?;
        Ok(recorded_of(&row))
    }
}

fn recorded_of(r: &tokio_postgres::Row) -> Recorded {
    Recorded {
        generation: u64::try_from(r.get::<_, i64>(0)).unwrap_or(0),
        restored: u64::try_from(r.get::<_, i64>(1)).unwrap_or(0),
    }
}
