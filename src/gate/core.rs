//! The gate's state machine (module doc of [`super`]): synchronous, every
//! transition one critical section, model-checked with loom
//! (`scripts/loom.sh`).

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::sync::Notify;

use crate::admission::{Admit, Refusal};
use crate::epoch::Epoch;

#[cfg(not(fencegate_loom))]
use crate::lock_order::Ordered as Guard;
#[cfg(not(fencegate_loom))]
use std::sync::{atomic::AtomicBool, atomic::Ordering, Mutex};

#[cfg(fencegate_loom)]
use loom::sync::{atomic::AtomicBool, atomic::Ordering, Mutex, MutexGuard as Guard};

/// The abort signal shared by the passes of one epoch.
#[derive(Debug, Default)]
pub struct AbortSignal {
    aborted: AtomicBool,
    notify: Notify,
}

impl AbortSignal {
    fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    /// Whether a newer epoch's drain timed out and aborted the passes.
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }

    /// Resolves once aborted.
    pub async fn wait(&self) {
        loop {
            let n = self.notify.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if self.is_aborted() {
                return;
            }
            n.await;
        }
    }
}

#[derive(Debug)]
struct Slot {
    /// Passes held by requests being forwarded.
    count: usize,
    /// Passes of requests whose outcome is unknown: their workers were answered,
    /// the destination may still be executing them. Only a drain abort ends them.
    lingering: usize,
    abort: Arc<AbortSignal>,
}

#[derive(Debug)]
struct State {
    /// The durable high-water mark.
    mark: Epoch,
    /// `mark`, or the epoch a raise in progress is moving to: nothing below it is admitted.
    barrier: Epoch,
    /// Nothing above this epoch is admitted: below `mark` only while a restarted
    /// gate settles (a drain of the previous process may not have completed).
    settled: Epoch,
    inflight: BTreeMap<Epoch, Slot>,
    raises: u64,
    drains_started: u64,
    drains_aborted: u64,
    /// Admits nothing more (the fence is stopping).
    closed: bool,
}

/// Counters for metrics and the admin API.
#[derive(Debug, Clone, Copy, Default)]
pub struct GateStats {
    /// The durable high-water mark.
    pub mark: Epoch,
    /// The mark, or the epoch a raise in progress is moving to.
    pub barrier: Epoch,
    /// Requests admitted and not yet answered by the upstream (SPEC §5).
    pub in_flight: usize,
    /// Requests whose outcome is unknown, still counted by a drain (lingering).
    pub in_doubt: usize,
    /// Mark raises (one per newer epoch admitted).
    pub raises: u64,
    /// Raises that had to wait for older requests in flight.
    pub drains_started: u64,
    /// Drains that timed out and aborted what was in flight.
    pub drains_aborted: u64,
}

/// One registered request in flight (the core's half of a [`Pass`]).
#[derive(Debug)]
pub struct Entry {
    /// The epoch the request was admitted at.
    pub epoch: Epoch,
    /// Its epoch's abort signal, fired when a newer epoch's drain times out.
    pub abort: Arc<AbortSignal>,
}

/// Why the gate admitted nothing.
#[derive(Debug)]
pub enum Denied {
    /// The admission decision refused the claim.
    Refused(Refusal),
    /// The gate is closed: its fence is stopping (a reload removed the lease, or
    /// the instance no longer owns it).
    Closed,
}

impl From<Refusal> for Denied {
    fn from(r: Refusal) -> Self {
        Denied::Refused(r)
    }
}

/// What starting a raise decided.
#[derive(Debug)]
pub enum RaiseStart {
    /// Someone already raised to this epoch: admitted at the mark.
    Entered(Entry),
    /// At the mark, but the gate is settling after a restart: wait, then retry.
    Settling,
    /// The barrier is now at the epoch; persist, then drain (`draining`: older
    /// requests are in flight, a drain started).
    Raising {
        /// Whether older requests were in flight.
        draining: bool,
    },
}

/// What a look at a raise's drain found.
#[derive(Debug)]
pub enum FinishRaise {
    /// Older requests are still in flight (or lingering).
    Draining,
    /// Drained: the mark moved, and the raiser's claim, decided again, holds.
    Entered(Entry),
    /// Drained: the mark moved, but the raiser's claim no longer holds.
    Refused(Refusal),
    /// The gate closed while the raise waited.
    Closed,
}

/// The gate's state machine. Every method is one critical section.
#[derive(Debug)]
pub struct Core {
    state: Mutex<State>,
}

impl Core {
    /// A core at `mark` with nothing left to settle.
    pub fn new(mark: Epoch) -> Core {
        Core::settling(mark, mark)
    }

    /// A core that admits nothing above `settled` until [`Core::settle`].
    pub fn settling(mark: Epoch, settled: Epoch) -> Core {
        Core {
            state: Mutex::new(State {
                mark,
                barrier: mark,
                settled: settled.min(mark),
                inflight: BTreeMap::new(),
                raises: 0,
                drains_started: 0,
                drains_aborted: 0,
                closed: false,
            }),
        }
    }

