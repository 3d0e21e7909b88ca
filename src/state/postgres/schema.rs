//! The PostgreSQL schema fencegate owns: created or migrated at start-up, inside
//! one transaction holding an advisory lock (several instances starting at once
//! do not race), its version kept in a table of its own. A database whose schema
//! is newer than this build understands is refused.

use tokio_postgres::Client;

use crate::state::StateError;

/// The schema version this build writes and understands.
pub const VERSION: i32 = 13;

/// `pg_advisory_xact_lock` key: "fencegat" in ASCII.
const LOCK_KEY: i64 = 0x6665_6e63_6567_6174;

/// Epochs are u64; PostgreSQL has no unsigned type. This maps them onto `bigint`
/// keeping their order (so `GREATEST` and `<` work on marks).
pub fn epoch_to_sql(e: u64) -> i64 {
    (e ^ (1 << 63)) as i64
}

/// The inverse of [`epoch_to_sql`].
pub(crate) fn epoch_from_sql(v: i64) -> u64 {
    (v as u64) ^ (1 << 63)
}

/// Each step takes the schema from version `i` to `i + 1`.
const MIGRATIONS: &[&str] = &[
    // 0 → 1
    "CREATE TABLE fencegate_owners (
        shard integer PRIMARY KEY,
        generation bigint NOT NULL
    );
    CREATE TABLE fencegate_marks (
        lease text PRIMARY KEY,
        shard integer NOT NULL,
        mark bigint NOT NULL,
        drained bigint NOT NULL,
        owner_generation bigint NOT NULL
    );
    CREATE TABLE fencegate_dedup (
        route text NOT NULL,
        key text NOT NULL,
        shard integer NOT NULL,
        state smallint NOT NULL,
        fingerprint bytea NOT NULL,
        epoch bigint NOT NULL,
        owner_generation bigint NOT NULL,
        created_ms bigint NOT NULL,
        updated_ms bigint NOT NULL,
        status smallint,
        header_names text[],
        header_values bytea[],
        body bytea,
        PRIMARY KEY (route, key)
    );
    CREATE INDEX fencegate_dedup_by_state ON fencegate_dedup (state, route, key);
    CREATE INDEX fencegate_dedup_done_by_age ON fencegate_dedup (created_ms) WHERE state = 1;
    CREATE INDEX fencegate_dedup_in_flight_by_shard ON fencegate_dedup (shard) WHERE state = 0;",
    // 1 → 2: the request's method and path (NULL in older records), and
    // listings oldest first.
    "ALTER TABLE fencegate_dedup ADD COLUMN method text, ADD COLUMN path text;
    CREATE INDEX fencegate_dedup_by_state_age ON fencegate_dedup (state, created_ms, route, key);",
    // 2 → 3: cluster membership, advisory (balancing shards; SPEC §10.2).
    "CREATE TABLE fencegate_members (
        instance_id text PRIMARY KEY,
        seen_at timestamptz NOT NULL
    );",
    // 3 → 4: a `done` record expires a TTL after it became done (`updated_ms`),
    // not after its creation: the sweep's index follows. Existing rows need no
    // change: every transition to done has always set `updated_ms`.
    "CREATE INDEX fencegate_dedup_done_by_done_time ON fencegate_dedup (updated_ms) WHERE state = 1;
    DROP INDEX IF EXISTS fencegate_dedup_done_by_age;",
    // 4 → 5: batched writes (issue 27). `claim` numbers a claim while it is in
    // flight (an uncertain batch settles exactly its own claims); `headers`
    // keeps a response's headers as one value (a batch of outcomes is one array
    // per column; PostgreSQL arrays cannot nest unevenly). Older records keep
    // `header_names`/`header_values` and are read as before. Adding nullable
    // columns rewrites nothing.
    "ALTER TABLE fencegate_dedup ADD COLUMN claim bigint, ADD COLUMN headers bytea;",
    // 5 → 6: shard ownership in the database (SPEC §10.2, issue 28): the owner
    // row names its instance, counts its renewals (a successor watches them on
    // its own clock), and shows its expiry on the database's clock; the
    // previous tenure's owner and last renewal are kept for inspection; the
    // owner's own gate_ttl (`ttl_ms`) is what a contender waits; a release
    // names the generation it released (`released_generation`: an owner set
    // to NULL by hand is not a release), and rows are never deleted (a
    // trigger refuses it: a deleted row would be free at once). A
    // membership row counts its beats the same way.
    "ALTER TABLE fencegate_owners
        ADD COLUMN owner text,
        ADD COLUMN advertise text,
        ADD COLUMN renewals bigint NOT NULL DEFAULT 0,
        ADD COLUMN expires_at timestamptz,
        ADD COLUMN renewed_at timestamptz,
        ADD COLUMN taken_at timestamptz,
        ADD COLUMN previous_owner text,
        ADD COLUMN previous_renewed_at timestamptz,
        ADD COLUMN ttl_ms bigint,
        ADD COLUMN released_generation bigint;
    CREATE OR REPLACE FUNCTION fencegate_owners_kept() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        RAISE EXCEPTION 'fencegate_owners rows are never deleted: a deleted row would let another instance take the shard at once, beside its live owner. To move a shard, stop its owner (SIGTERM hands it over) or let its row go unrenewed (kill the owner: it is taken after gate_ttl + grace_ms)'
            USING ERRCODE = 'restrict_violation';
    END $$;
    DROP TRIGGER IF EXISTS fencegate_owners_kept ON fencegate_owners;
    CREATE TRIGGER fencegate_owners_kept BEFORE DELETE ON fencegate_owners
        FOR EACH ROW EXECUTE FUNCTION fencegate_owners_kept();
    DROP TRIGGER IF EXISTS fencegate_owners_not_truncated ON fencegate_owners;
    CREATE TRIGGER fencegate_owners_not_truncated BEFORE TRUNCATE ON fencegate_owners
        FOR EACH STATEMENT EXECUTE FUNCTION fencegate_owners_kept();
    ALTER TABLE fencegate_members ADD COLUMN beats bigint NOT NULL DEFAULT 0;",
    // 6 → 7: one index fewer to write (issue 27). `(state, route, key)` was
    // kept beside `(state, created_ms, route, key)`, which answers every query
    // it did (listings and counts by state, oldest first); each claim and
    // each outcome wrote both. Dropping it saved ~2 of the ~12 WAL records a
    // request writes.
    "DROP INDEX IF EXISTS fencegate_dedup_by_state;",
    // 7 → 8: the set-up this database (or schema) belongs to (SPEC §10, issue
    // 39): one row, written by the first instance that starts on it, read by
    // every other at start-up and while it runs ([`super::postgres::set_up_record`]).
    // Two set-ups in one database share marks and answer each other's retries.
    "CREATE TABLE fencegate_set_up (
        one boolean PRIMARY KEY DEFAULT true CHECK (one),
        id text NOT NULL,
        store text NOT NULL,
        prefix text NOT NULL,
        mode text NOT NULL,
        recorded_by text NOT NULL,
        recorded_at timestamptz NOT NULL DEFAULT now(),
        mac text
    );",
    // 8 → 9: queued delivery (SPEC §11, issue 38). A message per (route,
    // key), its request kept once; `(lease, seq)` of the messages not settled
    // is each lease's queue in order. Every write is conditioned on the
    // shard's owner generation ([`crate::queue::postgres`]).
    "CREATE TABLE fencegate_queue (
        route text NOT NULL,
        key text NOT NULL,
        lease text NOT NULL,
        shard integer NOT NULL,
        seq bigint NOT NULL,
        epoch bigint NOT NULL,
        status text NOT NULL,
        settled boolean NOT NULL,
        accepted_ms bigint NOT NULL,
        updated_ms bigint NOT NULL,
        owner_generation bigint NOT NULL,
        message text NOT NULL,
        request bytea NOT NULL,
        PRIMARY KEY (route, key)
    );
    CREATE UNIQUE INDEX fencegate_queue_order ON fencegate_queue (lease, seq) WHERE NOT settled;
    CREATE INDEX fencegate_queue_settled_by_age ON fencegate_queue (updated_ms) WHERE settled;
    CREATE TABLE fencegate_queue_leases (
        lease text PRIMARY KEY,
        next_seq bigint NOT NULL,
        sent_epoch bigint
    );",
    // 9 → 10: the messages that may still be sent (pending, delivering,
    // failed), by lease and by route, so that a takeover's and a reload's
    // check (SPEC §11: no direct route past them, no route moved off them)
    // reads a few index entries instead of every message kept for the TTL.
    "CREATE INDEX fencegate_queue_held_by_lease ON fencegate_queue (lease, route)
        WHERE status IN ('pending', 'delivering', 'failed');
    CREATE INDEX fencegate_queue_held_by_route ON fencegate_queue (route, lease)
        WHERE status IN ('pending', 'delivering', 'failed');",
    // 10 → 11: per lease, the restore of the state (a generation,
    // `fencegate_identity.restored`) its queue was last fenced for (SPEC §10,
    // identity and generations; [`crate::queue::Queue::fence_if_restored`]).
    "ALTER TABLE fencegate_queue_leases ADD COLUMN restore_fenced bigint NOT NULL DEFAULT 0;",
    // 11 → 12: an operator's pauses of a queued route or a lease (SPEC §11,
    // pause and resume), read by whichever member serves the lease; and bulk
    // jobs (recovering in bulk), progressed by whichever members serve the
    // leases they edit.
    "CREATE TABLE fencegate_queue_paused (
        kind text NOT NULL,
        name text NOT NULL,
        since_ms bigint NOT NULL,
        PRIMARY KEY (kind, name)
    );
    CREATE TABLE fencegate_queue_jobs (
        id text PRIMARY KEY,
        job text NOT NULL
    );",
    // 12 → 13: the database's work per dedup request (issue 51). Each claim
    // and each outcome wrote `(state, created_ms, route, key)`, ~113 bytes of
    // WAL each time (`pg_walinspect`: 5.7 index leaf inserts a request); a
    // record is now indexed by what each state is looked up for, each index
    // partial, so a claim writes the primary key and the in-flight index and
    // an outcome the primary key and the done index. Listings name their
    // state in the statement (a partial index is not chosen for `state = $1`
    // under a generic plan); done records are swept through the time of
    // their claim (`updated_ms >= created_ms`, so every record done before
    // the cut-off was claimed before it). The cost: listing one route's done
    // records walks every done record's index entry and reads its row (the
    // old index held the route): ~0.8 s at 500,000 done records for a route
    // with few, where it was ~0.1 s — an operator's query, paid once, against
    // two index entries less on every request.
    "DROP INDEX IF EXISTS fencegate_dedup_by_state_age;
    DROP INDEX IF EXISTS fencegate_dedup_done_by_done_time;
    CREATE INDEX IF NOT EXISTS fencegate_dedup_done_by_claim_time ON fencegate_dedup (created_ms) WHERE state = 1;
    CREATE INDEX IF NOT EXISTS fencegate_dedup_in_doubt_by_age ON fencegate_dedup (created_ms, route, key) WHERE state = 2;",
];

