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
//!
//! [`Keeper`] is what is the keeper's own: its cadence, the membership it
//! saw, the wake-up for an early look. Balance is decided by [`plan`], a pure
//! function of the shards as weighed at one look ([`Weighed`]); the rounds
//! themselves are the cluster's, which they drive.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::shard::Seen;
use super::{lock, shard_of_id, Cluster};
use crate::state::ownership::{Beats, Renewed};
use crate::state::Owner;

/// The keeper's own state: its cadence (from `gate_ttl`), membership as the
/// beats were seen to change on this instance's clock, and the wake-up for an
/// early look. What it renews, reads and balances is the cluster's
/// ([`Cluster::run`]).
pub(super) struct Keeper {
    /// This instance's id: always a member, as it sees it.
    id: String,
    /// `gate_ttl`.
    ttl: Duration,
    /// Each member's latest beat count and when it was first seen.
    beats: Mutex<HashMap<String, (u64, Instant)>>,
    /// Instances seen alive at the last beat, in id order.
    members: Mutex<Vec<String>>,
    /// Wakes the look loop for an early round (a request found no owner).
    nudged: tokio::sync::Notify,
}

impl Keeper {
    /// The keeper of instance `id`, whose `gate_ttl` is `ttl`: alone in its
    /// membership until a beat is seen.
    pub(super) fn new(id: &str, ttl: Duration) -> Keeper {
        Keeper {
            id: id.to_owned(),
            ttl,
            beats: Mutex::new(HashMap::new()),
            members: Mutex::new(vec![id.to_owned()]),
            nudged: tokio::sync::Notify::new(),
        }
    }

    /// How often renewals start: a third of `gate_ttl`, however long the last
    /// took.
    pub(super) fn renew_every(&self) -> Duration {
        self.ttl / 3
    }

    /// How often the owner rows are read: a tenth of `gate_ttl`, 100 ms to 1 s
    /// (a takeover after a crash comes at most this much after the earliest).
    pub(super) fn look_every(&self) -> Duration {
        (self.ttl / 10).clamp(Duration::from_millis(100), Duration::from_secs(1))
    }

    /// How long a renewal may go unanswered before a second is sent beside
    /// it: a fifth of `gate_ttl`, at least 200 ms.
    pub(super) fn hedge_after(&self) -> Duration {
        (self.ttl / 5).max(Duration::from_millis(200))
    }

    /// Instances seen alive at the last beat, this one included.
    pub(super) fn members(&self) -> Vec<String> {
        lock(&self.members).clone()
    }

    /// Asks for an early look.
    pub(super) fn nudge(&self) {
        self.nudged.notify_one();
    }

    /// Membership by beats seen to change on this instance's clock: a member
    /// is alive for `gate_ttl` after its count was last seen to change; one
    /// whose row is gone (it left) is gone at once.
    pub(super) fn saw_beats(&self, beats: Vec<Beats>) {
        let now = Instant::now();
        let mut seen = lock(&self.beats);
        // A member that left (its row deleted) is gone at once.
        seen.retain(|id, _| beats.iter().any(|b| b.instance == *id));
        for Beats {
            instance: id,
            count: n,
        } in beats
        {
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
            .filter(|(id, (_, at))| **id == self.id || now.duration_since(*at) < alive_for)
            .map(|(id, _)| id.clone())
            .collect();
        if !members.contains(&self.id) {
            members.push(self.id.clone());
        }
        members.sort();
        *lock(&self.members) = members;
    }
}

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

    async fn renew_loop(self: Arc<Self>, stop: CancellationToken) {
        let mut ticks = tokio::time::interval(self.keeper.renew_every());
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
            let every = self.keeper.look_every();
            let wait = self.next_free_in().map_or(every, |d| d.min(every));
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
                _ = self.keeper.nudged.notified() => {
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
        let held: Vec<Owner> = (0..self.shards)
            .zip(&self.by_shard)
            .filter_map(|(shard, g)| lock(&g.holding).map(|generation| Owner { shard, generation }))
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
            Ok(beats) => self.keeper.saw_beats(beats),
            Err(e) => {
                tracing::warn!(error = %e, "cluster heartbeat failed; balancing on the last membership seen")
            }
        }
    }

