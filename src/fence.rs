//! Everything fencegate keeps for one lease: its gate (mark, in-flight, drain), the
//! epochs it knows (cached forever: objects are immutable), and how they are kept
//! current (one [`refresh_all`] task paces the listings of every fence). The
//! running fences are kept in [`Fences`]: one per lease, started (its mark loaded
//! from the state store) and stopped (its requests drained or aborted) as a unit
//! at run time — start-up uses exactly this, a config reload and a cluster's shard
//! handover will too.
//!
//! Locks: a fence has one std mutex (its known epochs) and its gate has another.
//! A thread never holds both (`lock_order`, checked in debug builds): the
//! admission decision runs under the gate's lock, so it reads the latest known
//! epoch from an atomic mirror, never from `known`; and [`Fence::view`] copies out
//! of `known` and releases it before it reads the gate.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use tokio_util::sync::CancellationToken;

use crate::admission::{self, Claim, Facts, Refusal};
use crate::epoch::{Epoch, EpochObject, LeaseName};
use crate::gate::{Denied, Gate, GateStats, Pass, RaiseError};
use crate::lease::{Epochs, StoreError};
use crate::lock_order::Ordered;
use crate::state::{Owner, StateError, StateStore};

/// Why a fence admitted nothing.
#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    #[error("{0}")]
    Refused(Refusal),
    #[error("the lease store cannot be reached and epoch {epoch} of lease {lease} cannot be validated from cache: {detail}")]
    StoreUnavailable {
        lease: LeaseName,
        epoch: Epoch,
        detail: String,
    },
    #[error("the high-water mark cannot be made durable: {0}")]
    State(StateError),
    /// The fence is stopping or stopped: this instance does not serve the lease now.
    #[error("lease {lease} is not served by this instance right now")]
    Stopped { lease: LeaseName },
}

impl From<Refusal> for FenceError {
    fn from(r: Refusal) -> Self {
        FenceError::Refused(r)
    }
}

#[derive(Default)]
struct Known {
    latest: Epoch,
    /// Interpreted objects of the epochs that can still admit (≥ latest).
    objects: BTreeMap<Epoch, Arc<EpochObject>>,
    last_ok: Option<Instant>,
    last_error: Option<String>,
}

/// Counters of store traffic, for metrics and the steady-state claim (zero calls
/// per request).
#[derive(Debug, Default)]
pub struct StoreCalls {
    pub lists: AtomicU64,
    pub gets: AtomicU64,
    pub errors: AtomicU64,
    pub on_demand: AtomicU64,
}

pub struct Fence {
    lease: LeaseName,
    epochs: Epochs,
    state: Arc<dyn StateStore>,
    /// The generation every state write of this fence carries (`state::Owner`).
    owner: Owner,
    gate: Arc<Gate>,
    known: Mutex<Known>,
    /// `known.latest`, readable without the lock (raised only under it): the
    /// admission decision reads it under the gate's lock.
    latest: AtomicU64,
    refresh_lock: tokio::sync::Mutex<()>,
    refreshes_started: AtomicU64,
    stop: CancellationToken,
    pub calls: StoreCalls,
}

/// A snapshot for the admin API.
#[derive(Debug, Clone)]
pub struct FenceView {
    pub lease: LeaseName,
    pub gate: GateStats,
    pub latest_known: Epoch,
    pub holder: Option<String>,
    pub expires_at: Option<SystemTime>,
    pub store_ok: bool,
    pub last_error: Option<String>,
}

