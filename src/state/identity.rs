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
//!   tree, or `fencegate_identity`). Each gate object its instance writes on
//!   shard 0 carries the generation the state had (`state_generation`), and
//!   the state is raised past it, durably, once the object is written. So
//!   while nothing is copied, every gate object of this state names a
//!   generation below the state's own; a state that finds one at or above
//!   its own is older than something sent from it — a copy or a restored
//!   backup — and each lease's queue is *fenced* before any of its messages
//!   is sent ([`crate::queue::fence_restored`]).
//!
//! The neon pageserver's generation numbers and Kafka's producer epochs are
//! the same shape: a counter kept outside the copied state, compared with what
//! the state recorded.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use super::StateError;

/// The generation a state has recorded, and the latest restore found in it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Recorded {
    /// Carried by each gate object written from this state, and raised past
    /// it once the object is written (0: never raised).
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
    /// `found`, `seen` is a gate object's generation at or above the state's
    /// own — the state is a copy — and the restore is recorded at the new
    /// generation, unless one was recorded above `seen` already (another
    /// instance found the same copy first). What is recorded then.
    async fn advance(&self, seen: u64, found: bool) -> Result<Recorded, StateError>;
}

/// What a writer of gate objects keeps of its state's generation: what the
/// next object carries, and the raise after it.
pub struct Stamp {
    inner: Arc<Inner>,
}

struct Inner {
    gens: Arc<dyn Generations>,
    /// The state's generation as last raised here.
    generation: AtomicU64,
    /// The next object may carry `generation`: the state's generation is
    /// known ([`Stamp::find`]) and no object carries it yet (the last raise
    /// succeeded). Otherwise objects carry none — never one the state has
    /// not been raised past — and [`Stamp::written`] raises nothing until
    /// the state's generation is known.
    fresh: AtomicBool,
    /// Whether the generation is known ([`Stamp::find`] ran).
    found: AtomicBool,
    /// A raise that failed is being retried in the background.
    retrying: AtomicBool,
    /// [`Recorded::restored`], as found at start-up.
    restored: AtomicU64,
}

/// How often a raise that failed is tried again: well within the time a
/// starting cluster member waits before it concludes (`settle`).
const RETRY: Duration = Duration::from_millis(250);

impl Stamp {
    /// A stamp that stamps and raises nothing until [`Stamp::find`].
    pub fn new(gens: Arc<dyn Generations>) -> Stamp {
        Stamp {
            inner: Arc::new(Inner {
                gens,
                generation: AtomicU64::new(0),
                fresh: AtomicBool::new(false),
                found: AtomicBool::new(false),
                retrying: AtomicBool::new(false),
                restored: AtomicU64::new(0),
            }),
        }
    }

