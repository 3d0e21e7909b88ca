//! The history checker of the fault campaign: given what the destination recorded,
//! what every worker saw, the epoch objects in the store and the routes' drain
//! timeouts, it verifies per lease the properties fencegate promises (SPEC §1, §4–§6).
//!
//! # Rules
//!
//! - **R1 epoch order** — arrivals at the destination never go back in epoch: no
//!   request of epoch e arrives after a request of a newer epoch e' > e arrived.
//! - **R2 drain** — for epochs e < e', every e request finished at the destination
//!   (the origin wrote its answer) before the first e' request arrived. R1 is the
//!   special case where the e request had not even arrived yet; both are reported
//!   from the same comparison of an e request `a` with `b`, the earliest first
//!   arrival of any epoch above e (if `a` was complete before `b` arrived, it was
//!   before every later newer arrival too).
//!
//!   **The one exemption is the one SPEC §5 allows: the drain that `b` waited for
//!   timed out.** The history does not say which drain that was, but a correct
//!   fencegate bounds its timing, so the checker verifies the bound instead: the
//!   pair is exempt only if `b.arrive >= a.invoke + D`, where `a.invoke` is when
//!   `a`'s worker attempt was invoked and `D` is the smallest `drain_timeout_ms`
//!   among the routes of the lease ([`History::drain_timeout_ns`]). Why that bound
//!   holds whenever the drain timed out: `a` was admitted after it was invoked, and
//!   any raise above e that `b` went through started at some R after that
//!   admission (a raise started earlier would have refused `a`); while `a` is in
//!   flight that raise forwards nothing before R + its route's drain timeout ≥
//!   a.invoke + D. A request whose outcome is unknown (route timeout, reset,
//!   abandoned, aborted) still counts as in flight, so it cannot end the drain
//!   early. After a crash or restart at S > a.invoke, nothing above the epoch
//!   whose drain completed is forwarded before S + the lease's longest drain
//!   timeout, and a raise waits that long too. So an older request still at the
//!   destination (or only arriving there: the bytes of an aborted forward may be
//!   read late by a stopped origin) when `b` arrived sooner than `a.invoke + D` is a
//!   violation, whatever `a`'s worker was answered: 504 `drain_aborted` or
//!   `upstream_timeout`, a connection reset by a fencegate crash, or its own
//!   client timeout exempt nothing by themselves (they did, before: that hid a
//!   restart forgetting its drain, a route timeout releasing a drain while the
//!   destination still executed the request, and an aborted forward still writing
//!   to the origin). A pair whose `a` has no known attempt (also an R3 violation)
//!   or whose lease has no known drain timeout gets no exemption. Exempt pairs are
//!   counted under one reason, "drain timeout elapsed".
//!
//!   Nor does a request that fencegate was still *writing* to the destination
//!   after `b` arrived ([`Arrival::wrote_after`] later than `b.arrive`: a large
//!   upload's last bytes, which the destination read whole): SPEC §5 has an
//!   aborted request's upstream write stop at once, before the raise forwards
//!   anything newer, so a request still being written then was not aborted by
//!   the drain `b` waited for — whatever the timing bound says. Across a
//!   cluster takeover (SPEC §10.2) the bound always holds (the successor waits
//!   out the gate lease and then settles a drain timeout), and this is what
//!   tells an old owner that aborted its shard's requests at `gate_ttl` from one
//!   that let an upload stream on after the successor forwarded a newer epoch.
//! - **R3 token** — every request that reached the destination was sent by a known
//!   worker attempt on the same route, with the epoch fencegate forwarded, and that
//!   epoch's object in the store is an acquire whose `token_sha256` is the SHA-256
//!   of the token the worker sent.
//! - **R4 dedup** — each (route, Idempotency-Key) reached the destination at most
//!   once (the campaign's routes use the default `in_doubt = "reject"` and the
//!   origin never answers a retryable status, so no key is ever legitimately
//!   forwarded twice), and every replay (`X-Fencegate-Replayed: true`) has the
//!   status and byte-identical body of the origin's answer to the key's first
//!   arrival.
//! - **R5 outcome** — an answer that is the origin's (no `X-Fencegate-Error`, not
//!   replayed) belongs to a request that is at the destination, with that status
//!   and body; a replay, or a refusal whose code means "not forwarded", belongs to
//!   a request that is not. 504 `upstream_timeout`/`drain_aborted`, connection
//!   errors and client timeouts are indeterminate. An unknown fencegate code is a
//!   violation (the checker must be able to classify every answer).
//! - **R6 expiry** — no request reaches a running destination more than
//!   [`EXPIRY_SLACK_NS`] after its epoch's expiry on the store's clock
//!   (`LastModified + ttl_ms`, the very bound fencegate admits against; SPEC §4).
//!   A raise that waited in a drain past its expiry must be decided again and
//!   refused, not forwarded. Exempt: an arrival whose `[expiry, arrival]` overlaps
//!   a pause of the origin (a stopped origin reads a request late). The slack
//!   covers a request admitted just before the expiry and forwarded after it.
//!
//! The checker is pure: the campaign builds a [`History`] from the logs, and the
//! unit tests at the bottom build small ones by hand, one per rule broken.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;

use sha2::{Digest, Sha256};

pub mod queued;

