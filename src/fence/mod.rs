//! Everything fencegate keeps for one lease: its gate (mark, in-flight, drain), the
//! epochs it knows (cached forever: objects are immutable), and how they are kept
//! current ([`Refresh`]: store calls follow traffic, see there). The
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
//!
//! Here: the fence of one lease ([`Fence`], [`FenceError`], [`FenceView`]);
//! `refresh.rs`: how fences are kept current (SPEC §4.3); `registry.rs`: the
//! running fences ([`Fences`]).

mod refresh;
mod registry;

pub(crate) use refresh::{refresh_all, Refresh};
pub(crate) use registry::Fences;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use tokio_util::sync::CancellationToken;

use self::refresh::fresh;

use crate::admission::{self, Claim, Facts, Refusal};
use crate::epoch::{Epoch, EpochObject, LeaseName};
use crate::gate::{Denied, Gate, GateStats, Pass, RaiseError};
use crate::lease::{Epochs, StoreError};
use crate::lock_order::Ordered;
use crate::state::{LeaseMarks, Owner, StateError, StateStore};

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
    /// When listings are due, and how recent knowledge must be ([`Refresh`]).
    refresh: Arc<Refresh>,
    /// Start of the latest completed listing attempt ([`Refresh::now`]; 0: never).
    listed_at: AtomicU64,
    /// Start of the listing in progress (0: none).
    listing_since: AtomicU64,
    /// The latest admission attempt: a lease nobody asked about since its last
    /// listing is not listed again.
    used_at: AtomicU64,
    /// Itself, for the refresh schedule.
    this: Weak<Fence>,
    /// The token bytes last admitted, and their epoch: a request carrying the same
    /// bytes at that epoch needs no SHA-256 (see `Facts::token_verified`).
    verified: Mutex<Option<(Epoch, Box<[u8]>)>>,
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
    /// How long ago the latest successful listing started: what the view knows
    /// is at least this old (an idle lease is not listed).
    pub listed_ago: Option<Duration>,
}

