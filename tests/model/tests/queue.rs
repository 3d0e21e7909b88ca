//! The checks of the queue's model (`scripts/model.sh`): queued delivery
//! (SPEC §11) across takes of its shard, with an operator's retry and drop.
//! Each hole check holds with the protocol's design and fails with one
//! `QHoles` switch on.

use std::time::Instant;

use fencegate_model::queue::{qprop, QCfg, QHoles, QProto};
use stateright::{Checker, Expectation, HasDiscoveries, Model};

/// Searches `cfg` exhaustively (or until the first failure when `stop_early`);
/// the properties that failed and the reachabilities reached.
#[allow(clippy::disallowed_methods)]
fn run(name: &str, cfg: QCfg, stop_early: bool) -> (Vec<&'static str>, Vec<&'static str>) {
    let start = Instant::now();
    let model = QProto::new(cfg);
    let props = model.properties();
    let mut builder = model.checker().threads(2);
    if stop_early {
        builder = builder.finish_when(HasDiscoveries::AnyFailures);
    }
    let c = builder.spawn_bfs().join();
    let (mut failed, mut reached) = (vec![], vec![]);
    for p in props {
        match (p.expectation, c.discovery(p.name).is_some()) {
            (Expectation::Always, true) => failed.push(p.name),
            (Expectation::Sometimes, true) => reached.push(p.name),
            _ => {}
        }
    }
    println!(
        "queue model check {name}: {} states, {:.1} s, {}",
        c.unique_state_count(),
        start.elapsed().as_secs_f64(),
        if failed.is_empty() {
            "every property holds".to_owned()
        } else {
            format!("counterexample for {failed:?}")
        }
    );
    if let Some(p) = failed.first() {
        for (_, a) in c.discovery(p).expect("found").into_vec() {
            if let Some(a) = a {
                println!("    {a:?}");
            }
        }
    }
    (failed, reached)
}

fn fails(name: &str, holes: QHoles, properties: &[&'static str]) {
    let cfg = QCfg {
        holes,
        ..QCfg::two_owners()
    };
    let (failed, _) = run(name, cfg, true);
    assert!(
        failed.iter().any(|p| properties.contains(p)),
        "{name}: expected a counterexample for one of {properties:?}, got {failed:?}"
    );
}

/// Two instances, three takes (restarts among them), closed windows, failures,
/// an operator's retries and a drop: every property holds, a message is sent
/// again after a take, and a retried message is delivered.
#[test]
fn queue_across_takes_with_operators() {
    let (failed, reached) = run("two owners, takes, retry, drop", QCfg::two_owners(), false);
    assert!(failed.is_empty(), "{failed:?}");
    assert!(reached.contains(&qprop::RESENT_AFTER_TAKE));
    assert!(reached.contains(&qprop::RETRIED_DELIVERED));
}

/// Three instances, three takes, longer: `FENCEGATE_MODEL_LONG=1` only.
#[test]
fn queue_three_owners() {
    if std::env::var_os("FENCEGATE_MODEL_LONG").is_none() {
        return;
    }
    let cfg = QCfg {
        instances: 3,
        takes: 3,
        expiries: 3,
        epochs: vec![1, 1, 2, 2],
        ..QCfg::two_owners()
    };
    let (failed, _) = run("three owners, three takes", cfg, false);
    assert!(failed.is_empty(), "{failed:?}");
}

/// A deliverer that ignores the owner generation: a deposed owner's stale
/// write puts a delivered message back, or its place, and it arrives again
/// out of order.
#[test]
fn hole_deliverer_ignores_the_owner_generation() {
    fails(
        "deliverer ignores the generation",
        QHoles {
            ignore_generation: true,
            ..QHoles::default()
        },
        &[qprop::Q2, qprop::Q3],
    );
}

/// A retry that does not look for a newer epoch: an older epoch's message
/// arrives after a newer one's.
#[test]
fn hole_retry_past_a_newer_epoch() {
    fails(
        "retry past a newer epoch",
        QHoles {
            retry_past_newer: true,
            ..QHoles::default()
        },
        &[qprop::Q1],
    );
}

/// No check under the edits lock: a message dropped between the read and the
/// start is sent.
#[test]
fn hole_start_without_the_check() {
    fails(
        "start without the check",
        QHoles {
            no_recheck: true,
            ..QHoles::default()
        },
        &[qprop::Q3],
    );
}

/// A head whose outcome is unknown passed over: it is never settled (or the
/// next arrives before it).
#[test]
fn hole_unknown_outcome_passed_over() {
    fails(
        "a delivering head passed over",
        QHoles {
            skip_delivering: true,
            ..QHoles::default()
        },
        &[qprop::Q2, qprop::Q4],
    );
}