/// Fencegate codes that mean the request was not forwarded (SPEC §6, §7).
pub const NOT_FORWARDED: [&str; 21] = [
    "route_not_found",
    "epoch_missing",
    "epoch_malformed",
    "dedup_key_malformed",
    "body_too_large",
    "body_malformed",
    "body_timeout",
    "token_missing",
    "token_invalid",
    "epoch_unknown",
    "epoch_invalid",
    "epoch_stale",
    "lease_expired",
    "store_unavailable",
    "dedup_in_flight",
    "dedup_in_doubt",
    "dedup_key_reused",
    "dedup_done",
    "upstream_unreachable",
    "upgrade_unsupported",
    "shard_unavailable",
];

/// Fencegate codes after which the request may or may not be at the destination.
pub const INDETERMINATE: [&str; 2] = ["upstream_timeout", "drain_aborted"];

/// The reason R1/R2 report for an exempt pair (module doc).
pub const EXEMPT_DRAIN_TIMEOUT: &str = "drain timeout elapsed";

/// What one worker attempt came to, as the worker saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Response {
        status: u16,
        /// `X-Fencegate-Error`, when fencegate answered itself.
        error: Option<String>,
        replayed: bool,
        body: String,
    },
    ConnError(String),
    /// The worker's own client timeout.
    Timeout,
}

/// One request a worker sent (a retry or a duplicate is its own attempt).
#[derive(Debug, Clone)]
pub struct Attempt {
    pub worker: u32,
    /// Unique per attempt; sent as `X-Campaign-Req` and recorded by the origin.
    pub req: String,
    /// op, retry, dup, forged, future.
    pub kind: String,
    pub route: String,
    pub epoch: u64,
    pub token: String,
    pub key: String,
    /// CLOCK_MONOTONIC ns.
    pub invoke: u64,
    pub complete: u64,
    pub outcome: Outcome,
    /// The fencegate it was sent to (`host:port`), when known.
    pub addr: Option<String>,
    /// A queued route's acceptance (`202`, `X-Fencegate-Delivery: queued`):
    /// the message's place and epoch as the answer's body gave them.
    pub accepted: Option<Accepted>,
}

/// What a `202` of a queued route said (SPEC §11).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accepted {
    pub seq: u64,
    pub epoch: u64,
}

/// One request as the destination recorded it.
#[derive(Debug, Clone)]
pub struct Arrival {
    pub seq: u64,
    pub route: String,
    pub req: Option<String>,
    pub epoch: Option<u64>,
    pub key: Option<String>,
    pub arrive: u64,
    /// When the origin wrote its answer; `None` if it never did.
    pub complete: Option<u64>,
    /// A time at which fencegate was verifiably still writing this request to
    /// the destination (a held upload read whole: scripts/campaign/origin.py).
    pub wrote_after: Option<u64>,
    pub status: Option<u16>,
    pub body: Option<String>,
    /// The `webhook-id` header (a signing route's).
    pub webhook_id: Option<String>,
}

/// An epoch object as read from the store at the end of the campaign.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoredEpoch {
    Acquire { token_sha256: String },
    Release,
    Invalid(String),
}

#[derive(Debug, Clone, Default)]
pub struct History {
    /// route → lease.
    pub routes: BTreeMap<String, String>,
    pub attempts: Vec<Attempt>,
    pub arrivals: Vec<Arrival>,
    /// (lease, epoch) → object.
    pub epochs: BTreeMap<(String, u64), StoredEpoch>,
    /// route → its `drain_timeout_ms`, in ns (the R1/R2 exemption bound).
    pub drain_timeout_ns: BTreeMap<String, u64>,
    /// (lease, epoch) → the acquire's expiry on the store's clock, in mono ns (R6).
    pub expiry_ns: BTreeMap<(String, u64), u64>,
    /// `[stop, cont]` of each pause of the origin, in mono ns (`cont` 0: never resumed).
    pub origin_pauses: Vec<(u64, u64)>,
    /// The routes with `delivery = "queued"` (all of them signing): judged by
    /// Q1–Q4 instead of R1, R2, R4 and R6 ([`queued`]).
    pub queued: BTreeSet<String>,
    /// (route, key) → the queued message as fencegate's admin API showed it
    /// at the end, after the queue drained.
    pub messages: BTreeMap<(String, String), Message>,
    /// The stretches in which a copy of the instance with a copy of its state
    /// served (the clone step's takeover): see [`queued`].
    pub forks: Vec<Fork>,
}

/// A queued message as `GET /v1/deliveries/{route}/{key}` showed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub seq: u64,
    pub epoch: u64,
    /// pending, delivering, delivered, failed or dropped.
    pub status: String,
    pub attempts: u64,
    pub unknown_outcomes: u64,
}

/// A copy of the instance that took over with a copy of its `data_dir`
/// (legitimately: the original was frozen past its gate lease), served from
/// `from` to `to` (mono ns; `to` includes a slack for its last attempt), and
/// was then killed while the original went on with its own state.
#[derive(Debug, Clone, Default)]
pub struct Fork {
    pub from: u64,
    pub to: u64,
    /// The copy's proxy address: its acceptances were kept in the copy's state.
    pub addr: String,
    /// The copy's messages just before it was killed (those that reached the
    /// destination meanwhile).
    pub messages: BTreeMap<(String, String), Message>,
}

/// R6: how long after its epoch's expiry a forwarded request may still reach a
/// running destination (admitted just before the expiry, then forwarded).
pub const EXPIRY_SLACK_NS: u64 = 500_000_000;

