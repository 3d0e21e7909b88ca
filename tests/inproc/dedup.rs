//! SPEC §6: replay, conflicts, derived keys, outcomes. Every test asserts what the
//! origin received. (Crashes on each durable boundary: `tests/it/dedup.rs`.)

use std::time::Duration;

use fencegate::lease::acquire::Holding;
use http::Request;

use crate::support::*;

async fn setup(route_extra: &str) -> (Origin, Fencegate, Holding) {
    setup_with_log(route_extra, "info").await
}

async fn setup_with_log(route_extra: &str, log: &str) -> (Origin, Fencegate, Holding) {
    let origin = Origin::start().await;
    let fg = Fencegate::start_with(
        Setup {
            server: "admin_token = \"admin-secret\"",
            log,
            ..Setup::default()
        },
        &format!(
            "{}{}",
            route_toml("pay", "pay", &origin, route_extra),
            route_toml(
                "resend",
                "pay",
                &origin,
                "in_doubt = \"resend\"\ntimeout_ms = 300"
            ),
        ),
    )
    .await;
    let a = acquire(&fg.epochs, "pay", "worker-a", Duration::from_secs(60)).await;
    (origin, fg, a)
}

on_both_backends! {
async fn done_key_is_replayed_byte_identical() {
    let (origin, fg, a) = setup("").await;
    let first = send(keyed(&fg, "/pay/charge", &a, "charge-1", "amount=5")).await;
    assert_eq!(first.status, 200);
    assert!(first.headers.get("x-fencegate-replayed").is_none());
    let again = send(keyed(&fg, "/pay/charge", &a, "charge-1", "amount=5")).await;
    assert_eq!(again.status, first.status);
    assert_eq!(again.body, first.body);
    assert_eq!(again.headers["x-origin-seq"], first.headers["x-origin-seq"]);
    assert_eq!(again.headers["content-type"], first.headers["content-type"]);
    assert_eq!(again.headers["x-fencegate-replayed"], "true");
    assert_eq!(
        origin.count(),
        1,
        "the retry must not reach the destination"
    );
    assert_eq!(
        origin.log()[0].header("idempotency-key").as_deref(),
        Some("charge-1")
    );
    // Same key, another payload: 422, nothing forwarded.
    let other = send(keyed(&fg, "/pay/charge", &a, "charge-1", "amount=500")).await;
    other.assert_error(422, "dedup_key_reused");
    assert_eq!(origin.count(), 1);
    // A newer epoch retrying a done key gets the replay: the action already happened.
    let b = force_next_epoch(&fg.epochs, "pay", "worker-b", Duration::from_secs(60)).await;
    let r = send(keyed(&fg, "/pay/charge", &b, "charge-1", "amount=5")).await;
    assert_eq!(r.headers["x-fencegate-replayed"], "true");
    // Fencing first: the old epoch is refused before its key is looked at.
    send(keyed(&fg, "/pay/charge", &a, "charge-1", "amount=5"))
        .await
        .assert_error(409, "epoch_stale");
    assert_eq!(origin.count(), 1);
    assert!(fg.metric_sum("fencegate_dedup_replays_total").await >= 2.0);
}
}

on_both_backends! {
async fn in_flight_key_is_refused_until_the_first_finishes() {
    let (origin, fg, a) = setup("").await;
    let req = worker_req(&fg.url("/pay/x"), a.epoch.get(), &a.token)
        .header("idempotency-key", "k-slow")
        .header("x-test-hold", "slow")
        .body(body("p"))
        .unwrap();
    let first = tokio::spawn(send(req));
    origin.wait_for(1).await;
    let dup = Request::post(fg.url("/pay/x"))
        .header("x-lease-epoch", a.epoch.get().to_string())
        .header("x-lease-token", &a.token)
        .header("idempotency-key", "k-slow")
        .header("x-test-hold", "slow")
        .body(body("p"))
        .unwrap();
    send(dup).await.assert_error(409, "dedup_in_flight");
    origin.release("slow");
    assert_eq!(first.await.unwrap().status, 200);
    assert_eq!(origin.count(), 1);
}
}

