//! A dedup record (SPEC §6) as every state backend keeps it, and the one rule
//! for when a new request may take over an existing record.

use bytes::Bytes;

use crate::epoch::Epoch;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    InFlight,
    Done,
    InDoubt,
}

impl State {
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
    pub status: u16,
    pub headers: Vec<(String, Vec<u8>)>,
    /// `None` when the body exceeded `max_replay_bytes` or an operator resolved the
    /// key as delivered.
    pub body: Option<Bytes>,
}

/// The request a record is for, as an operator needs to find it at the
/// destination (the path without its query, which may carry secrets).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestLine {
    pub method: String,
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
    pub state: State,
    pub fingerprint: [u8; 32],
    pub epoch: Epoch,
    pub created_ms: u64,
    pub updated_ms: u64,
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
    /// A `done` record created before this (ms since the Unix epoch) has expired.
    pub done_created_before_ms: u64,
}

impl Record {
    /// Whether this record has expired: only a `done` one ever does; an
    /// `in_flight` or `in_doubt` record never turns into "absent" (SPEC §6) — its
    /// request may still be at the destination.
    pub fn expired(&self, rules: &TakeOver) -> bool {
        self.state == State::Done && self.created_ms < rules.done_created_before_ms
    }

    /// The record a claim writes over this one, if it may: an expired record
    /// (whatever its request), or under `resend` an in-doubt record of the same
    /// request (keeping its creation time). `None`: the claim is answered from
    /// this record.
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
            done_created_before_ms: 50,
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
}