impl Fence {
    /// Creates the fence of `lease` from its durable mark. `settle` is the longest
    /// drain timeout of its routes: after a restart the first raise waits that long
    /// for requests the previous process may have left at the destination, and so
    /// does any request above the epoch its drains had completed through.
    pub async fn new(
        lease: LeaseName,
        epochs: Epochs,
        state: Arc<dyn StateStore>,
        owner: Owner,
        settle: Duration,
    ) -> Result<Arc<Fence>, StateError> {
        let marks = state.marks(&lease).await?;
        let (mark, drained) = (marks.mark, marks.drained);
        Ok(Arc::new(Fence {
            lease,
            epochs,
            state,
            owner,
            gate: Gate::restarted(mark, drained, settle),
            known: Mutex::new(Known {
                latest: mark,
                ..Known::default()
            }),
            latest: AtomicU64::new(mark.get()),
            refresh_lock: tokio::sync::Mutex::new(()),
            refreshes_started: AtomicU64::new(0),
            stop: CancellationToken::new(),
            calls: StoreCalls::default(),
        }))
    }

    pub fn lease(&self) -> &LeaseName {
        &self.lease
    }

    /// The generation this fence's state writes carry.
    pub fn owner(&self) -> Owner {
        self.owner
    }

    fn known(&self) -> Ordered<'_, Known> {
        crate::lock_order::lock("fence known", &self.known)
    }

    /// The latest epoch known for the lease, without taking `known`.
    fn latest(&self) -> Epoch {
        Epoch::new(self.latest.load(Ordering::SeqCst))
    }

    /// Stops the fence: out of the background refresh, nothing more admitted, the
    /// requests in flight finished — or aborted after `drain_timeout`.
    pub async fn stop(&self, drain_timeout: Duration) {
        self.stop.cancel();
        self.gate.close(drain_timeout).await;
    }

    pub fn is_stopped(&self) -> bool {
        self.stop.is_cancelled()
    }

    fn denied(&self, d: Denied) -> FenceError {
        match d {
            Denied::Refused(r) => FenceError::Refused(r),
            Denied::Closed => FenceError::Stopped {
                lease: self.lease.clone(),
            },
        }
    }

    /// Lists newer epochs and reads the latest one's object, under the refresh lock.
    pub async fn refresh_now(&self) -> Result<(), StoreError> {
        let _one = self.refresh_lock.lock().await;
        self.refresh_locked().await
    }

    async fn refresh_locked(&self) -> Result<(), StoreError> {
        self.refreshes_started.fetch_add(1, Ordering::SeqCst);
        let res = self.refresh_inner().await;
        let mut k = self.known();
        match &res {
            Ok(()) => {
                k.last_ok = Some(Instant::now());
                k.last_error = None;
            }
            Err(e) => {
                self.calls.errors.fetch_add(1, Ordering::Relaxed);
                k.last_error = Some(e.to_string());
            }
        }
        res
    }

    async fn refresh_inner(&self) -> Result<(), StoreError> {
        let after = self.known().latest;
        self.calls.lists.fetch_add(1, Ordering::Relaxed);
        let latest = self.epochs.latest_after(&self.lease, after).await?;
        let cached = self.known().objects.contains_key(&latest);
        let object = if latest != Epoch::NONE && !cached {
            self.calls.gets.fetch_add(1, Ordering::Relaxed);
            self.epochs.read(&self.lease, latest).await?
        } else {
            None
        };
        let mut k = self.known();
        if latest > k.latest {
            k.latest = latest;
            self.latest.fetch_max(latest.get(), Ordering::SeqCst);
        }
        if let Some(o) = object {
            k.objects.insert(latest, Arc::new(o));
        }
        let keep_from = k.latest;
        k.objects.retain(|e, _| *e >= keep_from);
        Ok(())
    }

    /// An on-demand read for a request whose epoch is above what we know, or whose
    /// object we do not have. Coalesced: a request that waited while another read
    /// started *after* it arrived uses that read's result instead of making its own.
    async fn refresh_for(&self) -> Result<(), StoreError> {
        let arrived = self.refreshes_started.load(Ordering::SeqCst);
        let _one = self.refresh_lock.lock().await;
        if self.refreshes_started.load(Ordering::SeqCst) > arrived {
            // A read that started after this request arrived has completed.
            return match self.known().last_error.clone() {
                None => Ok(()),
                Some(e) => Err(StoreError::Unavailable(e)),
            };
        }
        self.calls.on_demand.fetch_add(1, Ordering::Relaxed);
        self.refresh_locked().await
    }

    fn has_answer_for(&self, epoch: Epoch) -> bool {
        let k = self.known();
        epoch < k.latest || k.objects.contains_key(&epoch)
    }

    /// SPEC §4: validates the claim and returns a pass, raising the mark and
    /// draining older requests when the claim is newer than the mark.
    pub async fn admit(
        &self,
        claim: Claim<'_>,
        require_token: bool,
        drain_timeout: Duration,
    ) -> Result<Pass, FenceError> {
        let epoch = claim.epoch;
        if require_token && claim.token.is_none() {
            return Err(Refusal::TokenMissing {
                lease: self.lease.clone(),
            }
            .into());
        }
        // Stale without I/O: below the barrier or below a known epoch.
        {
            let barrier = self.gate.barrier();
            let latest = self.latest();
            if admission::stale(epoch, barrier, latest) {
                return Err(Refusal::Stale {
                    lease: self.lease.clone(),
                    epoch,
                    high_water_mark: barrier,
                    latest_epoch: latest,
                }
                .into());
            }
        }
        // Needs the store: an epoch above what we know, or an object not yet read.
        if !self.has_answer_for(epoch) {
            if let Err(e) = self.refresh_for().await {
                return Err(FenceError::StoreUnavailable {
                    lease: self.lease.clone(),
                    epoch,
                    detail: e.to_string(),
                });
            }
        }
        let object = self.known().objects.get(&epoch).cloned();
        // Runs under the gate's lock (takes no other lock: module doc), at the
        // check and again when a raise's drain completes: the store's clock and the
        // latest known epoch are read each time, so a claim that expired or became
        // stale while it waited for the drain is refused, not forwarded.
        let decide = |mark: Epoch| {
            admission::decide(
                claim,
                Facts {
                    lease: &self.lease,
                    high_water_mark: mark,
                    latest_known: self.latest(),
                    object: object.as_deref(),
                    store_now: self.epochs.store_now(),
                    require_token,
                },
            )
        };
        if let Some(pass) = self
            .gate
            .try_enter(epoch, decide)
            .map_err(|d| self.denied(d))?
        {
            return Ok(pass);
        }
        self.gate
            .raise(
                epoch,
                drain_timeout,
                decide,
                || self.state.raise_mark(self.owner, &self.lease, epoch),
                |through| async move {
                    if let Err(e) = self.state.note_drained(self.owner, &self.lease, through).await {
                        // Only costs a longer settle after a restart.
                        tracing::warn!(lease = %self.lease, error = %e, "could not record a completed drain");
                    }
                },
            )
            .await
            .map_err(|e| match e {
                RaiseError::Denied(d) => self.denied(d),
                RaiseError::State(d) => FenceError::State(d),
            })
    }

    /// A snapshot for the admin API and metrics.
    ///
    /// Copies out of `known` and releases it before reading the gate (module doc).
    pub fn view(&self) -> FenceView {
        let view = {
            let k = self.known();
            let (holder, expires_at) = match k.objects.get(&k.latest).map(|o| o.as_ref()) {
                Some(EpochObject::Acquire {
                    holder, expires_at, ..
                }) => (Some(holder.clone()), Some(*expires_at)),
                Some(o) => (o.holder().map(str::to_owned), None),
                None => (None, None),
            };
            FenceView {
                lease: self.lease.clone(),
                gate: GateStats::default(),
                latest_known: k.latest,
                holder,
                expires_at,
                store_ok: k.last_error.is_none() && k.last_ok.is_some(),
                last_error: k.last_error.clone(),
            }
        };
        FenceView {
            gate: self.gate.stats(),
            ..view
        }
    }
}

