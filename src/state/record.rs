//! A dedup record (SPEC §6) as every state backend keeps it, and the one rule
//! for when a new request may take over an existing record.

use bytes::Bytes;

use crate::epoch::Epoch;

/// Where a dedup record stands (SPEC §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Claimed and forwarded; the outcome is not known yet.
    InFlight,
    /// The upstream answered; a repeat is answered from the record.
    Done,
    /// Sent, but the outcome is unknown (timeout, reset, crash); an operator resolves it.
    InDoubt,
}

impl State {
    /// The name the SPEC, admin API and logs use.
    pub fn as_str(self) -> &'static str {
        match self {
            State::InFlight => "in_flight",
            State::Done => "done",
            State::InDoubt => "in_doubt",
        }
    }
}

/// A stored response (for `done`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The upstream's status.
    pub status: u16,
    /// The upstream's response headers, replayed as they were.
    pub headers: Vec<(String, Vec<u8>)>,
    /// `None` when the body exceeded `max_replay_bytes` or an operator resolved the
    /// key as delivered.
    pub body: Option<Bytes>,
}

/// The request a record is for, as an operator needs to find it at the
/// destination (the path without its query, which may carry secrets).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestLine {
    /// The request's method.
    pub method: String,
    /// The request's path, without its query.
    pub path: String,
}

impl RequestLine {
    /// The longest path kept, in bytes.
    pub const MAX_PATH: usize = 1024;
    /// The longest method kept, in bytes.
    pub const MAX_METHOD: usize = 32;

    /// `path_query` without its query, each cut to its maximum.
    pub fn new(method: &str, path_query: &str) -> RequestLine {
        let path = path_query.split('?').next().unwrap_or_default();
        RequestLine {
            method: cut(method, Self::MAX_METHOD).to_owned(),
            path: cut(path, Self::MAX_PATH).to_owned(),
        }
    }
}

fn cut(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// One dedup record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Where the record stands.
    pub state: State,
    /// SHA-256 of the request, to tell a repeat from a reused key (422
    /// `dedup_key_reused`).
    pub fingerprint: [u8; 32],
    /// The epoch the request was admitted at.
    pub epoch: Epoch,
    /// When the key was first claimed, ms since the Unix epoch.
    pub created_ms: u64,
    /// When the record last changed state; for a `done` one, when it became
    /// `done`, where its retention starts ([`Record::expired`]).
    pub updated_ms: u64,
    /// The upstream's response, once `done`.
    pub response: Option<StoredResponse>,
    /// `None` for records written before fencegate kept it.
    pub request: Option<RequestLine>,
}

/// When a new request may take over an existing record of its key instead of
/// being answered from it.
#[derive(Debug, Clone, Copy)]
pub struct TakeOver {
    /// The route's `in_doubt = "resend"`: an in-doubt record of the *same*
    /// request may be forwarded again.
    pub in_doubt: bool,
    /// A `done` record that became `done` before this (ms since the Unix epoch)
    /// has expired.
    pub done_before_ms: u64,
}

impl Record {
    /// Whether this record has expired: only a `done` one ever does, counting
    /// from when it became `done` — its `updated_ms`, which every transition to
    /// `done` sets (an outcome written, an operator's resolution) and nothing
    /// changes afterwards. Not from its creation: a key that waited in doubt, or
    /// was resent, longer than the TTL would be born expired and forwarded again
    /// (issue 25). An `in_flight` or `in_doubt` record never turns into "absent"
    /// (SPEC §6): its request may still be at the destination.
    pub fn expired(&self, rules: &TakeOver) -> bool {
        self.state == State::Done && self.updated_ms < rules.done_before_ms
    }

    /// The record a claim writes over this one, if it may: an expired record
    /// (whatever its request), or under `resend` an in-doubt record of the same
    /// request (keeping its creation time; its retention starts when the resend's
    /// answer makes it `done`). `None`: the claim is answered from this record.
    pub fn taken_over_by(&self, fresh: &Record, rules: &TakeOver) -> Option<Record> {
        if self.expired(rules) {
            return Some(fresh.clone());
        }
        (rules.in_doubt && self.state == State::InDoubt && self.fingerprint == fresh.fingerprint)
            .then(|| Record {
                created_ms: self.created_ms,
                ..fresh.clone()
            })
    }

