//! The gate of one lease (SPEC §4–§5): the high-water mark, the requests in
//! flight, and the drain that orders them at the destination.
//!
//! Checking and forwarding are one step with respect to an epoch change: a request
//! holds a [`Pass`] from its admission check until the upstream's response has
//! arrived. Raising the mark to e' first stops admitting anything below e' (the
//! *barrier*), makes e' durable, then waits until no pass below e' remains — or,
//! after the drain timeout, aborts them — and only then decides the raiser's claim
//! again (it may have expired, or a newer epoch become known, while it waited) and
//! lets e' through.
//!
//! A request whose outcome is unknown (the route's timeout, a reset) may still be
//! executing at the destination: its pass [lingers](Pass::linger) — it still counts
//! for a drain — until a drain's timeout aborts it.
//!
//! A drain interrupted by a crash is not forgotten: the epoch the drains completed
//! through is kept beside the mark, and a gate restarted with that epoch below its
//! mark forwards nothing above it until the drain timeout has passed since the
//! start (*settling*); the first raise after a restart waits as long, for requests
//! the previous process may have left at the destination.
//!
//! The state machine is [`Core`]: synchronous, every transition one critical
//! section, model-checked with loom (`scripts/loom.sh`). [`Gate`] is the async
//! shell around it (waiting, timeouts, one raise at a time). No I/O happens here
//! except the caller's `persist` future; the admission decision is passed in and
//! evaluated under the lock, so a decision and the registration of its pass cannot
//! be separated by an epoch change.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

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

/// The async shell: waits for drains, times them out, runs one raise at a time.
pub struct Gate {
    core: Core,
    drained: Notify,
    raising: tokio::sync::Mutex<()>,
    /// After a restart with a mark already set, requests of the previous process
    /// may still be at the destination, invisible to us. Until this instant
    /// (start + drain timeout) no raise completes, and nothing above the epoch the
    /// previous process's drains completed through is forwarded (module doc).
    settle_until: Option<tokio::time::Instant>,
}

/// Why a raise did not produce a pass. `E` is the caller's `persist` error:
/// the gate does no I/O of its own and names no store.
#[derive(Debug)]
pub enum RaiseError<E> {
    /// The gate refused (stale, closed, settling).
    Denied(Denied),
    /// The raised mark could not be made durable: nothing is forwarded.
    State(E),
}

/// Admission to forward at `epoch`. Dropping it ends the request's time in flight.
pub struct Pass {
    gate: Arc<Gate>,
    entry: Entry,
    lingers: bool,
    /// When this request's admission waited for older requests to drain: the
    /// wait's start and end (its trace span). Measured, never decided on.
    drained: Option<(std::time::Instant, std::time::Instant)>,
}

impl Pass {
    /// The epoch the request was admitted at.
    pub fn epoch(&self) -> Epoch {
        self.entry.epoch
    }

    /// Resolves when a newer epoch's drain timed out and aborted this request.
    pub async fn aborted(&self) {
        self.entry.abort.wait().await
    }

    /// The drain this request's admission waited for, if it waited: start and end.
    pub fn drain_waited(&self) -> Option<(std::time::Instant, std::time::Instant)> {
        self.drained
    }

    /// Whether the request was aborted by a newer epoch's drain.
    pub fn is_aborted(&self) -> bool {
        self.entry.abort.is_aborted()
    }

    /// The abort signal, for a waiter that outlives a borrow of the pass (a
    /// streamed response body).
    pub fn abort_signal(&self) -> Arc<AbortSignal> {
        self.entry.abort.clone()
    }

    /// The epoch that aborted (or is draining) this one.
    pub fn newer_epoch(&self) -> Epoch {
        self.gate.core.barrier()
    }

    /// Ends the request's time in flight with its outcome unknown (a timeout or a
    /// reset after bytes were sent): the destination may still be executing it, so
    /// a drain keeps waiting for it until the drain's own timeout (SPEC §5).
    pub fn linger(mut self) {
        self.lingers = true;
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        if self.lingers {
            self.gate.core.linger(self.entry.epoch);
        } else {
            self.gate.core.leave(self.entry.epoch);
        }
        self.gate.drained.notify_waiters();
    }
}

