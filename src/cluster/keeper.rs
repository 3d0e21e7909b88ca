//! The keeper (SPEC §10.2): one task per instance, every third of `gate_ttl`,
//! renews the gate leases held here, looks at the others, records a heartbeat
//! and balances — takes free shards while below this instance's share, hands
//! shards over while above it.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use tokio_util::sync::CancellationToken;

use super::set_up::{Conflict, Verdict};
use super::shard::{Seen, ShardLease};
use super::{lock, shard_of_id, Cluster};
use crate::epoch::EpochObject;
use crate::lease::acquire::{self, AcquireError, Holding};
use crate::lease::StoreError;

impl Cluster {
    /// Keeps this instance's shards until `stop`, then hands them all over.
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        // Rounds start every third of gate_ttl, however long the last one took:
        // a slow store must not stretch the renewal period.
        let mut ticks = tokio::time::interval(self.ttl / 3);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let free_in = self.next_free_in();
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = ticks.tick() => {}
                _ = self.nudged.notified() => {
                    // At most a few early rounds a second, whatever the traffic.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                // A shard held elsewhere becomes free before the next tick: look
                // then, not up to a renew period later (a takeover after a
                // crash is that much sooner).
                _ = tokio::time::sleep(free_in.unwrap_or(self.ttl)), if free_in.is_some() => {}
            }
            self.round().await;
        }
    }

    /// How long until the earliest shard held elsewhere may be taken — its gate
    /// epoch's expiry plus `LastModified`'s resolution and `grace_ms`, on the
    /// earliest reading of the store's clock (what [`acquire::LeaseStatus::is_free`]
    /// decides on) — plus a little. A live owner's renewals keep pushing this
    /// beyond the next tick; only a dead or stalled owner's shard comes sooner.
    /// Not while the store fails: the last round's looks are stale, and rounds
    /// would follow one another as fast as they fail.
    pub(super) fn next_free_in(&self) -> Option<Duration> {
        if self.store_failures.load(Ordering::SeqCst) > 0 {
            return None;
        }
        let earliest = self.epochs.store().clock().earliest();
        self.gates
            .iter()
            .filter(|g| !g.busy.load(Ordering::SeqCst) && lock(&g.holding).is_none())
            .filter_map(|g| {
                let seen = lock(&g.seen);
                let (Some(st), Some(v), false) = (&seen.status, &seen.verdict, seen.free) else {
                    return None;
                };
                // Already past (the look came just before): look again.
                match crate::setup::gate_free_at(st, *v == Verdict::Ours, self.ttl, self.grace) {
                    crate::setup::Free::At(at) => {
                        Some(at.duration_since(earliest).unwrap_or_default())
                    }
                    _ => None,
                }
            })
            .min()
            .map(|d| d + Duration::from_millis(50))
    }

    /// One keeper round: renew and look, heartbeat, balance.
    pub(super) async fn round(self: &Arc<Self>) {
        self.store_failures.store(0, Ordering::SeqCst);
        let mut looks = tokio::task::JoinSet::new();
        for shard in 0..self.shards {
            let me = self.clone();
            looks.spawn(async move { me.renew_and_look(shard).await });
        }
        let mut conflict = None;
        while let Some(found) = looks.join_next().await {
            if let Ok(Some(c)) = found {
                conflict = Some(c);
            }
        }
        self.set_conflict(conflict);
        // An instance that reached the lease store for no shard this round can
        // neither renew nor take one: it stops announcing itself, so that the
        // others stop reserving its share and take its shards once their gate
        // leases expire. (It announced itself before: cut from S3 but not from
        // PostgreSQL, its shards stayed unserved for as long as the cut lasted —
        // found by the cluster fault campaign.)
        if self.store_failures.load(Ordering::SeqCst) >= self.shards as usize {
            tracing::warn!("the lease store answered no shard's call this round; not announcing this instance to the cluster");
        } else {
            match self.state.heartbeat(&self.id, self.ttl).await {
                Ok(m) => *lock(&self.members) = m,
                Err(e) => {
                    tracing::warn!(error = %e, "cluster heartbeat failed; balancing on the last membership seen")
                }
            }
        }
        if !self.stopping.is_cancelled() && lock(&self.conflict).is_none() {
            self.balance();
        }
    }

    /// Renews the shard's gate lease if held here, and records its latest gate;
    /// returns a conflict if that is a live gate object of another set-up.
    pub(super) async fn renew_and_look(self: &Arc<Self>, shard: u32) -> Option<Conflict> {
        let g = &self.gates[shard as usize];
        let held = lock(&g.holding).clone();
        if let Some(h) = held {
            let _op = g.op.lock().await;
            // A handover may have released it while we waited.
            if lock(&g.holding).as_ref() != Some(&h) {
                return None;
            }
            let sent = Instant::now();
            let decorate = self.decorate();
            let renewed = acquire::renew_direct(&self.epochs, &h, self.ttl, &decorate).await;
            match renewed {
                Ok(new) => {
                    self.extend(g, sent);
                    self.saw_ours(g, &new);
                    *lock(&g.holding) = Some(new.clone());
                    if g.serving.load(Ordering::SeqCst) == 0 && !g.busy.load(Ordering::SeqCst) {
                        // Self-fenced while renewals failed; held again: a new tenure.
                        drop(_op);
                        self.clone().spawn_takeover(shard, Some((new, sent)));
                    }
                }
                Err(AcquireError::NotHolder { why, .. }) => {
                    // Someone else created the next gate epoch: the tenure is over.
                    *lock(&g.holding) = None;
                    tracing::warn!(shard, gate_epoch = %h.epoch, why, "lost the gate lease of a shard");
                    self.stop_serving(shard, tokio::time::Instant::now(), "gate lease lost");
                }
                Err(e) => {
                    self.store_failures.fetch_add(1, Ordering::SeqCst);
                    tracing::warn!(shard, error = %e, "could not renew a shard's gate lease; retrying next round")
                }
            }
            return None;
        }
        match self.look(shard, g).await {
            Ok(seen) => {
                let conflict = seen
                    .verdict
                    .as_ref()
                    .and_then(|v| self.conflict_of(shard, v, seen.free, seen.holder.as_deref()));
                if let Some(Verdict::Untrusted(why)) = &seen.verdict {
                    if lock(&g.seen).epoch != seen.epoch {
                        tracing::error!(shard, gate_epoch = %seen.epoch, why, "an untrusted gate object: no owner is taken from it, nothing is relayed by it, and the shard is unavailable until gate_ttl after it was written");
                    }
                }
                *lock(&g.seen) = seen;
                conflict
            }
            Err(e) => {
                self.store_failures.fetch_add(1, Ordering::SeqCst);
                tracing::warn!(shard, error = %e, "could not look at a shard's gate lease");
                None
            }
        }
    }

    /// The latest gate object of a shard held elsewhere: one LIST a round (of the
    /// epochs after the last one seen), and a GET only when the epoch changed
    /// (gate objects are immutable). An owner and its `advertise` are taken
    /// only from an object a member of this set-up sealed ([`Verdict::Ours`]).
    pub(super) async fn look(&self, shard: u32, g: &ShardLease) -> Result<Seen, StoreError> {
        // Listed after the epoch last seen (objects are never deleted): the cost
        // of a look does not grow with the shard's history.
        let known = lock(&g.seen).epoch;
        let latest = self.epochs.latest_after(&g.name, known).await?;
        let cached = {
            let seen = lock(&g.seen);
            seen.status
                .clone()
                .filter(|st| st.latest == latest && seen.epoch == latest)
        };
        let mut st = match cached {
            Some(st) => st,
            None => acquire::status_at(&self.epochs, &g.name, latest).await?,
        };
        // Judged as of now, on the object read once.
        st.store_now = self.epochs.store_now();
        st.store_earliest = self.epochs.store().clock().earliest();
        let verdict = st
            .object
            .as_ref()
            .map(|_| self.verdict(shard, st.latest, st.record.as_ref()));
        let free = match &verdict {
            Some(v) => self.is_free(v, &st),
            None => true,
        };
        let mut seen = Seen {
            epoch: latest,
            free,
            verdict: verdict.clone(),
            status: Some(st.clone()),
            ..Seen::default()
        };
        if let Some(EpochObject::Acquire {
            holder, expires_at, ..
        }) = &st.object
        {
            seen.holder = Some(holder.clone());
            if verdict == Some(Verdict::Ours) && st.store_earliest <= *expires_at {
                seen.owner = Some(holder.clone());
                seen.expires_at = Some(*expires_at);
                seen.advertise = st.record.as_ref().and_then(|r| r.advertise.clone());
            }
        }
        Ok(seen)
    }

    pub(super) fn saw_ours(&self, g: &ShardLease, h: &Holding) {
        *lock(&g.seen) = Seen {
            epoch: h.epoch,
            owner: Some(self.id.clone()),
            holder: Some(self.id.clone()),
            advertise: Some(self.advertise.clone()),
            expires_at: Some(h.expires_at),
            free: false,
            status: None,
            verdict: Some(Verdict::Ours),
        };
    }

    /// Takes free shards while holding fewer than this instance's share, hands
    /// shards over while holding more (SPEC §10.2 balance). Shares: with `n`
    /// shards and `l` live instances each holds ⌊n/l⌋ or ⌈n/l⌉. Only an instance
    /// below ⌊n/l⌋ makes another one give up a shard, and then only the one holding
    /// the most (lowest id first) gives one per round: no flapping.
    pub(super) fn balance(self: &Arc<Self>) {
        let mut counts: HashMap<String, usize> = HashMap::new();
        let mut live: BTreeSet<String> = self.members().into_iter().collect();
        live.insert(self.id.clone());
        let mut free = Vec::new();
        let mut mine = Vec::new();
        for (shard, g) in (0..self.shards).zip(&self.gates) {
            if g.busy.load(Ordering::SeqCst) {
                if lock(&g.holding).is_some() {
                    *counts.entry(self.id.clone()).or_default() += 1;
                }
                continue;
            }
            if lock(&g.holding).is_some() {
                *counts.entry(self.id.clone()).or_default() += 1;
                mine.push(shard);
                continue;
            }
            let seen = lock(&g.seen).clone();
            match seen.owner {
                Some(o) => {
                    live.insert(o.clone());
                    *counts.entry(o).or_default() += 1;
                }
                None if seen.free => free.push(shard),
                None => {}
            }
        }
        let n = self.shards as usize;
        let l = live.len().max(1);
        let (lo, hi) = (n / l, n.div_ceil(l));
        let held = counts.get(&self.id).copied().unwrap_or(0);
        let count = |id: &String| counts.get(id).copied().unwrap_or(0);
        let starving = live.iter().any(|id| *id != self.id && count(id) < lo);
        if held > hi {
            for shard in mine.iter().rev().take(held - hi) {
                self.clone()
                    .spawn_handover(*shard, "balancing: more than this instance's share");
            }
            return;
        }
        if held == hi && hi > lo && starving {
            let most = live
                .iter()
                .map(|id| (std::cmp::Reverse(count(id)), id))
                .min();
            if most.map(|(_, id)| id) == Some(&self.id) {
                if let Some(shard) = mine.last() {
                    self.clone()
                        .spawn_handover(*shard, "balancing: an instance holds less than its share");
                }
            }
            return;
        }
        let want = if held < lo {
            lo - held
        } else if held < hi && !starving {
            hi - held
        } else {
            0
        };
        // Start at a place of our own so that instances do not all race for the
        // same free shard.
        let offset = usize::try_from(shard_of_id(&self.id) % n.max(1) as u64).unwrap_or(0);
        free.sort_by_key(|s| (*s as usize + n - offset) % n);
        // Shard 0 first while it is not this set-up's: until it is, no other
        // shard is served ([`crate::setup`]'s anchor).
        let (free, want) = if self.anchored() {
            (free, want)
        } else if free.contains(&0) {
            (vec![0], 1)
        } else {
            (Vec::new(), 0)
        };
        for shard in free.into_iter().take(want) {
            self.clone().spawn_takeover(shard, None);
        }
    }
}