    /// Under the one-lock-at-a-time rule (`lock_order`): `decide` closures run
    /// under this lock and must take no other.
    fn lock(&self) -> Guard<'_, State> {
        #[cfg(not(fencegate_loom))]
        return crate::lock_order::lock("gate", &self.state);
        // The state stays consistent under every panic-free path; a poisoned lock
        // only means another thread panicked elsewhere.
        #[cfg(fencegate_loom)]
        return self.state.lock().unwrap_or_else(|p| p.into_inner());
    }

    fn register(st: &mut State, epoch: Epoch) -> Entry {
        let slot = st.inflight.entry(epoch).or_insert_with(|| Slot {
            count: 0,
            lingering: 0,
            abort: Arc::new(AbortSignal::default()),
        });
        slot.count += 1;
        Entry {
            epoch,
            abort: slot.abort.clone(),
        }
    }

    /// Admits at the current mark; `Ok(None)` means a raise is needed.
    pub fn try_enter(
        &self,
        epoch: Epoch,
        decide: impl FnOnce(Epoch) -> Result<Admit, Refusal>,
    ) -> Result<Option<Entry>, Denied> {
        let mut st = self.lock();
        if st.closed {
            return Err(Denied::Closed);
        }
        let admit = decide(st.barrier)?;
        if admit == Admit::AtMark
            && epoch == st.mark
            && st.barrier == st.mark
            && epoch <= st.settled
        {
            return Ok(Some(Self::register(&mut st, epoch)));
        }
        Ok(None)
    }

    /// Starts a raise to `epoch` (callers serialize raises): sets the barrier.
    pub fn begin_raise(
        &self,
        epoch: Epoch,
        decide: impl FnOnce(Epoch) -> Result<Admit, Refusal>,
    ) -> Result<RaiseStart, Denied> {
        let mut st = self.lock();
        if st.closed {
            return Err(Denied::Closed);
        }
        match decide(st.barrier)? {
            Admit::AtMark if epoch > st.settled => Ok(RaiseStart::Settling),
            Admit::AtMark => Ok(RaiseStart::Entered(Self::register(&mut st, epoch))),
            Admit::Raise => {
                st.barrier = epoch;
                st.raises += 1;
                let draining = st.inflight.range(..epoch).next().is_some();
                if draining {
                    st.drains_started += 1;
                }
                Ok(RaiseStart::Raising { draining })
            }
        }
    }

    /// Undoes a raise whose mark could not be made durable.
    pub fn cancel_raise(&self) {
        let mut st = self.lock();
        st.barrier = st.mark;
    }

    /// Completes the raise if nothing older is in flight: the mark moves (the
    /// drain is complete, and the gate settled through `epoch`), the raiser's
    /// claim is decided again and, if it holds, registered — atomically.
    pub fn try_finish_raise(
        &self,
        epoch: Epoch,
        decide: impl FnOnce(Epoch) -> Result<Admit, Refusal>,
    ) -> FinishRaise {
        let mut st = self.lock();
        if st.closed {
            st.barrier = st.mark;
            return FinishRaise::Closed;
        }
        if st.inflight.range(..epoch).next().is_some() {
            return FinishRaise::Draining;
        }
        st.mark = epoch;
        st.settled = epoch;
        match decide(epoch) {
            Ok(_) => FinishRaise::Entered(Self::register(&mut st, epoch)),
            Err(r) => FinishRaise::Refused(r),
        }
    }

    /// Admits nothing more; returns how many requests are still in flight.
    pub fn close(&self) -> usize {
        let mut st = self.lock();
        st.closed = true;
        st.inflight.values().map(|s| s.count).sum()
    }

    /// Requests in flight (not counting lingering ones).
    pub fn in_flight(&self) -> usize {
        self.lock().inflight.values().map(|s| s.count).sum()
    }

    /// The restart's settling time has passed: admits up to the mark again.
    pub fn settle(&self) {
        let mut st = self.lock();
        st.settled = st.settled.max(st.mark);
    }

    /// Drain timeout: aborts every request older than `epoch`, and stops counting
    /// the lingering ones (whose workers were answered long ago).
    pub fn abort_older(&self, epoch: Epoch) {
        let mut st = self.lock();
        st.drains_aborted += 1;
        for slot in st.inflight.range_mut(..epoch).map(|(_, s)| s) {
            slot.abort.abort();
            slot.lingering = 0;
        }
        st.inflight
            .retain(|e, s| *e >= epoch || s.count > 0 || s.lingering > 0);
    }

    /// A request's time in flight ended.
    pub fn leave(&self, epoch: Epoch) {
        self.end(epoch, false);
    }

    /// A request's outcome is unknown: it keeps counting for a drain (lingers)
    /// until a drain's timeout aborts it.
    pub fn linger(&self, epoch: Epoch) {
        self.end(epoch, true);
    }

    fn end(&self, epoch: Epoch, linger: bool) {
        let mut st = self.lock();
        if let Some(slot) = st.inflight.get_mut(&epoch) {
            slot.count -= 1;
            if linger {
                slot.lingering += 1;
            }
            if slot.count == 0 && slot.lingering == 0 {
                st.inflight.remove(&epoch);
            }
        }
    }

    /// The mark, or the epoch a raise in progress is moving to.
    pub fn barrier(&self) -> Epoch {
        self.lock().barrier
    }

    /// Counters, read in one critical section.
    pub fn stats(&self) -> GateStats {
        let st = self.lock();
        GateStats {
            mark: st.mark,
            barrier: st.barrier,
            in_flight: st.inflight.values().map(|s| s.count).sum(),
            in_doubt: st.inflight.values().map(|s| s.lingering).sum(),
            raises: st.raises,
            drains_started: st.drains_started,
            drains_aborted: st.drains_aborted,
        }
    }
}
