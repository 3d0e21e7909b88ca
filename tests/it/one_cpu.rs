//! fencegate on one CPU runs on tokio's current-thread scheduler (one thread
//! for everything: requests, the refresher, the guard, the flusher's wake-ups).
//! The rules that rest on tasks running beside each other, asserted at the
//! destination in that mode: a newer epoch waits for the older one's request
//! to end (SPEC §5), the older epoch is refused after it (§4), and a keyed
//! retry is answered from its record (§6).

use std::time::Duration;

use crate::support::*;

const LEASE: &str = "billing";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_one_thread_the_drain_the_fence_and_the_replay_hold() {
    skip_without_python!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let fg = Fencegate::start_with_env(
        &format!(
            "{}{}",
            s3.store_toml(60_000),
            route_toml("billing", LEASE, &origin, "")
        ),
        &[("TOKIO_WORKER_THREADS", "1")],
    );
    assert!(
        fg.stderr().contains("current-thread scheduler"),
        "not on one thread: {}",
        fg.stderr()
    );
    let epochs = s3.epochs().await;
    let a = acquire(&epochs, LEASE, "worker-a", Duration::from_secs(30)).await;
    let slow = spawn_post(&fg, &a, &[("x-test-hold", "slow-a")], b"A".to_vec());
    origin.wait_for(1).await;
    let b = force_next_epoch(&epochs, LEASE, "worker-b", Duration::from_secs(30)).await;
    let newer = spawn_post(&fg, &b, &[], b"B".to_vec());
    eventually("the drain started", || drains_started(&fg)).await;
    // The one thread that holds B in its drain answers the admin listener
    // (the metric above) and keeps B from the origin while A is there.
    assert_eq!(
        origin.log().len(),
        1,
        "B reached the origin while A was there"
    );
    origin.release("slow-a");
    assert_eq!(slow.await.unwrap().unwrap().status, 200);
    assert_eq!(newer.await.unwrap().unwrap().status, 200);
    let log = origin.log();
    assert_eq!(log.len(), 2);
    assert_eq!(log[1].epoch(), Some(b.epoch.get()));
    let a_done = log[0].completed.expect("A's exchange completed");
    assert!(
        log[1].arrived >= a_done,
        "B arrived before A's exchange ended"
    );
    post(&fg, "/billing/x", &a, "A late")
        .await
        .assert_error(409, "epoch_stale");
    let first = send(keyed(&fg, "/billing/x", &b, "k-1", "charge")).await;
    let again = send(keyed(&fg, "/billing/x", &b, "k-1", "charge")).await;
    assert_eq!(first.status, 200);
    assert_eq!(again.status, first.status);
    assert_eq!(first.body, again.body);
    let bodies: Vec<_> = origin
        .log()
        .iter()
        .map(|x| String::from_utf8_lossy(&x.body).into_owned())
        .collect();
    assert_eq!(bodies, vec!["A", "B", "charge"], "the retry was forwarded");
}
