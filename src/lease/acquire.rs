//! The worker side of SPEC §2: acquire, renew, release and show, in any process
//! that can reach the store (the `fencegate lease` CLI, tests, the demo).
//!
//! The subtle part is the *uncertain result*: a create whose response was lost (a
//! timeout, a reset, a 5xx, or an SDK retry answered 412 because the first attempt
//! had in fact succeeded). We never count such a result as a win or a loss: we read
//! epoch L+1 back and compare the token hash.

use std::time::{Duration, SystemTime};

use bytes::Bytes;

use super::{CreateOutcome, Epochs, StoreError};
use crate::epoch::{Epoch, EpochObject, EpochRecord, LeaseName, TokenHash};

/// A tenure this process holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holding {
    /// The lease held.
    pub lease: LeaseName,
    /// The epoch whose object this process created.
    pub epoch: Epoch,
    /// The token sent as `X-Lease-Token`; its hash is in the object.
    pub token: String,
    /// The `holder` written in the object.
    pub holder: String,
    /// `LastModified + ttl` of our epoch object, on the store's clock.
    pub expires_at: SystemTime,
}

/// What a worker may learn instead of a tenure.
#[derive(Debug, thiserror::Error)]
pub enum AcquireError {
    /// Someone else holds the lease (or the caller no longer does).
    #[error("lease {lease} is held by {holder:?} at epoch {epoch} until {}", crate::clock::rfc3339(*.expires_at))]
    Held {
        /// The lease asked for.
        lease: LeaseName,
        /// The epoch that holds it.
        epoch: Epoch,
        /// Who holds it.
        holder: String,
        /// When the holder's tenure ends, on the store's clock (then `grace_ms`).
        expires_at: SystemTime,
    },
    /// The caller claimed a tenure it does not hold (renew/release).
    #[error("not the holder of lease {lease} at epoch {epoch}: {why}")]
    NotHolder {
        /// The lease named.
        lease: LeaseName,
        /// The epoch the caller claimed.
        epoch: Epoch,
        /// Why the claim does not hold.
        why: String,
    },
    /// The store failed, or its answer was uncertain and could not be read back.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Lost too many races in a row, or epoch numbers ran out.
    #[error("gave up on lease {lease}: {why}")]
    GaveUp {
        /// The lease asked for.
        lease: LeaseName,
        /// Why it gave up.
        why: String,
    },
}

impl AcquireError {
    /// True when the answer is "someone else has it" (CLI exit code 3).
    pub fn is_held(&self) -> bool {
        matches!(
            self,
            AcquireError::Held { .. } | AcquireError::NotHolder { .. }
        )
    }
}

/// The state of a lease as a reader sees it.
#[derive(Debug, Clone)]
pub struct LeaseStatus {
    /// The latest epoch in the store (`Epoch::NONE` when there is none).
    pub latest: Epoch,
    /// What the latest object means to admission, if there is one.
    pub object: Option<EpochObject>,
    /// The latest object as stored, if it parses (a gate object's set-up, MAC…).
    pub record: Option<EpochRecord>,
    /// The latest object's `LastModified`.
    pub written: Option<SystemTime>,
    /// For a latest object without a MAC: when the nearest acquire below it
    /// that parses expires (its own `LastModified + ttl_ms`) — the latest any
    /// tenure it may have cut short could last. `Some(None)`-like absence is
    /// [`PriorExpiry::Unknown`] when none was found within [`PRIOR_WALK`].
    pub prior_expiry: Option<PriorExpiry>,
    /// The store's clock, upper estimate (for judging one's own tenure).
    pub store_now: SystemTime,
    /// The store's clock, lower estimate (for judging someone else's tenure).
    pub store_earliest: SystemTime,
}

/// `LastModified` is truncated to the second (SPEC §2): the create may have
/// happened up to this much later than it says.
pub const LAST_MODIFIED_RESOLUTION: Duration = Duration::from_secs(1);

/// When a contender may take a lease whose latest acquire expires at
/// `expires_at` (`LastModified + ttl`): past its grace, counted from the latest
/// instant the truncated `LastModified` allows.
pub fn free_at(expires_at: SystemTime, grace: Duration) -> SystemTime {
    expires_at + LAST_MODIFIED_RESOLUTION + grace
}