on_both_backends! {
async fn derived_key_catches_a_blind_retry_and_none_forwards_both() {
    let origin = Origin::start().await;
    let fg = Fencegate::start(
        200,
        &format!(
            "{}{}",
            route_toml("derived", "l", &origin, ""),
            route_toml("plain", "l", &origin, "derive_key = \"none\""),
        ),
    )
    .await;
    let a = acquire(&fg.epochs, "l", "w", Duration::from_secs(60)).await;
    assert_eq!(post(&fg, "/derived/x?n=1", &a, "same").await.status, 200);
    let retry = post(&fg, "/derived/x?n=1", &a, "same").await;
    assert_eq!(retry.headers["x-fencegate-replayed"], "true");
    assert_eq!(post(&fg, "/derived/x?n=2", &a, "same").await.status, 200);
    assert_eq!(origin.count(), 2);
    let expect = fencegate::dedup::DedupKey::derive("derived", "POST", "/derived/x?n=1", b"same");
    assert_eq!(
        origin.log()[0].header("idempotency-key").as_deref(),
        Some(expect.as_str())
    );
    // derive_key = "none": identical repeats are legitimate and both forwarded.
    assert_eq!(post(&fg, "/plain/x", &a, "same").await.status, 200);
    assert_eq!(post(&fg, "/plain/x", &a, "same").await.status, 200);
    let log = origin.log();
    assert_eq!(log.len(), 4);
    assert_ne!(
        log[2].header("idempotency-key"),
        log[3].header("idempotency-key")
    );
}
}

on_both_backends! {
async fn retryable_status_deletes_the_record() {
    let (origin, fg, a) = setup("").await;
    let mk = |status: &str| {
        worker_req(&fg.url("/pay/x"), a.epoch.get(), &a.token)
            .header("idempotency-key", "k-retry")
            .header("x-test-status", status)
            .body(body("p"))
            .unwrap()
    };
    assert_eq!(send(mk("503")).await.status, 503);
    // The 503 was not recorded: the retry is forwarded, and its 201 is.
    assert_eq!(send(mk("201")).await.status, 201);
    let replay = send(mk("201")).await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.headers["x-fencegate-replayed"], "true");
    assert_eq!(origin.count(), 2);
    // A non-retryable error status is a response like any other: kept and replayed.
    let mk2 = |status: &str| {
        worker_req(&fg.url("/pay/x"), a.epoch.get(), &a.token)
            .header("idempotency-key", "k-400")
            .header("x-test-status", status)
            .body(body("p"))
            .unwrap()
    };
    assert_eq!(send(mk2("400")).await.status, 400);
    assert_eq!(
        send(mk2("400")).await.headers["x-fencegate-replayed"],
        "true"
    );
    assert_eq!(origin.count(), 3);
}
}

