//! Exclusion between set-ups on one prefix (SPEC §10): what a gate object is to
//! this cluster ([`Verdict`]), when it lets a contender in, the check at
//! start-up, the anchor (shard 0) checked after it is taken from another set-up, and
//! the conflict that stops all forwarding while another set-up's gate lease is
//! live.

use super::{lock, shard_name, Cluster, ClusterError};
use crate::epoch::{Epoch, EpochRecord};
use crate::lease::acquire;
use crate::lease::StoreError;
use crate::set_up::SetUp;

/// A live gate object of another set-up under this cluster's prefix (SPEC
/// §10.2): a single instance, or a cluster of another shard count. While one is
/// seen, this instance forwards nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflict {
    /// The shard whose gate object was seen.
    pub shard: u32,
    /// The set-up that object names.
    pub theirs: SetUp,
    /// This instance's set-up.
    pub ours: SetUp,
    /// The instance that wrote the object.
    pub holder: String,
}

impl std::fmt::Display for Conflict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (instance {:?}, gate lease {:04}) uses this lease store and prefix; this is {}. Two set-ups on one prefix void the fence: stop one (a single instance and a cluster never share a prefix; changing [cluster] shards needs every instance stopped first)",
            self.theirs, self.holder, self.shard, self.ours
        )
    }
}

/// What a gate object read from the store is to this cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Sealed by a member (this peer token) of this set-up.
    Ours,
    /// Another set-up's: a single instance (which seals nothing), or a cluster
    /// of another shard count with this peer token.
    Foreign(SetUp),
    /// Neither: unparsable, or claiming to be a cluster's without a valid MAC
    /// (forged, or a member with another peer token). Nothing is taken from it.
    Untrusted(String),
}

/// Why the anchor just taken is not served.
pub(super) enum AnchorError {
    Conflict(Conflict),
    Store(StoreError),
}

impl Cluster {
    /// SPEC §10.2: a live gate object of another set-up under the prefix — on any
    /// shard this cluster uses, or any the set-up named by shard 0 uses —
    /// refuses start-up. Running, the keeper looks again every round.
    pub(super) async fn check_set_up(&self) -> Result<(), ClusterError> {
        // Every shard gate lease ever used under the prefix, whatever shard 0's
        // latest object claims (it may be garbage).
        // (A cluster keeps only shard 0's, its anchor, in the store; older
        // builds kept one per shard.)
        let shards = crate::set_up::shards_in_use(&self.epochs).await?.max(1);
        for shard in 0..shards {
            let read = self.read_latest(shard).await?;
            if let Some(c) = self.live_conflict(shard, read.as_ref()) {
                return Err(ClusterError::OtherSetUp(c));
            }
            // This build writes gate objects on shard 0 only (the anchor):
            // a live one of this set-up elsewhere is an older build's member.
            if let Some((epoch, Some(rec), false)) = &read {
                if shard != 0 && self.verdict(shard, *epoch, Some(rec)) == Verdict::Ours {
                    return Err(ClusterError::OlderBuild {
                        shard,
                        holder: rec.holder.clone(),
                    });
                }
            }
        }
        Ok(())
    }

    /// The latest gate object of `shard` (any shard name, ours or another
    /// set-up's): its epoch, its record if it parses, and whether it is free.
    /// Listed after the epoch this instance last saw of it, if any (never
    /// below the latest: the look or renewal that saw it listed or created it),
    /// so that a takeover's anchor check does not page through shard 0's history.
    pub(super) async fn read_latest(
        &self,
        shard: u32,
    ) -> Result<Option<(Epoch, Option<EpochRecord>, bool)>, StoreError> {
        let name = shard_name(shard);
        let known = if shard == 0 {
            lock(&self.anchor.seen).epoch
        } else {
            Epoch::NONE
        };
        let latest = self.epochs.latest_after(&name, known).await?;
        self.read_at(shard, latest).await
    }

    /// The gate object of `shard` at `epoch` ([`Cluster::read_latest`]); whether
    /// it is free is judged as of now.
    pub(super) async fn read_at(
        &self,
        shard: u32,
        epoch: Epoch,
    ) -> Result<Option<(Epoch, Option<EpochRecord>, bool)>, StoreError> {
        if epoch == Epoch::NONE {
            return Ok(None);
        }
        let st = acquire::status_at(&self.epochs, &shard_name(shard), epoch).await?;
        if st.object.is_none() {
            return Ok(None);
        }
        let free = self.is_free(&self.verdict(shard, epoch, st.record.as_ref()), &st);
        Ok(Some((epoch, st.record, free)))
    }