impl LeaseStatus {
    /// Whether a contender may take the lease now: no epoch, a release, an
    /// unparsable latest object, or an acquire expired by more than `grace` even on
    /// the earliest reading of the store's clock — its expiry counted from the
    /// latest instant its truncated `LastModified` allows. Counted from
    /// `LastModified` as written, a holder that stalled `self_fence_margin + grace`
    /// could still write after a successor took over (the protocol model,
    /// tests/model: `last_modified_resolution_must_be_rounded_up`).
    pub fn is_free(&self, grace: Duration) -> bool {
        match &self.object {
            Some(EpochObject::Acquire { expires_at, .. }) => {
                self.store_earliest > free_at(*expires_at, grace)
            }
            _ => true,
        }
    }
}

/// A fresh random token: 256 bits, hex.
pub fn fresh_token() -> String {
    let mut b = [0u8; 32];
    crate::entropy::fill(&mut b);
    hex::encode(b)
}

/// Steps 1–2 of SPEC §2: the latest epoch and its object.
pub async fn status(epochs: &Epochs, lease: &LeaseName) -> Result<LeaseStatus, StoreError> {
    status_after(epochs, lease, Epoch::NONE).await
}

/// [`status`] listing only the epochs after `known`, one the caller knows exists
/// (its own tenure's): epoch objects are never deleted, so the latest is at least
/// `known`, and the listing does not grow with the lease's history — a gate lease
/// renewed every few seconds has hundreds of thousands of epochs within a month,
/// and listing them all on every renewal would come to outlast the renewal.
pub async fn status_after(
    epochs: &Epochs,
    lease: &LeaseName,
    known: Epoch,
) -> Result<LeaseStatus, StoreError> {
    let latest = epochs.latest_after(lease, known).await?;
    status_at(epochs, lease, latest).await
}

/// The status of `lease` whose latest epoch is `latest` (listed by the caller):
/// its object, read once, and — for a release that carries a token — whether it
/// proves the tenure it releases (one more read, of the epoch before).
pub async fn status_at(
    epochs: &Epochs,
    lease: &LeaseName,
    latest: Epoch,
) -> Result<LeaseStatus, StoreError> {
    let stored = if latest == Epoch::NONE {
        None
    } else {
        let key = crate::epoch::object_key(epochs.prefix(), lease, latest);
        epochs.store().get(&key).await?
    };
    let (object, record, written) = match &stored {
        Some(o) => (
            Some(EpochObject::from_stored(
                lease,
                latest,
                &o.body,
                o.last_modified,
            )),
            serde_json::from_slice::<EpochRecord>(&o.body).ok(),
            Some(o.last_modified),
        ),
        None => (None, None, None),
    };
    // A gate object without a MAC may be forged: whoever judges it needs to
    // know when the tenure it may have cut short ends (the nearest acquire
    // below it that parses). Objects with a MAC and worker leases never pay for it.
    let prior_expiry = if record.as_ref().is_some_and(|r| r.mac.is_some()) {
        None
    } else {
        prior_acquire_expiry(epochs, lease, latest).await?
    };
    Ok(LeaseStatus {
        latest,
        object,
        record,
        written,
        prior_expiry,
        store_now: epochs.store_now(),
        store_earliest: epochs.store().clock().earliest(),
    })
}

/// How far below an untrusted gate object [`status_at`] looks for the acquire
/// it follows.
pub const PRIOR_WALK: u64 = 64;

/// When the tenure below an untrusted object ends, as far as the store shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PriorExpiry {
    /// The nearest acquire below it expires (or expired) then.
    At(SystemTime),
    /// No epoch below it: nothing to cut short.
    Nothing,
    /// Nothing parses within [`PRIOR_WALK`] epochs below it: unknown, so never.
    Unknown,
}

/// The expiry of the nearest acquire below `latest` that parses.
async fn prior_acquire_expiry(
    epochs: &Epochs,
    lease: &LeaseName,
    latest: Epoch,
) -> Result<Option<PriorExpiry>, StoreError> {
    if latest == Epoch::NONE {
        return Ok(None);
    }
    let mut e = latest.get();
    for _ in 0..PRIOR_WALK {
        e -= 1;
        if e == 0 {
            return Ok(Some(PriorExpiry::Nothing));
        }
        if let Some(EpochObject::Acquire { expires_at, .. }) =
            epochs.read(lease, Epoch::new(e)).await?
        {
            return Ok(Some(PriorExpiry::At(expires_at)));
        }
    }
    Ok(Some(PriorExpiry::Unknown))
}