on_both_backends! {
async fn upstream_timeout_leaves_the_key_in_doubt_under_both_policies() {
    let (origin, fg, a) = setup("timeout_ms = 300").await;
    // reject (default): the timed-out key is in doubt; a retry is refused.
    let slow = |path: &str, hold: &str| {
        worker_req(&fg.url(path), a.epoch.get(), &a.token)
            .header("idempotency-key", "k-doubt")
            .header("x-test-hold", hold)
            .body(body("p"))
            .unwrap()
    };
    send(slow("/pay/x", "h1"))
        .await
        .assert_error(504, "upstream_timeout");
    let retry = send(slow("/pay/x", "h1")).await;
    retry.assert_error(409, "dedup_in_doubt");
    assert_eq!(origin.count(), 1);
    let rec = fg.admin_json("/v1/dedup/pay/k-doubt").await;
    assert_eq!(rec["state"], "in_doubt");
    // The operator checks the destination and resolves it: not delivered → deleted.
    let resolve = |outcome: &str, token: Option<&str>| {
        let mut b = Request::post(fg.admin_url("/v1/dedup/pay/k-doubt/resolve"));
        if let Some(t) = token {
            b = b.header("authorization", format!("Bearer {t}"));
        }
        b.body(body(&format!("{{\"outcome\": \"{outcome}\"}}")))
            .unwrap()
    };
    assert_eq!(send(resolve("not_delivered", None)).await.status, 401);
    assert_eq!(
        send(resolve("not_delivered", Some("wrong"))).await.status,
        401
    );
    assert_eq!(
        send(resolve("not_delivered", Some("admin-secret")))
            .await
            .status,
        200
    );
    origin.release("h1");
    // resend: the in-doubt key is forwarded again, with the same key.
    send(slow("/resend/x", "h2"))
        .await
        .assert_error(504, "upstream_timeout");
    origin.release("h2");
    let again = send(
        worker_req(&fg.url("/resend/x"), a.epoch.get(), &a.token)
            .header("idempotency-key", "k-doubt")
            .header("x-test-hold", "h2")
            .body(body("p"))
            .unwrap(),
    );
    // h2 was released before this request arrives; release again for the new holder.
    let origin2 = origin.clone();
    let releaser = tokio::spawn(async move {
        origin2.wait_for(3).await;
        origin2.release("h2");
    });
    assert_eq!(again.await.status, 200);
    releaser.await.unwrap();
    let log = origin.log();
    assert_eq!(log.len(), 3);
    assert_eq!(
        log[1].header("idempotency-key"),
        log[2].header("idempotency-key")
    );
}
}

on_both_backends! {
async fn a_key_resolved_as_delivered_is_answered_dedup_done() {
    let (origin, fg, a) = setup("timeout_ms = 300").await;
    let req = || {
        worker_req(&fg.url("/pay/x"), a.epoch.get(), &a.token)
            .header("idempotency-key", "k-deliv")
            .header("x-test-hold", "hd")
            .body(body("p"))
            .unwrap()
    };
    send(req()).await.assert_error(504, "upstream_timeout");
    let r = resolve(&fg, "pay", "k-deliv", "delivered").await;
    assert_eq!(r.status, 200, "{:?}", r.json());
    // Delivered, but with no response to replay: never an empty 200.
    let retry = send(req()).await;
    retry.assert_error(409, "dedup_done");
    assert_eq!(retry.json()["upstream_status"], serde_json::Value::Null);
    assert_eq!(origin.count(), 1);
    origin.release("hd");
}
}

on_both_backends! {
/// A worker that gives up and hangs up mid-forward must not cut the forward short:
/// the upstream's answer is still recorded, so the retry is answered from the
/// record, never repeated and never stuck `in_flight`.
async fn a_client_hanging_up_does_not_cut_a_forward_short() {
    let (origin, fg, a) = setup_with_log("", "debug").await;
    let req = worker_req(&fg.url("/pay/x"), a.epoch.get(), &a.token)
        .header("idempotency-key", "k-gone")
        .header("x-test-hold", "gone")
        .body(body("p"))
        .unwrap();
    let client = tokio::spawn(send(req));
    origin.wait_for(1).await;
    client.abort(); // the worker hangs up while the origin works
    assert!(client.await.unwrap_err().is_cancelled());
    eventually("fencegate saw the connection close", || async {
        fg.logs.text().contains("connection ended")
    })
    .await;
    origin.release("gone");
    eventually("the abandoned forward recorded its answer", || async {
        let r = send(keyed(&fg, "/pay/x", &a, "k-gone", "p")).await;
        r.headers.get("x-fencegate-replayed").is_some()
    })
    .await;
    assert_eq!(
        origin.count(),
        1,
        "the retry must not reach the destination"
    );
}
}