    /// What a gate object of `shard` is to this cluster.
    pub(super) fn verdict(&self, shard: u32, epoch: Epoch, rec: Option<&EpochRecord>) -> Verdict {
        let Some(rec) = rec else {
            return Verdict::Untrusted("the gate object does not parse".into());
        };
        // A sealed object is ours only where it was written: copied to another
        // shard or epoch it proves nothing (the prefix is in the key).
        if rec.lease != shard_name(shard).as_str() || rec.epoch != epoch.get() {
            return Verdict::Untrusted(format!(
                "the gate object at shard {shard} epoch {epoch} names lease {:?} epoch {}: copied from elsewhere",
                rec.lease, rec.epoch
            ));
        }
        let theirs = SetUp::of(rec);
        let ours = SetUp::Cluster {
            shards: self.shards,
        };
        if self.key.verifies(rec) {
            return if theirs == ours {
                Verdict::Ours
            } else {
                Verdict::Foreign(theirs)
            };
        }
        match theirs {
            SetUp::Single if shard == 0 => Verdict::Foreign(theirs),
            // A single instance holds shard 0 only.
            SetUp::Single => Verdict::Untrusted(format!(
                "the gate object of epoch {} claims a single instance ({:?}) on shard {shard}, which a single instance never uses: forged",
                rec.epoch, rec.holder
            )),
            SetUp::Cluster { .. } => Verdict::Untrusted(format!(
                "the gate object of epoch {} names holder {:?} but its MAC does not verify: not written by a member with this peer_token (forged, or a member configured with another token)",
                rec.epoch, rec.holder
            )),
        }
    }

    /// Whether a contender may take a shard whose latest gate object is read in
    /// `st` (SPEC §2 step 2, with `grace_ms`): a member's object is believed;
    /// anything else — another set-up's, forged, garbage — ends the tenure it
    /// follows no sooner than that tenure would end itself
    /// ([`crate::set_up::gate_free`]).
    pub(super) fn is_free(&self, verdict: &Verdict, st: &acquire::LeaseStatus) -> bool {
        crate::set_up::gate_free(st, *verdict == Verdict::Ours, self.ttl, self.grace)
    }

    /// A conflict if `read` (a shard's latest gate object) is a live one of
    /// another set-up.
    pub(super) fn live_conflict(
        &self,
        shard: u32,
        read: Option<&(Epoch, Option<EpochRecord>, bool)>,
    ) -> Option<Conflict> {
        let (epoch, rec, free) = read?;
        let holder = rec.as_ref().map(|r| r.holder.as_str());
        self.conflict_of(
            shard,
            &self.verdict(shard, *epoch, rec.as_ref()),
            *free,
            holder,
        )
    }

    /// The conflict a shard's latest gate object makes: another set-up's, live.
    pub(super) fn conflict_of(
        &self,
        shard: u32,
        verdict: &Verdict,
        free: bool,
        holder: Option<&str>,
    ) -> Option<Conflict> {
        match verdict {
            Verdict::Foreign(theirs) if !free => Some(Conflict {
                shard,
                theirs: *theirs,
                ours: SetUp::Cluster {
                    shards: self.shards,
                },
                holder: holder.unwrap_or_default().to_owned(),
            }),
            _ => None,
        }
    }

    /// Records the last round's conflict. On a new one, every shard stops at
    /// once (another set-up may be forwarding the same leases right now); when
    /// it is gone, shards are taken again as after any takeover (settling).
    pub(super) fn set_conflict(&self, now: Option<Conflict>) {
        let before = std::mem::replace(&mut *lock(&self.conflict), now.clone());
        match (&before, &now) {
            (None, Some(c)) => {
                tracing::error!(conflict = %c, "another fencegate set-up holds a gate lease under this prefix: this instance forwards nothing until it is gone");
            }
            (Some(_), None) => {
                tracing::warn!(
                    "the other fencegate set-up's gate leases have ended: serving again"
                );
            }
            _ => {}
        }
        if now.is_some() {
            self.anchor.window.close();
            for shard in 0..self.shards {
                self.stop_serving(
                    shard,
                    tokio::time::Instant::now(),
                    "another set-up shares the prefix",
                );
            }
        }
    }

    /// After creating the anchor's epoch `epoch` over another set-up's object:
    /// a set-up that took shard 0 over from another one looks at every shard
    /// that one used — after its own create, so of two set-ups starting side
    /// by side one sees the other.
    pub(super) async fn check_anchor(&self, epoch: Epoch) -> Result<(), AnchorError> {
        if epoch.get() <= 1 {
            return Ok(());
        }
        let before = self
            .read_at(0, Epoch::new(epoch.get() - 1))
            .await
            .map_err(AnchorError::Store)?;
        let shards = match &before {
            None => return Ok(()),
            // Whatever the object before ours claims (it may be garbage),
            // every shard gate lease ever used under the prefix is looked at.
            Some((e, rec, _)) => match self.verdict(0, *e, rec.as_ref()) {
                Verdict::Ours => return Ok(()),
                _ => crate::set_up::shards_in_use(&self.epochs)
                    .await
                    .map_err(AnchorError::Store)?
                    .max(self.shards),
            },
        };
        for s in 1..shards {
            let read = self.read_latest(s).await.map_err(AnchorError::Store)?;
            if let Some(c) = self.live_conflict(s, read.as_ref()) {
                return Err(AnchorError::Conflict(c));
            }
        }
        Ok(())
    }
}