    async fn renew_held(self: &Arc<Self>, held: &[Owner]) {
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
        for &h in held {
            let Owner { shard, generation } = h;
            let g = &self.by_shard[shard as usize];
            let _op = g.op.lock().await;
            if *lock(&g.holding) != Some(generation) {
                continue; // released or restarted meanwhile
            }
            match renewed.iter().find(|r| r.owner == h) {
                Some(&Renewed { renewals, .. }) => {
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
                    if g.serving().is_none()
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
                    tracing::warn!(
                        shard,
                        generation = generation.get(),
                        "lost a shard: its row changed"
                    );
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
        held: &[Owner],
    ) -> Result<(Instant, Vec<Renewed>), crate::state::StateError> {
        let deadline = held
            .iter()
            .map(|h| self.forward_deadline(&self.by_shard[h.shard as usize]))
            .max();
        let patience =
            |from: Instant| deadline.map_or(Duration::ZERO, |d| d.saturating_duration_since(from));
        let sent = Instant::now();
        self.db_calls.fetch_add(1, Ordering::Relaxed);
        let first = self
            .owners
            .renew_shards(&self.id, held, self.ttl, patience(sent));
        tokio::pin!(first);
        let hedge_after = self.keeper.hedge_after();
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
                self.keeper.saw_beats(beats);
            }
        }
        if !self.stopping.is_cancelled() && !self.stopped_by_another_set_up() {
            self.balance();
        }
    }

    /// Takes free shards while holding fewer than this instance's share, hands
    /// shards over while holding more ([`plan`]), once the anchor is known to
    /// be this set-up's.
    pub(super) fn balance(self: &Arc<Self>) {
        if !self.vouches() {
            return; // nothing is served until the anchor is this set-up's
        }
        let shards: Vec<Weighed> = self
            .by_shard
            .iter()
            .map(|g| {
                let held = lock(&g.holding).is_some();
                if g.busy.load(Ordering::SeqCst) {
                    return Weighed::Busy { held };
                }
                if held {
                    return Weighed::Held;
                }
                let seen = lock(&g.seen).clone();
                match seen
                    .owner(self.ttl, self.grace)
                    .and_then(|r| r.owner.clone())
                {
                    Some(o) if o != self.id => Weighed::Owned(o),
                    // A row naming this instance that it does not hold (a
                    // restart of this instance): free once watched long
                    // enough, like any.
                    _ if seen.is_free(self.ttl, self.grace) => Weighed::Free {
                        was: seen
                            .row
                            .as_ref()
                            .and_then(|r| r.owner.clone())
                            .filter(|o| *o != self.id),
                    },
                    _ => Weighed::Waiting,
                }
            })
            .collect();
        let plan = plan(&self.id, &self.keeper.members(), &shards);
        for (shard, why) in plan.hand_over {
            self.clone().spawn_handover(shard, why);
        }
        for shard in plan.take {
            self.clone().spawn_takeover(shard);
        }
    }
}

/// A shard as balance weighs it (its view here, at one look).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Weighed {
    /// A takeover or a handover of it is running here; `held`: its row is
    /// held here (counted in this instance's share).
    Busy { held: bool },
    /// Its row is held here.
    Held,
    /// Another instance's tenure of it may still run.
    Owned(String),
    /// Free to take: released, never taken, or watched unchanged for
    /// `gate_ttl + grace_ms`; `was`: the other instance whose tenure ran out.
    Free { was: Option<String> },
    /// None of these (a row naming this instance, which it does not hold, not
    /// yet watched long enough).
    Waiting,
}

/// What one balance does: the shards to take and those to hand over (with
/// why), in the order they are started.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Plan {
    pub(super) take: Vec<u32>,
    pub(super) hand_over: Vec<(u32, &'static str)>,
}