#[derive(Debug, Clone)]
pub struct Violation {
    pub rule: &'static str,
    pub what: String,
    pub entries: Vec<String>,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "[{}] {}", self.rule, self.what)?;
        for e in &self.entries {
            writeln!(f, "    {e}")?;
        }
        Ok(())
    }
}

/// Per-lease figures.
#[derive(Debug, Clone, Default)]
pub struct LeaseFigures {
    pub epochs_in_store: usize,
    pub epochs_at_destination: usize,
    pub arrivals: usize,
    pub attempts: usize,
}

#[derive(Debug, Clone, Default)]
pub struct Report {
    pub violations: Vec<Violation>,
    pub leases: BTreeMap<String, LeaseFigures>,
    /// Attempts by outcome ("200 origin", "409 epoch_stale", "replayed 200", ...).
    pub outcomes: BTreeMap<String, usize>,
    pub kinds: BTreeMap<String, usize>,
    /// R1/R2 comparisons that an exemption settled, by reason.
    pub exempt: BTreeMap<&'static str, usize>,
    /// R1/R2 comparisons made (arrivals with a newer epoch after them).
    pub ordered_pairs: usize,
    pub replays_checked: usize,
    pub keys_at_destination: usize,
    /// The queued routes' figures ([`queued`]).
    pub queued: queued::Figures,
    /// The CLOCK_MONOTONIC ns that the violations' `+s` times count from.
    pub start: u64,
}

fn sha256_hex(s: &str) -> String {
    hex::encode(Sha256::digest(s.as_bytes()))
}

/// Formats times relative to the start of the history, in seconds.
struct Clock(u64);

impl Clock {
    fn t(&self, ns: u64) -> String {
        format!("{:+.3}s", (ns as f64 - self.0 as f64) / 1e9)
    }

    fn arrival(&self, a: &Arrival) -> String {
        format!(
            "arrival #{} route {} epoch {:?} key {:?} req {:?} arrived {} completed {} status {:?} body {:?}",
            a.seq,
            a.route,
            a.epoch,
            a.key,
            a.req,
            self.t(a.arrive),
            a.complete.map_or("never".into(), |c| self.t(c)),
            a.status,
            a.body
        )
    }

    fn attempt(&self, a: &Attempt) -> String {
        format!(
            "attempt {} ({}) worker {} route {} epoch {} key {} invoked {} completed {} -> {:?}",
            a.req,
            a.kind,
            a.worker,
            a.route,
            a.epoch,
            a.key,
            self.t(a.invoke),
            self.t(a.complete),
            a.outcome
        )
    }
}

fn outcome_label(o: &Outcome) -> String {
    match o {
        Outcome::Response {
            status,
            replayed: true,
            ..
        } => format!("replayed {status}"),
        Outcome::Response {
            status,
            error: Some(code),
            ..
        } => format!("{status} {code}"),
        Outcome::Response { status, .. } => format!("{status} origin"),
        Outcome::ConnError(_) => "connection error".into(),
        Outcome::Timeout => "client timeout".into(),
    }
}

