//! The gate of one lease (SPEC §4–§5): the high-water mark, the requests in
//! flight, and the drain that orders them at the destination.
//!
//! Checking and forwarding are one step with respect to an epoch change: a request
//! holds a [`Pass`] from its admission check until the upstream's response has
//! arrived. Raising the mark to e' first stops admitting anything below e' (the
//! *barrier*), makes e' durable, then waits until no pass below e' remains — or,
//! after the drain timeout, aborts them — and only then lets e' through.
//!
//! No I/O happens here except the caller's `persist` future; the admission
//! decision is passed in and evaluated under the gate's lock, so a decision and the
//! registration of its pass cannot be separated by an epoch change.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::admission::{Admit, Refusal};
use crate::durable::DurableError;
use crate::epoch::Epoch;

#[derive(Debug)]
struct Slot {
    count: usize,
    abort: CancellationToken,
}

#[derive(Debug)]
struct State {
    /// The durable high-water mark.
    mark: Epoch,
    /// `mark`, or the epoch a raise in progress is moving to: nothing below it is admitted.
    barrier: Epoch,
    inflight: BTreeMap<Epoch, Slot>,
    raises: u64,
    drains_started: u64,
    drains_aborted: u64,
}

pub struct Gate {
    state: Mutex<State>,
    drained: Notify,
    raising: tokio::sync::Mutex<()>,
}

/// Why a raise did not produce a pass.
#[derive(Debug)]
pub enum RaiseError {
    Refused(Refusal),
    Durable(DurableError),
}

/// Counters for metrics and the admin API.
#[derive(Debug, Clone, Copy, Default)]
pub struct GateStats {
    pub mark: Epoch,
    pub barrier: Epoch,
    pub in_flight: usize,
    /// Mark raises (one per newer epoch admitted).
    pub raises: u64,
    /// Raises that had to wait for older requests in flight.
    pub drains_started: u64,
    pub drains_aborted: u64,
}

/// Admission to forward at `epoch`. Dropping it ends the request's time in flight.
pub struct Pass {
    gate: Arc<Gate>,
    epoch: Epoch,
    abort: CancellationToken,
}

impl Pass {
    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// Resolves when a newer epoch's drain timed out and aborted this request.
    pub async fn aborted(&self) {
        self.abort.cancelled().await
    }

    pub fn is_aborted(&self) -> bool {
        self.abort.is_cancelled()
    }

    /// The epoch that aborted (or is draining) this one.
    pub fn newer_epoch(&self) -> Epoch {
        self.gate.lock().barrier
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        let mut st = self.gate.lock();
        if let Some(slot) = st.inflight.get_mut(&self.epoch) {
            slot.count -= 1;
            if slot.count == 0 {
                st.inflight.remove(&self.epoch);
            }
        }
        drop(st);
        self.gate.drained.notify_waiters();
    }
}

