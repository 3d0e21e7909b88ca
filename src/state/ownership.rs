//! Shard ownership and membership (SPEC §10.2): the owner rows a cluster's
//! instances take, renew and release, and their membership beats. Not dedup
//! state: only a backend several instances share has them (PostgreSQL), and
//! the cluster's keeper is their only user.

use async_trait::async_trait;

use super::StateError;

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
    pub generation: u64,
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

    /// Takes `shard` for `id`: a new generation (one above the row's), only if
    /// the row is still exactly as seen — `seen` its `(generation, renewals)`,
    /// `None` when it had no row. Returns the new generation, or `None` when
    /// the row had changed (someone renewed or took it). Waits for every state
    /// write of the older generation in progress (the owner row's lock), so
    /// none commits after it.
    async fn take_shard(
        &self,
        shard: u32,
        seen: Option<(u64, u64)>,
        id: &str,
        advertise: &str,
        ttl: std::time::Duration,
    ) -> Result<Option<u64>, StateError>;

    /// Renews every `(shard, generation)` of `held` that `id` still owns, in one
    /// statement; returns those renewed with their renewal count. Waits for
    /// the answer at least `patience` (and at least the store's own timeout):
    /// a renewal counts from its send, so one answered late but before the
    /// owner's deadline still extends its window (SPEC §10.2).
    async fn renew_shards(
        &self,
        id: &str,
        held: &[(u32, u64)],
        ttl: std::time::Duration,
        patience: std::time::Duration,
    ) -> Result<Vec<(u32, u64, u64)>, StateError>;

    /// Releases `shard` held by `id` under `generation` (a handover): a
    /// successor may take it at once. Whether it was released.
    async fn release_shard(
        &self,
        id: &str,
        shard: u32,
        generation: u64,
    ) -> Result<bool, StateError>;

    /// Membership, advisory: counts a beat of `id` and returns every member's
    /// beat count (liveness is judged by watching a count change on the
    /// caller's monotonic clock, never by the database's clock).
    async fn beat(&self, id: &str) -> Result<Vec<(String, u64)>, StateError>;

    /// A graceful stop: `id` is no longer a member.
    async fn leave(&self, id: &str) -> Result<(), StateError>;
}
