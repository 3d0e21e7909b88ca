//! A tenure of one shard (SPEC §10.2): taking its row (conditioned on the row
//! as watched), the state claim and the fences started at the latest epoch,
//! serving it until its forwarding deadline — the shard's own window, and the
//! anchor's — and leaving it, self-fenced, handed over or lost, with every
//! lease held to the shard's one abort deadline.
//!
//! [`Tenures`] is what a tenure starts and stops besides the row — the
//! state's claim, the in-doubt records, the fences, the work that follows
//! (the queue) — and owns those handles. When a tenure starts or stops, and
//! under which generation, is the cluster's (`impl Cluster` below).

use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::time::Instant;

use super::shard::Shard;
use super::{lock, weakened, Cluster, TenureWork};
use crate::dedup::Dedup;
use crate::fence::Fences;
use crate::state::{Generation, Owner, OwnerRow, StateStore};

/// What a tenure of a shard here starts and stops besides its row: the
/// state's claim of the shard, the records a previous owner left in flight,
/// the fences of the shard's leases, and the work that follows them (the
/// queue). The cluster decides when (its row taken, its deadline passed, a
/// handover); this does it, the same for every shard.
pub(super) struct Tenures {
    pub(super) fences: Arc<Fences>,
    /// Where the shard is claimed under the tenure's generation.
    state: Arc<dyn StateStore>,
    dedup: Arc<Dedup>,
    /// Work that follows each tenure here besides the fences (the queue).
    work: OnceLock<Arc<dyn TenureWork>>,
}

impl Tenures {
    pub(super) fn new(
        fences: Arc<Fences>,
        state: Arc<dyn StateStore>,
        dedup: Arc<Dedup>,
    ) -> Tenures {
        Tenures {
            fences,
            state,
            dedup,
            work: OnceLock::new(),
        }
    }

    /// Makes `work` follow every tenure from now on (set once).
    pub(super) fn follow(&self, work: Arc<dyn TenureWork>) {
        let _ = self.work.set(work);
    }