/// Why `epoch` is not the caller's tenure, from a [`status_after`] `epoch`.
fn not_latest(st: &LeaseStatus, epoch: Epoch) -> String {
    if st.latest == epoch && st.object.is_none() {
        format!("epoch {epoch} does not exist")
    } else {
        format!(
            "the latest epoch is {} and it is not this tenure",
            st.latest
        )
    }
}

/// How many lost races or uncertain results one call tolerates before giving up.
const MAX_ROUNDS: usize = 16;

enum Created {
    Won(SystemTime),
    Lost,
}

/// Step 3: conditionally creates `epoch` with `body`, deciding uncertain results by
/// reading the object back. `ours` says whether a stored object is our write.
async fn create_decided(
    epochs: &Epochs,
    lease: &LeaseName,
    epoch: Epoch,
    body: Bytes,
    ours: impl Fn(&EpochObject, &[u8]) -> bool,
) -> Result<Created, AcquireError> {
    let mut last_err = None;
    for attempt in 0..MAX_ROUNDS {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(20 * (1 << attempt.min(5)))).await;
        }
        match epochs.create(lease, epoch, body.clone()).await {
            Ok(CreateOutcome::Created)
            | Ok(CreateOutcome::AlreadyExists)
            | Err(StoreError::Unavailable(_)) => {}
            Err(e @ StoreError::Refused(_)) => return Err(e.into()),
        }
        // Read back whatever the create said: a 412 may hide our own earlier
        // attempt, and a success needs the object's LastModified for the expiry.
        let key = crate::epoch::object_key(epochs.prefix(), lease, epoch);
        match epochs.store().get(&key).await {
            Ok(Some(obj)) => {
                let parsed = EpochObject::from_stored(lease, epoch, &obj.body, obj.last_modified);
                if ours(&parsed, &obj.body) {
                    let expires_at = match parsed {
                        EpochObject::Acquire { expires_at, .. } => expires_at,
                        _ => obj.last_modified,
                    };
                    return Ok(Created::Won(expires_at));
                }
                return Ok(Created::Lost);
            }
            // Not there: the create did not happen; creating again is safe.
            Ok(None) => continue,
            Err(e) => last_err = Some(e),
        }
    }
    Err(last_err
        .map(AcquireError::Store)
        .unwrap_or_else(|| AcquireError::GaveUp {
            lease: lease.clone(),
            why: format!("could not create epoch {epoch}"),
        }))
}

/// Acquires `lease` if it is free (SPEC §2 steps 1–3). `current` is a tenure the
/// caller holds (renewal); without it, a valid acquire by anyone is `Held`.
pub async fn acquire(
    epochs: &Epochs,
    lease: &LeaseName,
    holder: &str,
    ttl: Duration,
    grace: Duration,
    current: Option<(Epoch, &str)>,
) -> Result<Holding, AcquireError> {
    let plain = |_: &mut EpochRecord| {};
    acquire_with(epochs, lease, holder, ttl, grace, current, None, &plain).await
}

/// Whether the record of a latest acquire naming the caller's own holder shows
/// that its writer can no longer write (the instance guard: the same instance
/// restarted without its token, SPEC §10.1).
pub type Reclaim<'a> = &'a (dyn Fn(&EpochRecord) -> bool + Sync);

/// How a gate lease's contender (SPEC §10) judges the latest object, in place
/// of a worker's [`LeaseStatus::is_free`]: a gate object may be forged by
/// anyone who can write under `.gate/`, so its own word (a release, a short
/// TTL, garbage) must not end the tenure it follows any sooner than that
/// tenure's own end ([`crate::set_up::gate_free`]).
pub struct GateRules<'a> {
    /// Whether the latest object lets a contender in now.
    pub free: &'a (dyn Fn(&LeaseStatus) -> bool + Sync),
    /// An acquire under our own holder name this lets us take back at once.
    pub reclaim: Option<Reclaim<'a>>,
}