impl Gate {
    /// A gate at `mark` for a fresh state (nothing to settle).
    pub fn new(mark: Epoch) -> Arc<Gate> {
        Gate::restarted(mark, mark, Duration::ZERO)
    }

    /// A gate whose previous process may have left requests in flight: with a
    /// mark already set, for `settle` (the drain timeout) from now the first raise
    /// waits and nothing above `drained` (the epoch the previous process's drains
    /// completed through) is admitted.
    pub fn restarted(mark: Epoch, drained: Epoch, settle: Duration) -> Arc<Gate> {
        let settle_until = (mark != Epoch::NONE && !settle.is_zero())
            .then(|| tokio::time::Instant::now() + settle);
        let settled = if settle_until.is_some() {
            drained
        } else {
            mark
        };
        Arc::new(Gate {
            core: Core::settling(mark, settled),
            drained: Notify::new(),
            raising: tokio::sync::Mutex::new(()),
            settle_until,
        })
    }

    /// Counters for metrics and the admin API.
    pub fn stats(&self) -> GateStats {
        self.core.stats()
    }

    /// The durable high-water mark.
    pub fn mark(&self) -> Epoch {
        self.core.stats().mark
    }

    /// Whether a raise is under way (persisting, settling or draining).
    pub fn raise_pending(&self) -> bool {
        self.raising.try_lock().is_err()
    }

    /// The mark, or the epoch a raise in progress is moving to: nothing below it is
    /// admitted.
    pub fn barrier(&self) -> Epoch {
        self.core.barrier()
    }

    fn pass(self: &Arc<Self>, entry: Entry) -> Pass {
        Pass {
            gate: self.clone(),
            entry,
            lingers: false,
            drained: None,
        }
    }

    /// The fast path: admits at the current mark without waiting. `decide` receives
    /// the barrier as the high-water mark. `Ok(None)` means the request needs
    /// [`Gate::raise`].
    pub fn try_enter(
        self: &Arc<Self>,
        epoch: Epoch,
        decide: impl FnOnce(Epoch) -> Result<Admit, Refusal>,
    ) -> Result<Option<Pass>, Denied> {
        Ok(self.core.try_enter(epoch, decide)?.map(|e| self.pass(e)))
    }

    /// Closes the gate (nothing more is admitted, a raise waiting in a drain gives
    /// up) and waits for the requests in flight to finish; after `drain_timeout`
    /// aborts them (`drain_aborted`) and waits for them to leave.
    pub async fn close(&self, drain_timeout: Duration) {
        self.close_by(tokio::time::Instant::now() + drain_timeout)
            .await
    }

    /// Aborts every request in flight without closing the gate (the instance
    /// guard's lease could have ended: SPEC §10.1); new requests are kept out by
    /// the guard itself until it holds its lease again.
    pub fn abort_in_flight(&self) {
        self.core.abort_older(Epoch::new(u64::MAX));
    }

