//! SPEC §4–§6 at the fence's edges, asserted at the destination: a route timeout
//! during a drain, an abort with bytes still to write, a raise that outlives its
//! epoch, and an in-flight key past the dedup TTL. (A crash during a drain:
//! `tests/it/edges.rs`.)
//!
//! The lower bounds on arrival times below are the rule itself (nothing newer may
//! arrive before the drain's timeout has passed), not performance assertions.

use std::time::{Duration, Instant};

use crate::support::*;

const LEASE: &str = "billing";

on_both_backends! {
/// SPEC §5: a request whose route timeout fired may still be executing at the
/// destination; a newer epoch waits for it until the drain's own timeout.
async fn a_timed_out_request_keeps_the_drain_waiting_until_the_drain_timeout() {
    let drain = Duration::from_millis(1500);
    let (origin, fg) = billing_route(60_000, "timeout_ms = 300\ndrain_timeout_ms = 1500").await;
    let a = acquire(&fg.epochs, LEASE, "worker-a", Duration::from_secs(30)).await;
    let stuck = spawn_post(&fg, &a, &[("x-test-hold", "stuck")], b"A".to_vec());
    origin.wait_for(1).await;
    stuck
        .await
        .unwrap()
        .unwrap()
        .assert_error(504, "upstream_timeout");
    assert_eq!(
        fg.admin_json("/v1/leases").await["leases"][0]["in_doubt"],
        1
    );
    assert_eq!(fg.metric_sum("fencegate_in_doubt_in_drain").await, 1.0);
    let b = force_next_epoch(&fg.epochs, LEASE, "worker-b", Duration::from_secs(30)).await;
    let raised = Instant::now();
    let r = post(&fg, "/billing/x", &b, "B").await;
    assert_eq!(r.status, 200);
    let log = origin.log();
    assert_eq!(log.len(), 2);
    assert!(log[0].completed.is_none(), "A is still at the destination");
    assert!(
        log[1].arrived >= raised + drain,
        "B arrived {:?} after its raise began, while A was still at the destination",
        log[1].arrived - raised
    );
    assert_eq!(fg.metric_sum("fencegate_drains_aborted_total").await, 1.0);
    origin.release("stuck");
}
}

on_both_backends! {
/// The same for a request without a body and without a record (a GET without an
/// Idempotency-Key, streamed): its timeout does not end the drain either.
async fn a_timed_out_get_keeps_the_drain_waiting_until_the_drain_timeout() {
    let drain = Duration::from_millis(1500);
    let (origin, fg) = billing_route(60_000, "timeout_ms = 300\ndrain_timeout_ms = 1500").await;
    let a = acquire(&fg.epochs, LEASE, "worker-a", Duration::from_secs(30)).await;
    let get = worker_req(&fg.url("/billing/poll"), a.epoch.get(), &a.token)
        .method("GET")
        .header("x-test-hold", "stuck")
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let stuck = tokio::spawn(try_send(get));
    origin.wait_for(1).await;
    stuck
        .await
        .unwrap()
        .unwrap()
        .assert_error(504, "upstream_timeout");
    let b = force_next_epoch(&fg.epochs, LEASE, "worker-b", Duration::from_secs(30)).await;
    let raised = Instant::now();
    let r = post(&fg, "/billing/x", &b, "B").await;
    assert_eq!(r.status, 200);
    let log = origin.log();
    assert_eq!(log.len(), 2);
    assert!(log[0].completed.is_none(), "A is still at the destination");
    assert!(
        log[1].arrived >= raised + drain,
        "B arrived {:?} after its raise began, while the GET was still at the destination",
        log[1].arrived - raised
    );
    origin.release("stuck");
}
}

on_both_backends! {
/// SPEC §5/§6: an abort stops writing at once. A's large body is being read
/// slowly when B's drain times out: the connection is cut, and the destination
/// never gets A whole — not even after B has completed.
async fn an_abort_stops_writing_the_older_request() {
    const SIZE: usize = 24 << 20;
    let (origin, fg) = billing_route(
        60_000,
        "drain_timeout_ms = 300\nmax_body_bytes = 33554432\ntimeout_ms = 30000",
    )
    .await;
    let a = acquire(&fg.epochs, LEASE, "worker-a", Duration::from_secs(30)).await;
    let big = spawn_post(&fg, &a, &[("x-test-hold-body", "a-body")], vec![b'a'; SIZE]);
    origin.wait_for(1).await;
    let b = force_next_epoch(&fg.epochs, LEASE, "worker-b", Duration::from_secs(30)).await;
    assert_eq!(post(&fg, "/billing/x", &b, "B").await.status, 200);
    big.await
        .unwrap()
        .unwrap()
        .assert_error(504, "drain_aborted");
    // B has completed; now the destination reads what it can of A.
    origin.release("a-body");
    eventually("the origin finished reading A", || async {
        origin.log()[0].completed.is_some()
    })
    .await;
    let a_at_origin = &origin.log()[0];
    assert!(
        !a_at_origin.body_whole && a_at_origin.body_read < SIZE,
        "A's body reached the destination after the abort: {} of {SIZE} bytes, whole: {}",
        a_at_origin.body_read,
        a_at_origin.body_whole
    );
    // The key is in doubt, never "not delivered".
    let key = origin.log()[0].header("idempotency-key").unwrap();
    let rec = fg.admin_json(&format!("/v1/dedup/billing/{key}")).await;
    assert_eq!(rec["state"], "in_doubt", "{rec}");
}
}