/// [`acquire`] with two additions for gate leases (SPEC §10): `gate` judges
/// whether the latest object lets a contender in ([`GateRules`]: its `free`
/// replaces `grace`'s rule, its `reclaim` takes a lease whose latest acquire
/// names `holder` back at once when it says so of that acquire's record), and
/// `decorate` adds fields to the object written.
#[allow(clippy::too_many_arguments)]
pub async fn acquire_with(
    epochs: &Epochs,
    lease: &LeaseName,
    holder: &str,
    ttl: Duration,
    grace: Duration,
    current: Option<(Epoch, &str)>,
    gate: Option<&GateRules<'_>>,
    decorate: &(dyn Fn(&mut EpochRecord) + Sync),
) -> Result<Holding, AcquireError> {
    let known = current.map_or(Epoch::NONE, |(e, _)| e);
    for _ in 0..MAX_ROUNDS {
        let st = status_after(epochs, lease, known).await?;
        let mine = match (current, &st.object) {
            (Some((e, tok)), Some(EpochObject::Acquire { token, .. })) => {
                e == st.latest && token.matches(&TokenHash::of(tok.as_bytes()))
            }
            _ => false,
        };
        if let Some((e, _)) = current {
            if !mine {
                return Err(AcquireError::NotHolder {
                    lease: lease.clone(),
                    epoch: e,
                    why: not_latest(&st, e),
                });
            }
            if let Some(EpochObject::Acquire { expires_at, .. }) = &st.object {
                if st.store_now > *expires_at {
                    return Err(AcquireError::NotHolder {
                        lease: lease.clone(),
                        epoch: e,
                        why: "the tenure has expired".into(),
                    });
                }
            }
        } else if !(gate.map_or_else(|| st.is_free(grace), |g| (g.free)(&st))
            || reclaimable(&st, holder, gate.and_then(|g| g.reclaim)))
        {
            // Neither free nor our own tenure to take back (a restart lost its token).
            // (A gate lease's rules may hold even a release or garbage a while.)
            let (holder, expires_at) = match &st.object {
                Some(EpochObject::Acquire {
                    holder, expires_at, ..
                }) => (holder.clone(), *expires_at),
                _ => (
                    st.record
                        .as_ref()
                        .map_or_else(|| "an unreadable object".to_owned(), |r| r.holder.clone()),
                    st.written.unwrap_or(st.store_now),
                ),
            };
            return Err(AcquireError::Held {
                lease: lease.clone(),
                epoch: st.latest,
                holder,
                expires_at,
            });
        }
        let Some(next) = st.latest.next() else {
            return Err(AcquireError::GaveUp {
                lease: lease.clone(),
                why: "epoch numbers are exhausted".into(),
            });
        };
        match create_acquire(epochs, lease, next, holder, ttl, decorate).await? {
            Some(held) => return Ok(held),
            // Losing a race is never permission to work: look again.
            None => continue,
        }
    }
    Err(AcquireError::GaveUp {
        lease: lease.clone(),
        why: "lost too many races in a row".into(),
    })
}

/// Whether the latest epoch in `st` is an acquire by `holder` that `reclaim`
/// lets it take back at once, judged on the record as stored.
fn reclaimable(st: &LeaseStatus, holder: &str, reclaim: Option<Reclaim<'_>>) -> bool {
    let Some(gone) = reclaim else {
        return false;
    };
    matches!(&st.object, Some(EpochObject::Acquire { holder: h, .. }) if h == holder)
        && st
            .record
            .as_ref()
            .is_some_and(|r| r.epoch == st.latest.get() && gone(r))
}

/// Renews a held tenure in two store calls: creates L+1 straight away (the
/// conditional create is the check — if anyone else created L+1 first, the
/// tenure is lost) and reads it back for its `LastModified`. For gate leases,
/// renewed every few seconds: [`acquire_with`]'s LIST and GET first add nothing
/// a conditional create does not decide. An expired but still latest epoch is
/// renewed too: nobody can have held the lease in between.
pub async fn renew_direct(
    epochs: &Epochs,
    current: &Holding,
    ttl: Duration,
    decorate: &(dyn Fn(&mut EpochRecord) + Sync),
) -> Result<Holding, AcquireError> {
    let lease = &current.lease;
    let next = current.epoch.next().ok_or_else(|| AcquireError::GaveUp {
        lease: lease.clone(),
        why: "epoch numbers are exhausted".into(),
    })?;
    create_acquire(epochs, lease, next, &current.holder, ttl, decorate)
        .await?
        .ok_or_else(|| AcquireError::NotHolder {
            lease: lease.clone(),
            epoch: current.epoch,
            why: format!("epoch {next} was created by someone else first"),
        })
}

