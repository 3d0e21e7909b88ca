//! The checks of the protocol model (`scripts/model.sh`): each an exhaustive
//! breadth-first search of its bounds, printing its state count and time.
//!
//! Units are ticks of 500 ms (see `Cfg::cluster`): gate_ttl 6 (renewals every
//! 2), self_fence_margin 2, grace 2, drain_timeout 2, route timeout 1; the
//! checks with a long upload (issue 25.1, and a stopped owner's next tenure)
//! take self_fence_margin 3, grace 1, drain_timeout 1, route timeout 8 and
//! writes that last. Each hole check holds with the protocol's design and
//! fails with one `Holes` switch on. `FENCEGATE_MODEL_LONG=1` adds a third
//! instance, longer horizons, crashes and a handover.

use std::time::Instant;

use fencegate_model::{prop, Cfg, Holes, Proto, ReqSpec};
use stateright::{Checker, Expectation, HasDiscoveries, Model};

struct Outcome {
    failed: Vec<&'static str>,
    reached: Vec<&'static str>,
}

/// Searches `cfg` exhaustively (or until the first failure when `stop_early`).
/// (The repository's `clippy.toml` bans `Instant::now` in fencegate's code;
/// here it only times the search.)
#[allow(clippy::disallowed_methods)]
fn run(name: &str, cfg: Cfg, stop_early: bool) -> Outcome {
    let start = Instant::now();
    let model = Proto::new(cfg);
    let props = model.properties();
    let mut builder = model.checker().threads(2);
    if stop_early {
        builder = builder.finish_when(HasDiscoveries::AnyFailures);
    }
    let c = builder.spawn_bfs().join();
    let mut out = Outcome {
        failed: vec![],
        reached: vec![],
    };
    for p in props {
        match (p.expectation, c.discovery(p.name).is_some()) {
            (Expectation::Always, true) => out.failed.push(p.name),
            (Expectation::Sometimes, true) => out.reached.push(p.name),
            _ => {}
        }
    }
    println!(
        "model check {name}: {} states, {:.1} s, {}",
        c.unique_state_count(),
        start.elapsed().as_secs_f64(),
        if out.failed.is_empty() {
            "every property holds".to_owned()
        } else {
            format!("counterexample for {:?}", out.failed)
        }
    );
    if let Some(p) = out.failed.first() {
        for (st, a) in c.discovery(p).expect("found").into_vec() {
            if let Some(a) = a.filter(|a| *a != fencegate_model::Action::Tick) {
                println!("    t={:>2} {a:?}", st.now);
            }
        }
    }
    out
}

fn holds(name: &str, cfg: Cfg) -> Outcome {
    let out = run(name, cfg, false);
    assert!(out.failed.is_empty(), "{name}: {:?} failed", out.failed);
    out
}