    /// SPEC §10.2 takeover: claim the shard's state, turn older generations'
    /// in-flight records in doubt, start its fences at max(stored, listed).
    /// The work that follows may refuse first (`Err`: why).
    pub(super) async fn start(&self, g: &Shard, owner: Owner) -> Result<(), String> {
        if let Some(w) = self.work.get() {
            w.check(&g.lease_names()).await?;
        }
        self.state
            .claim_shard(owner)
            .await
            .map_err(|e| e.to_string())?;
        let in_doubt = self.dedup.recover(owner).await.map_err(|e| e.to_string())?;
        if in_doubt > 0 {
            tracing::warn!(
                shard = owner.shard,
                records = in_doubt,
                "dedup records left in flight by the shard's previous owner are now in doubt"
            );
        }
        for (lease, settle) in &g.leases {
            self.fences
                .take_over(lease, *settle, owner)
                .await
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// The tenure started is served: the work that follows it begins.
    pub(super) fn started(&self, g: &Shard) {
        if let Some(w) = self.work.get() {
            w.started(&g.lease_names());
        }
    }

    /// Stops serving shard number `shard` (`g`) now: no new admissions or
    /// forwards; its requests in flight may finish until `deadline`, then are
    /// aborted. Counted in `g.stopping` until they have. False when no tenure
    /// was served.
    pub(super) fn stop(&self, shard: u32, g: &Shard, deadline: Instant, why: &'static str) -> bool {
        let Some(generation) = g.unserve() else {
            return false;
        };
        let owner = Owner { shard, generation };
        let stops = self.stop_leases(g, owner, |_| deadline);
        let stopping = g.stopping.clone();
        stopping.send_modify(|n| *n += 1);
        tokio::spawn(async move {
            stops.join_all().await;
            stopping.send_modify(|n| *n = n.saturating_sub(1));
            tracing::info!(shard, why, "stopped serving a shard");
        });
        true
    }

    /// Closes the fence of every lease of the shard at once (the leases of one
    /// shard never wait for one another: closed one after another, each with
    /// a timeout of its own, the last would be aborted long after `gate_ttl`)
    /// and returns the drains, each aborting what is in flight at its deadline
    /// (`deadline` of the lease's drain timeout).
    pub(super) fn stop_leases(
        &self,
        g: &Shard,
        owner: Owner,
        deadline: impl Fn(Duration) -> Instant,
    ) -> tokio::task::JoinSet<bool> {
        let mut stops = tokio::task::JoinSet::new();
        for (lease, drain) in &g.leases {
            let (fences, lease, at) = (self.fences.clone(), lease.clone(), deadline(*drain));
            stops.spawn(async move { fences.stop_owned(&lease, owner, at).await });
        }
        // The queue's attempts on the shard, held to the longest of its
        // leases' bounds (the abort deadline, or a handover's drain).
        if let Some(w) = self.work.get().cloned() {
            let longest = g.leases.iter().map(|(_, d)| *d).max().unwrap_or_default();
            let at = deadline(longest);
            stops.spawn(async move {
                w.stop(owner.shard, at).await;
                true
            });
        }
        stops
    }
}

impl Cluster {
    /// The shard's one abort deadline (SPEC §10.2): `gate_ttl` after its latest
    /// renewal was sent, and never later than the anchor's. Every lease of the
    /// shard is held to it, however the shard is left.
    pub(super) fn abort_deadline(&self, g: &Shard) -> Instant {
        g.window
            .abort_deadline()
            .min(self.anchor.window.abort_deadline())
    }

    /// When forwards on the shard stop: its own window, and the anchor's.
    pub(super) fn forward_deadline(&self, g: &Shard) -> Instant {
        g.window
            .forward_deadline()
            .min(self.anchor.window.forward_deadline())
    }

    /// Whether forwards on the shard may start now.
    pub(super) fn window_open(&self, g: &Shard) -> bool {
        g.window.is_open() && self.anchor.window.is_open()
    }

    /// Takes `shard` (or starts a new tenure on a row owned here) in the
    /// background.
    pub(super) fn spawn_takeover(self: Arc<Self>, shard: u32) {
        let g = &self.by_shard[shard as usize];
        // Not while leaving: a graceful stop's handover may still be draining
        // the shard (a renewal answered then must not take it again).
        if self.stopping.is_cancelled()
            || self.stopped_by_another_set_up()
            || g.busy.swap(true, Ordering::SeqCst)
        {
            return;
        }
        tokio::spawn(async move {
            self.take_over(shard).await;
            self.by_shard[shard as usize]
                .busy
                .store(false, Ordering::SeqCst);
        });
    }

    pub(super) async fn take_over(self: &Arc<Self>, shard: u32) {
        let g = &self.by_shard[shard as usize];
        // A tenure of this shard stopped here (self-fenced, then renewed in
        // time) may still have requests in flight until its abort deadline,
        // which can come after a new tenure's settle; and their outcomes are
        // written under its generation, which a new take would make stale
        // (both were found delivering late). They end first; meanwhile the row stays
        // this instance's, renewed.
        g.previous_tenure_ended().await;
        let previous = lock(&g.seen).clone();
        let generation = {
            let _op = g.op.lock().await;
            // The take is conditioned on the pair judged free, as it is
            // now: a look since the judgement may have shown a new tenure
            // (another instance's take), which was never watched (the
            // protocol model's `take_from_latest_read`). A row of this
            // instance's own (a new tenure after a self-fence) needs no wait.
            let holding = *lock(&g.holding);
            let from = {
                let seen = lock(&g.seen);
                let own = seen.row.as_ref().is_some_and(|r| {
                    r.owner.as_deref() == Some(self.id.as_str()) && holding == Some(r.generation)
                });
                if !own && !seen.is_free(self.ttl, self.grace) {
                    return;
                }
                seen.taken_from()
            };
            let sent = Instant::now();
            self.db_calls.fetch_add(1, Ordering::Relaxed);
            match self
                .owners
                .take_shard(shard, from, &self.id, &self.advertise, self.ttl)
                .await
            {
                Ok(Some(generation)) => {
                    g.window
                        .extend(self.window_from(sent), self.ttl, self.margin);
                    *lock(&g.holding) = Some(generation);
                    let mut seen = lock(&g.seen);
                    seen.since = Some(Instant::now());
                    seen.row = Some(OwnerRow {
                        shard,
                        generation,
                        owner: Some(self.id.clone()),
                        advertise: Some(self.advertise.clone()),
                        renewals: 0,
                        expires_at: None,
                        ttl: Some(self.ttl),
                        released: false,
                    });
                    generation
                }
                Ok(None) => return, // renewed or taken meanwhile
                Err(e) => {
                    // Outcome unknown: if it committed, the row names this
                    // instance under a generation it does not hold; it is
                    // taken (by anyone, this one included) once watched
                    // unchanged for gate_ttl + grace.
                    tracing::warn!(shard, error = %e, "could not take a free shard");
                    return;
                }
            }
        };
        let owner = Owner { shard, generation };
        if !self.anchor.window.is_open() || self.stopped_by_another_set_up() {
            tracing::info!(
                shard,
                "the prefix's anchor is not known to be this set-up's: handing the shard back"
            );
            self.hand_back(shard).await;
            return;
        }
        if let Err(e) = self.tenures.start(g, owner).await {
            tracing::warn!(shard, error = %e, "could not start serving a shard; handing it back");
            self.hand_back(shard).await;
            return;
        }
        if self.stopping.is_cancelled() {
            return;
        }
        g.serve(generation);
        self.tenures.started(g);
        self.takeovers.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            shard,
            generation = generation.get(),
            previous = previous
                .row
                .as_ref()
                .and_then(|r| r.owner.as_deref())
                .unwrap_or("none"),
            leases = g.leases.len(),
            "took over a shard"
        );
        let me = self.clone();
        tokio::spawn(async move { me.watch_deadline(shard, generation).await });
    }

    /// Stops the shard at its forwarding deadline unless a renewal moved it.
    pub(super) async fn watch_deadline(self: &Arc<Self>, shard: u32, generation: Generation) {
        let g = &self.by_shard[shard as usize];
        loop {
            if g.serving() != Some(generation) {
                return;
            }
            let until = self.forward_deadline(g);
            let now = Instant::now();
            if now >= until && weakened::no_self_fence() {
                return;
            }
            if now >= until {
                tracing::warn!(
                    shard,
                    generation = generation.get(),
                    anchor = self.anchor.window.is_open(),
                    "the shard's ownership (or the prefix's anchor) was not renewed in time: no new forwards; requests in flight are aborted at gate_ttl"
                );
                self.self_fences.fetch_add(1, Ordering::Relaxed);
                self.stop_serving(shard, self.abort_deadline(g), "self-fenced");
                // A renewal answered late may have extended the window between
                // the look above and the stop, and seen the shard still served
                // (so started no new tenure): looked at after the stop, one of
                // the two sees the other, and the shard is served again now
                // rather than a renewal period later.
                if self.window_open(g) && lock(&g.holding).is_some() {
                    self.clone().spawn_takeover(shard);
                }
                return;
            }
            // Woken at least every look period: the anchor's window may
            // have been cut short (closed) meanwhile.
            tokio::time::sleep((until - now).min(self.keeper.look_every())).await;
        }
    }

    /// Stops serving `shard` now ([`Tenures::stop`]).
    pub(super) fn stop_serving(&self, shard: u32, deadline: Instant, why: &'static str) {
        self.tenures
            .stop(shard, &self.by_shard[shard as usize], deadline, why);
    }

    pub(super) fn spawn_handover(self: Arc<Self>, shard: u32, why: &'static str) {
        let g = &self.by_shard[shard as usize];
        if g.busy.swap(true, Ordering::SeqCst) {
            return;
        }
        tokio::spawn(async move {
            tracing::info!(shard, why, "handing a shard over");
            self.hand_over(shard).await;
            self.by_shard[shard as usize]
                .busy
                .store(false, Ordering::SeqCst);
        });
    }

    /// A graceful handover: no new requests, the in-flight ones finish (or are
    /// aborted after their drain timeout), then the row is released so that a
    /// successor takes the shard at once.
    pub(super) async fn hand_over(&self, shard: u32) {
        let g = &self.by_shard[shard as usize];
        // A renewal may still move the shard's deadline while the drains run, but
        // a database lost partway must not: what is in flight is aborted by the
        // deadline of the latest renewal sent before the handover began at the
        // latest, whatever the leases' own drain timeouts.
        let latest = self.abort_deadline(g);
        // Not served (a tenure self-fenced meanwhile): generation 0, an owner
        // no fence of a cluster is held by.
        let generation = g.unserve().unwrap_or(Generation::SINGLE);
        let owner = Owner { shard, generation };
        let now = Instant::now();
        self.tenures
            .stop_leases(g, owner, |drain| (now + drain).min(latest))
            .join_all()
            .await;
        if self.hand_back(shard).await {
            self.handovers.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Releases the row of a held shard, once no tenure of it here has
    /// requests in flight (a successor settles only a drain timeout, and a
    /// self-fenced tenure's requests run until its abort deadline); true if
    /// released.
    pub(super) async fn hand_back(&self, shard: u32) -> bool {
        let g = &self.by_shard[shard as usize];
        g.unserve();
        g.previous_tenure_ended().await;
        let _op = g.op.lock().await;
        let Some(generation) = lock(&g.holding).take() else {
            return false;
        };
        g.window.close();
        self.db_calls.fetch_add(1, Ordering::Relaxed);
        match self
            .owners
            .release_shard(&self.id, Owner { shard, generation })
            .await
        {
            Ok(released) => {
                if let Some(row) = lock(&g.seen).row.as_mut() {
                    if row.generation == generation {
                        row.owner = None;
                        row.advertise = None;
                        row.released = released;
                    }
                }
                tracing::info!(
                    shard,
                    generation = generation.get(),
                    released,
                    "released a shard"
                );
                released
            }
            Err(e) => {
                tracing::warn!(shard, error = %e, "could not release a shard; a successor waits for its expiry");
                false
            }
        }
    }

    /// Graceful stop (SIGTERM, after the in-flight requests finished or were
    /// abandoned): every shard is handed over, and this instance leaves. The
    /// anchor is not released: it is the set-up's, and the other members keep
    /// renewing it.
    pub async fn leave(self: &Arc<Self>) {
        self.stopping.cancel();
        // A takeover under way finishes (or gives up) first: then nothing is
        // taken behind our back. Bounded: a database call has its own timeout.
        for _ in 0..250 {
            if !self.by_shard.iter().any(|g| g.busy.load(Ordering::SeqCst)) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut held = Vec::new();
        for (shard, g) in (0..self.shards).zip(&self.by_shard) {
            if lock(&g.holding).is_some() {
                held.push(shard);
            }
        }
        let mut releases = tokio::task::JoinSet::new();
        for shard in held {
            let me = self.clone();
            releases.spawn(async move { me.hand_over(shard).await });
        }
        while releases.join_next().await.is_some() {}
        if let Err(e) = self.owners.leave(&self.id).await {
            tracing::warn!(error = %e, "could not record leaving the cluster");
        }
    }
}