on_both_backends! {
/// SPEC §4: a raiser's claim is decided again when its drain completes. B waited
/// behind A for longer than B's own lease: it is refused, never forwarded.
async fn a_raise_that_outlives_its_epoch_is_refused_when_the_drain_ends() {
    let (origin, fg) = billing_route(60_000, "drain_timeout_ms = 30000").await;
    let a = acquire(&fg.epochs, LEASE, "worker-a", Duration::from_secs(30)).await;
    let slow = spawn_post(&fg, &a, &[("x-test-hold", "slow-a")], b"A".to_vec());
    origin.wait_for(1).await;
    let b = force_next_epoch(&fg.epochs, LEASE, "worker-b", Duration::from_millis(2500)).await;
    let raiser = spawn_post(&fg, &b, &[], b"B, raised".to_vec());
    eventually("the drain started", || drains_started(&fg)).await;
    // B expires while its raise waits. Then a fresh B request says so at once.
    fg.advance_to(b.expires_at);
    post(&fg, "/billing/x", &b, "B, probe")
        .await
        .assert_error(409, "lease_expired");
    origin.release("slow-a");
    assert_eq!(slow.await.unwrap().unwrap().status, 200);
    raiser
        .await
        .unwrap()
        .unwrap()
        .assert_error(409, "lease_expired");
    assert_eq!(origin.count(), 1, "only A reached the origin");
}
}

on_both_backends! {
/// SPEC §4: the same, when a newer epoch became known while the raise waited.
async fn a_raise_superseded_while_it_drains_is_refused_when_the_drain_ends() {
    let (origin, fg) = billing_route(100, "drain_timeout_ms = 30000").await;
    let a = acquire(&fg.epochs, LEASE, "worker-a", Duration::from_secs(30)).await;
    let slow = spawn_post(&fg, &a, &[("x-test-hold", "slow-a")], b"A".to_vec());
    origin.wait_for(1).await;
    let b = force_next_epoch(&fg.epochs, LEASE, "worker-b", Duration::from_secs(30)).await;
    let raiser = spawn_post(&fg, &b, &[], b"B, raised".to_vec());
    eventually("the drain started", || drains_started(&fg)).await;
    let c = force_next_epoch(&fg.epochs, LEASE, "worker-c", Duration::from_secs(30)).await;
    eventually("fencegate knows C", || async {
        fg.admin_json("/v1/leases")
            .await
            .to_string()
            .contains(&format!("\"latest_epoch\":{}", c.epoch.get()))
    })
    .await;
    origin.release("slow-a");
    assert_eq!(slow.await.unwrap().unwrap().status, 200);
    let r = raiser.await.unwrap().unwrap();
    r.assert_error(409, "epoch_stale");
    assert_eq!(r.json()["latest_epoch"], c.epoch.get());
    assert_eq!(origin.count(), 1, "only A reached the origin");
}
}

on_both_backends! {
/// SPEC §6: an `in_flight` record never expires into "absent": a retry of a key
/// still at the destination past the dedup TTL is refused, not sent again.
async fn an_in_flight_key_past_the_dedup_ttl_is_not_forwarded_again() {
    let origin = Origin::start().await;
    let fg = Fencegate::start(
        60_000,
        &format!(
            "[dedup]\nttl = \"1s\"\n{}",
            route_toml("billing", LEASE, &origin, "")
        ),
    )
    .await;
    let a = acquire(&fg.epochs, LEASE, "worker-a", Duration::from_secs(30)).await;
    let first = spawn_post(
        &fg,
        &a,
        &[("x-test-hold", "first"), ("idempotency-key", "k-1")],
        b"once".to_vec(),
    );
    origin.wait_for(1).await;
    // The TTL passes (and then some) on fencegate's clock.
    fg.clock.advance(Duration::from_millis(1500));
    let retry = send(keyed(&fg, "/billing/x", &a, "k-1", "once")).await;
    retry.assert_error(409, "dedup_in_flight");
    origin.release("first");
    assert_eq!(first.await.unwrap().unwrap().status, 200);
    assert_eq!(origin.count(), 1, "the key reached the destination once");
}
}