    /// An operator's "delivered" (SPEC §8): `done` as of `now_ms`, without a
    /// response to replay. Its retention starts now.
    pub fn delivered(self, now_ms: u64) -> Record {
        Record {
            state: State::Done,
            updated_ms: now_ms,
            response: None,
            ..self
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(state: State, fp: u8, created_ms: u64) -> Record {
        Record {
            state,
            fingerprint: [fp; 32],
            epoch: Epoch::new(1),
            created_ms,
            updated_ms: created_ms,
            response: None,
            request: None,
        }
    }

    #[test]
    fn only_expired_done_records_and_resent_in_doubt_ones_are_taken_over() {
        let fresh = rec(State::InFlight, 1, 100);
        let rules = |in_doubt| TakeOver {
            in_doubt,
            done_before_ms: 50,
        };
        // Expired `done`: taken over whatever its request.
        assert_eq!(
            rec(State::Done, 2, 49).taken_over_by(&fresh, &rules(false)),
            Some(fresh.clone())
        );
        assert_eq!(
            rec(State::Done, 1, 50).taken_over_by(&fresh, &rules(true)),
            None
        );
        // `in_flight` and `in_doubt` never expire.
        for s in [State::InFlight, State::InDoubt] {
            assert_eq!(rec(s, 1, 0).taken_over_by(&fresh, &rules(false)), None);
        }
        // `resend`: an in-doubt record of the same request, keeping its creation.
        let resent = rec(State::InDoubt, 1, 10).taken_over_by(&fresh, &rules(true));
        assert_eq!(
            resent.map(|r| (r.state, r.created_ms)),
            Some((State::InFlight, 10))
        );
        assert_eq!(
            rec(State::InDoubt, 2, 10).taken_over_by(&fresh, &rules(true)),
            None
        );
        assert_eq!(
            rec(State::InFlight, 1, 10).taken_over_by(&fresh, &rules(true)),
            None
        );
    }

    /// Expiry as of `now` with a TTL of `ttl` (as `Dedup` computes it).
    fn at(now: u64, ttl: u64, in_doubt: bool) -> TakeOver {
        TakeOver {
            in_doubt,
            done_before_ms: (now + 1).saturating_sub(ttl),
        }
    }

    /// Issue 25, point 3: a record written `done` long after its claim (a slow
    /// upstream, a key in doubt for a while) is kept a TTL from then.
    #[test]
    fn a_done_record_expires_a_ttl_after_it_became_done_not_after_its_creation() {
        let ttl = 8_000;
        let done = Record {
            updated_ms: 10_000,
            ..rec(State::Done, 1, 0)
        };
        for now in [10_000, 12_000, 17_999] {
            assert!(!done.expired(&at(now, ttl, false)), "expired at {now}");
        }
        assert!(done.expired(&at(18_000, ttl, false)));
        // Not taken over by a new claim before then, whatever the policy.
        let fresh = rec(State::InFlight, 2, 17_999);
        assert_eq!(done.taken_over_by(&fresh, &at(17_999, ttl, true)), None);
        assert_eq!(
            done.taken_over_by(&fresh, &at(18_000, ttl, false)),
            Some(fresh)
        );
    }

    /// Issue 25, point 3: an operator resolves a key as delivered after it waited
    /// in doubt longer than the TTL; the resolved record is not born expired.
    #[test]
    fn an_operators_late_delivered_is_kept_a_ttl_from_the_resolution() {
        let ttl = 8_000;
        let doubt = Record {
            updated_ms: 300,
            ..rec(State::InDoubt, 1, 0)
        };
        let resolved = doubt.delivered(10_000);
        assert_eq!(
            (resolved.state, resolved.created_ms, resolved.updated_ms),
            (State::Done, 0, 10_000)
        );
        assert_eq!(resolved.response, None);
        assert!(!resolved.expired(&at(10_000, ttl, false)));
        assert!(!resolved.expired(&at(17_999, ttl, false)));
        assert!(resolved.expired(&at(18_000, ttl, false)));
        // The identical retry right after the resolution is answered from it.
        let retry = rec(State::InFlight, 1, 10_001);
        assert_eq!(resolved.taken_over_by(&retry, &at(10_001, ttl, true)), None);
    }

    /// Issue 25, point 3: a resend keeps the first claim's creation time, but
    /// its answer starts the retention.
    #[test]
    fn a_late_resend_is_kept_a_ttl_from_its_answer() {
        let ttl = 8_000;
        let doubt = rec(State::InDoubt, 1, 0);
        let fresh = rec(State::InFlight, 1, 10_000);
        let resent = doubt
            .taken_over_by(&fresh, &at(10_000, ttl, true))
            .expect("resent");
        assert_eq!((resent.created_ms, resent.updated_ms), (0, 10_000));
        let answered = Record {
            state: State::Done,
            updated_ms: 10_050,
            ..resent
        };
        assert!(!answered.expired(&at(18_049, ttl, false)));
        assert!(answered.expired(&at(18_050, ttl, false)));
    }
}
