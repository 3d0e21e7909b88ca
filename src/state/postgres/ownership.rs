//! Shard ownership rows (SPEC §10.2, issue 28): taking a shard, renewing every
//! shard an instance owns in one statement, releasing one, reading them all,
//! and membership beats. Each is one statement that commits on its own.
//!
//! Nothing here judges time on the database's clock: `expires_at` (`now()`) is
//! written for people to read. A successor judges a tenure over when it has
//! seen the row's `(generation, renewals)` unchanged for `gate_ttl + grace_ms`
//! on its own monotonic clock, and takes it with an `UPDATE` conditioned on
//! exactly that pair: a renewal that committed meanwhile, even one whose owner
//! never learnt of it, makes the take match no row.

use std::time::{Duration, UNIX_EPOCH};

use async_trait::async_trait;

use super::{PostgresState, StateError};
use crate::state::ownership::{Beats, Generation, Renewed, RowVersion};
use crate::state::{Owner, OwnerRow, OwnershipStore};

fn int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn uint(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

#[async_trait]
impl OwnershipStore for PostgresState {
    async fn owner_rows(&self) -> Result<Vec<OwnerRow>, StateError> {
        let rows = self
            .with("reading shard owners", |c| async move {
                let st = c
                    .prepare_cached(
                        "SELECT shard, generation, owner, advertise, renewals, \
                         (extract(epoch FROM expires_at) * 1000)::bigint, ttl_ms, \
                         released_generation IS NOT DISTINCT FROM generation AND owner IS NULL \
                         FROM fencegate_owners ORDER BY shard",
                    )
                    .await?;
                c.query(&st, &[]).await
            })
            .await?;
        Ok(rows
            .iter()
            .map(|r| {
                let ms: Option<i64> = r.get(5);
                OwnerRow {
                    shard: u32::try_from(r.get::<_, i32>(0)).unwrap_or(u32::MAX),
                    generation: Generation::new(uint(r.get(1))),
                    owner: r.get(2),
                    advertise: r.get(3),
                    renewals: uint(r.get(4)),
                    expires_at: ms.map(|m| UNIX_EPOCH + Duration::from_millis(uint(m))),
                    ttl: r
                        .get::<_, Option<i64>>(6)
                        .map(|t| Duration::from_millis(uint(t))),
                    released: r.get(7),
                }
            })
            .collect())
    }

    async fn take_shard(
        &self,
        shard: u32,
        seen: Option<RowVersion>,
        id: &str,
        advertise: &str,
        ttl: Duration,
    ) -> Result<Option<Generation>, StateError> {
        self.writable()?;
        let sh = i32::try_from(shard).unwrap_or(i32::MAX);
        let secs = ttl.as_secs_f64();
        let ttl_ms = int(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX));
        let row = self
            .with("taking a shard", |c| async move {
                match seen {
                    None => {
                        let st = c
                            .prepare_cached(
                                "INSERT INTO fencegate_owners AS o (shard, generation, owner, advertise, \
                                 renewals, expires_at, renewed_at, taken_at, ttl_ms) \
                                 VALUES ($1, 1, $2, $3, 0, now() + make_interval(secs => $4), now(), now(), $5) \
                                 ON CONFLICT (shard) DO NOTHING RETURNING generation",
                            )
                            .await?;
                        c.query_opt(&st, &[&sh, &id, &advertise, &secs, &ttl_ms]).await
                    }
                    Some(RowVersion {
                        generation,
                        renewals,
                    }) => {
                        // The row lock taken here waits for every state write
                        // share-locking it (`fenced::owner_ok`): none of the old
                        // generation commits after this.
                        let st = c
                            .prepare_cached(
                                "UPDATE fencegate_owners SET generation = generation + 1, \
                                 owner = $2, advertise = $3, renewals = 0, \
                                 expires_at = now() + make_interval(secs => $4), \
                                 renewed_at = now(), taken_at = now(), \
                                 previous_owner = owner, previous_renewed_at = renewed_at, ttl_ms = $7 \
                                 WHERE shard = $1 AND generation = $5 AND renewals = $6 \
                                 RETURNING generation",
                            )
                            .await?;
                        c.query_opt(
                            &st,
                            &[
                                &sh,
                                &id,
                                &advertise,
                                &secs,
                                &int(generation.get()),
                                &int(renewals),
                                &ttl_ms,
                            ],
                        )
                        .await
                    }
                }
            })
            .await?;
        self.committed();
        Ok(row.map(|r| Generation::new(uint(r.get(0)))))
    }

    async fn renew_shards(
        &self,
        id: &str,
        held: &[Owner],
        ttl: Duration,
        patience: Duration,
    ) -> Result<Vec<Renewed>, StateError> {
        self.writable()?;
        let shards: Vec<i32> = held
            .iter()
            .map(|h| i32::try_from(h.shard).unwrap_or(i32::MAX))
            .collect();
        let gens: Vec<i64> = held.iter().map(|h| int(h.generation.get())).collect();
        let secs = ttl.as_secs_f64();
        let ttl_ms = int(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX));
        let rows = self
            .with_timeout("renewing shards", patience.max(self.timeout), |c| async move {
                let st = c
                    .prepare_cached(
                        // The rows are locked in shard order first, as every
                        // batch write share-locks them: in plan order, a renewal
                        // and a batch of this instance could deadlock (one of
                        // them refused, sent again or renewed late).
                        "WITH locked AS MATERIALIZED (SELECT shard FROM fencegate_owners \
                           WHERE shard = ANY($2::integer[]) ORDER BY shard FOR NO KEY UPDATE) \
                         UPDATE fencegate_owners o SET renewals = o.renewals + 1, \
                         expires_at = now() + make_interval(secs => $4), renewed_at = now(), ttl_ms = $5 \
                         FROM unnest($2::integer[], $3::bigint[]) AS h(shard, generation) \
                         WHERE o.shard = h.shard AND o.generation = h.generation AND o.owner = $1 \
                           AND o.shard IN (SELECT shard FROM locked) \
                         RETURNING o.shard, o.generation, o.renewals",
                    )
                    .await?;
                c.query(&st, &[&id, &shards, &gens, &secs, &ttl_ms]).await
            })
            .await?;
        self.committed();
        Ok(rows
            .iter()
            .map(|r| Renewed {
                owner: Owner {
                    shard: u32::try_from(r.get::<_, i32>(0)).unwrap_or(u32::MAX),
                    generation: Generation::new(uint(r.get(1))),
                },
                renewals: uint(r.get(2)),
            })
            .collect())
    }

    async fn release_shard(&self, id: &str, held: Owner) -> Result<bool, StateError> {
        self.writable()?;
        let sh = i32::try_from(held.shard).unwrap_or(i32::MAX);
        let generation = int(held.generation.get());
        let n = self
            .with("releasing a shard", |c| async move {
                let st = c
                    .prepare_cached(
                        "UPDATE fencegate_owners SET owner = NULL, advertise = NULL, \
                         expires_at = now(), released_generation = generation \
                         WHERE shard = $1 AND generation = $2 AND owner = $3",
                    )
                    .await?;
                c.execute(&st, &[&sh, &generation, &id]).await
            })
            .await?;
        self.committed();
        Ok(n == 1)
    }

    async fn beat(&self, id: &str) -> Result<Vec<Beats>, StateError> {
        self.writable()?;
        let rows = self
            .with("cluster heartbeat", |c| async move {
                let st = c
                    .prepare_cached(
                        "INSERT INTO fencegate_members AS m (instance_id, seen_at, beats) \
                         VALUES ($1, now(), 1) \
                         ON CONFLICT (instance_id) DO UPDATE SET seen_at = now(), beats = m.beats + 1",
                    )
                    .await?;
                c.execute(&st, &[&id]).await?;
                let st = c
                    .prepare_cached(
                        "SELECT instance_id, beats FROM fencegate_members ORDER BY instance_id",
                    )
                    .await?;
                c.query(&st, &[]).await
            })
            .await?;
        Ok(rows
            .iter()
            .map(|r| Beats {
                instance: r.get(0),
                count: uint(r.get(1)),
            })
            .collect())
    }

    async fn leave(&self, id: &str) -> Result<(), StateError> {
        self.writable()?;
        self.with("leaving the cluster", |c| async move {
            let st = c
                .prepare_cached("DELETE FROM fencegate_members WHERE instance_id = $1")
                .await?;
            c.execute(&st, &[&id]).await
        })
        .await
        .map(drop)
    }
}