    /// [`Gate::close`] with an absolute deadline: what is still in flight at
    /// `deadline` is aborted. A cluster's shard closes all its leases' gates by
    /// the shard's one deadline (SPEC §10.2: nothing in flight past `gate_ttl`),
    /// never each by a timeout of its own started when its turn came.
    pub async fn close_by(&self, deadline: tokio::time::Instant) {
        self.core.close();
        self.drained.notify_waiters();
        let mut aborted = false;
        loop {
            let notified = self.drained.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.core.in_flight() == 0 {
                return;
            }
            if aborted {
                notified.await;
                continue;
            }
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep_until(deadline) => {
                    self.core.abort_older(Epoch::new(u64::MAX));
                    aborted = true;
                }
            }
        }
    }

    /// The slow path: raises the mark to `epoch` (made durable by `persist`), drains
    /// older requests, decides the claim again and admits. Concurrent raises of one
    /// lease run one at a time. `drained` is told once the drain has completed
    /// (whether the claim then holds or not), to keep that epoch beside the mark.
    ///
    /// Must run to completion once started (the server finishes a request its client dropped), or the
    /// barrier may be left above the mark.
    pub async fn raise<P, D, E>(
        self: &Arc<Self>,
        epoch: Epoch,
        drain_timeout: Duration,
        decide: impl Fn(Epoch) -> Result<Admit, Refusal>,
        persist: impl FnOnce() -> P,
        drained: impl FnOnce(Epoch) -> D,
    ) -> Result<Pass, RaiseError<E>>
    where
        P: Future<Output = Result<(), E>>,
        D: Future<Output = ()>,
    {
        let _one_at_a_time = self.raising.lock().await;
        // When a drain started (older requests in flight at the barrier): its
        // trace span runs from here to the entry.
        let drain_started = loop {
            match self
                .core
                .begin_raise(epoch, &decide)
                .map_err(RaiseError::Denied)?
            {
                RaiseStart::Entered(e) => return Ok(self.pass(e)),
                RaiseStart::Settling => self.settle().await,
                RaiseStart::Raising { draining } => {
                    break draining.then(crate::clock::stopwatch);
                }
            }
        };
        if let Err(e) = persist().await {
            self.core.cancel_raise();
            return Err(RaiseError::State(e));
        }
        self.settle().await;
        let deadline = tokio::time::Instant::now() + drain_timeout;
        let mut aborted = false;
        loop {
            let notified = self.drained.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match self.core.try_finish_raise(epoch, &decide) {
                FinishRaise::Entered(e) => {
                    let mut pass = self.pass(e);
                    pass.drained = drain_started.map(|s| (s, crate::clock::stopwatch()));
                    drained(epoch).await;
                    return Ok(pass);
                }
                FinishRaise::Refused(r) => {
                    drained(epoch).await;
                    return Err(RaiseError::Denied(Denied::Refused(r)));
                }
                FinishRaise::Closed => return Err(RaiseError::Denied(Denied::Closed)),
                FinishRaise::Draining => {}
            }
            if aborted {
                notified.await;
                continue;
            }
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep_until(deadline) => {
                    self.core.abort_older(epoch);
                    aborted = true;
                }
            }
        }
    }

    /// Waits out a restart's settling time, if any is left.
    async fn settle(&self) {
        if let Some(until) = self.settle_until {
            tokio::time::sleep_until(until).await;
        }
        self.core.settle();
    }
}

/// The admission decision by epoch alone, for the gate's tests and loom model.
#[cfg(test)]
mod test_support {
    use super::*;
    use crate::epoch::LeaseName;

    pub(super) fn admit_if(epoch: Epoch) -> impl Fn(Epoch) -> Result<Admit, Refusal> {
        move |mark| {
            if epoch < mark {
                Err(Refusal::Stale {
                    lease: LeaseName::parse("l").unwrap(),
                    epoch,
                    high_water_mark: mark,
                    latest_epoch: mark,
                })
            } else if epoch == mark {
                Ok(Admit::AtMark)
            } else {
                Ok(Admit::Raise)
            }
        }
    }
}

#[cfg(all(test, not(fencegate_loom)))]
mod tests {
    use super::test_support::admit_if;
    use super::*;
    use crate::state::StateError;

    async fn ok() -> Result<(), StateError> {
        Ok(())
    }

    /// A raise to `epoch` that persists at once and notes nothing.
    async fn raise(
        g: &Arc<Gate>,
        epoch: u64,
        drain: Duration,
    ) -> Result<Pass, RaiseError<StateError>> {
        let e = Epoch::new(epoch);
        g.raise(e, drain, admit_if(e), ok, |_| async {}).await
    }

    #[tokio::test(start_paused = true)]
    async fn raise_waits_for_older_passes() {
        let g = Gate::new(Epoch::new(7));
        let old = g
            .try_enter(Epoch::new(7), admit_if(Epoch::new(7)))
            .unwrap()
            .unwrap();
        let g2 = g.clone();
        let raise = tokio::spawn(async move { raise(&g2, 8, Duration::from_secs(10)).await });
        tokio::task::yield_now().await;
        // The barrier is up: new epoch-7 requests are refused while the drain runs.
        assert!(g.try_enter(Epoch::new(7), admit_if(Epoch::new(7))).is_err());
        assert!(!raise.is_finished());
        assert_eq!(g.mark(), Epoch::new(7));
        drop(old);
        let pass = raise.await.unwrap().unwrap();
        assert_eq!(pass.epoch(), Epoch::new(8));
        assert_eq!(g.mark(), Epoch::new(8));
    }

