//! Shard ownership and membership (SPEC §10.2): the owner rows a cluster's
//! instances take, renew and release, and their membership beats. Not dedup
//! state: only a backend several instances share has them (PostgreSQL), and
//! the cluster's keeper is their only user.

use async_trait::async_trait;

use super::{Owner, StateError};

/// A shard's owner generation (SPEC §10.2): raised by every take of the
/// shard's row, carried by every state write of the tenure, and what a
/// deposed owner's writes are refused by. Not an epoch (a lease's, in the
/// lease store) and not a shard number: its own type, so that none is passed
/// for another. Ordered; no arithmetic but [`Generation::next`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Generation(u64);

impl Generation {
    /// A single instance's (SPEC §10.1): it owns its one shard without a
    /// row, and no take writes it.
    pub const SINGLE: Generation = Generation(0);

    /// The generation of a shard's first take (a row inserted).
    pub const FIRST: Generation = Generation(1);

    /// The generation as stored (`fencegate_owners.generation`).
    pub const fn new(n: u64) -> Generation {
        Generation(n)
    }

    /// The number stored and shown.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// The generation a take of a row at this one writes.
    pub fn next(self) -> Generation {
        Generation(self.0.saturating_add(1))
    }
}

impl std::fmt::Display for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// A row as a contender watched it: the `(generation, renewals)` a take is
/// conditioned on. Any renewal or take since changes it, and the take then
/// matches no row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowVersion {
    /// The tenure's generation.
    pub generation: Generation,
    /// Its renewals so far.
    pub renewals: u64,
}

/// A renewal's result for one held shard: its row, renewed once more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Renewed {
    /// The shard and the generation it is still held under.
    pub owner: Owner,
    /// The tenure's renewals, this one included.
    pub renewals: u64,
}

/// An instance's membership beats as counted in the database (advisory: the
/// count is watched for change on the caller's clock).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Beats {
    /// The instance's id.
    pub instance: String,
    /// Its beats so far.
    pub count: u64,
}

/// A shard's ownership row as the database holds it (SPEC §10.2): who owns the
/// shard, under which generation, and how many renewals the tenure has had. A
/// successor judges expiry by watching `(generation, renewals)` stay unchanged
/// on its own monotonic clock, never by `expires_at` (the database's clock, for
/// display only).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerRow {
    /// The shard.
    pub shard: u32,
    /// The tenure's generation: every state write of the shard carries it.
    pub generation: Generation,
    /// The owning instance; `None` when released (free at once).
    pub owner: Option<String>,
    /// The owner's advertised proxy URL.
    pub advertise: Option<String>,
    /// Renewals of this tenure so far.
    pub renewals: u64,
    /// `now() + gate_ttl` at the latest renewal, on the database's clock (shown,
    /// never judged on).
    pub expires_at: Option<std::time::SystemTime>,
    /// The owner's own `gate_ttl`, as it wrote it with its take and renewals:
    /// it aborts what it has in flight that long after a renewal's send, so a
    /// contender configured with a shorter one waits this long (members with
    /// different `gate_ttl`, as during a rolling config change).
    pub ttl: Option<std::time::Duration>,
    /// Released by its owner (a handover): free at once. An owner set to NULL
    /// any other way (by hand) is not a release: the row is watched like a
    /// live one.
    pub released: bool,
}

/// Owner rows and membership, in the database several instances share.
#[async_trait]
pub trait OwnershipStore: Send + Sync + 'static {
    /// Every shard's row ([`OwnerRow`]), in shard order.
    async fn owner_rows(&self) -> Result<Vec<OwnerRow>, StateError>;

    /// Takes `shard` for `id`: a new generation (the row's [`Generation::next`],
    /// or [`Generation::FIRST`]), only if the row is still exactly as seen —
    /// `seen` its version, `None` when it had no row. Returns the new generation, or `None` when
    /// the row had changed (someone renewed or took it). Waits for every state
    /// write of the older generation in progress (the owner row's lock), so
    /// none commits after it.
    async fn take_shard(
        &self,
        shard: u32,
        seen: Option<RowVersion>,
        id: &str,
        advertise: &str,
        ttl: std::time::Duration,
    ) -> Result<Option<Generation>, StateError>;

    /// Renews every shard of `held` that `id` still owns under the generation
    /// given (each an [`Owner`]: the shard and its generation), in one
    /// statement; returns those renewed with their renewal count. Waits for
    /// the answer at least `patience` (and at least the store's own timeout):
    /// a renewal counts from its send, so one answered late but before the
    /// owner's deadline still extends its window (SPEC §10.2).
    async fn renew_shards(
        &self,
        id: &str,
        held: &[Owner],
        ttl: std::time::Duration,
        patience: std::time::Duration,
    ) -> Result<Vec<Renewed>, StateError>;

    /// Releases the shard `id` holds as `held` (its shard and generation; a
    /// handover): a successor may take it at once. Whether it was released.
    async fn release_shard(&self, id: &str, held: Owner) -> Result<bool, StateError>;

    /// Membership, advisory: counts a beat of `id` and returns every member's
    /// beat count (liveness is judged by watching a count change on the
    /// caller's monotonic clock, never by the database's clock).
    async fn beat(&self, id: &str) -> Result<Vec<Beats>, StateError>;

    /// A graceful stop: `id` is no longer a member.
    async fn leave(&self, id: &str) -> Result<(), StateError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A generation orders, shows and advances as the number stored.
    #[test]
    fn a_generation_is_the_stored_number_ordered_and_raised_by_one() {
        assert_eq!(Generation::FIRST.get(), 1);
        assert_eq!(Generation::FIRST.next(), Generation::new(2));
        assert!(Generation::new(2) > Generation::FIRST);
        assert_eq!(Generation::new(7).to_string(), "7");
        assert_eq!(Generation::new(u64::MAX).next(), Generation::new(u64::MAX));
    }
}