/// The search stops at its first counterexample, which must break one of
/// `properties` (a late write may show as S1 or S2 first, whichever the search
/// meets first).
fn fails(name: &str, cfg: Cfg, properties: &[&'static str]) {
    let out = run(name, cfg, true);
    assert!(
        out.failed.iter().any(|p| properties.contains(p)),
        "{name}: expected a counterexample for one of {properties:?}, got {:?}",
        out.failed
    );
}

/// The ordering properties a late write breaks.
const ORDER: &[&str] = &[prop::S1, prop::S2];

fn req(epoch: u8, key: Option<u8>) -> ReqSpec {
    req_in(0, epoch, key)
}

/// A request of lease `lease` (0 or 1).
fn req_in(lease: u8, epoch: u8, key: Option<u8>) -> ReqSpec {
    ReqSpec {
        lease,
        epoch,
        key,
        not_before: 0,
    }
}

fn long() -> bool {
    std::env::var_os("FENCEGATE_MODEL_LONG").is_some()
}

/// Two instances, renewals, one crash: every property holds, and a takeover
/// after the owner died is reached, then a delivery after it.
#[test]
fn cluster_crash_and_takeover() {
    let mut cfg = Cfg::cluster();
    cfg.reqs = vec![req(1, Some(0)), req(2, Some(1)), req(1, Some(0))];
    cfg.crashes = 1;
    cfg.lose_responses = true;
    if long() {
        cfg.instances = 3;
        cfg.store_cuts = 1;
        cfg.horizon = 18;
    }
    let out = holds("cluster: crash, takeover, a retried key", cfg);
    assert!(out.reached.contains(&prop::TAKEOVER_AFTER_DEATH));
    assert!(out.reached.contains(&prop::DELIVERED_AFTER_TAKEOVER));
}

/// The database as a nemesis: every row write (take, renewal) applied a tick
/// after it was sent or at once, its answer a tick after that or at once, and
/// one answer lost (the writer never learns the outcome: a renewal that
/// committed extends nothing, a take that committed leaves a row naming an
/// instance that does not serve it).
#[test]
fn row_writes_applied_late_or_their_answers_lost() {
    let mut cfg = Cfg::cluster();
    cfg.reqs = vec![req(1, Some(0)), req(2, Some(1))];
    cfg.row_writes = 4;
    cfg.db_delay = 1;
    cfg.db_losses = 1;
    cfg.horizon = 12;
    if long() {
        cfg.handovers = 1;
    }
    let out = holds("cluster: row writes a tick late, one answer lost", cfg);
    assert!(out.reached.contains(&prop::DELIVERED_AFTER_TAKEOVER));
}

/// A handover: the owner stops, its requests finish or are aborted a drain
/// timeout later (by its abort deadline at the latest), then it releases the
/// row, which a contender takes at once.
#[test]
fn handover_then_take() {
    let mut cfg = Cfg::cluster();
    cfg.reqs = vec![req(1, Some(0)), req(2, Some(1))];
    cfg.row_writes = 4;
    cfg.handovers = 1;
    cfg.horizon = 12;
    let out = holds("cluster: a handover", cfg);
    assert!(out.reached.contains(&prop::DELIVERED_AFTER_TAKEOVER));
}

/// A cluster whose owner stalls between its last check and its write (a
/// pause; no renewals, so nothing extends its window).
fn stall(pause: u8) -> Cfg {
    let mut cfg = Cfg::cluster();
    cfg.reqs = vec![req(1, Some(0)), req(2, Some(1))];
    cfg.pauses = 1;
    cfg.max_pause = pause;
    cfg.renew = false;
    cfg.horizon = 14;
    if long() {
        cfg.crashes = 1;
    }
    cfg
}

/// SPEC §10.2's limit, without the settle after a takeover (the ownership
/// rows alone): a stall of `self_fence_margin + grace` holds; one tick longer
/// and an older epoch reaches the destination after a newer one.
#[test]
fn stall_limit_of_the_ownership_rows_is_margin_plus_grace() {
    let c = Cfg::cluster();
    let limit = c.margin + c.grace;
    let mut cfg = stall(limit);
    cfg.holes.no_takeover_settle = true;
    let out = holds("stall = margin + grace, no takeover settle", cfg.clone());
    assert!(out.reached.contains(&prop::DELIVERED_AFTER_TAKEOVER));
    cfg.max_pause = limit + 1;
    fails("stall = margin + grace + 1, no takeover settle", cfg, ORDER);
}

/// With the settle of SPEC §10.2 (nothing above the drained-through epoch for a
/// drain timeout after the takeover) the limit is a drain timeout longer.
/// Renewals that stop when the owner is cut from the lease store at any time
/// move neither bound: the owner counts from a renewal's send, the contender
/// from the read that showed its commit. (With renewals applied or answered a
/// tick late as well: 47 M states, every property holds at the bound.)
#[test]
fn stall_limit_with_the_takeover_settle_adds_the_drain_timeout() {
    let c = Cfg::cluster();
    let limit = c.margin + c.grace + c.drain_timeout;
    holds("stall = margin + grace + drain_timeout", stall(limit));
    fails(
        "stall = margin + grace + drain_timeout + 1",
        stall(limit + 1),
        ORDER,
    );
    let renewing = |pause| {
        let mut cfg = stall(pause);
        cfg.renew = true;
        cfg.store_cuts = 1;
        cfg.row_writes = 3;
        cfg.crashes = 0;
        cfg
    };
    holds(
        "stall = margin + grace + drain_timeout, renewals",
        renewing(limit),
    );
    fails(
        "stall = margin + grace + drain_timeout + 1, renewals",
        renewing(limit + 1),
        ORDER,
    );
}

/// The window runs from the renewal's (or take's) *send*: an answer that
/// arrives late must not extend it. Requests without a dedup record, so no
/// conditioned write stands in the way.
#[test]
fn the_ownership_window_runs_from_the_send() {
    let mut cfg = Cfg::cluster();
    cfg.reqs = vec![req(1, None), req(2, None)];
    cfg.renew = false;
    cfg.horizon = 14;
    cfg.db_delay = 6;
    holds(
        "database answers 6 ticks late, window from send",
        cfg.clone(),
    );
    cfg.holes.window_from_confirm = true;
    fails(
        "database answers 6 ticks late, window from the answer",
        cfg,
        &[prop::S2],
    );
}

/// A contender whose read of the row is answered 6 ticks after it executed (a
/// slow database, or a stall of the contender between the read and its
/// judgement): the owner's renewals committed meanwhile are not in what it
/// judges. Requests without a dedup record, so no conditioned write stands in
/// the way.
fn stale_read() -> Cfg {
    let mut cfg = Cfg::cluster();
    cfg.reqs = vec![req(1, None), req(2, None)];
    cfg.row_writes = 5;
    cfg.slow_reads = 1;
    cfg.look_delay = 6;
    cfg.horizon = 10;
    cfg
}

/// The take is conditioned on exactly the `(generation, renewals)` pair the
/// contender watched unchanged for `gate_ttl + grace`: a renewal committed
/// after the read it judged on makes the take match nothing. Conditioned on
/// the generation alone, the take succeeds while the owner's window (from that
/// renewal's send) is still open. Sent conditioned on whatever pair the latest
/// read showed when the take goes out (`take_over` reading `Seen` again after
/// `balance` judged it), a read that arrived in between makes the take match a
/// row just taken or renewed: two owners at once.
#[test]
fn a_take_is_conditioned_on_the_pair_it_watched() {
    holds(
        "stale read, take conditioned on the watched pair",
        stale_read(),
    );
    let mut cfg = stale_read();
    cfg.holes.take_unconditioned = true;
    fails(
        "stale read, take conditioned on the generation only",
        cfg,
        ORDER,
    );
    let mut cfg = stale_read();
    cfg.holes.take_from_latest_read = true;
    fails(
        "stale read, take conditioned on the latest read's pair",
        cfg,
        ORDER,
    );
}

/// The database's clock jumps forward (up to 6 ticks) once: a contender that
/// judges the row's age on its own clock from its read is not moved; one that
/// compares the renewal's commit time with the database's `now()` takes the
/// row while the owner still forwards.
#[test]
fn a_take_never_judges_on_the_database_clock() {
    let mut cfg = Cfg::cluster();
    cfg.reqs = vec![req(1, None), req(2, None)];
    cfg.renew = false;
    cfg.db_jump = 6;
    cfg.horizon = 12;
    holds(
        "database clock jumps, row judged on the contender's clock",
        cfg.clone(),
    );
    cfg.holes.take_on_db_clock = true;
    fails(
        "database clock jumps, row judged on the database's clock",
        cfg,
        ORDER,
    );
}

/// An owner whose renewal's answer is lost stops at its forwarding deadline,
/// its requests in flight to be aborted at `gate_ttl`. Then either its next
/// renewal succeeds and it takes its own row again (a new tenure, settling a
/// drain timeout), or it hands the shard over (a balancing round, a SIGTERM)
/// and a contender takes the released row at once (settling a drain timeout).
/// With the drain timeout (1) below `self_fence_margin` (3) and a long upload
/// of epoch 1 in flight, the stopped tenure's requests must end before the
/// next tenure forwards epoch 2: aborted when the owner takes its row again,
/// held to the handover's deadline (and waited for) before the release. Left
/// to their own abort deadline, epoch 1 is still being written when epoch 2
/// arrives.
fn stopped_owner() -> Cfg {
    let mut cfg = Cfg::cluster();
    cfg.reqs = vec![req(1, Some(0)), req(2, Some(1))];
    cfg.margin = 3;
    cfg.grace = 1;
    cfg.drain_timeout = 1;
    cfg.route_timeout = 8;
    cfg.long_writes = true;
    cfg.row_writes = 4;
    cfg.db_losses = 1;
    cfg.handovers = 1;
    cfg.horizon = 10;
    cfg
}

#[test]
fn a_stopped_tenure_ends_before_the_next_one_forwards() {
    holds(
        "owner stopped, then its own row taken again or handed over",
        stopped_owner(),
    );
    let mut cfg = stopped_owner();
    cfg.holes.retake_spares_stopped = true;
    fails(
        "owner stopped, own row taken again: stopped tenure left to its deadline",
        cfg,
        &[prop::S2],
    );
    let mut cfg = stopped_owner();
    cfg.holes.handover_spares_stopped = true;
    fails(
        "owner stopped, then handed over: released at once",
        cfg,
        &[prop::S2],
    );
}

/// One instance (SPEC §10.1), its guard held for the whole run.
fn single(reqs: Vec<ReqSpec>) -> Cfg {
    let mut cfg = Cfg::single();
    cfg.reqs = reqs;
    cfg.horizon = 12;
    cfg
}

/// An edge of the single-instance fence: every property holds with the fixed
/// design, and `property` fails once `old_design` switches its hole back on.
fn edge(name: &str, cfg: Cfg, old_design: fn(&mut Holes), property: &'static str) {
    holds(&format!("single: {name}"), cfg.clone());
    let mut old = cfg;
    old_design(&mut old.holes);
    fails(&format!("single: {name}, old design"), old, &[property]);
}

/// A crash during a drain: after the restart nothing above the drained-through
/// epoch is forwarded until a drain timeout has passed. Forgetting that epoch
/// forwards the raised epoch while the old request is still at the destination.
#[test]
fn single_crash_during_a_drain() {
    let mut cfg = single(vec![req(1, Some(0)), req(2, Some(1)), req(2, Some(2))]);
    cfg.crashes = 1;
    edge(
        "crash during a drain",
        cfg,
        |h| h.forget_drain = true,
        prop::S2,
    );
}

/// A route timeout during a drain: the request lingers (the destination may
/// still be executing it) until the drain's timeout. Ending its pass instead
/// lets the newer epoch through at once.
#[test]
fn single_route_timeout_during_a_drain() {
    let mut cfg = single(vec![req(1, Some(0)), req(2, Some(1))]);
    cfg.lose_responses = true;
    edge(
        "route timeout during a drain",
        cfg,
        |h| h.timeout_leaves = true,
        prop::S2,
    );
}

/// A raise that outlives its epoch in the drain is decided again: refused.
#[test]
fn single_raise_outliving_its_epoch() {
    let mut cfg = single(vec![req(1, Some(0)), req(2, Some(1))]);
    cfg.worker_ttl = 3;
    cfg.drain_timeout = 3;
    edge(
        "raise outliving its epoch",
        cfg,
        |h| h.no_redecide = true,
        prop::S3,
    );
}

/// An in-flight record older than the dedup TTL is still in flight: a retry of
/// its key is refused. Expiring it forwards the key a second time.
#[test]
fn single_in_flight_record_older_than_the_dedup_ttl() {
    let mut cfg = single(vec![req(1, Some(0)), req(1, Some(0))]);
    cfg.dedup_ttl = 2;
    cfg.lose_responses = true;
    edge(
        "in-flight record older than the dedup TTL",
        cfg,
        |h| h.inflight_expires = true,
        prop::S4,
    );
}

/// Issue 25 point 1: a shard of two leases whose owner is cut from the lease
/// store at any time (it vouches for no anchor: it renews no row from then on)
/// while each lease may have a request in flight — lease 0 a slow one, lease 1
/// a long epoch-1 upload — and lease 1's workers move to epoch 2, which the
/// owner or its successor forwards. Writes last (a request is written until it
/// is answered, aborted or times out) and the drain timeout (1 tick) is
/// below the route timeout (8: no request times out before the successor
/// forwards). `self_fence_margin` 3 exceeds grace + drain timeout, so a close
/// that ends `margin` after the previous one outlives the successor's settle.
fn two_leases_owner_cut() -> Cfg {
    let mut cfg = Cfg::cluster();
    cfg.leases = 2;
    cfg.worker_epochs = [1, 2];
    cfg.reqs = vec![
        req_in(0, 1, None),
        req_in(1, 1, Some(0)),
        req_in(1, 2, Some(1)),
    ];
    cfg.margin = 3;
    cfg.grace = 1;
    cfg.drain_timeout = 1;
    cfg.route_timeout = 8;
    cfg.long_writes = true;
    cfg.store_cuts = 1;
    cfg.horizon = 12;
    cfg
}

/// Every fence of the shard shares its one deadline: nothing is forwarded after
/// `gate_ttl − margin`, everything in flight is aborted at `gate_ttl`, before
/// the successor may forward. Closing the fences one after another, each with a
/// deadline of its own, leaves lease 1's epoch-1 upload being written when the
/// successor forwards its epoch 2.
#[test]
fn two_leases_share_the_shard_deadline() {
    let cfg = two_leases_owner_cut();
    let out = holds(
        "two leases, owner cut: one deadline for the shard",
        cfg.clone(),
    );
    assert!(out.reached.contains(&prop::DELIVERED_AFTER_TAKEOVER));
    if long() {
        // A crash too; each tenure one take (no renewals).
        let mut crash = cfg.clone();
        crash.renew = false;
        crash.crashes = 1;
        holds(
            "two leases, owner cut, a crash, no renewals: one deadline for the shard",
            crash,
        );
    }
    let mut old = cfg;
    old.holes.sequential_close = true;
    fails(
        "two leases, owner cut: fences closed one after another",
        old,
        &[prop::S2],
    );
}
