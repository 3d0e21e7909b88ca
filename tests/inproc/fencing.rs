//! SPEC §1, §4, §5: the late worker, expiry, forged epochs, the drain, a store
//! that cannot be reached. (A crash is in `tests/it/fencing.rs`.)

use std::time::Duration;

use crate::support::*;

const LEASE: &str = "billing";

fn bodies(o: &Origin) -> Vec<String> {
    o.log()
        .iter()
        .map(|a| String::from_utf8_lossy(&a.body).into_owned())
        .collect()
}

on_both_backends! {
async fn late_worker_is_refused_and_absent_at_origin() {
    let (origin, fg) = billing_route(200, "").await;
    let epochs = &fg.epochs;
    let a = acquire(epochs, LEASE, "worker-a", Duration::from_millis(3500)).await;
    post(&fg, "/billing/publish", &a, "A: result v1")
        .await
        .status
        .is_success()
        .then_some(())
        .expect("A admitted");
    // A pauses past its lease. B sees it expired (plus grace) and takes over.
    fg.expire_with_grace(&a);
    let b = acquire(epochs, LEASE, "worker-b", Duration::from_secs(30)).await;
    assert!(b.epoch > a.epoch);
    assert_eq!(
        post(&fg, "/billing/publish", &b, "B: result v2")
            .await
            .status,
        200
    );
    // A wakes up and sends its old work.
    let late = post(&fg, "/billing/publish", &a, "A: stale result").await;
    late.assert_error(409, "epoch_stale");
    assert_eq!(late.json()["lease"], LEASE);
    assert_eq!(late.json()["epoch"], a.epoch.get());
    assert_eq!(late.json()["high_water_mark"], b.epoch.get());
    assert_eq!(bodies(&origin), vec!["A: result v1", "B: result v2"]);
}
}

on_both_backends! {
async fn late_worker_refused_before_the_new_leader_sends_anything() {
    let (origin, fg) = billing_route(100, "").await;
    let epochs = &fg.epochs;
    let a = acquire(epochs, LEASE, "worker-a", Duration::from_millis(3500)).await;
    assert_eq!(post(&fg, "/billing/x", &a, "A1").await.status, 200);
    fg.expire_with_grace(&a);
    let b = acquire(epochs, LEASE, "worker-b", Duration::from_secs(30)).await;
    // B has not sent anything yet: A is refused anyway (expired, or a newer epoch is known).
    let late = post(&fg, "/billing/x", &a, "A-late").await;
    assert!(
        matches!(
            late.error_code().as_deref(),
            Some("lease_expired" | "epoch_stale")
        ),
        "{late:?}"
    );
    assert_eq!(bodies(&origin), vec!["A1"]);
    assert_eq!(post(&fg, "/billing/x", &b, "B1").await.status, 200);
}
}

on_both_backends! {
async fn expiry_is_enforced_with_nobody_taking_over() {
    let (origin, fg) = billing_route(200, "").await;
    let a = acquire(&fg.epochs, LEASE, "worker-a", Duration::from_millis(3500)).await;
    assert_eq!(post(&fg, "/billing/x", &a, "in time").await.status, 200);
    // Just before the end of the tenure on the store's clock: still admitted.
    fg.advance_to(a.expires_at - Duration::from_millis(1));
    assert_eq!(
        post(&fg, "/billing/x", &a, "just in time").await.status,
        200
    );
    // The tenure is over on the store's clock.
    fg.advance_to(a.expires_at);
    let r = post(&fg, "/billing/x", &a, "too late").await;
    r.assert_error(409, "lease_expired");
    assert!(r.json()["expired_at"].is_string());
    assert_eq!(bodies(&origin), vec!["in time", "just in time"]);
}
}

