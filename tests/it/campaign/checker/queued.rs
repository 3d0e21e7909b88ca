//! The queued routes' rules (SPEC §11), judged on what the destination
//! recorded, the workers' `202`s and each message as fencegate's admin API
//! showed it at the end (after the faults healed and the queue drained):
//!
//! - **Q1 acceptance order** — per lease, the first arrivals of distinct
//!   messages come in `seq` order (a message's place: the admin API's, else
//!   its `202`'s). An arrival of a message with no known place is reported too.
//! - **Q2 epoch order** — no message of an older epoch arrives after a message
//!   of a newer epoch of its lease arrived (was sent). No exemption: a queued
//!   message's place is taken under its gate pass, and the deliverer sends the
//!   next only once the one before is settled, so not even a timed-out drain
//!   lets an older message through after a newer one.
//! - **Q3 delivery** — every message answered `202` arrives at least once by
//!   the end, unless it ended `failed` or `dropped`; it is still in the queue
//!   at the end, at the place its `202` gave (kill -9 at any point loses no
//!   accepted message).
//! - **Q4 duplicates** — a message arrives more than once only after an
//!   attempt whose outcome was unknown (timed out, reset, or out when the
//!   process died: `unknown_outcomes`), or after the destination answered an
//!   attempt with a status fencegate retries (not 2xx, and not a 4xx other
//!   than 408, 409, 425, 429: the destination refused that arrival itself).
//!   So, per message: `arrivals − arrivals answered with such a status ≤ 1 +
//!   unknown_outcomes`. Every arrival carries the dedup key and the same
//!   `webhook-id`, `{route}:{key}` (the campaign's queued routes sign).
//!
//! Of the direct routes' rules, R3 (token) applies to queued arrivals as it is
//! (a queued message is admitted as §4 says) and R5 judges the workers'
//! answers (a `202` is an acceptance; a refusal queued nothing; a replay is an
//! answer the destination gave the message). R1 is replaced by Q2, R4 by Q4.
//! R2 (drain) and R6 (expiry) are not applied: SPEC §11 orders the messages,
//! it does not ask an older one to have *finished* at the destination before a
//! newer one arrives (it was answered, or timed out: an unknown outcome), and
//! delivers messages after their epoch expired by design.
//!
//! **Forks.** In runs of a minute or more, the clone step lets a copy of the
//! instance take over with a copy of its `data_dir` (the original frozen past
//! its gate lease), then kills the copy while the original goes on with its
//! own state ([`Fork`]). Both then deliver what was queued before the fork,
//! each in its order: the history is judged in segments — before the fork,
//! while the copy served, after it — Q1, Q2 and Q4 within each (Q4 with the
//! copy's `unknown_outcomes` while it served), and the copy's own acceptances
//! are exempt from Q3 (its state was thrown away). The original must not send
//! while the copy holds the guard: its arrivals would fall in the copy's
//! segment and break the rules there.
//!
//! **In a cluster** there is no fork: the shard's owners share one database,
//! and a takeover resumes the same queue from its head. The history is one
//! segment, and every `202` must be delivered (or fail, or be dropped)
//! whichever owner accepted it and whichever delivers it. An attempt that a
//! tenure's end cut (the owner frozen, killed, or cut from the store or the
//! database with the attempt out) is an unknown outcome: the next owner finds
//! the message `delivering`, counts it in `unknown_outcomes` and sends it
//! again first, so Q4 holds with no allowance of its own; an attempt a
//! deposed owner sends after its successor's (the cluster's honest limit) is
//! not exempted.

use super::*;

/// Refusals of a queued route after which nothing was queued under the
/// request (SPEC §11), besides [`NOT_FORWARDED`].
pub const NOT_QUEUED: [&str; 4] = [
    "delivery_failed",
    "delivery_dropped",
    "dedup_key_missing",
    // A pass aborted by the drain timeout takes no place.
    "drain_aborted",
];

/// A queued route's answers after which the message may or may not be queued:
/// a state write that failed, and in a cluster a request relayed to the
/// lease's shard owner that did not answer (SPEC §10.2: the owner may have
/// accepted it).
pub const INDETERMINATE: [&str; 2] = ["state_unavailable", "upstream_timeout"];