    #[tokio::test(start_paused = true)]
    async fn drain_timeout_aborts_older_passes() {
        let g = Gate::new(Epoch::new(1));
        let old = g
            .try_enter(Epoch::new(1), admit_if(Epoch::new(1)))
            .unwrap()
            .unwrap();
        let g2 = g.clone();
        let raise = tokio::spawn(async move { raise(&g2, 2, Duration::from_millis(500)).await });
        // The holder of the old pass gives up when told to.
        old.aborted().await;
        assert!(old.is_aborted());
        assert_eq!(old.newer_epoch(), Epoch::new(2));
        drop(old);
        raise.await.unwrap().unwrap();
        assert_eq!(g.stats().drains_aborted, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn failed_persist_lowers_the_barrier_again() {
        let g = Gate::new(Epoch::new(3));
        let res = g
            .raise(
                Epoch::new(4),
                Duration::from_secs(1),
                admit_if(Epoch::new(4)),
                || async { Err(StateError::Write("disk full".into())) },
                |_| async {},
            )
            .await;
        assert!(matches!(res, Err(RaiseError::State(_))));
        assert_eq!(g.stats().barrier, Epoch::new(3));
        assert!(g
            .try_enter(Epoch::new(3), admit_if(Epoch::new(3)))
            .unwrap()
            .is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn after_a_restart_the_first_raise_waits_out_a_drain() {
        let start = tokio::time::Instant::now();
        let g = Gate::restarted(Epoch::new(4), Epoch::new(4), Duration::from_secs(3));
        // Requests at the mark need no ordering: admitted at once.
        assert!(g
            .try_enter(Epoch::new(4), admit_if(Epoch::new(4)))
            .unwrap()
            .is_some());
        let p = raise(&g, 5, Duration::from_secs(1)).await.unwrap();
        assert!(start.elapsed() >= Duration::from_secs(3));
        drop(p);
        // A fresh gate (no mark: nothing can have been forwarded) does not wait.
        let start = tokio::time::Instant::now();
        let g = Gate::restarted(Epoch::NONE, Epoch::NONE, Duration::from_secs(3));
        raise(&g, 1, Duration::from_secs(1)).await.unwrap();
        assert_eq!(start.elapsed(), Duration::ZERO);
    }

    /// A crash interrupted the drain to 5 (mark 5, drains completed through 4):
    /// after the restart nothing at 5 is forwarded until the settle time has
    /// passed, while a request at 4 is refused as stale as ever.
    #[tokio::test(start_paused = true)]
    async fn after_a_crash_mid_drain_the_raised_epoch_waits_out_the_drain() {
        let start = tokio::time::Instant::now();
        let g = Gate::restarted(Epoch::new(5), Epoch::new(4), Duration::from_secs(3));
        assert!(g
            .try_enter(Epoch::new(5), admit_if(Epoch::new(5)))
            .unwrap()
            .is_none());
        assert!(g.try_enter(Epoch::new(4), admit_if(Epoch::new(4))).is_err());
        let p = g
            .raise(
                Epoch::new(5),
                Duration::from_secs(1),
                admit_if(Epoch::new(5)),
                ok,
                |_| async { panic!("no drain ran") },
            )
            .await
            .unwrap();
        assert_eq!(start.elapsed(), Duration::from_secs(3));
        // Settled: the next one goes straight through.
        assert!(g
            .try_enter(Epoch::new(5), admit_if(Epoch::new(5)))
            .unwrap()
            .is_some());
        drop(p);
    }

    /// A request whose outcome is unknown keeps the drain waiting until the
    /// drain's timeout, which then ends it (its worker was answered long ago).
    #[tokio::test(start_paused = true)]
    async fn a_lingering_request_holds_the_drain_until_its_timeout() {
        let g = Gate::new(Epoch::new(1));
        let old = g
            .try_enter(Epoch::new(1), admit_if(Epoch::new(1)))
            .unwrap()
            .unwrap();
        old.linger();
        assert_eq!((g.stats().in_flight, g.stats().in_doubt), (0, 1));
        let start = tokio::time::Instant::now();
        let drained = std::sync::atomic::AtomicU64::new(0);
        let p = g
            .raise(
                Epoch::new(2),
                Duration::from_millis(700),
                admit_if(Epoch::new(2)),
                ok,
                |e| {
                    drained.store(e.get(), Ordering::SeqCst);
                    async {}
                },
            )
            .await
            .unwrap();
        assert_eq!(start.elapsed(), Duration::from_millis(700));
        assert_eq!(drained.load(Ordering::SeqCst), 2);
        let st = g.stats();
        assert_eq!((st.drains_aborted, st.in_doubt, st.in_flight), (1, 0, 1));
        drop(p);
    }

    /// The raiser's claim is decided again when the drain completes: an epoch
    /// that expired (or was superseded) while it waited is refused, not forwarded,
    /// and the mark stays raised.
    #[tokio::test(start_paused = true)]
    async fn a_raise_is_decided_again_when_its_drain_completes() {
        let g = Gate::new(Epoch::new(1));
        let old = g
            .try_enter(Epoch::new(1), admit_if(Epoch::new(1)))
            .unwrap()
            .unwrap();
        let expired = Arc::new(AtomicBool::new(false));
        let g2 = g.clone();
        let exp = expired.clone();
        let raise = tokio::spawn(async move {
            let e2 = Epoch::new(2);
            g2.raise(
                e2,
                Duration::from_secs(10),
                move |mark| {
                    if exp.load(Ordering::SeqCst) {
                        Err(Refusal::Expired {
                            lease: crate::epoch::LeaseName::parse("l").unwrap(),
                            epoch: e2,
                            expired_at: std::time::SystemTime::UNIX_EPOCH,
                        })
                    } else {
                        admit_if(e2)(mark)
                    }
                },
                ok,
                |_| async {},
            )
            .await
        });
        tokio::task::yield_now().await;
        expired.store(true, Ordering::SeqCst);
        drop(old);
        let res = raise.await.unwrap();
        assert!(matches!(
            res,
            Err(RaiseError::Denied(Denied::Refused(Refusal::Expired { .. })))
        ));
        let st = g.stats();
        assert_eq!(
            (st.mark, st.barrier, st.in_flight),
            (Epoch::new(2), Epoch::new(2), 0)
        );
    }

    /// Closing admits nothing more, lets a raise waiting in a drain give up, and
    /// aborts what is still in flight after the drain timeout.
    #[tokio::test(start_paused = true)]
    async fn closing_refuses_new_requests_and_aborts_the_rest_after_the_timeout() {
        let g = Gate::new(Epoch::new(1));
        let old = g
            .try_enter(Epoch::new(1), admit_if(Epoch::new(1)))
            .unwrap()
            .unwrap();
        let g2 = g.clone();
        let raise = tokio::spawn(async move { raise(&g2, 2, Duration::from_secs(60)).await });
        tokio::task::yield_now().await;
        let start = tokio::time::Instant::now();
        let g3 = g.clone();
        let closing = tokio::spawn(async move { g3.close(Duration::from_secs(2)).await });
        assert!(matches!(
            raise.await.unwrap(),
            Err(RaiseError::Denied(Denied::Closed))
        ));
        assert!(matches!(
            g.try_enter(Epoch::new(1), admit_if(Epoch::new(1))),
            Err(Denied::Closed)
        ));
        old.aborted().await;
        assert_eq!(start.elapsed(), Duration::from_secs(2));
        drop(old);
        closing.await.unwrap();
        assert_eq!(g.stats().in_flight, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_raisers_to_one_epoch_both_pass() {
        let g = Gate::new(Epoch::new(1));
        let raiser = || {
            let g = g.clone();
            tokio::spawn(async move { raise(&g, 5, Duration::from_secs(1)).await })
        };
        let (a, b) = (raiser(), raiser());
        let (pa, pb) = (a.await.unwrap().unwrap(), b.await.unwrap().unwrap());
        assert_eq!(g.stats().in_flight, 2);
        assert_eq!(g.stats().raises, 1);
        assert_eq!(g.stats().drains_started, 0);
        drop((pa, pb));
        assert_eq!(g.stats().in_flight, 0);
    }
}

/// Model checking of the gate's state machine: every interleaving of a request
/// entering at e and leaving, a raise to e' (barrier, drain check, finish), and a
/// drain-timeout abort. Run with `scripts/loom.sh`.
#[cfg(all(test, fencegate_loom))]
mod loom_tests {
    use super::*;
    use loom::sync::atomic::AtomicUsize;
    use loom::sync::Arc as LArc;

    use super::test_support::admit_if as decide_for;

    /// The destination, as the property sees it: how many e-requests are "at the
    /// origin" right now, and whether e' ever arrived while one was.
    struct Destination {
        old_active: AtomicUsize,
        violated: AtomicBool,
    }

    #[test]
    fn a_newer_epoch_never_overlaps_an_older_request_unless_aborted() {
        loom::model(|| {
            let core = LArc::new(Core::new(Epoch::new(1)));
            let dest = LArc::new(Destination {
                old_active: AtomicUsize::new(0),
                violated: AtomicBool::new(false),
            });
            // A request at the current epoch 1: check, forward, finish.
            let old = {
                let (core, dest) = (core.clone(), dest.clone());
                loom::thread::spawn(move || {
                    if let Ok(Some(entry)) =
                        core.try_enter(Epoch::new(1), decide_for(Epoch::new(1)))
                    {
                        // Forwarded: at the destination until its response is complete.
                        dest.old_active.store(1, Ordering::SeqCst);
                        loom::thread::yield_now();
                        dest.old_active.store(0, Ordering::SeqCst);
                        core.leave(entry.epoch);
                    }
                })
            };
            // A raise to epoch 2 that polls its drain a bounded number of times,
            // then aborts what is left, then waits for the aborted to leave.
            let new = {
                let (core, dest) = (core.clone(), dest.clone());
                loom::thread::spawn(move || {
                    let e2 = Epoch::new(2);
                    match core.begin_raise(e2, decide_for(e2)).unwrap() {
                        RaiseStart::Entered(_) | RaiseStart::Settling => {
                            unreachable!("nobody else raises; nothing to settle")
                        }
                        RaiseStart::Raising { .. } => {}
                    }
                    let mut tries = 0;
                    let entry = loop {
                        match core.try_finish_raise(e2, decide_for(e2)) {
                            FinishRaise::Entered(e) => break e,
                            FinishRaise::Refused(r) => panic!("refused after the drain: {r}"),
                            FinishRaise::Closed => unreachable!("nobody closes the gate"),
                            FinishRaise::Draining => {}
                        }
                        tries += 1;
                        if tries == 2 {
                            core.abort_older(e2);
                        }
                        loom::thread::yield_now();
                    };
                    // Epoch 2 "arrives at the destination". Even an aborted request
                    // must have left (its forward dropped) before the raise finishes.
                    if dest.old_active.load(Ordering::SeqCst) != 0 {
                        dest.violated.store(true, Ordering::SeqCst);
                    }
                    core.leave(entry.epoch);
                })
            };
            // A late epoch-1 request arriving at any point: once the barrier is up it
            // must be refused.
            let late = {
                let core = core.clone();
                loom::thread::spawn(move || {
                    let before = core.stats().barrier;
                    let r = core.try_enter(Epoch::new(1), decide_for(Epoch::new(1)));
                    if before == Epoch::new(2) {
                        assert!(r.is_err(), "admitted below the barrier");
                    }
                    if let Ok(Some(e)) = r {
                        core.leave(e.epoch);
                    }
                })
            };
            old.join().unwrap();
            new.join().unwrap();
            late.join().unwrap();
            assert!(
                !dest.violated.load(Ordering::SeqCst),
                "epoch 2 reached the destination while epoch 1 was there"
            );
            let st = core.stats();
            assert_eq!(st.mark, Epoch::new(2));
            assert_eq!(st.in_flight, 0);
        });
    }

    /// A request whose outcome is unknown lingers: whatever the interleaving, a
    /// raise to a newer epoch completes only after a drain abort, never while the
    /// older request may still be at the destination.
    #[test]
    fn a_lingering_request_is_drained_only_by_an_abort() {
        loom::model(|| {
            let core = LArc::new(Core::new(Epoch::new(1)));
            let aborted = LArc::new(AtomicBool::new(false));
            // Set once the old request was admitted; never cleared: after its
            // timeout it may still be at the destination.
            let at_destination = LArc::new(AtomicBool::new(false));
            let old = {
                let (core, at_dest) = (core.clone(), at_destination.clone());
                loom::thread::spawn(move || {
                    if let Ok(Some(e)) = core.try_enter(Epoch::new(1), decide_for(Epoch::new(1))) {
                        at_dest.store(true, Ordering::SeqCst);
                        // Timed out: the destination may still be executing it.
                        core.linger(e.epoch);
                    }
                })
            };
            let new = {
                let (core, aborted, at_dest) =
                    (core.clone(), aborted.clone(), at_destination.clone());
                loom::thread::spawn(move || {
                    let e2 = Epoch::new(2);
                    assert!(matches!(
                        core.begin_raise(e2, decide_for(e2)),
                        Ok(RaiseStart::Raising { .. })
                    ));
                    let mut tries = 0;
                    loop {
                        match core.try_finish_raise(e2, decide_for(e2)) {
                            FinishRaise::Entered(e) => {
                                // Epoch 2 goes to the destination: never past a
                                // lingering epoch-1 request without an abort.
                                assert!(
                                    !at_dest.load(Ordering::SeqCst)
                                        || aborted.load(Ordering::SeqCst),
                                    "epoch 2 forwarded past a lingering epoch-1 request"
                                );
                                core.leave(e.epoch);
                                return;
                            }
                            FinishRaise::Draining => {}
                            other => panic!("{other:?}"),
                        }
                        tries += 1;
                        if tries == 2 {
                            aborted.store(true, Ordering::SeqCst);
                            core.abort_older(e2);
                        }
                        loom::thread::yield_now();
                    }
                })
            };
            old.join().unwrap();
            new.join().unwrap();
            let st = core.stats();
            assert_eq!((st.mark, st.in_flight, st.in_doubt), (Epoch::new(2), 0, 0));
        });
    }

    /// A restarted gate whose drain was interrupted admits nothing above the
    /// epoch it completed through until the settle time has passed.
    #[test]
    fn a_settling_gate_admits_nothing_above_its_drained_epoch() {
        loom::model(|| {
            let core = LArc::new(Core::settling(Epoch::new(2), Epoch::new(1)));
            let settled = LArc::new(AtomicBool::new(false));
            let req = {
                let (core, settled) = (core.clone(), settled.clone());
                loom::thread::spawn(move || {
                    let before = settled.load(Ordering::SeqCst);
                    if let Ok(Some(e)) = core.try_enter(Epoch::new(2), decide_for(Epoch::new(2))) {
                        // Admitted at 2: only after the settle (it can only have
                        // happened before this try_enter if the flag was set).
                        assert!(settled.load(Ordering::SeqCst) || before);
                        core.leave(e.epoch);
                    }
                })
            };
            let timer = {
                let (core, settled) = (core.clone(), settled.clone());
                loom::thread::spawn(move || {
                    settled.store(true, Ordering::SeqCst);
                    core.settle();
                })
            };
            req.join().unwrap();
            timer.join().unwrap();
            assert!(core
                .try_enter(Epoch::new(2), decide_for(Epoch::new(2)))
                .unwrap()
                .is_some());
        });
    }

    #[test]
    fn a_failed_persist_restores_admission_at_the_old_mark() {
        loom::model(|| {
            let core = LArc::new(Core::new(Epoch::new(3)));
            let raiser = {
                let core = core.clone();
                loom::thread::spawn(move || {
                    let e4 = Epoch::new(4);
                    assert!(matches!(
                        core.begin_raise(e4, decide_for(e4)),
                        Ok(RaiseStart::Raising { .. })
                    ));
                    core.cancel_raise();
                })
            };
            let req = {
                let core = core.clone();
                loom::thread::spawn(move || {
                    if let Ok(Some(e)) = core.try_enter(Epoch::new(3), decide_for(Epoch::new(3))) {
                        core.leave(e.epoch);
                    }
                })
            };
            raiser.join().unwrap();
            req.join().unwrap();
            let st = core.stats();
            assert_eq!(
                (st.mark, st.barrier, st.in_flight),
                (Epoch::new(3), Epoch::new(3), 0)
            );
        });
    }
}
