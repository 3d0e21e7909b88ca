//! A tenure of one shard (SPEC §10.2): taking it (the create, the anchor check,
//! the state claim and the fences started at the latest epoch), serving it
//! until its forwarding deadline, and leaving it — self-fenced, handed over or
//! lost — with every lease held to the shard's one abort deadline.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::set_up::{AnchorError, Verdict};
use super::shard::{Seen, ShardLease};
use super::{lock, weakened, Cluster};
use crate::epoch::EpochRecord;
use crate::lease::acquire::{self, AcquireError, Holding};
use crate::setup::SetUp;
use crate::state::Owner;

impl Cluster {
    /// Extends the shard's forwarding window and its abort deadline after a gate
    /// create sent at `sent`.
    pub(super) fn extend(&self, g: &ShardLease, sent: Instant) {
        g.window.extend(sent, self.ttl, self.margin);
    }

    /// The shard's one abort deadline (SPEC §10.2): `gate_ttl` after its latest
    /// gate create was sent. Every lease of the shard is held to it, however
    /// the shard is left.
    pub(super) fn abort_deadline(&self, g: &ShardLease) -> tokio::time::Instant {
        g.window.abort_deadline()
    }

    pub(super) fn decorate(&self) -> impl Fn(&mut EpochRecord) + Sync + '_ {
        move |r: &mut EpochRecord| {
            r.advertise = Some(self.advertise.clone());
            SetUp::Cluster {
                shards: self.shards,
            }
            .stamp(r);
            r.state = Some(self.state_id.clone());
            self.key.seal(r);
        }
    }

    /// Takes `shard` (or starts a new tenure on a gate epoch already held) in the
    /// background.
    pub(super) fn spawn_takeover(self: Arc<Self>, shard: u32, held: Option<(Holding, Instant)>) {
        let g = &self.gates[shard as usize];
        if lock(&self.conflict).is_some() || g.busy.swap(true, Ordering::SeqCst) {
            return;
        }
        tokio::spawn(async move {
            self.take_over(shard, held).await;
            self.gates[shard as usize]
                .busy
                .store(false, Ordering::SeqCst);
        });
    }

    pub(super) async fn take_over(self: &Arc<Self>, shard: u32, held: Option<(Holding, Instant)>) {
        let g = &self.gates[shard as usize];
        let previous = lock(&g.seen).clone();
        let holding = match held {
            Some((h, _)) => h,
            None => {
                let _op = g.op.lock().await;
                let sent = Instant::now();
                let decorate = self.decorate();
                // Judged again as the create's read sees it, by this cluster's
                // rule: a forged object's own word frees nothing early.
                let free = |st: &acquire::LeaseStatus| {
                    self.is_free(&self.verdict(shard, st.latest, st.record.as_ref()), st)
                };
                let rules = acquire::GateRules {
                    free: &free,
                    reclaim: None,
                };
                let taken = acquire::acquire_with(
                    &self.epochs,
                    &g.name,
                    &self.id,
                    self.ttl,
                    self.grace,
                    None,
                    Some(&rules),
                    &decorate,
                )
                .await;
                match taken {
                    Ok(h) => {
                        self.extend(g, sent);
                        self.saw_ours(g, &h);
                        *lock(&g.holding) = Some(h.clone());
                        h
                    }
                    Err(AcquireError::Held { .. } | AcquireError::NotHolder { .. }) => return,
                    Err(e) => {
                        tracing::warn!(shard, error = %e, "could not take a free shard");
                        return;
                    }
                }
            }
        };
        let owner = Owner {
            shard,
            generation: holding.epoch.get(),
        };
        if let Err(why) = self.check_anchor(shard, holding.epoch).await {
            match why {
                AnchorError::Conflict(c) => {
                    self.set_conflict(Some(c));
                }
                AnchorError::NotAnchored => tracing::info!(
                    shard,
                    "shard 0's latest gate object is not this set-up's yet: handing the shard back until it is"
                ),
                AnchorError::Store(e) => {
                    tracing::warn!(shard, error = %e, "could not check the prefix's set-up after taking a shard; handing it back")
                }
            }
            self.hand_back(shard).await;
            return;
        }
        if lock(&self.conflict).is_some() {
            self.hand_back(shard).await;
            return;
        }
        if let Err(e) = self.start_tenure(g, owner).await {
            tracing::warn!(shard, error = %e, "could not start serving a shard; handing it back");
            self.hand_back(shard).await;
            return;
        }
        if self.stopping.is_cancelled() {
            return;
        }
        g.serving.store(owner.generation, Ordering::SeqCst);
        self.takeovers.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            shard,
            gate_epoch = owner.generation,
            previous = previous.holder.as_deref().unwrap_or("none"),
            leases = g.leases.len(),
            "took over a shard"
        );
        let me = self.clone();
        tokio::spawn(async move { me.watch_deadline(shard, owner.generation).await });
    }

    /// SPEC §10.2 takeover: claim the shard's state, turn older generations'
    /// in-flight records in doubt, start its fences at max(stored, listed).
    pub(super) async fn start_tenure(&self, g: &ShardLease, owner: Owner) -> Result<(), String> {
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

    /// Stops the shard at its forwarding deadline unless a renewal moved it.
    pub(super) async fn watch_deadline(&self, shard: u32, generation: u64) {
        let g = &self.gates[shard as usize];
        loop {
            if g.serving.load(Ordering::SeqCst) != generation {
                return;
            }
            let until = g.window.forward_until_ms();
            let now = g.window.now_ms();
            if now >= until && weakened::no_self_fence() {
                return;
            }
            if now >= until {
                tracing::warn!(
                    shard,
                    gate_epoch = generation,
                    "the shard's gate lease was not renewed in time: no new forwards; requests in flight are aborted at gate_ttl"
                );
                self.stop_serving(shard, self.abort_deadline(g), "self-fenced");
                return;
            }
            tokio::time::sleep(Duration::from_millis(until - now)).await;
        }
    }

    /// Stops serving `shard` now: no new admissions or forwards; its requests in
    /// flight may finish until `deadline`, then are aborted.
    pub(super) fn stop_serving(
        &self,
        shard: u32,
        deadline: tokio::time::Instant,
        why: &'static str,
    ) {
        let g = &self.gates[shard as usize];
        let generation = g.serving.swap(0, Ordering::SeqCst);
        if generation == 0 {
            return;
        }
        let owner = Owner { shard, generation };
        let stops = self.stop_leases(g, owner, |_| deadline);
        tokio::spawn(async move {
            stops.join_all().await;
            tracing::info!(shard, why, "stopped serving a shard");
        });
    }

    /// Closes the fence of every lease of the shard at once (the leases of one
    /// shard never wait for one another: closed one after another, each with
    /// a timeout of its own, the last would be aborted long after `gate_ttl`)
    /// and returns the drains, each aborting what is in flight at its deadline.
    pub(super) fn stop_leases(
        &self,
        g: &ShardLease,
        owner: Owner,
        deadline: impl Fn(Duration) -> tokio::time::Instant,
    ) -> tokio::task::JoinSet<bool> {
        let mut stops = tokio::task::JoinSet::new();
        for (lease, drain) in &g.leases {
            let (fences, lease, at) = (self.fences.clone(), lease.clone(), deadline(*drain));
            stops.spawn(async move { fences.stop_owned(&lease, owner, at).await });
        }
        stops
    }

    pub(super) fn spawn_handover(self: Arc<Self>, shard: u32, why: &'static str) {
        let g = &self.gates[shard as usize];
        if g.busy.swap(true, Ordering::SeqCst) {
            return;
        }
        tokio::spawn(async move {
            tracing::info!(shard, why, "handing a shard over");
            self.hand_over(shard).await;
            self.gates[shard as usize]
                .busy
                .store(false, Ordering::SeqCst);
        });
    }

    /// A graceful handover: no new requests, the in-flight ones finish (or are
    /// aborted after their drain timeout), then a `release` gate object lets a
    /// successor take the shard at once.
    pub(super) async fn hand_over(&self, shard: u32) {
        let g = &self.gates[shard as usize];
        // A renewal may still move the shard's deadline while the drains run, but
        // a store lost partway must not: what is in flight is aborted by the
        // deadline of the latest create sent before the handover began at the
        // latest, whatever the leases' own drain timeouts.
        let latest = self.abort_deadline(g);
        let generation = g.serving.swap(0, Ordering::SeqCst);
        let owner = Owner { shard, generation };
        let now = tokio::time::Instant::now();
        self.stop_leases(g, owner, |drain| (now + drain).min(latest))
            .join_all()
            .await;
        if self.hand_back(shard).await {
            self.handovers.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Writes the `release` gate object of a held shard; true if released.
    pub(super) async fn hand_back(&self, shard: u32) -> bool {
        let g = &self.gates[shard as usize];
        g.serving.store(0, Ordering::SeqCst);
        let _op = g.op.lock().await;
        let Some(h) = lock(&g.holding).take() else {
            return false;
        };
        g.window.close();
        *lock(&g.seen) = Seen {
            epoch: h.epoch,
            free: true,
            verdict: Some(Verdict::Ours),
            ..Seen::default()
        };
        let decorate = self.decorate();
        match acquire::release_with(
            &self.epochs,
            &g.name,
            &self.id,
            h.epoch,
            &h.token,
            &decorate,
        )
        .await
        {
            Ok(e) => {
                tracing::info!(shard, gate_epoch = %e, "released a shard");
                true
            }
            Err(e) => {
                tracing::warn!(shard, error = %e, "could not release a shard; a successor waits for its expiry");
                false
            }
        }
    }

    /// Graceful stop (SIGTERM, after the in-flight requests finished or were
    /// abandoned): every shard is handed over, and this instance leaves.
    pub async fn leave(self: &Arc<Self>) {
        self.stopping.cancel();
        // A takeover under way finishes (or gives up) first: then nothing is
        // taken behind our back. Bounded: a store call has its own timeout.
        for _ in 0..250 {
            if !self.gates.iter().any(|g| g.busy.load(Ordering::SeqCst)) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut held = Vec::new();
        for (shard, g) in (0..self.shards).zip(&self.gates) {
            if lock(&g.holding).is_some() {
                held.push(shard);
            }
        }
        // Side by side: with the store slow or away each release waits out its
        // own timeouts, and one after another they could outlast the stop.
        let mut releases = tokio::task::JoinSet::new();
        for shard in held {
            let me = self.clone();
            releases.spawn(async move { me.hand_over(shard).await });
        }
        while releases.join_next().await.is_some() {}
        if let Err(e) = self.state.leave(&self.id).await {
            tracing::warn!(error = %e, "could not record leaving the cluster");
        }
    }
}