impl Fence {
    /// Creates the fence of `lease` from its durable marks (`stored`, read by the
    /// caller), or from `floor` when that is higher (a takeover starts at the latest epoch listed in the store,
    /// SPEC §10.2). `settle` is the longest drain timeout of its routes: after a
    /// restart or a takeover the first raise waits that long for requests the
    /// previous process may have left at the destination, and so does any request
    /// above the epoch its drains had completed through.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        lease: LeaseName,
        epochs: Epochs,
        state: Arc<dyn StateStore>,
        owner: Owner,
        settle: Duration,
        refresh: Arc<Refresh>,
        stored: LeaseMarks,
        floor: Epoch,
    ) -> Arc<Fence> {
        let (mark, drained) = (stored.mark.max(floor), stored.drained);
        Arc::new_cyclic(|this| Fence {
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
            refresh,
            listed_at: AtomicU64::new(0),
            listing_since: AtomicU64::new(0),
            used_at: AtomicU64::new(0),
            this: this.clone(),
            verified: Mutex::new(None),
            stop: CancellationToken::new(),
            calls: StoreCalls::default(),
        })
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
        self.stop_by(tokio::time::Instant::now() + drain_timeout)
            .await
    }

    /// Aborts what is in flight through this fence ([`Gate::abort_in_flight`]).
    pub fn abort_in_flight(&self) {
        self.gate.abort_in_flight();
    }

    /// [`Fence::stop`] with an absolute deadline for what is in flight.
    pub async fn stop_by(&self, deadline: tokio::time::Instant) {
        self.stop.cancel();
        self.gate.close_by(deadline).await;
    }

    /// Whether the last store call for this lease failed (cheaper than a
    /// [`Fence::view`], for counting over every lease).
    pub fn store_failing(&self) -> bool {
        self.known().last_error.is_some()
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

    /// The background refresh's listing: skipped when another (a request's) made
    /// it unnecessary while this one waited for the lock.
    async fn refresh_due(&self) -> Result<(), StoreError> {
        let _one = self.refresh_lock.lock().await;
        if !self.wants_listing(self.refresh.now()) {
            return Ok(());
        }
        self.refresh_locked().await
    }

    async fn refresh_locked(&self) -> Result<(), StoreError> {
        let started = self.refresh.now();
        let started_at = Instant::now();
        self.listing_since.store(started, Ordering::SeqCst);
        self.refreshes_started.fetch_add(1, Ordering::SeqCst);
        let res = self.refresh_inner().await;
        {
            let mut k = self.known();
            match &res {
                Ok(()) => {
                    k.last_ok = Some(started_at);
                    k.last_error = None;
                }
                Err(e) => {
                    self.calls.errors.fetch_add(1, Ordering::Relaxed);
                    k.last_error = Some(e.to_string());
                }
            }
        }
        // A failed attempt counts as a listing too, from when it gave up: during
        // a store outage a lease in use is tried once per interval and admits
        // from cache meanwhile (as an epoch validated from cache always could,
        // SPEC §4, and as before calls followed traffic), rather than requests
        // waiting for a store that does not answer.
        let counted = if res.is_ok() {
            started
        } else {
            self.refresh.now()
        };
        self.listed_at.fetch_max(counted, Ordering::SeqCst);
        self.listing_since.store(0, Ordering::SeqCst);
        self.refresh
            .schedule(counted, &self.lease, self.this.clone());
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

    /// Whether what the fence knows is recent enough to admit `epoch` on: its object
    /// is known (or a newer epoch is), and the latest listing is not older than the
    /// refresh interval ([`Refresh`]).
    fn answers(&self, epoch: Epoch, now: u64) -> bool {
        self.has_answer_for(epoch)
            && fresh(
                now,
                self.listed_at.load(Ordering::SeqCst),
                self.listing_since.load(Ordering::SeqCst),
                self.refresh.interval_ms(),
            )
    }

    /// An on-demand read for a request whose epoch is above what we know, whose
    /// object we do not have, or that arrives after the lease was idle for longer
    /// than the refresh interval. Coalesced: a request that waited while another
    /// read started *after* it arrived, or made what we know fresh again, uses
    /// that read's result instead of making its own.
    async fn refresh_for(&self, epoch: Epoch) -> Result<(), StoreError> {
        let arrived = self.refreshes_started.load(Ordering::SeqCst);
        let _one = self.refresh_lock.lock().await;
        if self.answers(epoch, self.refresh.now()) {
            return Ok(());
        }
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
        let now = self.refresh.now();
        self.used_at.store(now, Ordering::SeqCst);
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
        // Needs the store: an epoch above what we know, an object not yet read, or
        // knowledge older than the refresh interval (the lease was idle, so the
        // background refresh left it alone). When the store does not answer, an
        // epoch validated from cache is still admitted; any other is refused.
        if !self.answers(epoch, now) {
            if let Err(e) = self.refresh_for(epoch).await {
                if !self.has_answer_for(epoch) {
                    return Err(FenceError::StoreUnavailable {
                        lease: self.lease.clone(),
                        epoch,
                        detail: e.to_string(),
                    });
                }
            }
        }
        let object = self.known().objects.get(&epoch).cloned();
        let token_verified = claim.token.is_some_and(|t| self.was_verified(epoch, t));
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
                    token_verified,
                },
            )
        };
        if let Some(pass) = self
            .gate
            .try_enter(epoch, decide)
            .map_err(|d| self.denied(d))?
        {
            self.note_verified(epoch, claim.token, token_verified);
            return Ok(pass);
        }
        let pass = self.gate
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
            })?;
        self.note_verified(epoch, claim.token, token_verified);
        Ok(pass)
    }

    fn verified(&self) -> Ordered<'_, Option<(Epoch, Box<[u8]>)>> {
        crate::lock_order::lock("fence verified token", &self.verified)
    }

    /// Whether `token` is the one last admitted at `epoch` (compared in constant
    /// time, like the hashes it stands in for).
    fn was_verified(&self, epoch: Epoch, token: &[u8]) -> bool {
        match &*self.verified() {
            Some((e, t)) if *e == epoch && t.len() == token.len() => {
                t.iter().zip(token).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
            }
            _ => false,
        }
    }

    /// Remembers an admitted claim's token (its hash matched the epoch's object).
    fn note_verified(&self, epoch: Epoch, token: Option<&[u8]>, already: bool) {
        if let (Some(t), false) = (token, already) {
            *self.verified() = Some((epoch, t.into()));
        }
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
                listed_ago: k.last_ok.map(|t| t.elapsed()),
            }
        };
        FenceView {
            gate: self.gate.stats(),
            ..view
        }
    }
}