/// SPEC §10.2 balance, decided on the shards as weighed (indexed by shard)
/// and the members seen alive, for instance `me`. Shares: with `n` shards and
/// `l` live instances each holds ⌊n/l⌋ or ⌈n/l⌉. Only an instance below
/// ⌊n/l⌋ makes another one give up a shard, and then only the one holding the
/// most (lowest id first) gives one per round: no flapping. An instance whose
/// tenure ran out (a free shard's last owner) reserves no share, whatever its
/// last beat says, unless it still owns another shard.
pub(super) fn plan(me: &str, members: &[String], shards: &[Weighed]) -> Plan {
    let me = me.to_owned();
    let mut counts: HashMap<String, usize> = HashMap::new();
    let mut live: BTreeSet<String> = members.iter().cloned().collect();
    live.insert(me.clone());
    let mut free = Vec::new();
    let mut mine = Vec::new();
    let mut gone: BTreeSet<String> = BTreeSet::new();
    for (shard, w) in (0u32..).zip(shards) {
        match w {
            Weighed::Busy { held } => {
                if *held {
                    *counts.entry(me.clone()).or_default() += 1;
                }
            }
            Weighed::Held => {
                *counts.entry(me.clone()).or_default() += 1;
                mine.push(shard);
            }
            Weighed::Owned(o) => {
                live.insert(o.clone());
                *counts.entry(o.clone()).or_default() += 1;
            }
            Weighed::Free { was } => {
                // Its owner stopped renewing: dead or cut off.
                if let Some(o) = was {
                    gone.insert(o.clone());
                }
                free.push(shard);
            }
            Weighed::Waiting => {}
        }
    }
    live.retain(|id| !gone.contains(id) || counts.contains_key(id));
    let n = shards.len();
    let l = live.len().max(1);
    let (lo, hi) = (n / l, n.div_ceil(l));
    let held = counts.get(&me).copied().unwrap_or(0);
    let count = |id: &String| counts.get(id).copied().unwrap_or(0);
    let starving = live.iter().any(|id| *id != me && count(id) < lo);
    let mut plan = Plan::default();
    if held > hi {
        for shard in mine.iter().rev().take(held - hi) {
            plan.hand_over
                .push((*shard, "balancing: more than this instance's share"));
        }
        return plan;
    }
    if held == hi && hi > lo && starving {
        let most = live
            .iter()
            .map(|id| (std::cmp::Reverse(count(id)), id))
            .min();
        if most.map(|(_, id)| id) == Some(&me) {
            if let Some(shard) = mine.last() {
                plan.hand_over
                    .push((*shard, "balancing: an instance holds less than its share"));
            }
        }
        return plan;
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
    let offset = usize::try_from(shard_of_id(&me) % n.max(1) as u64).unwrap_or(0);
    free.sort_by_key(|s| (*s as usize + n - offset) % n);
    plan.take = free.into_iter().take(want).collect();
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::advance;

    fn beats(of: &[(&str, u64)]) -> Vec<Beats> {
        of.iter()
            .map(|(i, n)| Beats {
                instance: (*i).to_owned(),
                count: *n,
            })
            .collect()
    }

    fn members(of: &[&str]) -> Vec<String> {
        of.iter().map(|m| (*m).to_owned()).collect()
    }

    /// The keeper's periods follow `gate_ttl`: renewals every third, looks
    /// every tenth (100 ms to 1 s), a second renewal after a fifth (at least
    /// 200 ms).
    #[test]
    fn the_cadence_follows_gate_ttl_within_its_bounds() {
        let k = Keeper::new("a", Duration::from_secs(6));
        assert_eq!(k.renew_every(), Duration::from_secs(2));
        assert_eq!(k.look_every(), Duration::from_millis(600));
        assert_eq!(k.hedge_after(), Duration::from_millis(1200));
        let short = Keeper::new("a", Duration::from_millis(500));
        assert_eq!(short.look_every(), Duration::from_millis(100));
        assert_eq!(short.hedge_after(), Duration::from_millis(200));
        let long = Keeper::new("a", Duration::from_secs(60));
        assert_eq!(long.look_every(), Duration::from_secs(1));
    }

    /// Membership (SPEC §10.2, advisory): a member is alive for `gate_ttl`
    /// after its beat count was last seen to change on this clock, never by
    /// the database's; one whose row is gone left at once; this instance is
    /// always its own member.
    #[tokio::test(start_paused = true)]
    async fn a_member_is_alive_for_gate_ttl_after_its_beat_last_changed() {
        let ttl = Duration::from_secs(6);
        let k = Keeper::new("a", ttl);
        assert_eq!(k.members(), members(&["a"]), "alone before any beat");
        k.saw_beats(beats(&[("b", 1), ("c", 4)]));
        assert_eq!(k.members(), members(&["a", "b", "c"]));
        advance(ttl - Duration::from_millis(1)).await;
        k.saw_beats(beats(&[("a", 1), ("b", 2), ("c", 4)]));
        assert_eq!(k.members(), members(&["a", "b", "c"]), "c: not yet");
        advance(Duration::from_millis(1)).await;
        k.saw_beats(beats(&[("a", 2), ("b", 2), ("c", 4)]));
        assert_eq!(
            k.members(),
            members(&["a", "b"]),
            "c's count unchanged for gate_ttl: not alive"
        );
        k.saw_beats(beats(&[("a", 3), ("b", 2), ("c", 5)]));
        assert_eq!(k.members(), members(&["a", "b", "c"]), "c beats again");
        k.saw_beats(beats(&[("c", 5)]));
        assert_eq!(
            k.members(),
            members(&["a", "c"]),
            "b's row deleted (it left): gone at once; a is its own member"
        );
    }

    /// Alone, an instance takes every free shard, starting at a place of its
    /// own (its id's hash), so that instances starting together spread out.
    #[test]
    fn alone_every_free_shard_is_taken_from_a_place_of_its_own() {
        let free = vec![Weighed::Free { was: None }; 4];
        let p = plan("a", &members(&["a"]), &free);
        assert!(p.hand_over.is_empty());
        let offset = (shard_of_id("a") % 4) as u32;
        let want: Vec<u32> = (0..4).map(|i| (i + offset) % 4).collect();
        assert_eq!(p.take, want);
    }

    /// Above its share (⌈n/l⌉) an instance hands the excess over, its highest
    /// shards first; a shard whose takeover or handover is running counts in
    /// its share but is never handed over.
    #[test]
    fn above_its_share_the_excess_is_handed_over() {
        let shards = [
            Weighed::Busy { held: true },
            Weighed::Held,
            Weighed::Held,
            Weighed::Held,
        ];
        let p = plan("a", &members(&["a", "b"]), &shards);
        assert!(p.take.is_empty());
        let handed: Vec<u32> = p.hand_over.iter().map(|(s, _)| *s).collect();
        assert_eq!(handed, vec![3, 2]);
    }

    /// At ⌈n/l⌉ while another member is below ⌊n/l⌋, the instance holding
    /// the most (lowest id first) gives one shard a round; the others wait.
    #[test]
    fn a_starving_member_gets_one_shard_a_round_from_the_one_holding_most() {
        // Five shards, three members (shares of 1 or 2): a and b hold two
        // each, c none; the fifth is free.
        let all = members(&["a", "b", "c"]);
        let a_view = [
            Weighed::Held,
            Weighed::Held,
            Weighed::Owned("b".into()),
            Weighed::Owned("b".into()),
            Weighed::Free { was: None },
        ];
        let p = plan("a", &all, &a_view);
        assert_eq!(p.take, Vec::<u32>::new(), "a takes nothing more");
        let handed: Vec<u32> = p.hand_over.iter().map(|(s, _)| *s).collect();
        assert_eq!(
            handed,
            vec![1],
            "a, holding most with the lowest id, gives one"
        );
        // b holds as many, but a gives: b neither gives nor takes.
        let b_view = [
            Weighed::Owned("a".into()),
            Weighed::Owned("a".into()),
            Weighed::Held,
            Weighed::Held,
            Weighed::Free { was: None },
        ];
        assert_eq!(plan("b", &all, &b_view), Plan::default());
        // Four shards, two members, a holds three (above ⌈4/2⌉): it hands one
        // over, and takes nothing.
        let p = plan(
            "a",
            &members(&["a", "b"]),
            &[
                Weighed::Held,
                Weighed::Held,
                Weighed::Held,
                Weighed::Free { was: None },
            ],
        );
        assert_eq!((p.take.len(), p.hand_over.len()), (0, 1));
    }

    /// An owner whose tenure ran out (its shard is free) reserves no share,
    /// whatever its last beat says: the live take its shards. While it still
    /// owns another shard it counts.
    #[test]
    fn an_owner_whose_tenure_ran_out_reserves_no_share() {
        let shards = [
            Weighed::Held,
            Weighed::Free {
                was: Some("b".into()),
            },
        ];
        let p = plan("a", &members(&["a", "b"]), &shards);
        assert_eq!(p.take, vec![1], "b is gone: a's share is both");
        let shards = [
            Weighed::Held,
            Weighed::Free {
                was: Some("b".into()),
            },
            Weighed::Owned("b".into()),
            Weighed::Held,
        ];
        let p = plan("a", &members(&["a", "b"]), &shards);
        assert_eq!(p, Plan::default(), "b still owns a shard: a holds its two");
        // A shard not yet free (a row naming this instance, not held here)
        // is neither taken nor counted.
        let p = plan("a", &members(&["a"]), &[Weighed::Waiting, Weighed::Held]);
        assert_eq!(p, Plan::default());
    }
}
