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

mod core;
#[cfg(all(test, fencegate_loom))]
mod loom_tests;
#[cfg(all(test, not(fencegate_loom)))]
mod tests;

pub use self::core::{AbortSignal, Core, Denied, Entry, FinishRaise, GateStats, RaiseStart};

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use crate::admission::{Admit, Refusal};
use crate::epoch::Epoch;

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