impl Fence {
    /// Whether the background refresh should list this fence at `now`: it is
    /// running, its latest listing is an interval old, and it is in use — asked
    /// about since that listing started, or a raise is waiting (it decides its
    /// claim again when its drain ends, on what the fence knows by then).
    fn wants_listing(&self, now: u64) -> bool {
        let listed = self.listed_at.load(Ordering::SeqCst);
        !self.is_stopped()
            && now >= listed.saturating_add(self.refresh.interval_ms())
            && (self.used_at.load(Ordering::SeqCst) >= listed || self.gate.raise_pending())
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
        let (_registry, mut fences, epochs, durable) = registry_on(dir, &["l"]).await;
        (fences.remove(0), epochs, durable)
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

    /// The token cache stands in for the SHA-256 only for the very bytes admitted
    /// at that very epoch: a different token, or the same one at another epoch
    /// whose object names another hash, is still checked. Fails when the cache
    /// matches on the epoch alone or on a prefix.
    #[tokio::test]
    async fn a_verified_token_is_remembered_only_for_its_bytes_and_epoch() {
        let dir = tempfile::tempdir().unwrap();
        let (fence, epochs, durable) = fence_on(dir.path()).await;
        create_epoch(&epochs, 1).await;
        let admit = |e: u64, t: &'static [u8]| {
            let fence = fence.clone();
            async move {
                let claim = Claim {
                    epoch: Epoch::new(e),
                    token: Some(t),
                };
                fence
                    .admit(claim, true, Duration::from_secs(1))
                    .await
                    .map(drop)
            }
        };
        let invalid = |r: Result<(), FenceError>| {
            matches!(r, Err(FenceError::Refused(Refusal::TokenInvalid { .. })))
        };
        admit(1, b"t1").await.unwrap();
        assert!(fence.was_verified(Epoch::new(1), b"t1"));
        assert!(invalid(admit(1, b"t2").await));
        assert!(invalid(admit(1, b"t").await));
        assert!(invalid(admit(1, b"t11").await));
        admit(1, b"t1").await.unwrap();
        create_epoch(&epochs, 2).await;
        assert!(invalid(admit(2, b"t1").await));
        admit(2, b"t2").await.unwrap();
        assert!(!fence.was_verified(Epoch::new(1), b"t1"));
        durable.close().await.unwrap();
    }

    async fn registry_on(
        dir: &std::path::Path,
        names: &[&str],
    ) -> (Arc<Fences>, Vec<Arc<Fence>>, Epochs, Arc<SledState>) {
        let store = DirStore::open(dir.join("store"), Arc::new(SystemClock)).unwrap();
        let epochs = Epochs::new(Arc::new(store), "p/");
        let durable = SledState::open(&dir.join("state")).unwrap();
        let registry = Fences::new(epochs.clone(), durable.clone(), Duration::from_secs(1));
        let mut fences = Vec::new();
        for l in names {
            let lease = LeaseName::parse(l).unwrap();
            fences.push(registry.start(&lease, Duration::ZERO).await.unwrap());
        }
        (registry, fences, epochs, durable)
    }

    fn lists(f: &Fence) -> u64 {
        f.calls.lists.load(Ordering::Relaxed)
    }

