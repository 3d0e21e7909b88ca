//! The admission decision of SPEC §4, as a pure function: no I/O, no clock reads,
//! no locks. The fence gathers the facts (mark, latest known epoch, the cached
//! epoch object, the store-clock estimate) and asks; this answers.

use std::time::SystemTime;

use crate::epoch::{Epoch, EpochObject, LeaseName, TokenHash};

/// What a request claims.
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    /// The epoch named by `X-Lease-Epoch`.
    pub epoch: Epoch,
    /// The `X-Lease-Token` bytes, if sent.
    pub token: Option<&'a [u8]>,
}

/// What fencegate knows about the lease at the moment of the decision.
#[derive(Debug, Clone, Copy)]
pub struct Facts<'a> {
    /// The lease the route names.
    pub lease: &'a LeaseName,
    /// HWM(L): the durable high-water mark (or a raise in progress).
    pub high_water_mark: Epoch,
    /// The greatest epoch seen by the refresher or an on-demand read.
    pub latest_known: Epoch,
    /// The epoch object of the claimed epoch; `None` when it does not exist.
    pub object: Option<&'a EpochObject>,
    /// The store's clock, estimated.
    pub store_now: SystemTime,
    /// The route's `require_token`: whether rule 2's token check applies.
    pub require_token: bool,
    /// The claim's token bytes equal ones already found to hash to this epoch's
    /// `token_sha256` (objects are immutable): the SHA-256 need not be computed
    /// again (it was ~7,000 instructions, ~10% of a forwarded request).
    pub token_verified: bool,
}

/// An admitted request: at the current mark, or one that raises it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// At the high-water mark: forwarded without a drain.
    AtMark,
    /// Above the mark: the mark is raised durably and lower epochs drained first (SPEC
    /// §5).
    Raise,
}

/// A refused request, with what the worker needs to know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The route requires a token and none was sent (rule 2).
    #[error("X-Lease-Token is required for lease {lease}")]
    TokenMissing {
        /// The lease of the route.
        lease: LeaseName,
    },
    /// SHA-256 of the token is not the epoch's `token_sha256` (rule 2).
    #[error("the token does not match epoch {epoch} of lease {lease}")]
    TokenInvalid {
        /// The lease of the route.
        lease: LeaseName,
        /// The claimed epoch.
        epoch: Epoch,
    },
    /// No epoch object exists for the claim (rule 2).
    #[error("epoch {epoch} of lease {lease} does not exist")]
    EpochUnknown {
        /// The lease of the route.
        lease: LeaseName,
        /// The claimed epoch.
        epoch: Epoch,
        /// The greatest epoch known, so the worker can tell it is ahead or behind.
        latest_epoch: Epoch,
    },
    /// The epoch object does not parse, disagrees with its key, or is a release (rule 2).
    #[error("epoch {epoch} of lease {lease} admits no request: {reason}")]
    EpochInvalid {
        /// The lease of the route.
        lease: LeaseName,
        /// The claimed epoch.
        epoch: Epoch,
        /// What is wrong with the object.
        reason: String,
    },
    /// Below the mark, or a newer epoch is known (rules 1 and 3).
    #[error("epoch {epoch} of lease {lease} is stale: a newer epoch has been seen (high-water mark {high_water_mark}, latest epoch {latest_epoch})")]
    Stale {
        /// The lease of the route.
        lease: LeaseName,
        /// The claimed epoch.
        epoch: Epoch,
        /// The durable mark at the time of the decision.
        high_water_mark: Epoch,
        /// The greatest epoch known.
        latest_epoch: Epoch,
    },
    /// Past `LastModified + ttl_ms` on the store's clock (rule 4).
    #[error("epoch {epoch} of lease {lease} has expired on the store's clock")]
    Expired {
        /// The lease of the route.
        lease: LeaseName,
        /// The claimed epoch.
        epoch: Epoch,
        /// When it expired, on the store's clock.
        expired_at: SystemTime,
    },
}

