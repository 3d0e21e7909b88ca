//! The prefix's anchor (SPEC §10): the one gate lease a cluster keeps in the
//! lease store, under `{prefix}.gate/0000/`, so that a single instance (which
//! has no database) or a cluster of another shard count on the same prefix
//! sees a live gate object of this set-up and stays out, and this cluster sees
//! theirs.
//!
//! The anchor is the set-up's, not a member's: any member may create its next
//! epoch while the latest is one of this set-up's (it grants nothing among
//! members — shards are owned in the database). The owner of shard 0 renews it
//! a quarter of its TTL after the latest create; the others only when their own
//! window of it has less than a quarter left, so it outlives any one member.
//! Its TTL is twice `gate_ttl`; every member reads the next epoch's key
//! (one GET) every quarter of `gate_ttl`.
//!
//! Every member serves only while its *anchor window* is open: until
//! `anchor_ttl − self_fence_margin` after a lower bound, on its own monotonic
//! clock, of the latest anchor create — its own create's send, or the send of
//! its last read that found that epoch's key still absent. A contender of
//! another set-up waits for the anchor's expiry plus `LastModified`'s
//! resolution and `grace_ms` on the store's clock, so it starts after every
//! member has stopped (the same timing assumption as a gate lease's).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::exclusion::{AnchorError, Conflict, Verdict};
use super::{lock, Cluster};
use crate::epoch::{Epoch, EpochObject, EpochRecord};
use crate::lease::acquire::{self, AcquireError, Holding};
use crate::lease::StoreError;

/// The anchor as this member knows it.
#[derive(Debug, Clone, Default)]
pub(super) struct AnchorSeen {
    /// The latest epoch known (`NONE` before the first look).
    pub(super) epoch: Epoch,
    /// Listed once (start-up); afterwards the next key is read.
    pub(super) listed: bool,
    /// The latest object as read (or written here).
    pub(super) status: Option<acquire::LeaseStatus>,
    /// What the latest object is to this cluster (`None`: no object).
    pub(super) verdict: Option<Verdict>,
    /// Whether the latest object lets a contender in now.
    pub(super) free: bool,
    /// The send of the latest read that found epoch `epoch + 1` absent.
    pub(super) absent_at: Option<Instant>,
    /// A lower bound of the latest object's create, on this clock (ours only).
    pub(super) created_after: Option<Instant>,
    /// The holder named by the latest object.
    pub(super) holder: Option<String>,
}

pub(super) struct Anchor {
    pub(super) window: super::window::Window,
    /// The send of the latest anchor read the store answered.
    pub(super) answered: Mutex<Option<Instant>>,
    pub(super) seen: Mutex<AnchorSeen>,
    pub(super) op: tokio::sync::Mutex<()>,
}

impl Anchor {
    pub(super) fn new() -> Anchor {
        Anchor {
            window: super::window::Window::new(),
            answered: Mutex::new(None),
            seen: Mutex::new(AnchorSeen::default()),
            op: tokio::sync::Mutex::new(()),
        }
    }
}

#[async_trait::async_trait]
impl crate::state::identity::Checkpoint for Cluster {
    async fn checkpoint(&self) -> bool {
        self.checkpoint_anchor().await
    }
}

impl Cluster {
    /// Whether this instance may keep its shards: its window of the anchor is
    /// open and the lease store answered within a third of `gate_ttl` (a member
    /// that cannot reach the store cannot admit a new epoch: it lets its
    /// shards go to the others).
    pub(super) fn vouches(&self) -> bool {
        self.anchor.window.is_open()
            && lock(&self.anchor.answered).is_some_and(|at| at.elapsed() < self.ttl / 3)
    }

    /// When a window extended by a database call sent at `sent` starts: no
    /// later than the latest anchor read the store answered — an owner cut
    /// from the store self-fences as it did when its gate lease lived there.
    pub(super) fn window_from(&self, sent: Instant) -> Instant {
        lock(&self.anchor.answered).map_or(sent, |at| at.min(sent))
    }