/// The running fences, one per lease.
pub struct Fences {
    epochs: Epochs,
    state: Arc<dyn StateStore>,
    running: Mutex<BTreeMap<LeaseName, Arc<Fence>>>,
}

impl Fences {
    pub fn new(epochs: Epochs, state: Arc<dyn StateStore>) -> Arc<Fences> {
        Arc::new(Fences {
            epochs,
            state,
            running: Mutex::new(BTreeMap::new()),
        })
    }

    fn running(&self) -> Ordered<'_, BTreeMap<LeaseName, Arc<Fence>>> {
        crate::lock_order::lock("fences", &self.running)
    }

    /// Starts the fence of `lease` from its durable mark, or returns the running
    /// one. `settle` is the longest drain timeout of its routes ([`Fence::new`]).
    pub async fn start(
        &self,
        lease: &LeaseName,
        settle: Duration,
    ) -> Result<Arc<Fence>, StateError> {
        if let Some(f) = self.get(lease) {
            return Ok(f);
        }
        let fence = Fence::new(
            lease.clone(),
            self.epochs.clone(),
            self.state.clone(),
            Owner::SINGLE,
            settle,
        )
        .await?;
        // Two starters of one lease: the first one in wins, the other's is dropped
        // unused (nothing was admitted through it).
        Ok(self.running().entry(lease.clone()).or_insert(fence).clone())
    }

    pub fn get(&self, lease: &LeaseName) -> Option<Arc<Fence>> {
        self.running().get(lease).cloned()
    }

    /// Every running fence, by lease name.
    pub fn all(&self) -> Vec<Arc<Fence>> {
        self.running().values().cloned().collect()
    }

    /// Stops the fence of `lease` ([`Fence::stop`]) and forgets it. Returns
    /// whether it was running.
    pub async fn stop(&self, lease: &LeaseName, drain_timeout: Duration) -> bool {
        let fence = self.running().remove(lease);
        match fence {
            Some(f) => {
                f.stop(drain_timeout).await;
                true
            }
            None => false,
        }
    }
}

