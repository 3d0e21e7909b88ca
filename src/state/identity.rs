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

/// The generation a state has recorded, and the latest restore found in it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Recorded {
    /// Raised before each gate object written from this state (0: never).
    pub generation: u64,
    /// The generation at which a copy or restore of this state was last
    /// found (0: never): each lease's queue is fenced once for it
    /// ([`crate::queue::fence_restored`]), by whoever sends its messages next.
    pub restored: u64,
}

/// The state's generation ([module docs](self)).
#[async_trait]
pub trait Generations: Send + Sync + 'static {
    /// What the state has recorded.
    async fn recorded(&self) -> Result<Recorded, StateError>;

    /// Raises the generation to `max(recorded, seen) + 1`, durably. With
    /// `found`, `seen` is a gate object's generation above the state's own —
    /// the state is a copy — and the restore is recorded at the new
    /// generation, unless one was recorded since `seen` already (another
    /// instance found the same copy first). What is recorded then.
    async fn advance(&self, seen: u64, found: bool) -> Result<Recorded, StateError>;
}

/// At start-up: the highest generation a gate object of this state names,
/// `seen`, against the state's own. Raises the generation past both and
/// records a restore if the state is older; logs it.
pub async fn start(gens: &dyn Generations, state: &str, seen: u64) -> Result<Recorded, StateError> {
    let before = gens.recorded().await?;
    let found = seen > before.generation;
    if found {
        tracing::error!(
            state,
            recorded = before.generation,
            gate_objects = seen,
            "this state is older than its own gate objects: a copy of it, or a restored backup. What was sent from it after the copy is not in it: each lease's queued messages are fenced before any is sent (SPEC §10, identity and generations)"
        );
    }
    gens.advance(seen, found).await
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

/// Generations kept in memory: for tests of what keeps them (a state that
/// is never copied).
#[derive(Debug, Default)]
pub struct InMemory(std::sync::Mutex<Recorded>);

#[async_trait]
impl Generations for InMemory {
    async fn recorded(&self) -> Result<Recorded, StateError> {
        Ok(*self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }

    async fn advance(&self, seen: u64, found: bool) -> Result<Recorded, StateError> {
        let mut r = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let generation = r.generation.max(seen).saturating_add(1);
        if found && r.restored < seen {
            r.restored = generation;
        }
        r.generation = generation;
        Ok(*r)
    }
}
