//! The in-process harness itself: the clock moves only when told, and the
//! graceful stop flushes state and says so in fencegate's own log.

use std::time::Duration;

use fencegate::clock::Clock;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_clock_moves_only_when_told_and_stop_is_graceful() {
    let origin = Origin::start().await;
    let fg = Fencegate::start(200, &route_toml("jobs", "jobs", &origin, "")).await;
    let a = acquire(&fg.epochs, "jobs", "w", Duration::from_secs(1)).await;
    let t0 = fg.clock.now();
    assert_eq!(post(&fg, "/jobs/x", &a, "one").await.status, 200);
    assert_eq!(fg.clock.now(), t0, "the clock moved by itself");
    fg.advance_to(a.expires_at);
    post(&fg, "/jobs/x", &a, "two")
        .await
        .assert_error(409, "lease_expired");
    assert_eq!(origin.count(), 1);
    let logs = fg.logs.clone();
    fg.stop().await.unwrap();
    let text = logs.text();
    assert!(text.contains("stopped; durable state flushed"), "{text}");
}