/// Step 3 for an acquire: creates `next` with a fresh token, deciding an
/// uncertain result by reading it back. `None` when someone else created it.
async fn create_acquire(
    epochs: &Epochs,
    lease: &LeaseName,
    next: Epoch,
    holder: &str,
    ttl: Duration,
    decorate: &(dyn Fn(&mut EpochRecord) + Sync),
) -> Result<Option<Holding>, AcquireError> {
    let token = fresh_token();
    let hash = TokenHash::of(token.as_bytes());
    let mut record = EpochRecord::acquire(lease, next, holder, token.as_bytes(), ttl);
    decorate(&mut record);
    let ours = |o: &EpochObject, _: &[u8]| matches!(o, EpochObject::Acquire { token, .. } if token.matches(&hash));
    Ok(
        match create_decided(epochs, lease, next, Bytes::from(record.to_json()), ours).await? {
            Created::Won(expires_at) => Some(Holding {
                lease: lease.clone(),
                epoch: next,
                token,
                holder: holder.to_owned(),
                expires_at,
            }),
            Created::Lost => None,
        },
    )
}

/// Renews a tenure: acquires L+1 while holding L, with a fresh token.
pub async fn renew(
    epochs: &Epochs,
    lease: &LeaseName,
    holder: &str,
    epoch: Epoch,
    token: &str,
    ttl: Duration,
) -> Result<Holding, AcquireError> {
    acquire(
        epochs,
        lease,
        holder,
        ttl,
        Duration::ZERO,
        Some((epoch, token)),
    )
    .await
}

/// Releases a tenure: creates L+1 with `kind: "release"`. Returns the release epoch.
pub async fn release(
    epochs: &Epochs,
    lease: &LeaseName,
    holder: &str,
    epoch: Epoch,
    token: &str,
) -> Result<Epoch, AcquireError> {
    release_with(epochs, lease, holder, epoch, token, &|_| {}).await
}

