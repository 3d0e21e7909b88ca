//! What a state *is*, never how it is named or reached (SPEC §10,
//! "Identity and generations").
//!
//! A connection string, a `data_dir` path or an instance id say where state is
//! read from, not whose it is nor how recent it is: two environments reach
//! their own databases by one `host:port/db`, and a copied `data_dir`, a
//! cloned volume or a restored backup carry every name of the original. Two
//! facts do not travel that way:
//!
//! - **A database's id**, 128 random bits written into it once
//!   (`fencegate_identity`, beside the schema), which gate objects name in
//!   their `state` (`…?database_id=ID`). Two databases made apart never share
//!   one; a physical copy or a dump carries it, and is then told apart by —
//! - **the state's generation**, a counter kept in the state (sled's `meta`
//!   tree, or `fencegate_identity`) and raised, durably, before every gate
//!   object its instance writes, which carries it (`state_generation`). So
//!   while nothing is copied, no gate object of this state names a generation
//!   above the state's own; a state that finds one is older than what was
//!   sent from it — a copy or a restored backup — and is *fenced* before it
//!   sends anything ([`crate::queue::fence_restored`]).
//!
//! The neon pageserver's generation numbers and Kafka's producer epochs are
//! the same shape: a counter kept outside the copied state, compared with what
//! the state recorded.

use async_trait::async_trait;

use super::StateError;

/// The generation a state has recorded, and whether it was found older than
/// its gate objects and is not yet fenced.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Recorded {
    /// Raised before each gate object written from this state (0: never).
    pub generation: u64,
    /// Found older than a gate object written from it (a copy, a restore),
    /// and its queue not yet fenced: kept until [`Generations::fenced`], so
    /// that a crash between the finding and the fence finds it again.
    pub restored: bool,
}

/// The state's generation ([module docs](self)).
#[async_trait]
pub trait Generations: Send + Sync + 'static {
    /// What the state has recorded.
    async fn recorded(&self) -> Result<Recorded, StateError>;

    /// Raises the generation to `max(recorded, at_least) + 1` and, with
    /// `restored`, records that the state must be fenced; durable on return.
    /// The new generation.
    async fn advance(&self, at_least: u64, restored: bool) -> Result<u64, StateError>;

    /// The fence of a restored state is durable: the mark can go.
    async fn fenced(&self) -> Result<(), StateError>;
}

/// Before the first message of a newer epoch of a lease is sent, the state's
/// generation is raised and a gate object naming it written: a copy taken
/// before that send then finds itself older and fences its queue, however
/// soon after the send its original stopped. Epoch changes are rare; a
/// renewal out of turn costs a few store calls.
#[async_trait]
pub trait Checkpoint: Send + Sync + 'static {
    /// Whether the raise and the gate object were both written.
    async fn checkpoint(&self) -> bool;
}
