//! The owner check, once (SPEC §10.2): every write of a shard's owner — a
//! dedup claim or outcome, a mark, a queued message — holds only while no
//! newer generation holds the shard, and keeps the shard's owner row
//! share-locked until it commits. Dedup's statements, its batches and the
//! queue's transactions all take the check from here.

use tokio_postgres::Transaction;

use crate::state::Owner;

/// The shard's owner generation, its row share-locked: no newer generation holds the shard (`$SHARD`, `$GEN` are the writer's), and
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
const OWNER_GENERATION: &str = "COALESCE((SELECT o.generation FROM fencegate_owners o \
     WHERE o.shard = $SHARD FOR SHARE), 0)";

/// The owner rows of the shards in the int4 array `$1`, share-locked in shard
/// order (a batch writes under several owners at once): the same lock as
/// [`owner_ok`], for a `WITH owners AS MATERIALIZED (…)` of a batch.
macro_rules! owners_for_share {
    () => {
        "SELECT shard, generation FROM fencegate_owners WHERE shard = ANY($1::int4[]) \
         ORDER BY shard FOR SHARE"
    };
}
pub(crate) use owners_for_share;

/// The condition "no newer generation holds shard `$shard`" for a writer of
/// generation `$generation` (statement parameter numbers), locking the row.
pub(crate) fn owner_ok(shard: usize, generation: usize) -> String {
    format!(
        "{} <= ${generation}",
        OWNER_GENERATION.replace("$SHARD", &format!("${shard}"))
    )
}

/// [`owner_ok`] as a step of a transaction: `Ok(Err(stored))` when a newer
/// generation (`stored`) holds `owner`'s shard; the row stays share-locked
/// until the transaction ends either way.
pub(crate) async fn owner_holds(
    tx: &Transaction<'_>,
    owner: Owner,
) -> Result<Result<(), crate::state::Generation>, tokio_postgres::Error> {
    let sql = format!("SELECT {}", OWNER_GENERATION.replace("$SHARD", "$1"));
    let stored: i64 = tx
        .query_one(&sql, &[&i32::try_from(owner.shard).unwrap_or(i32::MAX)])
        .await?
        .get(0);
    let stored = crate::state::Generation::new(u64::try_from(stored).unwrap_or(0));
    Ok(if stored > owner.generation {
        Err(stored)
    } else {
        Ok(())
    })
}