/// Most store calls the background refresh has in flight at once.
const REFRESH_CONCURRENCY: usize = 32;

/// The background refresher of every fence (SPEC §4: each lease is listed at least
/// every `interval`), from one task. A listing per lease per interval is the rule,
/// but one task with a bounded number of calls in flight costs far less than a task
/// and a timer per lease (10,000 leases were 30% of a core idle), and a store
/// outage is logged once per round, not once per lease. Stopped fences are skipped.
pub async fn refresh_all(fences: Arc<Fences>, interval: Duration, stop: CancellationToken) {
    loop {
        let round = Instant::now();
        let fences = fences.all();
        let mut calls = tokio::task::JoinSet::new();
        let mut failed = 0usize;
        let mut first_error: Option<(LeaseName, StoreError)> = None;
        let mut note = |r: Option<Result<(LeaseName, Result<(), StoreError>), _>>| {
            if let Some(Ok((lease, Err(e)))) = r {
                failed += 1;
                first_error.get_or_insert((lease, e));
            }
        };
        for f in fences.iter().filter(|f| !f.is_stopped()) {
            while calls.len() >= REFRESH_CONCURRENCY {
                note(calls.join_next().await);
            }
            let f = f.clone();
            calls.spawn(async move { (f.lease.clone(), f.refresh_now().await) });
        }
        while let Some(r) = calls.join_next().await {
            note(Some(r));
        }
        if let Some((lease, e)) = first_error {
            tracing::warn!(failed, %lease, error = %e, "epoch refresh failed");
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(interval.saturating_sub(round.elapsed())) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::SystemClock;
    use crate::lease::dir::DirStore;
    use crate::state::sled::SledState;

    async fn create_epoch(epochs: &Epochs, e: u64) {
        let lease = LeaseName::parse("l").unwrap();
        let token = format!("t{e}");
        let rec = crate::epoch::EpochRecord::acquire(
            &lease,
            Epoch::new(e),
            "w",
            token.as_bytes(),
            Duration::from_secs(60),
        );
        epochs
            .create(&lease, Epoch::new(e), rec.to_json().into())
            .await
            .unwrap();
    }

    async fn fence_on(dir: &std::path::Path) -> (Arc<Fence>, Epochs, Arc<SledState>) {
        let store = DirStore::open(dir.join("store"), Arc::new(SystemClock)).unwrap();
        let epochs = Epochs::new(Arc::new(store), "p/");
        let lease = LeaseName::parse("l").unwrap();
        let durable = SledState::open(&dir.join("state")).unwrap();
        let fence = Fence::new(
            lease,
            epochs.clone(),
            durable.clone(),
            Owner::SINGLE,
            Duration::ZERO,
        )
        .await
        .unwrap();
        (fence, epochs, durable)
    }

    /// The lock-order rule (module doc) on every path where the fence's `known`
    /// and the gate's lock meet: admission at the mark and by a raise (the
    /// decision runs under the gate's lock), the admin/metrics snapshot, and the
    /// refresh. In debug builds nesting the two panics (`lock_order`), so this
    /// fails on a `decide` that reads `known` or a `view` that reads the gate
    /// while holding it — whichever interleaving the threads happen to take.
    #[tokio::test]
    async fn admission_view_and_refresh_never_hold_both_locks() {
        let dir = tempfile::tempdir().unwrap();
        let (fence, epochs, durable) = fence_on(dir.path()).await;
        create_epoch(&epochs, 1).await;
        let claim = |e: u64, t: &'static [u8]| Claim {
            epoch: Epoch::new(e),
            token: Some(t),
        };
        let p1 = fence
            .admit(claim(1, b"t1"), true, Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(fence.view().gate.in_flight, 1);
        drop(p1);
        let again = fence
            .admit(claim(1, b"t1"), true, Duration::from_secs(1))
            .await
            .unwrap();
        drop(again);
        create_epoch(&epochs, 2).await;
        fence.refresh_now().await.unwrap();
        let p2 = fence
            .admit(claim(2, b"t2"), true, Duration::from_secs(1))
            .await
            .unwrap();
        let v = fence.view();
        assert_eq!(
            (v.gate.mark, v.latest_known),
            (Epoch::new(2), Epoch::new(2))
        );
        drop(p2);
        assert!(fence
            .admit(claim(1, b"t1"), true, Duration::from_secs(1))
            .await
            .is_err());
        durable.close().await.unwrap();
    }

    /// One round lists every running fence once and skips a stopped one; with the
    /// stop token already cancelled, `refresh_all` returns after that round.
    #[tokio::test]
    async fn a_round_lists_each_running_fence_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = DirStore::open(dir.path().join("store"), Arc::new(SystemClock)).unwrap();
        let epochs = Epochs::new(Arc::new(store), "p/");
        let durable = SledState::open(&dir.path().join("state")).unwrap();
        let registry = Fences::new(epochs, durable.clone());
        let mut fences = Vec::new();
        for l in ["a", "b", "c", "a"] {
            let lease = LeaseName::parse(l).unwrap();
            fences.push(registry.start(&lease, Duration::ZERO).await.unwrap());
        }
        assert!(Arc::ptr_eq(&fences[0], &fences[3]));
        fences.pop();
        assert!(registry.stop(fences[2].lease(), Duration::ZERO).await);
        assert!(fences[2].is_stopped());
        assert_eq!(registry.all().len(), 2);
        let stop = CancellationToken::new();
        stop.cancel();
        refresh_all(registry.clone(), Duration::from_secs(3600), stop).await;
        let lists: Vec<u64> = fences
            .iter()
            .map(|f| f.calls.lists.load(Ordering::Relaxed))
            .collect();
        assert_eq!(lists, vec![1, 1, 0]);
        assert!(fences[0].view().store_ok);
        durable.close().await.unwrap();
    }
}
