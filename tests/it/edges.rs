//! SPEC §5 at the fence's edge, asserted at the destination: a crash during a
//! drain. (A route timeout during a drain, an abort with bytes still to write, a
//! raise that outlives its epoch, an in-flight key past the dedup TTL:
//! `tests/inproc/edges.rs`.)
//!
//! The lower bounds on arrival times below are the rule itself (nothing newer may
//! arrive before the drain's timeout has passed), not performance assertions.

use std::time::{Duration, Instant};

use crate::support::*;

const LEASE: &str = "billing";

/// SPEC §5: a drain interrupted by a crash is not forgotten. Epoch A is at the
/// destination, B's raise is draining, fencegate is killed: after the restart a
/// new B request waits out the drain timeout before it is forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_mid_drain_keeps_the_newer_epoch_out_until_the_drain_timeout() {
    skip_without_python!();
    let drain = Duration::from_millis(1500);
    let (_s3, origin, mut fg, epochs) = billing_route(60_000, "drain_timeout_ms = 1500").await;
    let a = acquire(&epochs, LEASE, "worker-a", Duration::from_secs(30)).await;
    let slow = spawn_post(&fg, &a, &[("x-test-hold", "slow-a")], b"A".to_vec());
    origin.wait_for(1).await;
    let b = force_next_epoch(&epochs, LEASE, "worker-b", Duration::from_secs(30)).await;
    let draining = spawn_post(&fg, &b, &[], b"B before the crash".to_vec());
    eventually("the drain started", || drains_started(&fg)).await;
    let before_kill = Instant::now();
    fg.restart(); // kill -9 mid-drain, start again on the same data directory
    assert!(draining.await.unwrap().is_err(), "its fencegate died");
    let after = post(&fg, "/billing/x", &b, "B after the restart").await;
    assert_eq!(after.status, 200);
    let log = origin.log();
    assert_eq!(
        log.len(),
        2,
        "only A and B-after-restart reached the origin"
    );
    assert_eq!(log[1].epoch(), Some(b.epoch.get()));
    assert!(
        log[1].arrived >= before_kill + drain,
        "B arrived {:?} after the kill, while A was still at the destination; the drain timeout is {drain:?}",
        log[1].arrived - before_kill
    );
    origin.release("slow-a");
    assert!(slow.await.unwrap().is_err(), "A's fencegate died");
}