/// Checks every rule; see the module documentation.
pub fn check(h: &History) -> Report {
    let start = h
        .attempts
        .iter()
        .map(|a| a.invoke)
        .chain(h.arrivals.iter().map(|a| a.arrive))
        .min()
        .unwrap_or(0);
    let clk = Clock(start);
    let mut r = Report {
        start,
        ..Report::default()
    };
    let mut v = |rule: &'static str, what: String, entries: Vec<String>| {
        r.violations.push(Violation {
            rule,
            what,
            entries,
        })
    };

    let mut by_req: HashMap<&str, &Attempt> = HashMap::new();
    for a in &h.attempts {
        if let Some(prev) = by_req.insert(&a.req, a) {
            v(
                "history",
                format!("two attempts share the request id {}", a.req),
                vec![clk.attempt(prev), clk.attempt(a)],
            );
        }
    }
    let mut arrivals_by_req: HashMap<&str, Vec<&Arrival>> = HashMap::new();
    for a in &h.arrivals {
        if let Some(req) = &a.req {
            arrivals_by_req.entry(req).or_default().push(a);
        }
    }
    let attempt_of = |a: &Arrival| a.req.as_deref().and_then(|r| by_req.get(r).copied());

    // R3: every arrival was admitted with the token that won its epoch.
    for a in &h.arrivals {
        let Some(at) = attempt_of(a) else {
            v(
                "R3 token",
                "a request reached the destination that no worker attempt sent".into(),
                vec![clk.arrival(a)],
            );
            continue;
        };
        let entries = || vec![clk.arrival(a), clk.attempt(at)];
        if at.route != a.route || a.epoch != Some(at.epoch) {
            v(
                "R3 token",
                "the destination saw another route or epoch than the worker sent".into(),
                entries(),
            );
            continue;
        }
        let Some(lease) = h.routes.get(&a.route) else {
            v("R3 token", "arrival on an unknown route".into(), entries());
            continue;
        };
        match h.epochs.get(&(lease.clone(), at.epoch)) {
            Some(StoredEpoch::Acquire { token_sha256 })
                if *token_sha256 == sha256_hex(&at.token) => {}
            Some(StoredEpoch::Acquire { .. }) => v(
                "R3 token",
                format!(
                    "admitted with a token that did not win epoch {} of lease {lease}",
                    at.epoch
                ),
                entries(),
            ),
            other => v(
                "R3 token",
                format!(
                    "admitted at epoch {} of lease {lease}, whose object is {other:?}",
                    at.epoch
                ),
                entries(),
            ),
        }
    }

    // R1 + R2, per lease.
    let mut per_lease: BTreeMap<&str, Vec<&Arrival>> = BTreeMap::new();
    let direct = |a: &&Arrival| !h.queued.contains(&a.route);
    for a in h.arrivals.iter().filter(direct) {
        if let (Some(lease), Some(_)) = (h.routes.get(&a.route), a.epoch) {
            per_lease.entry(lease).or_default().push(a);
        }
    }
    // The smallest drain timeout among each lease's routes.
    let mut drain_timeout: BTreeMap<&str, u64> = BTreeMap::new();
    for (route, d) in &h.drain_timeout_ns {
        if let Some(lease) = h.routes.get(route) {
            let e = drain_timeout.entry(lease.as_str()).or_insert(*d);
            *e = (*e).min(*d);
        }
    }
    for (lease, arrivals) in &per_lease {
        // The first arrival of each epoch, then for each epoch the first arrival of
        // any newer epoch.
        let mut first: BTreeMap<u64, &Arrival> = BTreeMap::new();
        for a in arrivals {
            let e = a.epoch.unwrap_or(0);
            if first.get(&e).is_none_or(|f| a.arrive < f.arrive) {
                first.insert(e, a);
            }
        }
        let mut newer_first: BTreeMap<u64, &Arrival> = BTreeMap::new();
        let mut running: Option<&Arrival> = None;
        for (e, f) in first.iter().rev() {
            if let Some(n) = running {
                newer_first.insert(*e, n);
            }
            if running.is_none_or(|n| f.arrive < n.arrive) {
                running = Some(f);
            }
        }
        for a in arrivals {
            let Some(b) = newer_first.get(&a.epoch.unwrap_or(0)) else {
                continue;
            };
            r.ordered_pairs += 1;
            if a.complete.is_some_and(|c| c < b.arrive) {
                continue;
            }
            let at = attempt_of(a);
            // Still being written after b arrived: not aborted by b's drain.
            let written_on = a.wrote_after.filter(|&w| w > b.arrive);
            // SPEC §5's one exemption, checked by its timing bound (module doc).
            let drain_elapsed = written_on.is_none()
                && at.is_some_and(|at| {
                    drain_timeout
                        .get(lease)
                        .is_some_and(|d| b.arrive >= at.invoke.saturating_add(*d))
                });
            if drain_elapsed {
                *r.exempt.entry(EXEMPT_DRAIN_TIMEOUT).or_default() += 1;
                continue;
            }
            let mut entries = vec![clk.arrival(a)];
            entries.extend(at.map(|at| clk.attempt(at)));
            entries.push(format!("first newer: {}", clk.arrival(b)));
            entries.extend(attempt_of(b).map(|bt| clk.attempt(bt)));
            entries.push(match (at, drain_timeout.get(lease)) {
                _ if written_on.is_some() => format!(
                    "not exempt: fencegate was still writing this request to the destination {} ({:.3}s after the newer request arrived): no drain aborted it",
                    clk.t(written_on.unwrap_or_default()),
                    (written_on.unwrap_or_default() as f64 - b.arrive as f64) / 1e9
                ),
                (Some(at), Some(d)) => format!(
                    "not exempt: the newer request arrived {:.3}s after this attempt was invoked, within the lease's smallest drain timeout ({:.3}s)",
                    (b.arrive as f64 - at.invoke as f64) / 1e9,
                    *d as f64 / 1e9
                ),
                (None, _) => "not exempt: no worker attempt sent this request".into(),
                (_, None) => format!("not exempt: no drain timeout is known for lease {lease}"),
            });
            if a.arrive > b.arrive {
                v(
                    "R1 epoch order",
                    format!(
                        "lease {lease}: an epoch-{} request arrived after an epoch-{} request",
                        a.epoch.unwrap_or(0),
                        b.epoch.unwrap_or(0)
                    ),
                    entries,
                );
            } else {
                v(
                    "R2 drain",
                    format!(
                        "lease {lease}: an epoch-{} request was still at the destination when the first epoch-{} request arrived",
                        a.epoch.unwrap_or(0),
                        b.epoch.unwrap_or(0)
                    ),
                    entries,
                );
            }
        }
    }

    // R6: nothing arrives well after its epoch's expiry (origin running).
    for a in h.arrivals.iter().filter(direct) {
        let (Some(lease), Some(e)) = (h.routes.get(&a.route), a.epoch) else {
            continue;
        };
        let Some(&x) = h.expiry_ns.get(&(lease.clone(), e)) else {
            continue;
        };
        let paused = h
            .origin_pauses
            .iter()
            .any(|&(stop, cont)| stop <= a.arrive && (cont == 0 || cont >= x));
        if a.arrive > x + EXPIRY_SLACK_NS && !paused {
            let mut entries = vec![clk.arrival(a)];
            entries.extend(attempt_of(a).map(|at| clk.attempt(at)));
            v(
                "R6 expiry",
                format!(
                    "lease {lease}: an epoch-{e} request arrived {:.3}s after the epoch expired",
                    (a.arrive - x) as f64 / 1e9
                ),
                entries,
            );
        }
    }

    // R4: at most once per key, and replays are the first answer.
    let mut by_key: BTreeMap<(&str, &str), Vec<&Arrival>> = BTreeMap::new();
    for a in h.arrivals.iter().filter(direct) {
        match &a.key {
            Some(k) => by_key.entry((&a.route, k)).or_default().push(a),
            None => v(
                "R4 dedup",
                "forwarded without a dedup key".into(),
                vec![clk.arrival(a)],
            ),
        }
    }
    r.keys_at_destination = by_key.len();
    for ((route, key), list) in by_key.iter_mut() {
        list.sort_by_key(|a| a.arrive);
        if list.len() > 1 {
            let mut entries = Vec::new();
            for a in list.iter() {
                entries.push(clk.arrival(a));
                entries.extend(attempt_of(a).map(|at| clk.attempt(at)));
            }
            v(
                "R4 dedup",
                format!(
                    "key {key} on route {route} reached the destination {} times",
                    list.len()
                ),
                entries,
            );
        }
    }
    for at in &h.attempts {
        let Outcome::Response {
            status,
            replayed: true,
            body,
            ..
        } = &at.outcome
        else {
            continue;
        };
        r.replays_checked += 1;
        if h.queued.contains(&at.route) {
            // SPEC §11: a delivered message's stored answer is the one the
            // destination gave the attempt that delivered it.
            let answered = h.arrivals.iter().any(|a| {
                a.route == at.route
                    && a.key.as_deref() == Some(at.key.as_str())
                    && a.status == Some(*status)
                    && a.body.as_deref() == Some(body)
            });
            if !answered {
                v(
                    "R5 outcome",
                    format!(
                        "a replay of queued message {} is no answer the destination gave it",
                        at.key
                    ),
                    vec![clk.attempt(at)],
                );
            }
            continue;
        }
        let first = by_key
            .get(&(at.route.as_str(), at.key.as_str()))
            .and_then(|l| l.first());
        match first {
            None => v(
                "R4 dedup",
                "a replay of a key that never reached the destination".into(),
                vec![clk.attempt(at)],
            ),
            Some(f) if f.status != Some(*status) || f.body.as_deref() != Some(body) => v(
                "R4 dedup",
                "a replay differs from the origin's first answer for its key".into(),
                vec![clk.attempt(at), clk.arrival(f)],
            ),
            Some(_) => {}
        }
    }

    // R5: outcomes against the destination.
    for at in &h.attempts {
        let label = match at.accepted {
            Some(_) => "202 queued".to_owned(),
            None => outcome_label(&at.outcome),
        };
        *r.outcomes.entry(label).or_default() += 1;
        *r.kinds.entry(at.kind.clone()).or_default() += 1;
        let arrived = arrivals_by_req
            .get(at.req.as_str())
            .map(Vec::as_slice)
            .unwrap_or_default();
        let entries = || {
            let mut e = vec![clk.attempt(at)];
            e.extend(arrived.iter().map(|a| clk.arrival(a)));
            e
        };
        let queued = h.queued.contains(&at.route);
        match &at.outcome {
            // A queued route's answer without an error is its acceptance
            // (SPEC §11): it says nothing of the destination yet (Q3 does).
            Outcome::Response {
                status: 202,
                error: None,
                replayed: false,
                ..
            } if queued && at.accepted.is_some() => {}
            Outcome::Response {
                status,
                error: None,
                replayed: false,
                ..
            } if queued => v(
                "R5 outcome",
                format!("a queued route answered {status} without an error, and not as an acceptance (202, X-Fencegate-Delivery: queued, seq)"),
                entries(),
            ),
            Outcome::Response {
                error: Some(code), ..
            } if queued => {
                // Refused at acceptance, nothing queued under this request.
                if queued::NOT_QUEUED.contains(&code.as_str())
                    || NOT_FORWARDED.contains(&code.as_str())
                {
                    if !arrived.is_empty() {
                        v(
                            "R5 outcome",
                            format!("refused with {code} (nothing queued), but it reached the destination"),
                            entries(),
                        );
                    }
                } else if !queued::INDETERMINATE.contains(&code.as_str()) {
                    v(
                        "R5 outcome",
                        format!(
                            "an error code the checker cannot classify on a queued route: {code}"
                        ),
                        entries(),
                    );
                }
            }
            Outcome::Response {
                status,
                error: None,
                replayed: false,
                body,
            } => match arrived {
                [] => v(
                    "R5 outcome",
                    format!(
                        "answered {status} by the origin, but it never reached the destination"
                    ),
                    entries(),
                ),
                [a] if a.status != Some(*status) || a.body.as_deref() != Some(body) => v(
                    "R5 outcome",
                    "the answer differs from what the origin sent".into(),
                    entries(),
                ),
                _ => {}
            },
            Outcome::Response { replayed: true, .. } if !arrived.is_empty() => v(
                "R5 outcome",
                "answered with a replay, but the request reached the destination".into(),
                entries(),
            ),
            Outcome::Response {
                error: Some(code), ..
            } => {
                if NOT_FORWARDED.contains(&code.as_str()) {
                    if !arrived.is_empty() {
                        v(
                            "R5 outcome",
                            format!("refused with {code} (not forwarded), but it reached the destination"),
                            entries(),
                        );
                    }
                } else if !INDETERMINATE.contains(&code.as_str()) {
                    v(
                        "R5 outcome",
                        format!("an error code the checker cannot classify: {code}"),
                        entries(),
                    );
                }
            }
            _ => {}
        }
    }

    // Figures.
    for (route, lease) in &h.routes {
        let f = r.leases.entry(lease.clone()).or_default();
        f.attempts += h.attempts.iter().filter(|a| &a.route == route).count();
        f.arrivals += h.arrivals.iter().filter(|a| &a.route == route).count();
    }
    for (lease, _) in h.epochs.keys() {
        r.leases.entry(lease.clone()).or_default().epochs_in_store += 1;
    }
    for (lease, arrivals) in &per_lease {
        let mut epochs: Vec<u64> = arrivals.iter().filter_map(|a| a.epoch).collect();
        epochs.sort_unstable();
        epochs.dedup();
        r.leases
            .entry(lease.to_string())
            .or_default()
            .epochs_at_destination = epochs.len();
    }
    queued::check(h, &clk, &mut r);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn attempt(
        req: &str,
        epoch: u64,
        token: &str,
        key: &str,
        t: (u64, u64),
        o: Outcome,
    ) -> Attempt {
        Attempt {
            worker: 1,
            req: req.into(),
            kind: "op".into(),
            route: "r0".into(),
            epoch,
            token: token.into(),
            key: key.into(),
            invoke: t.0 * MS,
            complete: t.1 * MS,
            outcome: o,
            addr: None,
            accepted: None,
        }
    }

    fn ok(body: &str) -> Outcome {
        Outcome::Response {
            status: 200,
            error: None,
            replayed: false,
            body: body.into(),
        }
    }

    fn refused(status: u16, code: &str) -> Outcome {
        Outcome::Response {
            status,
            error: Some(code.into()),
            replayed: false,
            body: format!("{{\"error\":\"{code}\"}}"),
        }
    }

    fn arrival(seq: u64, req: &str, epoch: u64, key: &str, t: (u64, u64), body: &str) -> Arrival {
        Arrival {
            seq,
            route: "r0".into(),
            req: Some(req.into()),
            epoch: Some(epoch),
            key: Some(key.into()),
            arrive: t.0 * MS,
            complete: Some(t.1 * MS),
            wrote_after: None,
            status: Some(200),
            body: Some(body.into()),
            webhook_id: None,
        }
    }

    /// A correct history: epoch 1 works, is drained, epoch 2 takes over; a late
    /// epoch-1 request is refused; a retry is replayed.
    fn good() -> History {
        let mut h = History::default();
        h.routes.insert("r0".into(), "l0".into());
        h.drain_timeout_ns.insert("r0".into(), 100 * MS);
        h.epochs.insert(
            ("l0".into(), 1),
            StoredEpoch::Acquire {
                token_sha256: sha256_hex("tokA"),
            },
        );
        h.epochs.insert(
            ("l0".into(), 2),
            StoredEpoch::Acquire {
                token_sha256: sha256_hex("tokB"),
            },
        );
        h.attempts = vec![
            attempt("a1", 1, "tokA", "k1", (0, 30), ok("one")),
            attempt("a2", 1, "tokA", "k1", (40, 45), {
                let mut o = ok("one");
                if let Outcome::Response { replayed, .. } = &mut o {
                    *replayed = true;
                }
                o
            }),
            attempt("b1", 2, "tokB", "k2", (50, 80), ok("two")),
            attempt("a3", 1, "tokA", "k3", (90, 91), refused(409, "epoch_stale")),
        ];
        h.arrivals = vec![
            arrival(1, "a1", 1, "k1", (10, 20), "one"),
            arrival(2, "b1", 2, "k2", (60, 70), "two"),
        ];
        h
    }

    fn rules(r: &Report) -> Vec<&'static str> {
        r.violations.iter().map(|v| v.rule).collect()
    }

    #[test]
    fn a_correct_history_passes() {
        let r = check(&good());
        assert!(r.violations.is_empty(), "{:#?}", r.violations);
        assert_eq!(r.ordered_pairs, 1);
        assert_eq!(r.replays_checked, 1);
        assert_eq!(r.outcomes["409 epoch_stale"], 1);
    }

    #[test]
    fn r1_an_arrival_that_goes_back_in_epoch() {
        let mut h = good();
        // The late epoch-1 request was admitted and arrived after epoch 2.
        h.attempts[3].outcome = ok("late");
        h.arrivals.push(arrival(3, "a3", 1, "k3", (95, 96), "late"));
        let r = check(&h);
        assert_eq!(rules(&r), vec!["R1 epoch order"], "{:#?}", r.violations);
        let text = r.violations[0].to_string();
        assert!(
            text.contains("req Some(\"a3\")") && text.contains("req Some(\"b1\")"),
            "{text}"
        );
    }

    #[test]
    fn r2_an_older_request_still_at_the_destination() {
        let mut h = good();
        // a1 completed at 65 ms, after b1 arrived at 60 ms, and its worker got 200.
        h.arrivals[0].complete = Some(65 * MS);
        let r = check(&h);
        assert_eq!(rules(&r), vec!["R2 drain"], "{:#?}", r.violations);
        assert!(r.violations[0].to_string().contains("completed +0.065s"));
    }

    /// `good()` with a1 (epoch 1, invoked at 0 ms) still at the destination until
    /// 65 ms, when b1 (epoch 2) arrived at 60 ms: only the drain timeout (100 ms
    /// on r0) can excuse it.
    fn a1_outlives_b1_arrival() -> History {
        let mut h = good();
        h.arrivals[0].complete = Some(65 * MS);
        // Its key is in doubt: no replay of it.
        h.attempts.remove(1);
        h
    }

    #[test]
    fn r2_no_exemption_before_the_drain_timeout_whatever_the_answer() {
        // b1 arrived 60 ms after a1 was invoked; the lease's drain timeout is 100 ms.
        for outcome in [
            refused(504, "drain_aborted"),
            refused(504, "upstream_timeout"),
            // The connection reset by a kill -9 of fencegate: a crash overlapping
            // [a1.invoke, b1.arrive] no longer exempts.
            Outcome::ConnError("reset".into()),
            Outcome::Timeout,
            ok("one"),
        ] {
            let mut h = a1_outlives_b1_arrival();
            h.attempts[0].outcome = outcome.clone();
            let r = check(&h);
            assert_eq!(
                rules(&r),
                vec!["R2 drain"],
                "{outcome:?}: {:#?}",
                r.violations
            );
            assert!(r.exempt.is_empty(), "{outcome:?}");
            let text = r.violations[0].to_string();
            assert!(
                text.contains("arrived 0.060s after") && text.contains("drain timeout (0.100s)"),
                "{text}"
            );
        }
    }

    #[test]
    fn r2_exempt_once_the_drain_timeout_elapsed_since_the_older_invoke() {
        let mut h = a1_outlives_b1_arrival();
        h.attempts[0].outcome = refused(504, "drain_aborted");
        // b1 arrives exactly a1.invoke + D (the bound is inclusive), then later.
        for arrive in [100, 101] {
            h.arrivals[1].arrive = arrive * MS;
            h.arrivals[1].complete = Some((arrive + 10) * MS);
            h.arrivals[0].complete = Some((arrive + 5) * MS);
            let r = check(&h);
            assert!(r.violations.is_empty(), "{:#?}", r.violations);
            assert_eq!(r.exempt[EXEMPT_DRAIN_TIMEOUT], 1);
            assert_eq!(r.exempt.len(), 1);
        }
        // 1 ms short of the bound: a violation.
        h.arrivals[1].arrive = 99 * MS;
        assert_eq!(rules(&check(&h)), vec!["R2 drain"]);
        // A later invoke moves the bound: invoked at 5 ms, b1 at 101 ms is too soon.
        h.arrivals[1].arrive = 101 * MS;
        h.attempts[0].invoke = 5 * MS;
        assert_eq!(rules(&check(&h)), vec!["R2 drain"]);
    }

    #[test]
    fn r1_late_bytes_of_an_aborted_forward() {
        // a1's bytes reached the origin only after b1 arrived (a stopped origin read
        // them late): exempt only past the drain timeout.
        let mut h = a1_outlives_b1_arrival();
        h.attempts[0].outcome = refused(504, "drain_aborted");
        h.arrivals[0].arrive = 70 * MS;
        h.arrivals[0].complete = Some(75 * MS);
        let r = check(&h);
        assert_eq!(rules(&r), vec!["R1 epoch order"], "{:#?}", r.violations);
        h.arrivals[1].arrive = 120 * MS;
        h.arrivals[1].complete = Some(125 * MS);
        h.arrivals[0].arrive = 130 * MS;
        h.arrivals[0].complete = Some(135 * MS);
        let r = check(&h);
        assert!(r.violations.is_empty(), "{:#?}", r.violations);
        assert_eq!(r.exempt[EXEMPT_DRAIN_TIMEOUT], 1);
    }

    #[test]
    fn r2_no_exemption_for_a_request_still_being_written_after_the_newer_arrived() {
        // a1 is an upload: invoked at 0 ms, its head at the destination at 10 ms,
        // its body read whole by 210 ms; b1 (epoch 2) arrived at 160 ms, past the
        // 100 ms drain timeout. Its last bytes were written after 150 ms (the
        // in-transit bound): written before b1 arrived, the timing bound exempts
        // the pair; written after, no drain aborted a1 in time.
        let mut h = a1_outlives_b1_arrival();
        h.attempts[0].outcome = refused(504, "drain_aborted");
        h.arrivals[1].arrive = 160 * MS;
        h.arrivals[1].complete = Some(170 * MS);
        h.arrivals[0].complete = Some(210 * MS);
        h.arrivals[0].wrote_after = Some(150 * MS);
        let r = check(&h);
        assert!(r.violations.is_empty(), "{:#?}", r.violations);
        assert_eq!(r.exempt[EXEMPT_DRAIN_TIMEOUT], 1);
        h.arrivals[0].wrote_after = Some(165 * MS);
        let r = check(&h);
        assert_eq!(rules(&r), vec!["R2 drain"], "{:#?}", r.violations);
        assert!(r.exempt.is_empty());
        let text = r.violations[0].to_string();
        assert!(text.contains("still writing"), "{text}");
    }

    #[test]
    fn r2_the_smallest_drain_timeout_of_the_lease_counts() {
        let mut h = a1_outlives_b1_arrival();
        h.attempts[0].outcome = refused(504, "drain_aborted");
        h.drain_timeout_ns.insert("r0".into(), 1000 * MS);
        assert_eq!(rules(&check(&h)), vec!["R2 drain"]);
        // Another route of the same lease drains within 50 ms: b1 at 60 ms is past.
        h.routes.insert("r0b".into(), "l0".into());
        h.drain_timeout_ns.insert("r0b".into(), 50 * MS);
        let r = check(&h);
        assert!(r.violations.is_empty(), "{:#?}", r.violations);
        // A route of another lease does not count.
        h.routes.insert("r0b".into(), "l9".into());
        assert_eq!(rules(&check(&h)), vec!["R2 drain"]);
    }

    /// R6: an arrival past its epoch's expiry (plus the slack) is a violation
    /// unless the origin was paused in between.
    #[test]
    fn r6_nothing_reaches_a_running_origin_well_after_its_epoch_expired() {
        let mut h = good();
        // Later on the clock, so that an expiry can lie well before the arrivals.
        for a in &mut h.attempts {
            a.invoke += 10_000 * MS;
            a.complete += 10_000 * MS;
        }
        for a in &mut h.arrivals {
            a.arrive += 10_000 * MS;
            a.complete = a.complete.map(|c| c + 10_000 * MS);
        }
        assert!(check(&h).violations.is_empty());
        let first = h.arrivals[0].arrive;
        // Epoch 1 expired just before its first arrival, within the slack: fine.
        h.expiry_ns
            .insert(("l0".into(), 1), first - EXPIRY_SLACK_NS / 2);
        assert!(
            check(&h).violations.is_empty(),
            "{:#?}",
            check(&h).violations
        );
        // Well before it: a request forwarded after its epoch expired.
        h.expiry_ns
            .insert(("l0".into(), 1), first - EXPIRY_SLACK_NS - MS);
        let r = check(&h);
        assert_eq!(rules(&r), vec!["R6 expiry"], "{:#?}", r.violations);
        // A pause of the origin in between: it read the request late.
        h.origin_pauses = vec![(first - 2 * MS, first - MS)];
        assert!(check(&h).violations.is_empty());
    }

    #[test]
    fn r2_no_exemption_without_an_attempt_or_a_drain_timeout() {
        let mut h = a1_outlives_b1_arrival();
        h.attempts[0].outcome = refused(504, "drain_aborted");
        h.arrivals[1].arrive = 500 * MS;
        h.arrivals[0].complete = Some(600 * MS);
        assert!(check(&h).violations.is_empty());
        // No drain timeout known for the lease.
        h.drain_timeout_ns.clear();
        let r = check(&h);
        assert_eq!(rules(&r), vec!["R2 drain"], "{:#?}", r.violations);
        assert!(r.violations[0].to_string().contains("no drain timeout"));
        // No attempt sent a1 (R3 says so too): nothing to measure from.
        let mut h = a1_outlives_b1_arrival();
        h.arrivals[1].arrive = 500 * MS;
        h.arrivals[0].complete = Some(600 * MS);
        h.attempts[0].outcome = refused(504, "drain_aborted");
        h.arrivals[0].req = Some("ghost".into());
        let r = check(&h);
        assert_eq!(
            rules(&r),
            vec!["R3 token", "R2 drain"],
            "{:#?}",
            r.violations
        );
        assert!(r.violations[1].to_string().contains("no worker attempt"));
    }

    #[test]
    fn r3_a_request_admitted_with_a_token_that_did_not_win() {
        let mut h = good();
        h.attempts[2].token = "forged".into();
        let r = check(&h);
        assert_eq!(rules(&r), vec!["R3 token"], "{:#?}", r.violations);
        assert!(r.violations[0].to_string().contains("attempt b1"));
        // An epoch that is a release admits nothing.
        let mut h = good();
        h.epochs.insert(("l0".into(), 2), StoredEpoch::Release);
        assert_eq!(rules(&check(&h)), vec!["R3 token"]);
        // Nobody sent it.
        let mut h = good();
        h.arrivals[1].req = Some("ghost".into());
        assert!(rules(&check(&h)).contains(&"R3 token"));
    }

    #[test]
    fn r4_a_key_that_reached_the_destination_twice() {
        let mut h = good();
        // The retry was forwarded again instead of replayed.
        h.attempts[1].outcome = ok("one again");
        h.arrivals
            .insert(1, arrival(3, "a2", 1, "k1", (41, 42), "one again"));
        let r = check(&h);
        assert_eq!(rules(&r), vec!["R4 dedup"], "{:#?}", r.violations);
        assert!(r.violations[0].what.contains("2 times"));
    }

    #[test]
    fn r4_a_replay_that_is_not_the_first_answer() {
        let mut h = good();
        if let Outcome::Response { body, .. } = &mut h.attempts[1].outcome {
            *body = "one!".into();
        }
        let r = check(&h);
        assert_eq!(rules(&r), vec!["R4 dedup"], "{:#?}", r.violations);
        assert!(r.violations[0].what.contains("differs"));
    }

    #[test]
    fn r5_an_answered_request_missing_at_the_destination() {
        let mut h = good();
        h.arrivals.remove(1);
        let r = check(&h);
        assert_eq!(rules(&r), vec!["R5 outcome"], "{:#?}", r.violations);
        assert!(r.violations[0].what.contains("never reached"));
    }

    #[test]
    fn r5_a_refused_request_present_at_the_destination() {
        let mut h = good();
        // Refused as stale, yet the destination saw it (before epoch 2: no R1/R2).
        h.attempts[3].invoke = 31 * MS;
        h.arrivals.push(arrival(3, "a3", 1, "k3", (32, 33), "x"));
        let r = check(&h);
        assert_eq!(rules(&r), vec!["R5 outcome"], "{:#?}", r.violations);
        assert!(r.violations[0].what.contains("epoch_stale"));
        // Indeterminate codes say nothing.
        h.attempts[3].outcome = refused(504, "upstream_timeout");
        assert!(check(&h).violations.is_empty());
        // A code the checker does not know is reported.
        h.attempts[3].outcome = refused(500, "mystery");
        assert_eq!(rules(&check(&h)), vec!["R5 outcome"]);
    }
}