on_both_backends! {
async fn forged_future_and_max_epochs_do_not_poison_the_lease() {
    let (origin, fg) = billing_route(200, "").await;
    let a = acquire(&fg.epochs, LEASE, "worker-a", Duration::from_secs(30)).await;
    assert_eq!(post(&fg, "/billing/x", &a, "a1").await.status, 200);
    for forged in [a.epoch.get() + 1, a.epoch.get() + 1000, u64::MAX] {
        let r = send(
            worker_req(&fg.url("/billing/x"), forged, &a.token)
                .body(body("forged"))
                .unwrap(),
        )
        .await;
        r.assert_error(403, "epoch_unknown");
        assert_eq!(r.json()["epoch"], forged);
    }
    let zero = send(
        worker_req(&fg.url("/billing/x"), 0, &a.token)
            .body(body("zero"))
            .unwrap(),
    )
    .await;
    zero.assert_error(409, "epoch_stale");
    // Wrong and missing token.
    let r = send(
        worker_req(&fg.url("/billing/x"), a.epoch.get(), "not-the-token")
            .body(body("x"))
            .unwrap(),
    )
    .await;
    r.assert_error(403, "token_invalid");
    let r = send(
        http::Request::post(fg.url("/billing/x"))
            .header("x-lease-epoch", a.epoch.get().to_string())
            .body(body("x"))
            .unwrap(),
    )
    .await;
    r.assert_error(401, "token_missing");
    // The legitimate holder is still admitted.
    assert_eq!(post(&fg, "/billing/x", &a, "a2").await.status, 200);
    assert_eq!(bodies(&origin), vec!["a1", "a2"]);
    let leases = fg.admin_json("/v1/leases").await;
    assert_eq!(leases["leases"][0]["high_water_mark"], a.epoch.get());
}
}

on_both_backends! {
async fn unparsable_and_release_epochs_admit_nothing_but_make_older_ones_stale() {
    let (origin, fg) = billing_route(100, "").await;
    let epochs = &fg.epochs;
    let a = acquire(epochs, LEASE, "worker-a", Duration::from_secs(30)).await;
    assert_eq!(post(&fg, "/billing/x", &a, "a1").await.status, 200);
    let garbage = a.epoch.get() + 1;
    put_raw(epochs, LEASE, garbage, b"{not json").await;
    let r = send(
        worker_req(&fg.url("/billing/x"), garbage, &a.token)
            .body(body("g"))
            .unwrap(),
    )
    .await;
    r.assert_error(403, "epoch_invalid");
    // The garbage epoch exists, so A's epoch is stale now.
    eventually("refresher sees the garbage epoch", || async {
        post(&fg, "/billing/x", &a, "a-after")
            .await
            .error_code()
            .as_deref()
            == Some("epoch_stale")
    })
    .await;
    // A release admits nothing either.
    let lease = fencegate::epoch::LeaseName::parse(LEASE).unwrap();
    let rel = fencegate::epoch::EpochRecord::release(
        &lease,
        fencegate::epoch::Epoch::new(garbage + 1),
        "worker-a",
    );
    put_raw(epochs, LEASE, garbage + 1, &rel.to_json()).await;
    let r = send(
        worker_req(&fg.url("/billing/x"), garbage + 1, &a.token)
            .body(body("r"))
            .unwrap(),
    )
    .await;
    r.assert_error(403, "epoch_invalid");
    assert_eq!(bodies(&origin), vec!["a1"]);
}
}

on_both_backends! {
async fn drain_completes_the_older_request_before_the_newer_reaches_the_origin() {
    let (origin, fg) = billing_route(60_000, "").await;
    let epochs = &fg.epochs;
    let a = acquire(epochs, LEASE, "worker-a", Duration::from_secs(30)).await;
    let url = fg.url("/billing/x");
    let (ea, ta) = (a.epoch.get(), a.token.clone());
    let slow = tokio::spawn(async move {
        send(
            worker_req(&url, ea, &ta)
                .header("x-test-hold", "slow-a")
                .body(body("A slow"))
                .unwrap(),
        )
        .await
    });
    origin.wait_for(1).await;
    let b = force_next_epoch(epochs, LEASE, "worker-b", Duration::from_secs(30)).await;
    let url = fg.url("/billing/x");
    let (eb, tb) = (b.epoch.get(), b.token.clone());
    let newer =
        tokio::spawn(async move { send(worker_req(&url, eb, &tb).body(body("B")).unwrap()).await });
    // B is admitted to the drain and waits there; it has not reached the origin.
    eventually("the drain started", || async {
        fg.metric_sum("fencegate_drains_started_total").await >= 1.0
    })
    .await;
    assert_eq!(
        origin.count(),
        1,
        "B must not reach the origin while A is in flight"
    );
    // A newer-epoch request is in progress: new epoch-A requests are refused now.
    post(&fg, "/billing/x", &a, "A again")
        .await
        .assert_error(409, "epoch_stale");
    origin.release("slow-a");
    assert_eq!(slow.await.unwrap().status, 200);
    assert_eq!(newer.await.unwrap().status, 200);
    let log = origin.log();
    assert_eq!(log.len(), 2);
    assert_eq!(log[0].epoch(), Some(ea));
    assert_eq!(log[1].epoch(), Some(eb));
    assert!(
        log[0].completed.unwrap() <= log[1].arrived,
        "A's response was complete before B arrived"
    );
}
}