on_both_backends! {
/// SPEC §6: a response over `max_replay_bytes` is recorded `done` without its
/// body and passed on whole; a retry gets 409 `dedup_done` naming the upstream's
/// status, never an empty 200 that looks like the answer.
async fn a_response_too_large_to_store_is_delivered_once_and_retried_as_dedup_done() {
    let (origin, fg, a) = setup("max_replay_bytes = 1000").await;
    let req = || {
        worker_req(&fg.url("/pay/big"), a.epoch.get(), &a.token)
            .header("idempotency-key", "k-big")
            .header("x-test-size", "5000")
            .header("x-test-status", "201")
            .body(body("p"))
            .unwrap()
    };
    let first = send(req()).await;
    assert_eq!((first.status.as_u16(), first.body.len()), (201, 5000));
    let retry = send(req()).await;
    retry.assert_error(409, "dedup_done");
    assert_eq!(retry.json()["upstream_status"], 201);
    assert_eq!(origin.count(), 1);
}

/// SPEC §6: without a worker's key, safe methods are never recorded (a poll is
/// answered by the destination, not by yesterday's record); a worker's own key
/// is honoured whatever the method.
async fn safe_methods_without_a_key_are_not_recorded() {
    let (origin, fg, a) = setup("").await;
    let get = |key: Option<&str>| {
        let mut r = Request::get(fg.url("/pay/status?x=1"))
            .header("x-lease-epoch", a.epoch.get().to_string())
            .header("x-lease-token", a.token.as_str());
        if let Some(k) = key {
            r = r.header("idempotency-key", k);
        }
        r.body(body("")).unwrap()
    };
    for _ in 0..2 {
        let r = send(get(None)).await;
        assert_eq!(r.status, 200);
        assert!(!r.headers.contains_key("x-fencegate-replayed"));
    }
    assert_eq!(origin.count(), 2, "both polls reached the destination");
    assert_eq!(send(get(Some("poll-1"))).await.status, 200);
    let again = send(get(Some("poll-1"))).await;
    assert_eq!(again.headers["x-fencegate-replayed"], "true");
    assert_eq!(origin.count(), 3);
}
}

/// `pay` (in doubt after 300 ms, `reject`) and `resend` (`in_doubt = "resend"`)
/// on lease `pay`, with `[dedup] ttl` = `ttl` and a sweep every 20 ms (on the
/// harness's clock, which moves only when told).
async fn setup_retention(ttl: Duration) -> (Origin, Fencegate, Holding) {
    let origin = Origin::start().await;
    let fg = Fencegate::start_with(
        Setup {
            server: "admin_token = \"admin-secret\"",
            ..Setup::default()
        },
        &format!(
            "[dedup]\nttl = \"{}ms\"\nsweep_interval = \"20ms\"\n\n{}{}",
            ttl.as_millis(),
            route_toml("pay", "pay", &origin, "timeout_ms = 300"),
            route_toml(
                "resend",
                "pay",
                &origin,
                "in_doubt = \"resend\"\ntimeout_ms = 300"
            ),
        ),
    )
    .await;
    let a = acquire(&fg.epochs, "pay", "worker-a", Duration::from_secs(600)).await;
    (origin, fg, a)
}

/// The operator's resolution of an in-doubt key (SPEC §8).
async fn resolve(fg: &Fencegate, route: &str, key: &str, outcome: &str) -> Reply {
    send(
        Request::post(fg.admin_url(&format!("/v1/dedup/{route}/{key}/resolve")))
            .header("authorization", "Bearer admin-secret")
            .body(body(&format!("{{\"outcome\": \"{outcome}\"}}")))
            .unwrap(),
    )
    .await
}