    /// At start-up: `seen`, the highest generation among the state's latest
    /// gate objects, against `before`, the state's generation as read before
    /// anything of this start was written. One at or above it was written
    /// after the state was copied: the restore is recorded (and logged).
    /// `settle`: writers other than this one may be between an object and
    /// its raise (a cluster's members), so a finding is confirmed by reading
    /// the state again after that long. The state is raised past `seen`
    /// either way; from then on objects carry its generation.
    pub async fn find(
        &self,
        state: &str,
        before: Recorded,
        seen: Option<u64>,
        settle: Option<Duration>,
    ) -> Result<(), StateError> {
        let inner = &self.inner;
        let older = |r: &Recorded| seen.is_some_and(|s| s >= r.generation);
        let mut recorded = before;
        if older(&recorded) {
            if let Some(d) = settle {
                tokio::time::sleep(d).await;
                recorded = inner.gens.recorded().await?;
            }
        }
        let found = older(&recorded);
        if found {
            tracing::error!(
                state,
                recorded = recorded.generation,
                gate_objects = seen.unwrap_or(0),
                "this state is older than its own gate objects: a copy of it, or a restored backup. What was sent from it after the copy is not in it: each lease's queued messages are fenced before any is sent (SPEC §10, identity and generations)"
            );
        }
        let now = inner.gens.advance(seen.unwrap_or(0), found).await?;
        inner.generation.store(now.generation, Ordering::SeqCst);
        inner.restored.store(now.restored, Ordering::SeqCst);
        inner.found.store(true, Ordering::SeqCst);
        inner.fresh.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// What the next gate object carries as `state_generation`.
    pub fn next(&self) -> Option<u64> {
        let inner = &self.inner;
        inner
            .fresh
            .load(Ordering::SeqCst)
            .then(|| inner.generation.load(Ordering::SeqCst))
    }

    /// After a gate object carrying `stamped` was created — or a create
    /// whose outcome is not known: raising is harmless — the state raised
    /// past it, durably, waiting for it. Whether the object is a checkpoint:
    /// it carried a generation and nobody raised the state between that and
    /// this raise, so every copy taken before this raise is at or below it.
    /// A raise that fails is tried again in the background
    /// ([`Stamp::written_soon`]).
    pub async fn written(&self, stamped: Option<u64>) -> bool {
        let inner = &self.inner;
        if !inner.found.load(Ordering::SeqCst) {
            return false;
        }
        match Inner::raise(inner).await {
            Ok(now) => stamped.is_some_and(|g| now == g + 1),
            Err(e) => {
                tracing::warn!(error = %e, "could not raise the state's generation after a gate object; trying again");
                self.written_soon();
                false
            }
        }
    }

    /// [`Stamp::written`] without waiting: a renewal must not wait on the
    /// state (a slow database would hold the next renewal back past the
    /// self-fence). Until the raise lands, objects carry no generation; one
    /// that fails is tried again every 250 ms until it succeeds — until then
    /// the latest object may name the state's own generation, which a
    /// starting cluster member would take for a copy.
    pub fn written_soon(&self) {
        let inner = &self.inner;
        if !inner.found.load(Ordering::SeqCst) {
            return;
        }
        inner.fresh.store(false, Ordering::SeqCst);
        if inner.retrying.swap(true, Ordering::SeqCst) {
            return;
        }
        let inner = self.inner.clone();
        tokio::spawn(async move {
            let mut said = false;
            loop {
                match Inner::raise(&inner).await {
                    Ok(_) => break,
                    Err(e) if !said => {
                        said = true;
                        tracing::warn!(error = %e, "could not raise the state's generation after a gate object; trying again");
                    }
                    Err(_) => {}
                }
                tokio::time::sleep(RETRY).await;
            }
            inner.retrying.store(false, Ordering::SeqCst);
        });
    }

    /// The generation at which the state was last found restored or copied
    /// (0: never).
    pub fn restored(&self) -> u64 {
        self.inner.restored.load(Ordering::SeqCst)
    }
}

impl Inner {
    /// Raises the state past the generation last raised here; the new one.
    async fn raise(inner: &Inner) -> Result<u64, StateError> {
        let base = inner.generation.load(Ordering::SeqCst);
        let r = inner.gens.advance(base, false).await?;
        inner.generation.store(r.generation, Ordering::SeqCst);
        inner.fresh.store(true, Ordering::SeqCst);
        Ok(r.generation)
    }
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
        if found && r.restored <= seen {
            r.restored = generation;
        }
        r.generation = generation;
        Ok(*r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh state, and one whose objects all lie below it, is no copy; an
    /// object at or above it makes it one, recorded once; a raise after an
    /// object is a checkpoint only when nobody raised in between.
    async fn started(gens: Arc<InMemory>, seen: Option<u64>) -> Stamp {
        let stamp = Stamp::new(gens.clone());
        let before = gens.recorded().await.unwrap();
        stamp.find("s", before, seen, None).await.unwrap();
        stamp
    }

    /// A fresh state, and one whose objects all lie below it, is no copy; an
    /// object at or above it makes it one, recorded once; a raise after an
    /// object is a checkpoint only when nobody raised in between.
    #[tokio::test]
    async fn a_state_at_or_below_its_own_objects_is_a_copy() {
        let gens = Arc::new(InMemory::default());
        let idle = Stamp::new(gens.clone());
        assert_eq!(idle.next(), None, "nothing stamped before the finding");
        assert!(!idle.written(None).await);
        assert_eq!(gens.recorded().await.unwrap().generation, 0, "nor raised");
        let fresh = started(gens.clone(), None).await;
        assert_eq!(fresh.restored(), 0);
        let g = fresh.next();
        assert_eq!(g, Some(1));
        assert!(fresh.written(g).await, "one writer: a checkpoint");
        assert_eq!(fresh.next(), Some(2));
        // Restarted, the objects below the state: no copy.
        let again = started(gens.clone(), Some(1)).await;
        assert_eq!(again.restored(), 0);
        // A copy taken at generation 3 meets an object that carried 3.
        let copy = Arc::new(InMemory::default());
        copy.advance(2, false).await.unwrap();
        let found = started(copy.clone(), Some(3)).await;
        assert_eq!(found.restored(), 4, "recorded at the raise past it");
        // Another start finding the same copy again records nothing new.
        let second = started(copy.clone(), Some(3)).await;
        assert_eq!(second.restored(), 4);
        // Someone else raised between the object and its raise: no checkpoint.
        let stamped = second.next();
        copy.advance(0, false).await.unwrap();
        assert!(!second.written(stamped).await);
    }
}