on_both_backends! {
async fn drain_timeout_aborts_the_older_request() {
    let (origin, fg) = billing_route(60_000, "drain_timeout_ms = 300").await;
    let epochs = &fg.epochs;
    let a = acquire(epochs, LEASE, "worker-a", Duration::from_secs(30)).await;
    let url = fg.url("/billing/x");
    let (ea, ta) = (a.epoch.get(), a.token.clone());
    let stuck = tokio::spawn(async move {
        send(
            worker_req(&url, ea, &ta)
                .header("x-test-hold", "never")
                .body(body("A stuck"))
                .unwrap(),
        )
        .await
    });
    origin.wait_for(1).await;
    let b = force_next_epoch(epochs, LEASE, "worker-b", Duration::from_secs(30)).await;
    let r = post(&fg, "/billing/x", &b, "B").await;
    assert_eq!(r.status, 200);
    let a_reply = stuck.await.unwrap();
    a_reply.assert_error(504, "drain_aborted");
    assert_eq!(a_reply.json()["latest_epoch"], b.epoch.get());
    assert_eq!(fg.metric_sum("fencegate_drains_aborted_total").await, 1.0);
    let log = origin.log();
    assert_eq!(log.len(), 2);
    assert_eq!(log[1].epoch(), Some(b.epoch.get()));
    origin.release("never");
}
}

on_both_backends! {
/// The store is down (every list and read fails before reaching it, as when it
/// does not answer within its timeout): an epoch fencegate has not validated yet
/// is refused, one validated from cache is still admitted.
async fn store_unreachable_fails_closed_for_unvalidated_epochs() {
    let (origin, fg) = billing_route(60_000, "").await;
    let epochs = &fg.epochs;
    let a = acquire(epochs, LEASE, "worker-a", Duration::from_secs(30)).await;
    assert_eq!(post(&fg, "/billing/x", &a, "a1").await.status, 200);
    let b = force_next_epoch(epochs, LEASE, "worker-b", Duration::from_secs(30)).await;
    fg.store.add(Rule::new(Op::List, Fault::Unavailable));
    fg.store.add(Rule::new(Op::Get, Fault::Unavailable));
    let r = post(&fg, "/billing/x", &b, "b-while-down").await;
    r.assert_error(503, "store_unavailable");
    assert_eq!(r.headers["retry-after"], "1");
    assert!(fg.store.fired() >= 1, "fencegate asked the store");
    // A's epoch is validated from cache and not expired: still admitted.
    assert_eq!(post(&fg, "/billing/x", &a, "a2-cached").await.status, 200);
    fg.store.clear();
    assert_eq!(post(&fg, "/billing/x", &b, "b1").await.status, 200);
    assert_eq!(bodies(&origin), vec!["a1", "a2-cached", "b1"]);
}
}

on_both_backends! {
async fn steady_state_requests_make_no_store_calls() {
    let (origin, fg) = billing_route(60_000, "derive_key = \"none\"").await;
    let a = acquire(&fg.epochs, LEASE, "worker-a", Duration::from_secs(60)).await;
    assert_eq!(post(&fg, "/billing/x", &a, "warm-up").await.status, 200);
    let before = fg.metric_sum("fencegate_store_calls_total").await;
    assert!(before >= 2.0, "the warm-up read the store: {before}");
    let at_the_store = |fg: &Fencegate| {
        [Op::List, Op::Get, Op::Create, Op::Delete]
            .iter()
            .map(|op| fg.store.calls(*op, None))
            .sum::<usize>()
    };
    let store_before = at_the_store(&fg);
    for i in 0..200 {
        assert_eq!(
            post(&fg, "/billing/x", &a, &format!("r{i}")).await.status,
            200
        );
    }
    let after = fg.metric_sum("fencegate_store_calls_total").await;
    assert_eq!(
        after - before,
        0.0,
        "store calls during 200 steady-state requests"
    );
    assert_eq!(
        at_the_store(&fg),
        store_before,
        "calls the store saw during 200 steady-state requests"
    );
    assert_eq!(origin.count(), 201);
}
}