/// Waits until two retention sweeps have started since the call (so one ran
/// whole after it).
async fn two_sweeps(fg: &Fencegate) {
    const SWEEPS: &str = "fencegate_state_duration_seconds_count{op=\"sweep\"}";
    let before = fg.metric_sum(SWEEPS).await;
    eventually("two sweeps", || async {
        fg.metric_sum(SWEEPS).await >= before + 2.0
    })
    .await;
}

/// How many times the origin received dedup key `key`.
fn arrivals_of(origin: &Origin, key: &str) -> usize {
    origin
        .log()
        .iter()
        .filter(|a| a.header("idempotency-key").as_deref() == Some(key))
        .count()
}

on_both_backends! {
/// SPEC §6 (issue 25, point 3): a record is kept for `[dedup] ttl` from the moment
/// it became `done`. A key left in doubt and resolved as delivered more than a
/// TTL after its claim stays `done` for a TTL from the resolution: the identical
/// retry is refused (409 `dedup_done`) and the sweeps leave it, so the
/// destination receives the key once. A TTL after the resolution it expires.
async fn a_late_delivered_resolution_is_kept_a_ttl_from_then() {
    let ttl = Duration::from_secs(8);
    let (origin, fg, a) = setup_retention(ttl).await;
    let req = |hold: bool| {
        let mut r = worker_req(&fg.url("/pay/charge"), a.epoch.get(), &a.token)
            .header("idempotency-key", "charge-7");
        if hold {
            r = r.header("x-test-hold", "stuck");
        }
        r.body(body("charge 7")).unwrap()
    };
    send(req(true)).await.assert_error(504, "upstream_timeout");
    fg.clock.advance(Duration::from_secs(10));
    let r = resolve(&fg, "pay", "charge-7", "delivered").await;
    assert_eq!(r.status, 200, "{:?}", r.json());
    assert_eq!(fg.admin_json("/v1/dedup/pay/charge-7").await["state"], "done");
    two_sweeps(&fg).await;
    let retry = send(req(false)).await;
    retry.assert_error(409, "dedup_done");
    assert_eq!(arrivals_of(&origin, "charge-7"), 1, "the retry reached the destination");
    // Kept a TTL from the resolution, not for ever.
    fg.clock.advance(ttl - Duration::from_millis(1));
    two_sweeps(&fg).await;
    send(req(false)).await.assert_error(409, "dedup_done");
    fg.clock.advance(Duration::from_millis(1));
    two_sweeps(&fg).await;
    assert_eq!(fg.admin_json("/v1/dedup/pay/charge-7").await["state"], serde_json::Value::Null);
    origin.release("stuck");
    assert_eq!(arrivals_of(&origin, "charge-7"), 1);
}

/// SPEC §6 (issue 25, point 3): under `in_doubt = "resend"` a key resent more
/// than a TTL after its first claim is `done` for a TTL from its new answer: a
/// retry after that answer is replayed, not forwarded a third time.
async fn a_late_resend_is_kept_a_ttl_from_its_answer() {
    let ttl = Duration::from_secs(8);
    let (origin, fg, a) = setup_retention(ttl).await;
    let req = |hold: bool| {
        let mut r = worker_req(&fg.url("/resend/charge"), a.epoch.get(), &a.token)
            .header("idempotency-key", "charge-8");
        if hold {
            r = r.header("x-test-hold", "stuck");
        }
        r.body(body("charge 8")).unwrap()
    };
    send(req(true)).await.assert_error(504, "upstream_timeout");
    fg.clock.advance(Duration::from_secs(10));
    let resent = send(req(false)).await;
    assert_eq!(resent.status, 200);
    assert!(!resent.headers.contains_key("x-fencegate-replayed"));
    two_sweeps(&fg).await;
    let retry = send(req(false)).await;
    assert_eq!(retry.status, 200);
    assert!(
        retry.headers.contains_key("x-fencegate-replayed"),
        "the retry was forwarded again"
    );
    origin.release("stuck");
    assert_eq!(arrivals_of(&origin, "charge-8"), 2, "the first send and the resend");
}
}
