use std::time::Instant;

use fencegate_model::*;
use stateright::{Checker, Model};

/// Runs a full BFS and returns (unique states, seconds, violated property names).
fn check(name: &str, cfg: Cfg) -> (usize, f64, Vec<&'static str>, Vec<&'static str>) {
    let start = Instant::now();
    let model = Proto::new(cfg);
    let props = model.properties();
    let c = model.checker().threads(2).spawn_bfs().join();
    let secs = start.elapsed().as_secs_f64();
    let mut failed = vec![];
    let mut reached = vec![];
    for p in props {
        let found = c.discovery(p.name).is_some();
        match p.expectation {
            stateright::Expectation::Always if found => failed.push(p.name),
            stateright::Expectation::Sometimes if found => reached.push(p.name),
            _ => {}
        }
    }
    println!(
        "{name}: {} states, depth {}, {secs:.1} s, failed {failed:?}, reached {reached:?}",
        c.unique_state_count(),
        c.max_depth()
    );
    (c.unique_state_count(), secs, failed, reached)
}

fn req(epoch: u8, key: Option<u8>) -> ReqSpec {
    ReqSpec { epoch, key, not_before: 0 }
}

#[test]
fn probe() {
    let mut cfg = Cfg::cluster();
    cfg.reqs = vec![req(1, Some(0)), req(2, Some(1))];
    cfg.crashes = 1;
    check("cluster crash", cfg);
}
