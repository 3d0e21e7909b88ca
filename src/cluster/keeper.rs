//! The keeper (SPEC §10.2): three tasks per instance.
//! - Renewals, every third of `gate_ttl`: one `UPDATE` renews every shard row
//!   this instance owns (only while its anchor window is open: an instance that
//!   cannot vouch for the prefix's anchor lets its shards go), and one beat
//!   records membership.
//! - Looks, every tenth of `gate_ttl` (at most 1 s, at least 100 ms): one
//!   `SELECT` of every owner row; a row whose `(generation, renewals)` has not
//!   changed for `gate_ttl + grace_ms` on this instance's clock is free, and so
//!   is a released one. Then balance: take free shards while below this
//!   instance's share, hand shards over while above it.
//! - The anchor ([`super::anchor`]), every quarter of `gate_ttl`.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::shard::Seen;
use super::{lock, shard_of_id, Cluster};

impl Cluster {
    /// Keeps this instance's shards until `stop` (then [`Cluster::leave`]
    /// hands them over).
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        let anchor = tokio::spawn(self.clone().anchor_loop(stop.clone()));
        let renewals = tokio::spawn(self.clone().renew_loop(stop.clone()));
        self.clone().look_loop(stop).await;
        let _ = anchor.await;
        let _ = renewals.await;
    }

    /// How often the owner rows are read: a tenth of `gate_ttl`, 100 ms to 1 s
    /// (a takeover after a crash comes at most this much after the earliest).
    pub(super) fn look_every(&self) -> Duration {
        (self.ttl / 10).clamp(Duration::from_millis(100), Duration::from_secs(1))
    }

    async fn renew_loop(self: Arc<Self>, stop: CancellationToken) {
        // Renewals start every third of gate_ttl, however long the last took.
        let mut ticks = tokio::time::interval(self.ttl / 3);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = ticks.tick() => {}
            }
            self.renew_round().await;
        }
    }

    async fn look_loop(self: Arc<Self>, stop: CancellationToken) {
        loop {
            self.look_round().await;
            let wait = self
                .next_free_in()
                .map_or(self.look_every(), |d| d.min(self.look_every()));
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
                _ = self.nudged.notified() => {
                    // At most a few early looks a second, whatever the traffic.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }

    /// How long until the earliest shard owned elsewhere may be taken, plus a
    /// little; `None` when none will be.
    pub(super) fn next_free_in(&self) -> Option<Duration> {
        let now = Instant::now();
        self.by_shard
            .iter()
            .filter(|g| !g.busy.load(Ordering::SeqCst) && lock(&g.holding).is_none())
            .filter_map(|g| lock(&g.seen).free_at(self.ttl, self.grace))
            .min()
            .map(|at| at.saturating_duration_since(now) + Duration::from_millis(20))
    }

    /// One renewal: every row held here, in one statement, then a beat.
    pub(super) async fn renew_round(self: &Arc<Self>) {
        let held: Vec<(u32, u64)> = (0..self.shards)
            .zip(&self.by_shard)
            .filter_map(|(s, g)| lock(&g.holding).map(|gen| (s, gen)))
            .collect();
        if self.state.set_up_conflict().is_some() {
            // The database is another set-up's now (SPEC §10): this instance
            // neither renews nor announces itself there; its shards self-fence.
            tracing::warn!("the database belongs to another set-up: not renewing shards or announcing this instance");
            return;
        }
        if !held.is_empty() {
            if !self.vouches() && !super::weakened::no_self_fence() {
                // Not renewing is how shards go to the others: this instance
                // cannot serve them while it cannot vouch for the anchor.
                tracing::warn!("the lease store does not answer, or the prefix's anchor is not known to be this set-up's: not renewing this instance's shards");
            } else {
                self.renew_held(&held).await;
            }
        }
        // An instance the lease store does not answer stops announcing itself,
        // so that the others stop reserving its share and take its shards
        // once its rows go unrenewed (announced, its shards stayed unserved
        // for as long as the cut lasted — found by the cluster fault campaign).
        if !lock(&self.anchor.answered).is_some_and(|at| at.elapsed() < self.ttl / 3) {
            tracing::warn!(
                "the lease store does not answer; not announcing this instance to the cluster"
            );
            return;
        }
        self.db_calls.fetch_add(1, Ordering::Relaxed);
        match self.owners.beat(&self.id).await {
            Ok(beats) => self.saw_beats(beats),
            Err(e) => {
                tracing::warn!(error = %e, "cluster heartbeat failed; balancing on the last membership seen")
            }
        }
    }

    async fn renew_held(self: &Arc<Self>, held: &[(u32, u64)]) {
        let (sent, renewed) = match self.renew_hedged(held).await {
            Ok(r) => r,
            Err(e) => {
                // Outcome unknown: the windows stay where the last confirmed
                // renewal put them (a renewal that did commit only makes a
                // successor wait longer).
                tracing::warn!(error = %e, shards = held.len(), "could not renew this instance's shards; retrying next period");
                return;
            }
        };
        for &(shard, generation) in held {
            let g = &self.by_shard[shard as usize];
            let _op = g.op.lock().await;
            if *lock(&g.holding) != Some(generation) {
                continue; // released or restarted meanwhile
            }
            match renewed
                .iter()
                .find(|(s, gen, _)| *s == shard && *gen == generation)
            {
                Some(&(_, _, renewals)) => {
                    g.window
                        .extend(self.window_from(sent), self.ttl, self.margin);
                    {
                        // The row as this renewal left it, seen now: this
                        // instance's own view names it the owner.
                        let mut seen = lock(&g.seen);
                        let now = Instant::now();
                        if let Some(row) = seen.row.as_mut() {
                            if row.generation == generation {
                                row.renewals = renewals;
                                seen.since = Some(now);
                            }
                        }
                    }
                    if g.serving.load(Ordering::SeqCst) == 0
                        && !g.busy.load(Ordering::SeqCst)
                        && !self.stopping.is_cancelled()
                    {
                        // Self-fenced while renewals failed; owned again: a new
                        // tenure, under a new generation.
                        drop(_op);
                        self.clone().spawn_takeover(shard);
                    }
                }
                None => {
                    *lock(&g.holding) = None;
                    tracing::warn!(shard, generation, "lost a shard: its row changed");
                    self.stop_serving(shard, Instant::now(), "ownership lost");
                }
            }
        }
    }

    /// One renewal of `held`, and when the one that answered was sent (the
    /// windows count from there).
    ///
    /// A renewal counts from its send (or from the anchor's last answer, if
    /// earlier: `window_from`): its answer is worth waiting for until the
    /// latest forwarding deadline among the shards it renews (SPEC §10.2),
    /// so a slow database costs no shard its tenure while the protocol's time
    /// remains; each shard still stops at its own deadline. And a renewal
    /// stuck on one connection (its backend hung) must not cost the window: if
    /// it has not answered within a fifth of `gate_ttl`, a second goes beside
    /// it on another connection, and the first of the two that renews wins.
    /// Each is a renewal of its own, conditioned like any; one whose outcome
    /// stays unknown only makes a successor wait longer.
    async fn renew_hedged(
        self: &Arc<Self>,
        held: &[(u32, u64)],
    ) -> Result<(Instant, Vec<(u32, u64, u64)>), crate::state::StateError> {
        let deadline = held
            .iter()
            .map(|&(s, _)| self.forward_deadline(&self.by_shard[s as usize]))
            .max();
        let patience =
            |from: Instant| deadline.map_or(Duration::ZERO, |d| d.saturating_duration_since(from));
        let sent = Instant::now();
        self.db_calls.fetch_add(1, Ordering::Relaxed);
        let first = self
            .owners
            .renew_shards(&self.id, held, self.ttl, patience(sent));
        tokio::pin!(first);
        let hedge_after = (self.ttl / 5).max(Duration::from_millis(200));
        if patience(sent) <= hedge_after {
            return first.await.map(|r| (sent, r));
        }
        tokio::select! {
            r = &mut first => return r.map(|r| (sent, r)),
            _ = tokio::time::sleep(hedge_after) => {}
        }
        tracing::warn!(
            waited_ms = hedge_after.as_millis() as u64,
            "a shard renewal has not answered; sending another beside it"
        );
        let sent2 = Instant::now();
        self.db_calls.fetch_add(1, Ordering::Relaxed);
        let second = self
            .owners
            .renew_shards(&self.id, held, self.ttl, patience(sent2));
        tokio::pin!(second);
        tokio::select! {
            r = &mut first => match r {
                Ok(r) => Ok((sent, r)),
                Err(_) => second.await.map(|r| (sent2, r)),
            },
            r = &mut second => match r {
                Ok(r) => Ok((sent2, r)),
                Err(_) => first.await.map(|r| (sent, r)),
            },
        }
    }

    /// Membership by beats seen to change on this instance's clock.
    fn saw_beats(&self, beats: Vec<(String, u64)>) {
        let now = Instant::now();
        let mut seen = lock(&self.beats);
        // A member that left (its row deleted) is gone at once.
        seen.retain(|id, _| beats.iter().any(|(b, _)| b == id));
        for (id, n) in beats {
            match seen.get(&id) {
                Some((m, _)) if *m == n => {}
                _ => {
                    seen.insert(id, (n, now));
                }
            }
        }
        let alive_for = self.ttl;
        let mut members: Vec<String> = seen
            .iter()
            .filter(|(id, (_, at))| *id == &self.id || now.duration_since(*at) < alive_for)
            .map(|(id, _)| id.clone())
            .collect();
        if !members.contains(&self.id) {
            members.push(self.id.clone());
        }
        members.sort();
        *lock(&self.members) = members;
    }

    /// One look: every owner row, then balance.
    pub(super) async fn look_round(self: &Arc<Self>) {
        self.db_calls.fetch_add(1, Ordering::Relaxed);
        let rows = match self.owners.owner_rows().await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "could not read the shards' owners");
                return;
            }
        };
        let now = Instant::now();
        let mut by_shard: HashMap<u32, crate::state::OwnerRow> =
            rows.into_iter().map(|r| (r.shard, r)).collect();
        for (shard, g) in (0..self.shards).zip(&self.by_shard) {
            let row = by_shard.remove(&shard);
            let mut seen = lock(&g.seen);
            let same = match (&seen.row, &row) {
                (Some(a), Some(b)) => {
                    a.generation == b.generation && a.renewals == b.renewals && a.owner == b.owner
                }
                (None, None) => true,
                _ => false,
            };
            let since = if same {
                seen.since.or(Some(now))
            } else {
                Some(now)
            };
            *seen = Seen { row, since };
        }
        // A released row (a member left or is balancing): membership now, so
        // that the shard is taken without waiting for the next beat.
        let released = self.by_shard.iter().any(|g| {
            lock(&g.holding).is_none() && lock(&g.seen).row.as_ref().is_some_and(|r| r.released)
        });
        if released {
            self.db_calls.fetch_add(1, Ordering::Relaxed);
            if let Ok(beats) = self.owners.beat(&self.id).await {
                self.saw_beats(beats);
            }
        }
        if !self.stopping.is_cancelled() && !self.stopped_by_another_set_up() {
            self.balance();
        }
    }

    /// Takes free shards while holding fewer than this instance's share, hands
    /// shards over while holding more (SPEC §10.2 balance). Shares: with `n`
    /// shards and `l` live instances each holds ⌊n/l⌋ or ⌈n/l⌉. Only an instance
    /// below ⌊n/l⌋ makes another one give up a shard, and then only the one holding
    /// the most (lowest id first) gives one per round: no flapping.
    pub(super) fn balance(self: &Arc<Self>) {
        if !self.vouches() {
            return; // nothing is served until the anchor is this set-up's
        }
        let mut counts: HashMap<String, usize> = HashMap::new();
        let mut live: BTreeSet<String> = self.members().into_iter().collect();
        live.insert(self.id.clone());
        let mut free = Vec::new();
        let mut mine = Vec::new();
        let mut gone: BTreeSet<String> = BTreeSet::new();
        for (shard, g) in (0..self.shards).zip(&self.by_shard) {
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
            match seen
                .owner(self.ttl, self.grace)
                .and_then(|r| r.owner.clone())
            {
                Some(o) if o != self.id => {
                    live.insert(o.clone());
                    *counts.entry(o).or_default() += 1;
                }
                // A row naming this instance that it does not hold (a restart
                // of this instance): free once watched long enough, like any.
                _ if seen.is_free(self.ttl, self.grace) => {
                    // Its owner stopped renewing: dead or cut off, whatever
                    // its last beat says — it reserves no share.
                    if let Some(o) = seen.row.as_ref().and_then(|r| r.owner.as_ref()) {
                        if *o != self.id {
                            gone.insert(o.clone());
                        }
                    }
                    free.push(shard)
                }
                _ => {}
            }
        }
        live.retain(|id| !gone.contains(id) || counts.contains_key(id));
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
        for shard in free.into_iter().take(want) {
            self.clone().spawn_takeover(shard);
        }
    }
}