/// Creates `schema` when missing. Looked up first: `CREATE SCHEMA IF NOT
/// EXISTS` needs the CREATE privilege on the database even when the schema
/// exists, and a role given a schema by its administrator may lack it. The
/// name is an unquoted identifier (checked with the config).
pub(super) async fn ensure_schema(
    tx: &tokio_postgres::Transaction<'_>,
    schema: &str,
) -> Result<(), tokio_postgres::Error> {
    let exists = tx
        .query_opt("SELECT 1 FROM pg_namespace WHERE nspname = $1", &[&schema])
        .await?
        .is_some();
    if !exists {
        tx.batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
            .await?;
    }
    Ok(())
}

/// Creates or migrates the schema — in `schema` when set (`[state] schema`,
/// created if missing; the connection's `search_path` names it), else where
/// the connection's `search_path` creates tables; returns the version found
/// before.
pub async fn migrate(client: &mut Client, schema: Option<&str>) -> Result<i32, StateError> {
    let err = |e: tokio_postgres::Error| {
        StateError::Write(format!("schema migration: {}", super::error::describe(&e)))
    };
    let tx = client.transaction().await.map_err(err)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&LOCK_KEY])
        .await
        .map_err(err)?;
    if let Some(schema) = schema {
        ensure_schema(&tx, schema).await.map_err(err)?;
    }
    tx.batch_execute("CREATE TABLE IF NOT EXISTS fencegate_schema (version integer NOT NULL)")
        .await
        .map_err(err)?;
    let found: i32 = match tx
        .query_opt("SELECT version FROM fencegate_schema", &[])
        .await
        .map_err(err)?
    {
        Some(row) => row.get(0),
        None => {
            tx.execute("INSERT INTO fencegate_schema (version) VALUES (0)", &[])
                .await
                .map_err(err)?;
            0
        }
    };
    if found > VERSION {
        return Err(StateError::Open {
            path: "[state] url".into(),
            detail: format!(
                "the database's fencegate schema is version {found}, newer than this build understands ({VERSION}): run a newer fencegate"
            ),
        });
    }
    for step in &MIGRATIONS[usize::try_from(found).unwrap_or(0)..] {
        tx.batch_execute(step).await.map_err(err)?;
    }
    tx.execute("UPDATE fencegate_schema SET version = $1", &[&VERSION])
        .await
        .map_err(err)?;
    tx.commit().await.map_err(err)?;
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epochs_keep_their_order_in_sql() {
        let es = [
            0,
            1,
            7,
            1 << 62,
            (1 << 63) - 1,
            1 << 63,
            u64::MAX - 1,
            u64::MAX,
        ];
        for w in es.windows(2) {
            assert!(epoch_to_sql(w[0]) < epoch_to_sql(w[1]), "{w:?}");
        }
        for e in es {
            assert_eq!(epoch_from_sql(epoch_to_sql(e)), e);
        }
    }
}