    /// Moves tokio's (paused) clock and lists what falls due, as `refresh_all` would.
    async fn advance(registry: &Fences, by: Duration) {
        let r = registry.refresh();
        tokio::time::advance(by).await;
        let now = r.now();
        let (ready, _) = r.take_due(now);
        for f in ready.into_iter().filter(|f| f.wants_listing(now)) {
            f.refresh_due().await.unwrap();
        }
    }

    /// Store calls follow traffic (SPEC §4.3): an idle lease is never listed; a
    /// lease in use is listed at most once per interval, and once more after its
    /// last request; a stopped one never. Fails when the refresh lists every lease
    /// each interval, or lists a used lease more often than the interval.
    #[tokio::test(start_paused = true)]
    async fn idle_leases_cost_nothing_and_used_ones_one_listing_per_interval() {
        let dir = tempfile::tempdir().unwrap();
        let (registry, fences, epochs, durable) = registry_on(dir.path(), &["l", "b", "c"]).await;
        assert!(Arc::ptr_eq(
            &fences[0],
            &registry
                .start(fences[0].lease(), Duration::ZERO)
                .await
                .unwrap()
        ));
        create_epoch(&epochs, 1).await;
        advance(&registry, Duration::from_secs(30)).await;
        assert_eq!(
            fences.iter().map(|f| lists(f)).sum::<u64>(),
            0,
            "idle leases were listed"
        );
        let claim = Claim {
            epoch: Epoch::new(1),
            token: Some(b"t1"),
        };
        // Used every 100 ms for 10 s.
        for _ in 0..100 {
            drop(
                fences[0]
                    .admit(claim, true, Duration::from_secs(1))
                    .await
                    .unwrap(),
            );
            advance(&registry, Duration::from_millis(100)).await;
        }
        let used = lists(&fences[0]);
        let on_demand = fences[0].calls.on_demand.load(Ordering::Relaxed);
        assert!(
            (10..=11).contains(&used),
            "{used} listings in 10 s of use, {on_demand} on demand"
        );
        assert_eq!(
            fences[0].calls.on_demand.load(Ordering::Relaxed),
            1,
            "only the first request waited"
        );
        // Idle again: at most the one listing booked while it was used.
        for _ in 0..30 {
            advance(&registry, Duration::from_secs(1)).await;
        }
        assert!(lists(&fences[0]) <= used + 1);
        assert_eq!(lists(&fences[1]) + lists(&fences[2]), 0);
        durable.close().await.unwrap();
    }

    /// SPEC §4.3 with an idle lease: nothing listed it while a newer epoch was
    /// created, so the first request after the interval reads the store before it
    /// is decided and the older epoch is refused. Fails when a request is decided
    /// on knowledge older than the refresh interval.
    #[tokio::test(start_paused = true)]
    async fn the_first_request_after_idle_learns_a_newer_epoch_before_admission() {
        let dir = tempfile::tempdir().unwrap();
        let (registry, fences, epochs, durable) = registry_on(dir.path(), &["l"]).await;
        create_epoch(&epochs, 1).await;
        let claim = Claim {
            epoch: Epoch::new(1),
            token: Some(b"t1"),
        };
        drop(
            fences[0]
                .admit(claim, true, Duration::from_secs(1))
                .await
                .unwrap(),
        );
        // One more listing falls due and finds nothing new; then the lease is idle.
        for _ in 0..5 {
            advance(&registry, Duration::from_secs(1)).await;
        }
        let before = lists(&fences[0]);
        create_epoch(&epochs, 2).await;
        for _ in 0..5 {
            advance(&registry, Duration::from_secs(1)).await;
        }
        assert_eq!(lists(&fences[0]), before, "the idle lease was listed");
        assert_eq!(fences[0].view().latest_known, Epoch::new(1));
        let r = fences[0].admit(claim, true, Duration::from_secs(1)).await;
        assert!(
            matches!(r, Err(FenceError::Refused(Refusal::Stale { latest_epoch, .. })) if latest_epoch == Epoch::new(2)),
            "{:?}",
            r.err()
        );
        durable.close().await.unwrap();
    }
}