    /// Seals an anchor gate object as this set-up's (SPEC §10).
    pub(super) fn decorate(&self, stamped: Option<u64>) -> impl Fn(&mut EpochRecord) + Sync + '_ {
        move |r: &mut EpochRecord| {
            r.advertise = Some(self.advertise.clone());
            crate::set_up::SetUp::Cluster {
                shards: self.shards,
            }
            .stamp(r);
            r.state = Some(self.state_id.clone());
            r.state_generation = stamped;
            self.key.seal(r);
        }
    }

    /// The anchor's TTL: twice `gate_ttl`.
    pub(super) fn anchor_ttl(&self) -> Duration {
        self.ttl * 2
    }

    pub(super) async fn anchor_loop(self: Arc<Self>, stop: CancellationToken) {
        let mut ticks = tokio::time::interval(self.ttl / 4);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = ticks.tick() => {}
            }
            let conflict = self.anchor_round().await;
            self.set_conflict(conflict);
        }
    }

    /// One look at the anchor, and a create when one is due; returns a
    /// conflict if its latest object is another set-up's, live.
    pub(super) async fn anchor_round(&self) -> Option<Conflict> {
        let _op = self.anchor.op.lock().await;
        let sent = Instant::now();
        if let Err(e) = self.read_anchor().await {
            tracing::warn!(error = %e, "could not read the prefix's anchor");
            return lock(&self.conflict).clone();
        }
        *lock(&self.anchor.answered) = Some(sent);
        let seen = lock(&self.anchor.seen).clone();
        if let Some(v) = &seen.verdict {
            if let Some(c) = self.conflict_of(0, v, seen.free, seen.holder.as_deref()) {
                return Some(c);
            }
            if let Verdict::Untrusted(why) = v {
                if !seen.free {
                    if self.anchor.window.is_open() {
                        tracing::error!(gate_epoch = %seen.epoch, why, "an untrusted gate object on the prefix's anchor: nothing is served until gate_ttl after it was written");
                        self.anchor.window.close();
                    }
                    return None;
                }
            }
        }
        let ours = seen.verdict == Some(Verdict::Ours)
            && matches!(
                seen.status.as_ref().and_then(|s| s.object.as_ref()),
                Some(EpochObject::Acquire { .. })
            );
        let now = Instant::now();
        let quarter = self.anchor_ttl() / 4;
        let due = if !self.anchor.window.is_open() {
            true
        } else if lock(&self.by_shard[0].holding).is_some() {
            seen.created_after
                .is_none_or(|c| now.saturating_duration_since(c) >= quarter)
        } else {
            self.anchor
                .window
                .forward_deadline()
                .saturating_duration_since(now)
                < quarter
        };
        if !due {
            return None;
        }
        if ours || (seen.verdict == Some(Verdict::Ours) && seen.epoch != Epoch::NONE) {
            self.renew_anchor(seen.epoch, false).await;
            None
        } else if seen.free || seen.verdict.is_none() {
            self.take_anchor().await
        } else {
            None
        }
    }

    /// Reads what is new on the anchor: a LIST at start-up, then the next
    /// epoch's key (one GET) until one is absent.
    async fn read_anchor(&self) -> Result<(), StoreError> {
        let name = super::shard_name(0);
        let listed = lock(&self.anchor.seen).listed;
        if !listed {
            let latest = self.epochs.latest_after(&name, Epoch::NONE).await?;
            let st = acquire::status_at(&self.epochs, &name, latest).await?;
            self.saw_anchor(latest, st, None);
            lock(&self.anchor.seen).listed = true;
        }
        for _ in 0..16 {
            let epoch = lock(&self.anchor.seen).epoch;
            let Some(next) = epoch.next() else {
                return Ok(());
            };
            let sent = Instant::now();
            let st = acquire::status_at(&self.epochs, &name, next).await?;
            if st.object.is_none() {
                let mut seen = lock(&self.anchor.seen);
                if seen.epoch == epoch {
                    seen.absent_at = Some(sent);
                }
                // Judged again as of now, on the object read once.
                if let Some(st) = seen.status.as_mut() {
                    st.store_now = self.epochs.store_now();
                    st.store_earliest = self.epochs.store().clock().earliest();
                }
                let free = match (&seen.verdict, &seen.status) {
                    (Some(v), Some(st)) => self.is_free(v, st),
                    _ => true,
                };
                seen.free = free;
                return Ok(());
            }
            let absent_at = lock(&self.anchor.seen).absent_at;
            self.saw_anchor(next, st, absent_at);
        }
        Ok(())
    }

    /// Records the anchor's object at `epoch`; `created_after` bounds its
    /// create from below on this clock, if known.
    fn saw_anchor(&self, epoch: Epoch, st: acquire::LeaseStatus, created_after: Option<Instant>) {
        let verdict = st
            .object
            .as_ref()
            .map(|_| self.verdict(0, epoch, st.record.as_ref()));
        let free = match &verdict {
            Some(v) => self.is_free(v, &st),
            None => true,
        };
        if verdict == Some(Verdict::Ours) {
            if let (Some(after), Some(EpochObject::Acquire { .. }), Some(rec)) =
                (created_after, &st.object, &st.record)
            {
                let ttl = Duration::from_millis(rec.ttl_ms.unwrap_or(0)).min(self.anchor_ttl());
                self.anchor.window.extend(after, ttl, self.margin);
            }
        } else if verdict.is_some() && self.anchor.window.is_open() {
            tracing::warn!(gate_epoch = %epoch, "the prefix's anchor is no longer this set-up's");
            self.anchor.window.close();
        }
        if let Some(Verdict::Untrusted(why)) = &verdict {
            tracing::error!(gate_epoch = %epoch, why, "an untrusted gate object on the prefix's anchor: no owner is taken from it, and nothing is served until gate_ttl after it was written");
        }
        let holder = st.record.as_ref().map(|r| r.holder.clone());
        *lock(&self.anchor.seen) = AnchorSeen {
            epoch,
            listed: true,
            status: Some(st),
            verdict,
            free,
            absent_at: None,
            created_after: created_after.filter(|_| epoch != Epoch::NONE),
            holder,
        };
    }

    /// Creates the anchor's next epoch over one of this set-up's.
    async fn renew_anchor(&self, latest: Epoch, checkpoint: bool) -> bool {
        let current = Holding {
            lease: super::shard_name(0),
            epoch: latest,
            token: String::new(),
            holder: self.id.clone(),
            expires_at: std::time::UNIX_EPOCH,
        };
        let stamped = self.stamp.next();
        let sent = Instant::now();
        let decorate = self.decorate(stamped);
        match acquire::renew_direct(&self.epochs, &current, self.anchor_ttl(), &decorate).await {
            Ok(h) => {
                self.created_anchor(h, sent, stamped);
                if checkpoint {
                    return self.stamp.written(stamped).await;
                }
                self.stamp.written_soon();
                false
            }
            // Someone created it first: the next read finds it.
            Err(AcquireError::NotHolder { .. }) => false,
            Err(e) => {
                tracing::warn!(error = %e, "could not renew the prefix's anchor");
                // Its object may have landed all the same: raise past it.
                self.stamp.written_soon();
                false
            }
        }
    }

    /// A create out of turn over this set-up's latest anchor object (a
    /// checkpoint, [`crate::state::identity::Checkpoint`]): whether it was
    /// written. Refused while the latest is not this set-up's.
    pub(super) async fn checkpoint_anchor(&self) -> bool {
        let _op = self.anchor.op.lock().await;
        let seen = lock(&self.anchor.seen).clone();
        if seen.verdict != Some(Verdict::Ours) || seen.epoch == Epoch::NONE {
            return false;
        }
        self.renew_anchor(seen.epoch, true).await
    }

    /// Takes the anchor over a free object of another set-up (or none): then,
    /// as after any takeover of shard 0, the shards that set-up used are read
    /// for a live gate object of theirs.
    async fn take_anchor(&self) -> Option<Conflict> {
        let name = super::shard_name(0);
        let free = |st: &acquire::LeaseStatus| {
            self.is_free(&self.verdict(0, st.latest, st.record.as_ref()), st)
        };
        let rules = acquire::GateRules {
            free: &free,
            reclaim: None,
        };
        let stamped = self.stamp.next();
        let sent = Instant::now();
        let decorate = self.decorate(stamped);
        let taken = acquire::acquire_with(
            &self.epochs,
            &name,
            &self.id,
            self.anchor_ttl(),
            self.grace,
            None,
            Some(&rules),
            &decorate,
        )
        .await;
        let h = match taken {
            Ok(h) => h,
            Err(AcquireError::Held { .. } | AcquireError::NotHolder { .. }) => return None,
            Err(e) => {
                tracing::warn!(error = %e, "could not take the prefix's anchor");
                self.stamp.written_soon();
                return None;
            }
        };
        // Raised past the object once it exists, whatever the check finds.
        self.stamp.written_soon();
        let epoch = h.epoch;
        match self.check_anchor(epoch).await {
            Ok(()) => {
                self.created_anchor(h, sent, stamped);
                None
            }
            Err(AnchorError::Conflict(c)) => Some(c),
            Err(AnchorError::Store(e)) => {
                tracing::warn!(error = %e, "could not check the prefix's set-up after taking its anchor");
                None
            }
        }
    }

    fn created_anchor(&self, h: Holding, sent: Instant, stamped: Option<u64>) {
        self.anchor
            .window
            .extend(sent, self.anchor_ttl(), self.margin);
        let mut rec = EpochRecord::acquire(
            &h.lease,
            h.epoch,
            &self.id,
            h.token.as_bytes(),
            self.anchor_ttl(),
        );
        (self.decorate(stamped))(&mut rec);
        let st = acquire::LeaseStatus {
            latest: h.epoch,
            object: Some(EpochObject::Acquire {
                holder: self.id.clone(),
                token: crate::epoch::TokenHash::of(h.token.as_bytes()),
                expires_at: h.expires_at,
            }),
            record: Some(rec),
            written: None,
            prior_expiry: None,
            store_now: self.epochs.store_now(),
            store_earliest: self.epochs.store().clock().earliest(),
        };
        *lock(&self.anchor.seen) = AnchorSeen {
            epoch: h.epoch,
            listed: true,
            status: Some(st),
            verdict: Some(Verdict::Ours),
            free: false,
            absent_at: None,
            created_after: Some(sent),
            holder: Some(self.id.clone()),
        };
        self.anchor_creates.fetch_add(1, Ordering::Relaxed);
    }
}