impl Gate {
    pub fn new(mark: Epoch) -> Arc<Gate> {
        Arc::new(Gate {
            state: Mutex::new(State {
                mark,
                barrier: mark,
                inflight: BTreeMap::new(),
                raises: 0,
                drains_started: 0,
                drains_aborted: 0,
            }),
            drained: Notify::new(),
            raising: tokio::sync::Mutex::new(()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state stays consistent under every panic-free path; a poisoned lock
        // only means another thread panicked elsewhere.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn stats(&self) -> GateStats {
        let st = self.lock();
        GateStats {
            mark: st.mark,
            barrier: st.barrier,
            in_flight: st.inflight.values().map(|s| s.count).sum(),
            raises: st.raises,
            drains_started: st.drains_started,
            drains_aborted: st.drains_aborted,
        }
    }

    pub fn mark(&self) -> Epoch {
        self.lock().mark
    }

    fn register(self: &Arc<Self>, st: &mut State, epoch: Epoch) -> Pass {
        let slot = st.inflight.entry(epoch).or_insert_with(|| Slot {
            count: 0,
            abort: CancellationToken::new(),
        });
        slot.count += 1;
        Pass {
            gate: self.clone(),
            epoch,
            abort: slot.abort.clone(),
        }
    }

    /// The fast path: admits at the current mark without waiting. `decide` receives
    /// the barrier as the high-water mark. `Ok(None)` means the request needs
    /// [`Gate::raise`].
    pub fn try_enter(
        self: &Arc<Self>,
        epoch: Epoch,
        decide: impl FnOnce(Epoch) -> Result<Admit, Refusal>,
    ) -> Result<Option<Pass>, Refusal> {
        let mut st = self.lock();
        let admit = decide(st.barrier)?;
        if admit == Admit::AtMark && epoch == st.mark && st.barrier == st.mark {
            return Ok(Some(self.register(&mut st, epoch)));
        }
        Ok(None)
    }

    /// The slow path: raises the mark to `epoch` (made durable by `persist`), drains
    /// older requests, and admits. Concurrent raises of one lease run one at a time.
    ///
    /// Must run to completion once started (the caller spawns the request), or the
    /// barrier may be left above the mark.
    pub async fn raise<P>(
        self: &Arc<Self>,
        epoch: Epoch,
        drain_timeout: Duration,
        decide: impl Fn(Epoch) -> Result<Admit, Refusal>,
        persist: impl FnOnce() -> P,
    ) -> Result<Pass, RaiseError>
    where
        P: Future<Output = Result<(), DurableError>>,
    {
        let _one_at_a_time = self.raising.lock().await;
        {
            let mut st = self.lock();
            match decide(st.barrier).map_err(RaiseError::Refused)? {
                // Someone raised to our epoch while we waited.
                Admit::AtMark => return Ok(self.register(&mut st, epoch)),
                Admit::Raise => {
                    st.barrier = epoch;
                    st.raises += 1;
                    if st.inflight.range(..epoch).next().is_some() {
                        st.drains_started += 1;
                    }
                }
            }
        }
        if let Err(e) = persist().await {
            let mut st = self.lock();
            st.barrier = st.mark;
            return Err(RaiseError::Durable(e));
        }
        let deadline = tokio::time::Instant::now() + drain_timeout;
        let mut aborted = false;
        loop {
            let notified = self.drained.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut st = self.lock();
                if st.inflight.range(..epoch).next().is_none() {
                    st.mark = epoch;
                    return Ok(self.register(&mut st, epoch));
                }
            }
            if aborted {
                notified.await;
                continue;
            }
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep_until(deadline) => {
                    let mut st = self.lock();
                    st.drains_aborted += 1;
                    for slot in st.inflight.range(..epoch).map(|(_, s)| s) {
                        slot.abort.cancel();
                    }
                    aborted = true;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::epoch::LeaseName;

    fn admit_if(epoch: Epoch) -> impl Fn(Epoch) -> Result<Admit, Refusal> {
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

    async fn ok() -> Result<(), DurableError> {
        Ok(())
    }

    #[tokio::test(start_paused = true)]
    async fn raise_waits_for_older_passes() {
        let g = Gate::new(Epoch::new(7));
        let old = g
            .try_enter(Epoch::new(7), admit_if(Epoch::new(7)))
            .unwrap()
            .unwrap();
        let g2 = g.clone();
        let raise = tokio::spawn(async move {
            g2.raise(
                Epoch::new(8),
                Duration::from_secs(10),
                admit_if(Epoch::new(8)),
                ok,
            )
            .await
        });
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
        let raise = tokio::spawn(async move {
            g2.raise(
                Epoch::new(2),
                Duration::from_millis(500),
                admit_if(Epoch::new(2)),
                ok,
            )
            .await
        });
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
                || async { Err(DurableError::Write("disk full".into())) },
            )
            .await;
        assert!(matches!(res, Err(RaiseError::Durable(_))));
        assert_eq!(g.stats().barrier, Epoch::new(3));
        assert!(g
            .try_enter(Epoch::new(3), admit_if(Epoch::new(3)))
            .unwrap()
            .is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_raisers_to_one_epoch_both_pass() {
        let g = Gate::new(Epoch::new(1));
        let a = {
            let g = g.clone();
            tokio::spawn(async move {
                g.raise(
                    Epoch::new(5),
                    Duration::from_secs(1),
                    admit_if(Epoch::new(5)),
                    ok,
                )
                .await
            })
        };
        let b = {
            let g = g.clone();
            tokio::spawn(async move {
                g.raise(
                    Epoch::new(5),
                    Duration::from_secs(1),
                    admit_if(Epoch::new(5)),
                    ok,
                )
                .await
            })
        };
        let (pa, pb) = (a.await.unwrap().unwrap(), b.await.unwrap().unwrap());
        assert_eq!(g.stats().in_flight, 2);
        assert_eq!(g.stats().raises, 1);
        assert_eq!(g.stats().drains_started, 0);
        drop((pa, pb));
        assert_eq!(g.stats().in_flight, 0);
    }
}