/// Statuses after which fencegate tries a message again (SPEC §11).
pub fn retried(status: u16) -> bool {
    let final_4xx = (400..500).contains(&status) && ![408, 409, 425, 429].contains(&status);
    !(200..300).contains(&status) && !final_4xx
}

/// What the queued routes' part of a history held.
#[derive(Debug, Clone, Default)]
pub struct Figures {
    /// Messages answered `202` (whose state was kept), by final status.
    pub accepted: BTreeMap<String, usize>,
    /// Messages answered `202` by a copy whose state was thrown away.
    pub accepted_by_copy: usize,
    pub arrivals: usize,
    pub messages_at_destination: usize,
    /// Arrivals after the first, explained by the destination's retried
    /// answer, and by an unknown outcome.
    pub again_after_answer: usize,
    pub again_after_unknown: usize,
    /// `unknown_outcomes` summed over the messages.
    pub unknown_outcomes: u64,
    /// Q1: consecutive first arrivals compared; Q2: epoch changes along the
    /// arrivals (newer after older: the comparisons that could go wrong).
    pub ordered_firsts: usize,
    pub epoch_changes: usize,
    pub epochs_at_destination: usize,
    /// The history's segments (1 without a fork).
    pub segments: usize,
}

impl Clock {
    fn message(&self, route: &str, key: &str, m: Option<&Message>) -> String {
        match m {
            Some(m) => format!(
                "message {route}/{key}: seq {} epoch {} {} after {} attempts, {} unknown outcomes",
                m.seq, m.epoch, m.status, m.attempts, m.unknown_outcomes
            ),
            None => format!("message {route}/{key}: not in fencegate's queue at the end"),
        }
    }
}

/// The segment of the history that time `t` falls in: 0 before the first
/// fork, 2i+1 while fork i served, 2i+2 after it.
fn segment(forks: &[Fork], t: u64) -> usize {
    forks.iter().filter(|f| f.from <= t).count() + forks.iter().filter(|f| f.to <= t).count()
}