impl Refusal {
    /// The lease and (when one was judged) the epoch, for the error body and logs (SPEC
    /// §7).
    pub(crate) fn lease_epoch(&self) -> (&LeaseName, Option<Epoch>) {
        match self {
            Refusal::TokenMissing { lease } => (lease, None),
            Refusal::TokenInvalid { lease, epoch }
            | Refusal::EpochUnknown { lease, epoch, .. }
            | Refusal::EpochInvalid { lease, epoch, .. }
            | Refusal::Stale { lease, epoch, .. }
            | Refusal::Expired { lease, epoch, .. } => (lease, Some(*epoch)),
        }
    }
}

/// Whether a claim is refused as stale without needing its epoch object: below the
/// mark, or below an epoch already known.
pub fn stale(claim: Epoch, facts_mark: Epoch, latest_known: Epoch) -> bool {
    claim < facts_mark || claim < latest_known
}

/// SPEC §4: admit only if e ≥ HWM, the object exists, parses, is an acquire whose
/// token hash matches, no newer epoch is known, and e has not expired (no grace).
pub fn decide(claim: Claim<'_>, f: Facts<'_>) -> Result<Admit, Refusal> {
    let lease = f.lease.clone();
    let epoch = claim.epoch;
    if f.require_token && claim.token.is_none() {
        return Err(Refusal::TokenMissing { lease });
    }
    if stale(epoch, f.high_water_mark, f.latest_known) {
        return Err(Refusal::Stale {
            lease,
            epoch,
            high_water_mark: f.high_water_mark,
            latest_epoch: f.latest_known,
        });
    }
    let (token_hash, expires_at) = match f.object {
        None => {
            return Err(Refusal::EpochUnknown {
                lease,
                epoch,
                latest_epoch: f.latest_known,
            })
        }
        Some(EpochObject::Invalid { reason }) => {
            return Err(Refusal::EpochInvalid {
                lease,
                epoch,
                reason: reason.clone(),
            })
        }
        Some(EpochObject::Release { .. }) => {
            return Err(Refusal::EpochInvalid {
                lease,
                epoch,
                reason: "the epoch is a release".into(),
            })
        }
        Some(EpochObject::Acquire {
            token, expires_at, ..
        }) => (token, *expires_at),
    };
    if f.token_verified && claim.token.is_some() {
        // Checked against this very object before.
    } else if f.require_token {
        let sent = TokenHash::of(claim.token.unwrap_or_default());
        if !token_hash.matches(&sent) {
            return Err(Refusal::TokenInvalid { lease, epoch });
        }
    } else if let Some(t) = claim.token {
        // A token sent on a trusted route must still be the right one.
        if !token_hash.matches(&TokenHash::of(t)) {
            return Err(Refusal::TokenInvalid { lease, epoch });
        }
    }
    if f.store_now >= expires_at {
        return Err(Refusal::Expired {
            lease,
            epoch,
            expired_at: expires_at,
        });
    }
    Ok(if epoch > f.high_water_mark {
        Admit::Raise
    } else {
        Admit::AtMark
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::Duration;

    fn t(s: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(s)
    }

    fn acquire(token: &[u8], expires: u64) -> EpochObject {
        EpochObject::Acquire {
            holder: "w".into(),
            token: TokenHash::of(token),
            expires_at: t(expires),
        }
    }

    fn facts<'a>(
        lease: &'a LeaseName,
        mark: u64,
        latest: u64,
        obj: Option<&'a EpochObject>,
        now: u64,
    ) -> Facts<'a> {
        Facts {
            lease,
            high_water_mark: Epoch::new(mark),
            latest_known: Epoch::new(latest),
            object: obj,
            store_now: t(now),
            require_token: true,
            token_verified: false,
        }
    }

    fn claim(e: u64, tok: &[u8]) -> Claim<'_> {
        Claim {
            epoch: Epoch::new(e),
            token: Some(tok),
        }
    }

    #[test]
    fn the_late_worker_is_refused() {
        let l = LeaseName::parse("billing").unwrap();
        let o7 = acquire(b"a", 100);
        // Epoch 8 was admitted: the mark is 8.
        let r = decide(claim(7, b"a"), facts(&l, 8, 8, Some(&o7), 50)).unwrap_err();
        assert!(matches!(r, Refusal::Stale { .. }));
        // Mark still 7 but the refresher saw 8.
        let r = decide(claim(7, b"a"), facts(&l, 7, 8, Some(&o7), 50)).unwrap_err();
        assert!(matches!(r, Refusal::Stale { .. }));
    }

    #[test]
    fn each_refusal_in_order() {
        let l = LeaseName::parse("billing").unwrap();
        let o = acquire(b"tok", 100);
        let rel = EpochObject::Release { holder: "w".into() };
        let inv = EpochObject::Invalid { reason: "x".into() };
        let no_token = Claim {
            epoch: Epoch::new(5),
            token: None,
        };
        assert!(matches!(
            decide(no_token, facts(&l, 5, 5, Some(&o), 1)),
            Err(Refusal::TokenMissing { .. })
        ));
        assert!(matches!(
            decide(claim(6, b"tok"), facts(&l, 5, 5, None, 1)),
            Err(Refusal::EpochUnknown { .. })
        ));
        assert!(matches!(
            decide(claim(5, b"tok"), facts(&l, 5, 5, Some(&rel), 1)),
            Err(Refusal::EpochInvalid { .. })
        ));
        assert!(matches!(
            decide(claim(5, b"tok"), facts(&l, 5, 5, Some(&inv), 1)),
            Err(Refusal::EpochInvalid { .. })
        ));
        assert!(matches!(
            decide(claim(5, b"bad"), facts(&l, 5, 5, Some(&o), 1)),
            Err(Refusal::TokenInvalid { .. })
        ));
        assert!(matches!(
            decide(claim(5, b"tok"), facts(&l, 5, 5, Some(&o), 100)),
            Err(Refusal::Expired { .. })
        ));
        assert_eq!(
            decide(claim(5, b"tok"), facts(&l, 5, 5, Some(&o), 99)),
            Ok(Admit::AtMark)
        );
        assert_eq!(
            decide(claim(6, b"tok"), facts(&l, 5, 6, Some(&o), 99)),
            Ok(Admit::Raise)
        );
        let mut trusted = facts(&l, 5, 5, Some(&o), 1);
        trusted.require_token = false;
        assert_eq!(decide(no_token, trusted), Ok(Admit::AtMark));
    }

    proptest! {
        /// Whatever the facts, an admitted claim is never below the mark or a known
        /// epoch, always carries the object's token, and has not expired.
        #[test]
        fn admitted_implies_every_rule(
            e in 0u64..20, mark in 0u64..20, latest in 0u64..20,
            tok in prop::sample::select(vec![&b"a"[..], b"b"]),
            obj_tok in prop::sample::select(vec![&b"a"[..], b"b"]),
            kind in 0u8..4, now in 0u64..20, exp in 0u64..20, require in any::<bool>(),
        ) {
            let l = LeaseName::parse("p").unwrap();
            let obj = match kind {
                0 => None,
                1 => Some(EpochObject::Release { holder: "w".into() }),
                2 => Some(EpochObject::Invalid { reason: "r".into() }),
                _ => Some(acquire(obj_tok, exp)),
            };
            let mut f = facts(&l, mark, latest, obj.as_ref(), now);
            f.require_token = require;
            match decide(claim(e, tok), f) {
                Ok(admit) => {
                    prop_assert!(e >= mark && e >= latest);
                    prop_assert!(kind == 3 && tok == obj_tok && now < exp);
                    prop_assert_eq!(admit == Admit::Raise, e > mark);
                }
                Err(Refusal::Stale { .. }) => prop_assert!(e < mark || e < latest),
                Err(_) => {}
            }
        }

        /// Raising the mark or learning of a newer epoch never turns a refusal into
        /// an admission (monotonicity of the fence).
        #[test]
        fn newer_knowledge_only_refuses_more(e in 1u64..20, mark in 0u64..20, latest in 0u64..20, bump in 0u64..5) {
            let l = LeaseName::parse("p").unwrap();
            let o = acquire(b"a", 100);
            let before = decide(claim(e, b"a"), facts(&l, mark, latest, Some(&o), 1)).is_ok();
            let after = decide(claim(e, b"a"), facts(&l, mark + bump, latest + bump, Some(&o), 1)).is_ok();
            prop_assert!(!after || before);
        }
    }
}