/// [`release`] with fields added to the object written (a gate lease's set-up
/// and MAC, SPEC §10).
pub async fn release_with(
    epochs: &Epochs,
    lease: &LeaseName,
    holder: &str,
    epoch: Epoch,
    token: &str,
    decorate: &(dyn Fn(&mut EpochRecord) + Sync),
) -> Result<Epoch, AcquireError> {
    // Listed after the tenure's own epoch, as a renewal is (`status_after`): a
    // graceful stop releases every shard, and must not page through its history.
    let st = status_after(epochs, lease, epoch).await?;
    let mine = matches!(&st.object, Some(EpochObject::Acquire { token: t, .. }) if st.latest == epoch && t.matches(&TokenHash::of(token.as_bytes())));
    if !mine {
        return Err(AcquireError::NotHolder {
            lease: lease.clone(),
            epoch,
            why: not_latest(&st, epoch),
        });
    }
    let next = epoch.next().ok_or_else(|| AcquireError::GaveUp {
        lease: lease.clone(),
        why: "epoch numbers are exhausted".into(),
    })?;
    let mut record = EpochRecord::release(lease, next, holder);
    decorate(&mut record);
    let body = Bytes::from(record.to_json());
    let expected = body.clone();
    match create_decided(epochs, lease, next, body, move |_, raw| {
        raw == &expected[..]
    })
    .await?
    {
        Created::Won(_) => Ok(next),
        Created::Lost => Err(AcquireError::NotHolder {
            lease: lease.clone(),
            epoch,
            why: format!("epoch {next} was created by someone else first"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::clock::{StoreClock, SystemClock};
    use crate::epoch::object_key;
    use crate::lease::dir::DirStore;
    use crate::lease::{CreateOutcome, LeaseStore, StoredObject};

    /// A store that remembers where each listing started.
    struct Listings {
        inner: DirStore,
        starts: Mutex<Vec<Option<String>>>,
    }

    #[async_trait::async_trait]
    impl LeaseStore for Listings {
        async fn list(
            &self,
            prefix: &str,
            start_after: Option<&str>,
        ) -> Result<Vec<String>, StoreError> {
            self.starts
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(start_after.map(str::to_owned));
            self.inner.list(prefix, start_after).await
        }
        async fn get(&self, key: &str) -> Result<Option<StoredObject>, StoreError> {
            self.inner.get(key).await
        }
        async fn create_if_absent(
            &self,
            key: &str,
            body: Bytes,
        ) -> Result<CreateOutcome, StoreError> {
            self.inner.create_if_absent(key, body).await
        }
        async fn delete(&self, key: &str) -> Result<(), StoreError> {
            self.inner.delete(key).await
        }
        fn clock(&self) -> &StoreClock {
            self.inner.clock()
        }
        fn describe(&self) -> String {
            "listings".into()
        }
    }

    /// A renewal, and a release, list only the epochs after their own tenure's
    /// (the instance guard renews this way every `gate_ttl / 3`, a graceful stop
    /// releases every shard): listing from the start paged through the whole
    /// history each time.
    #[tokio::test]
    async fn a_renewal_lists_only_the_epochs_after_its_own() {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = Arc::new(Listings {
            inner: DirStore::open(dir.path(), Arc::new(SystemClock)).expect("dir store"),
            starts: Mutex::default(),
        });
        let epochs = Epochs::new(store.clone(), "p/");
        let lease = LeaseName::parse("gate").expect("valid");
        let (ttl, grace) = (Duration::from_secs(30), Duration::ZERO);
        let mut held = acquire_with(&epochs, &lease, "me", ttl, grace, None, None, &|_| {})
            .await
            .expect("acquired");
        for _ in 0..3 {
            let current = Some((held.epoch, held.token.as_str()));
            held = acquire_with(&epochs, &lease, "me", ttl, grace, current, None, &|_| {})
                .await
                .expect("renewed");
        }
        assert_eq!(held.epoch, Epoch::new(4));
        release(&epochs, &lease, "me", held.epoch, &held.token)
            .await
            .expect("released");
        let starts = store.starts.lock().expect("not poisoned").clone();
        let after = |e: u64| Some(object_key("p/", &lease, Epoch::new(e)));
        assert_eq!(starts, vec![None, after(1), after(2), after(3), after(4)]);
        // A tenure that never existed is told so, not that it is the latest.
        let err = release(&epochs, &lease, "me", Epoch::new(9), "nope")
            .await
            .expect_err("no such tenure");
        assert!(err.to_string().contains("epoch 9 does not exist"), "{err}");
    }

    /// A live acquire under the caller's own holder is taken back at once only
    /// when `reclaim_own` says so of its stored record (the instance guard: its
    /// writer provably gone); otherwise it is held, as anyone else's is.
    #[tokio::test]
    async fn the_own_holder_is_taken_back_only_as_the_record_allows() {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = DirStore::open(dir.path(), Arc::new(SystemClock)).expect("dir store");
        let epochs = Epochs::new(Arc::new(store), "p/");
        let lease = LeaseName::parse("gate").expect("valid");
        let ttl = Duration::from_secs(30);
        let mark = |r: &mut EpochRecord| r.mode = Some("marked".into());
        acquire_with(&epochs, &lease, "me", ttl, ttl, None, None, &mark)
            .await
            .expect("acquired");
        let free = |st: &LeaseStatus| st.is_free(ttl);
        let rules = |reclaim| GateRules {
            free: &free,
            reclaim,
        };
        for reclaim in [None, Some(&(|_: &EpochRecord| false) as Reclaim<'_>)] {
            let err = acquire_with(
                &epochs,
                &lease,
                "me",
                ttl,
                ttl,
                None,
                Some(&rules(reclaim)),
                &|_| {},
            )
            .await
            .expect_err("held: no proof its writer is gone");
            assert!(matches!(err, AcquireError::Held { ref holder, .. } if holder == "me"));
        }
        let seen = |r: &EpochRecord| r.mode.as_deref() == Some("marked");
        let held = acquire_with(
            &epochs,
            &lease,
            "me",
            ttl,
            ttl,
            None,
            Some(&rules(Some(&seen))),
            &|_| {},
        )
        .await
        .expect("taken back at once");
        assert_eq!(held.epoch, Epoch::new(2));
        // Someone else's live acquire is never taken back, whatever the predicate.
        let err = acquire_with(
            &epochs,
            &lease,
            "other",
            ttl,
            ttl,
            None,
            Some(&rules(Some(&|_| true))),
            &|_| {},
        )
        .await
        .expect_err("held by me");
        assert!(err.is_held());
    }
}