/// Checks Q1–Q4 into `r` (module doc).
pub(super) fn check(h: &History, clk: &Clock, r: &mut Report) {
    if h.queued.is_empty() {
        return;
    }
    let mut forks = h.forks.clone();
    forks.sort_by_key(|f| f.from);
    r.queued.segments = 2 * forks.len() + 1;
    let copies: BTreeSet<&str> = forks.iter().map(|f| f.addr.as_str()).collect();
    let mut v = |rule: &'static str, what: String, entries: Vec<String>| {
        r.violations.push(Violation {
            rule,
            what,
            entries,
        })
    };
    let fig = &mut r.queued;
    // The message as the state of segment `seg` held it.
    let message = |seg: usize, route: &str, key: &str| -> Option<&Message> {
        let id = (route.to_owned(), key.to_owned());
        (seg % 2 == 1)
            .then(|| forks[seg / 2].messages.get(&id))
            .flatten()
            .or_else(|| h.messages.get(&id))
    };
    let mut accepted: BTreeMap<(&str, &str), Vec<&Attempt>> = BTreeMap::new();
    for at in &h.attempts {
        if at.accepted.is_some() && h.queued.contains(&at.route) {
            accepted.entry((&at.route, &at.key)).or_default().push(at);
        }
    }
    let place = |seg: usize, route: &str, key: &str| -> Option<u64> {
        message(seg, route, key).map(|m| m.seq).or_else(|| {
            accepted
                .get(&(route, key))
                .and_then(|l| l.first())
                .and_then(|at| at.accepted.map(|a| a.seq))
        })
    };

    // The queued arrivals by (lease, segment), in arrival order.
    let mut runs: BTreeMap<(&str, usize), Vec<&Arrival>> = BTreeMap::new();
    for a in &h.arrivals {
        if !h.queued.contains(&a.route) {
            continue;
        }
        fig.arrivals += 1;
        let lease = h.routes.get(&a.route).map_or("?", String::as_str);
        runs.entry((lease, segment(&forks, a.arrive)))
            .or_default()
            .push(a);
    }
    let mut epochs = BTreeSet::new();
    let mut at_destination = BTreeSet::new();
    for ((lease, seg), list) in runs.iter_mut() {
        list.sort_by_key(|a| (a.arrive, a.seq));
        let seg = *seg;
        let in_fork = if seg % 2 == 1 {
            " (while a copy served)"
        } else {
            ""
        };

        // Q1: first arrivals in seq order.
        let mut seen = BTreeSet::new();
        let mut highest: Option<(u64, &Arrival)> = None;
        for a in list.iter() {
            let Some(key) = a.key.as_deref() else {
                continue; // Q4 reports it
            };
            at_destination.insert((a.route.as_str(), key));
            if !seen.insert((a.route.as_str(), key)) {
                continue;
            }
            let Some(seq) = place(seg, &a.route, key) else {
                v(
                    "Q1 acceptance order",
                    format!("lease {lease}: a message reached the destination that fencegate's queue does not hold and no 202 placed{in_fork}"),
                    vec![clk.arrival(a)],
                );
                continue;
            };
            if let Some((top, b)) = highest {
                fig.ordered_firsts += 1;
                if seq < top {
                    let bkey = b.key.as_deref().unwrap_or_default();
                    v(
                        "Q1 acceptance order",
                        format!("lease {lease}: message seq {seq} first arrived after message seq {top}{in_fork}"),
                        vec![
                            clk.arrival(a),
                            clk.message(&a.route, key, message(seg, &a.route, key)),
                            format!("earlier: {}", clk.arrival(b)),
                            clk.message(&b.route, bkey, message(seg, &b.route, bkey)),
                        ],
                    );
                }
            }
            if highest.is_none_or(|(top, _)| seq > top) {
                highest = Some((seq, a));
            }
        }

        // Q2: never older after newer (every arrival, resends included).
        let mut newest: Option<(u64, &Arrival)> = None;
        for a in list.iter() {
            let Some(e) = a.epoch else {
                continue; // R3 reports it
            };
            epochs.insert((*lease, e));
            match newest {
                Some((top, b)) if e < top => {
                    let key = a.key.as_deref().unwrap_or_default();
                    v(
                        "Q2 epoch order",
                        format!("lease {lease}: an epoch-{e} message arrived after an epoch-{top} message{in_fork}"),
                        vec![
                            clk.arrival(a),
                            clk.message(&a.route, key, message(seg, &a.route, key)),
                            format!("first newer: {}", clk.arrival(b)),
                        ],
                    );
                }
                Some((top, _)) if e > top => {
                    fig.epoch_changes += 1;
                    newest = Some((e, a));
                }
                None => newest = Some((e, a)),
                _ => {}
            }
        }

        // Q4: repeats only after an unknown outcome or a retried answer.
        let mut by_key: BTreeMap<&str, Vec<&Arrival>> = BTreeMap::new();
        for a in list.iter() {
            let wid = a.key.as_deref().map(|k| format!("{}:{k}", a.route));
            if a.key.is_none() || a.webhook_id != wid {
                v(
                    "Q4 duplicates",
                    format!(
                        "lease {lease}: an attempt without its dedup key or its webhook-id ({:?}, expected {wid:?})",
                        a.webhook_id
                    ),
                    vec![clk.arrival(a)],
                );
            }
            if let Some(k) = a.key.as_deref() {
                by_key.entry(k).or_default().push(a);
            }
        }
        for (key, arrivals) in by_key {
            let route = arrivals[0].route.as_str();
            let m = message(seg, route, key);
            let answered = arrivals
                .iter()
                .filter(|a| a.status.is_some_and(retried))
                .count();
            let unknown = m.map_or(0, |m| m.unknown_outcomes) as usize;
            let unexplained = arrivals.len() - answered;
            fig.again_after_answer += answered.min(arrivals.len() - 1);
            fig.again_after_unknown += unexplained.saturating_sub(1).min(unknown);
            if unexplained > 1 + unknown {
                let mut entries = vec![clk.message(route, key, m)];
                entries.extend(arrivals.iter().map(|a| clk.arrival(a)));
                v(
                    "Q4 duplicates",
                    format!(
                        "lease {lease}: message {route}/{key} arrived {} times, {answered} of them answered with a status fencegate retries, with {unknown} unknown outcomes{in_fork}",
                        arrivals.len()
                    ),
                    entries,
                );
            }
        }
    }
    fig.messages_at_destination = at_destination.len();
    fig.epochs_at_destination = epochs.len();
    for (lease, _) in &epochs {
        r.leases
            .entry(lease.to_string())
            .or_default()
            .epochs_at_destination += 1;
    }

    // Q3: every 202 arrives, unless failed or dropped; no accepted message lost.
    for ((route, key), ats) in &accepted {
        let kept: Vec<&&Attempt> = ats
            .iter()
            .filter(|at| at.addr.as_deref().is_none_or(|a| !copies.contains(a)))
            .collect();
        if kept.is_empty() {
            fig.accepted_by_copy += 1;
            continue;
        }
        let m = h.messages.get(&(route.to_string(), key.to_string()));
        *fig.accepted
            .entry(m.map_or("missing".into(), |m| m.status.clone()))
            .or_default() += 1;
        fig.unknown_outcomes += m.map_or(0, |m| m.unknown_outcomes);
        let entries = || {
            let mut e = vec![clk.message(route, key, m)];
            e.extend(kept.iter().map(|at| clk.attempt(at)));
            e
        };
        let Some(m) = m else {
            v(
                "Q3 delivery",
                format!("message {route}/{key} was answered 202, and fencegate's queue does not hold it at the end"),
                entries(),
            );
            continue;
        };
        if let Some(at) = kept.iter().find(|at| {
            at.accepted
                .is_some_and(|a| a.seq != m.seq || a.epoch != m.epoch)
        }) {
            let a = at.accepted.unwrap_or(Accepted { seq: 0, epoch: 0 });
            v(
                "Q3 delivery",
                format!(
                    "message {route}/{key} was answered 202 at seq {} epoch {}, and is held at seq {} epoch {}: the acceptance was lost and the key accepted again",
                    a.seq, a.epoch, m.seq, m.epoch
                ),
                entries(),
            );
        }
        if m.status == "failed" || m.status == "dropped" {
            continue;
        }
        if !at_destination.contains(&(*route, *key)) {
            v(
                "Q3 delivery",
                format!("message {route}/{key} was answered 202 and never reached the destination ({} at the end)", m.status),
                entries(),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn accept(req: &str, key: &str, epoch: u64, seq: u64, at: u64) -> Attempt {
        Attempt {
            worker: 1,
            req: req.into(),
            kind: "op".into(),
            route: "q".into(),
            epoch,
            token: format!("tok{epoch}"),
            key: key.into(),
            invoke: at * MS,
            complete: (at + 1) * MS,
            outcome: Outcome::Response {
                status: 202,
                error: None,
                replayed: false,
                body: String::new(),
            },
            addr: Some("fg".into()),
            accepted: Some(Accepted { seq, epoch }),
        }
    }

    fn arrival(n: u64, req: &str, key: &str, epoch: u64, at: u64, status: u16) -> Arrival {
        Arrival {
            seq: n,
            route: "q".into(),
            req: Some(req.into()),
            epoch: Some(epoch),
            key: Some(key.into()),
            arrive: at * MS,
            complete: Some((at + 1) * MS),
            wrote_after: None,
            status: Some(status),
            body: Some(format!("answer {n}")),
            webhook_id: Some(format!("q:{key}")),
        }
    }

    fn message(seq: u64, epoch: u64, status: &str, unknown: u64) -> Message {
        Message {
            seq,
            epoch,
            status: status.into(),
            attempts: 1,
            unknown_outcomes: unknown,
        }
    }

    /// Epoch 1 queues m1, m2; epoch 2 queues m3. m1 was answered 409 once
    /// (retried), m2 timed out once (unknown), m3 was refused for good (422:
    /// failed) — and every rule holds.
    fn good() -> History {
        let mut h = History::default();
        h.routes.insert("q".into(), "lq".into());
        h.queued.insert("q".into());
        for e in [1, 2] {
            h.epochs.insert(
                ("lq".into(), e),
                StoredEpoch::Acquire {
                    token_sha256: sha256_hex(&format!("tok{e}")),
                },
            );
        }
        h.attempts = vec![
            accept("a1", "m1", 1, 0, 0),
            accept("a2", "m2", 1, 1, 2),
            accept("b1", "m3", 2, 2, 4),
        ];
        h.arrivals = vec![
            arrival(1, "a1", "m1", 1, 10, 409),
            arrival(2, "a1", "m1", 1, 20, 200),
            arrival(3, "a2", "m2", 1, 30, 200),
            arrival(4, "a2", "m2", 1, 40, 200),
            arrival(5, "b1", "m3", 2, 50, 422),
        ];
        for (key, m) in [
            ("m1", message(0, 1, "delivered", 0)),
            ("m2", message(1, 1, "delivered", 1)),
            ("m3", message(2, 2, "failed", 0)),
        ] {
            h.messages.insert(("q".into(), key.into()), m);
        }
        h
    }

    fn rules(r: &Report) -> Vec<&'static str> {
        r.violations.iter().map(|v| v.rule).collect()
    }

    #[test]
    fn a_correct_queued_history_passes() {
        let r = check_all(&good());
        assert!(r.violations.is_empty(), "{:#?}", r.violations);
        assert_eq!(r.queued.ordered_firsts, 2);
        assert_eq!(r.queued.epoch_changes, 1);
        assert_eq!(r.queued.again_after_answer, 1);
        assert_eq!(r.queued.again_after_unknown, 1);
        assert_eq!(r.queued.accepted["delivered"], 2);
        assert_eq!(r.queued.accepted["failed"], 1);
        // R2 and R6 are not applied: m2's second arrival is still at the
        // destination when m3 (epoch 2) arrives, and epoch 1 expired long
        // before its messages were delivered.
        let mut h = good();
        h.arrivals[3].complete = Some(60 * MS);
        for a in &mut h.arrivals {
            a.arrive += 2000 * MS;
            a.complete = a.complete.map(|c| c + 2000 * MS);
        }
        h.expiry_ns.insert(("lq".into(), 1), 0);
        let r = check_all(&h);
        assert!(r.violations.is_empty(), "{:#?}", r.violations);
        assert_eq!(r.ordered_pairs, 0, "no R1/R2 comparison on a queued route");
    }

    fn check_all(h: &History) -> Report {
        super::super::check(h)
    }

    #[test]
    fn q1_a_newer_message_first() {
        let mut h = good();
        // m2 (seq 1) first arrives before m1 (seq 0): same epoch, only Q1.
        h.arrivals[2].arrive = 5 * MS;
        h.arrivals[3].arrive = 6 * MS;
        let r = check_all(&h);
        assert_eq!(
            rules(&r),
            vec!["Q1 acceptance order"],
            "{:#?}",
            r.violations
        );
        assert!(r.violations[0]
            .what
            .contains("seq 0 first arrived after message seq 1"));
        // A message nobody placed.
        let mut h = good();
        h.arrivals.push(arrival(6, "a9", "m9", 2, 60, 200));
        assert!(rules(&check_all(&h)).contains(&"Q1 acceptance order"));
    }

    #[test]
    fn q2_an_older_epoch_resent_after_a_newer_one() {
        let mut h = good();
        // m2 sent again after m3: not a first arrival (Q1 holds), but older
        // after newer; and unexplained (Q4).
        h.arrivals.push(arrival(6, "a2", "m2", 1, 60, 200));
        let r = check_all(&h);
        assert_eq!(
            rules(&r),
            vec!["Q2 epoch order", "Q4 duplicates"],
            "{:#?}",
            r.violations
        );
        // Counted as unknown, it is still too late.
        h.messages
            .get_mut(&("q".into(), "m2".into()))
            .unwrap()
            .unknown_outcomes = 2;
        assert_eq!(rules(&check_all(&h)), vec!["Q2 epoch order"]);
    }

    #[test]
    fn q3_an_accepted_message_that_never_arrived_or_was_lost() {
        let mut h = good();
        h.arrivals.retain(|a| a.key.as_deref() != Some("m2"));
        let r = check_all(&h);
        assert_eq!(rules(&r), vec!["Q3 delivery"], "{:#?}", r.violations);
        assert!(r.violations[0].what.contains("never reached"));
        // A failed message need not arrive; a dropped one neither.
        let mut h = good();
        h.arrivals.retain(|a| a.key.as_deref() != Some("m3"));
        assert!(check_all(&h).violations.is_empty());
        // Gone from the queue, or at another place than its 202 said.
        let mut h = good();
        h.messages.remove(&("q".into(), "m2".into()));
        assert!(rules(&check_all(&h)).contains(&"Q3 delivery"));
        let mut h = good();
        h.attempts[1].accepted = Some(Accepted { seq: 7, epoch: 1 });
        let r = check_all(&h);
        assert_eq!(rules(&r), vec!["Q3 delivery"], "{:#?}", r.violations);
        assert!(r.violations[0].what.contains("accepted again"));
    }

    #[test]
    fn a_relayed_acceptance_whose_owner_did_not_answer_may_be_queued() {
        // In a cluster (SPEC §10.2) the instance that relayed m2's request
        // answered 504 upstream_timeout: the owner queued it anyway, and the
        // worker's retry was answered 202. m2 arrives under the first request.
        let mut h = good();
        let mut first = accept("a2", "m2", 1, 1, 2);
        first.accepted = None;
        first.outcome = Outcome::Response {
            status: 504,
            error: Some("upstream_timeout".into()),
            replayed: false,
            body: String::new(),
        };
        h.attempts[1] = first;
        let mut retry = accept("a2r", "m2", 1, 1, 3);
        retry.kind = "retry".into();
        h.attempts.push(retry);
        let r = check_all(&h);
        assert!(r.violations.is_empty(), "{:#?}", r.violations);
        // Refused as not sent to the owner (503 shard_unavailable), it must
        // not arrive.
        let Outcome::Response { error, status, .. } = &mut h.attempts[1].outcome else {
            unreachable!()
        };
        (*status, *error) = (503, Some("shard_unavailable".into()));
        assert_eq!(rules(&check_all(&h)), vec!["R5 outcome"]);
    }

    #[test]
    fn q4_a_repeat_without_an_unknown_outcome() {
        let mut h = good();
        h.messages
            .get_mut(&("q".into(), "m2".into()))
            .unwrap()
            .unknown_outcomes = 0;
        let r = check_all(&h);
        assert_eq!(rules(&r), vec!["Q4 duplicates"], "{:#?}", r.violations);
        assert!(r.violations[0].what.contains("arrived 2 times"));
        // Another webhook-id on a resend.
        let mut h = good();
        h.arrivals[3].webhook_id = Some("q:other".into());
        assert_eq!(rules(&check_all(&h)), vec!["Q4 duplicates"]);
    }

    #[test]
    fn a_fork_is_judged_in_segments() {
        // A copy with m1..m3 in its state took over at 25 ms, delivered m2 and
        // m3 and accepted m4, was killed; from 45 ms the original, with its own
        // state (no m4), delivered m2 and m3 again, in its order.
        let mut h = good();
        h.arrivals = vec![
            arrival(1, "a1", "m1", 1, 10, 409),
            arrival(2, "a1", "m1", 1, 20, 200),
            arrival(3, "a2", "m2", 1, 30, 200),
            arrival(4, "b1", "m3", 2, 32, 200),
            arrival(5, "b2", "m4", 2, 34, 200),
            arrival(6, "a2", "m2", 1, 50, 200),
            arrival(7, "b1", "m3", 2, 52, 422),
        ];
        let mut copy = accept("b2", "m4", 2, 3, 33);
        copy.addr = Some("copy".into());
        h.attempts.push(copy);
        let mut fork = Fork {
            from: 25 * MS,
            to: 45 * MS,
            addr: "copy".into(),
            messages: BTreeMap::new(),
        };
        for (key, m) in [
            ("m2", message(1, 1, "delivered", 0)),
            ("m3", message(2, 2, "delivered", 0)),
            ("m4", message(3, 2, "delivered", 0)),
        ] {
            fork.messages.insert(("q".into(), key.into()), m);
        }
        h.messages
            .get_mut(&("q".into(), "m2".into()))
            .unwrap()
            .unknown_outcomes = 0;
        let unforked = check_all(&h);
        assert!(
            rules(&unforked).contains(&"Q2 epoch order")
                && rules(&unforked).contains(&"Q4 duplicates"),
            "{:#?}",
            unforked.violations
        );
        h.forks.push(fork);
        let r = check_all(&h);
        assert!(r.violations.is_empty(), "{:#?}", r.violations);
        assert_eq!(r.queued.accepted_by_copy, 1);
        assert_eq!(r.queued.segments, 3);
        // The original sending beside the copy: m1 again, in the copy's segment.
        h.arrivals.push(arrival(8, "a1", "m1", 1, 36, 200));
        let r = check_all(&h);
        assert_eq!(
            rules(&r),
            vec!["Q1 acceptance order", "Q2 epoch order"],
            "{:#?}",
            r.violations
        );
    }
}
