//! Protecting the destination in process (SPEC §7 `upstream_held`, §9
//! `max_in_flight`, `max_retry_after`, `breaker`): what the circuit breaker
//! counts (an exchange that timed out is the upstream's failure; a 4xx answer,
//! or the worker's own stalled upload, is not), what keeps a slot of
//! `max_in_flight`, and which `Retry-After` values hold a route.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;

use crate::support::*;

/// `failures = 1`: a 404 from the origin leaves the breaker closed (the next
/// request is forwarded); a request the origin does not answer within the
/// route's timeout (504 `upstream_timeout`) opens it, and the next request is
/// refused `breaker_open` without reaching the origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_opens_the_breaker_and_a_4xx_does_not() {
    let (origin, fg) = billing_route(
        200,
        "timeout_ms = 300\nbreaker = { failures = 1, cool_down = \"10m\" }",
    )
    .await;
    let a = acquire(&fg.epochs, "billing", "worker-a", Duration::from_secs(30)).await;
    let url = fg.url("/billing/x");
    let r = send(
        worker_req(&url, a.epoch.get(), &a.token)
            .header("x-test-status", "404")
            .body(body("x"))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 404);
    assert_eq!(
        post(&fg, "/billing/x", &a, "still closed").await.status,
        200
    );

    let r = send(
        worker_req(&url, a.epoch.get(), &a.token)
            .header("x-test-hold", "never")
            .body(body("slow"))
            .unwrap(),
    )
    .await;
    r.assert_error(504, "upstream_timeout");
    let refused = send(keyed(&fg, "/billing/x", &a, "after", "x")).await;
    refused.assert_error(503, "upstream_held");
    assert_eq!(refused.json()["detail"], "breaker_open");
    assert_eq!(origin.count(), 3, "the refused request reached nothing");
    let view = fg.admin_json("/v1/routes").await;
    assert_eq!(view["routes"][0]["breaker"]["state"], "open", "{view}");
    origin.release("never");
}

/// `/v1/routes`' entry for the one route.
async fn route_view(fg: &Fencegate) -> serde_json::Value {
    fg.admin_json("/v1/routes").await["routes"][0].clone()
}

/// A request the origin answers 500 (`payload`), then the wait until the
/// breaker (`failures = 1`) is half-open.
async fn failed_until_half_open(
    fg: &Fencegate,
    a: &fencegate::lease::acquire::Holding,
    payload: &str,
) {
    let r = send(
        worker_req(&fg.url("/billing/x"), a.epoch.get(), &a.token)
            .header("x-test-status", "500")
            .body(body(payload))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 500);
    eventually("half-open", || async {
        route_view(fg).await["breaker"]["state"] == "half_open"
    })
    .await;
}

/// Route `billing` (`route_extra`: more of its keys) and a worker holding its
/// lease for 60 s.
async fn route_and_worker(
    route_extra: &str,
) -> (Origin, Fencegate, fencegate::lease::acquire::Holding) {
    let (origin, fg) = billing_route(60_000, route_extra).await;
    let a = acquire(&fg.epochs, "billing", "worker-a", Duration::from_secs(60)).await;
    (origin, fg, a)
}

/// A keyed POST of "A" to `/billing/x` that the origin holds under `hold`.
fn keyed_hold(
    fg: &Fencegate,
    h: &fencegate::lease::acquire::Holding,
    key: &str,
    hold: &str,
) -> Request<Full<Bytes>> {
    worker_req(&fg.url("/billing/x"), h.epoch.get(), &h.token)
        .header("idempotency-key", key)
        .header("x-test-hold", hold)
        .body(body("A"))
        .unwrap()
}

/// Starts a streamed (unrecorded) POST whose body the worker feeds; sends
/// `first` and returns the feed (kept open: the worker stalls) and the answer.
async fn stalled_upload(
    fg: &Fencegate,
    h: &fencegate::lease::acquire::Holding,
    extra: &[(&str, &str)],
) -> (
    tokio::sync::mpsc::Sender<Bytes>,
    tokio::task::JoinHandle<hyper::Result<hyper::Response<hyper::body::Incoming>>>,
    tokio::task::JoinHandle<()>,
) {
    let s = tokio::net::TcpStream::connect(fg.proxy_addr())
        .await
        .unwrap();
    let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s))
        .await
        .unwrap();
    let conn = tokio::spawn(async move {
        let _ = conn.await;
    });
    let (feed, rx) = tokio::sync::mpsc::channel(1);
    let mut req = Request::post("/billing/upload")
        .header("host", "fencegate.test")
        .header("x-lease-epoch", h.epoch.get().to_string())
        .header("x-lease-token", &h.token);
    for (n, v) in extra {
        req = req.header(*n, *v);
    }
    let req = req.body(Fed(rx)).unwrap();
    let answer = tokio::spawn(async move { tx.send_request(req).await });
    feed.send(Bytes::from_static(b"first ")).await.unwrap();
    (feed, answer, conn)
}

/// SPEC §7 (a request counts toward `max_in_flight` "as in §5") and §5 (a
/// request whose outcome is unknown keeps counting: the destination may still
/// be executing it): a request that timed out keeps its slot for the drain
/// timeout. With `max_in_flight = 1`, A times out (504) while the origin still
/// holds it, and B is refused 503 `upstream_held` (`in_flight_limit`): nothing
/// of B at the origin. Failed when `Ticket` dropped its slot on the failure path
/// at once while the pass lingered: B was forwarded next to A, and the origin
/// handled two at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_request_keeps_its_slot_while_the_origin_may_still_run_it() {
    let (origin, fg, a) =
        route_and_worker("timeout_ms = 300\ndrain_timeout_ms = 60000\nmax_in_flight = 1").await;
    let r = send(keyed_hold(&fg, &a, "slow", "never")).await;
    r.assert_error(504, "upstream_timeout");
    assert_eq!(origin.count(), 1);
    let b = send(keyed(&fg, "/billing/x", &a, "next", "B")).await;
    let seen = origin.count();
    let max = origin.max_concurrent();
    origin.release("never");
    assert_eq!(
        (b.status.as_u16(), b.error_code().as_deref(), seen, max),
        (503, Some("upstream_held"), 1, 1),
        "B was forwarded while the timed-out A (outcome unknown, SPEC §5) was still at the origin"
    );
}

/// An `upstream_held` answer says only that nothing of this request was
/// forwarded or recorded. A's key `k` is `in_flight` (A holds the route's only
/// slot at the origin); its concurrent retry with the same key is refused
/// without calling the key free (or answered as SPEC §6 does, 409
/// `dedup_in_flight`). Failed when the message told the worker "the idempotency
/// key, if any, is free": a worker that believed it and, say, resolved or
/// reused the key acted on a falsehood.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_held_never_calls_an_in_flight_key_free() {
    let (origin, fg, a) = route_and_worker("max_in_flight = 1").await;
    let first = tokio::spawn(try_send(keyed_hold(&fg, &a, "k", "h")));
    origin.wait_for(1).await;
    let record = fg.admin_json("/v1/dedup/billing/k").await;
    assert_eq!(record["state"], "in_flight", "{record}");
    let retry = send(keyed(&fg, "/billing/x", &a, "k", "A")).await;
    origin.release("h");
    assert_eq!(first.await.unwrap().unwrap().status, 200);
    let msg = retry.json()["message"].as_str().unwrap_or("").to_owned();
    assert!(
        retry.error_code().as_deref() == Some("dedup_in_flight") || !msg.contains("is free"),
        "a key in flight is called free: {} {msg}",
        retry.status
    );
}

/// A worker that drops a streamed answer midway gives its slot back (the route
/// is not left "full").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_cutting_a_streamed_answer_gives_its_slot_back() {
    let (origin, fg, a) = route_and_worker("max_in_flight = 1").await;
    let s = tokio::net::TcpStream::connect(fg.proxy_addr())
        .await
        .unwrap();
    let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s))
        .await
        .unwrap();
    let conn = tokio::spawn(conn);
    let resp = tx
        .send_request(
            Request::get("/billing/big")
                .header("host", "fencegate.test")
                .header("x-lease-epoch", a.epoch.get().to_string())
                .header("x-lease-token", &a.token)
                .header("x-test-stream-bytes", (256u64 << 20).to_string())
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let _ = &origin;
    let _ = body.frame().await;
    assert_eq!(route_view(&fg).await["in_flight"], 1);
    // The worker goes away mid-stream.
    drop(body);
    drop(tx);
    conn.abort();
    eventually("the slot given back", || async {
        route_view(&fg).await["in_flight"] == 0
    })
    .await;
    assert_eq!(post(&fg, "/billing/x", &a, "B").await.status, 200);
    assert_eq!(origin.count(), 2);
}

/// While the route is held (a 503 with `Retry-After: 60`), a stale worker is
/// told it is stale, not `upstream_held` (admission comes first), and the new
/// holder is refused `upstream_held` without anything reaching the origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_worker_is_told_so_before_upstream_held() {
    let (origin, fg) = billing_route(200, "").await;
    let a = acquire(
        &fg.epochs,
        "billing",
        "worker-a",
        Duration::from_millis(3500),
    )
    .await;
    let r = send(
        worker_req(&fg.url("/billing/x"), a.epoch.get(), &a.token)
            .header("x-test-status", "503")
            .header("x-test-retry-after", "60")
            .body(body("ask"))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 503);
    fg.expire_with_grace(&a);
    let b = acquire(&fg.epochs, "billing", "worker-b", Duration::from_secs(30)).await;
    let late = post(&fg, "/billing/x", &a, "late").await;
    assert!(
        matches!(
            late.error_code().as_deref(),
            Some("epoch_stale" | "lease_expired")
        ),
        "{late:?}"
    );
    post(&fg, "/billing/x", &b, "B")
        .await
        .assert_error(503, "upstream_held");
    assert_eq!(origin.count(), 1);
}

/// Retry-After on a 200, a malformed one, a date in the past and one of 0 hold
/// nothing; a huge one holds no longer than `max_retry_after` and the refusal
/// counts down from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_retry_after_values_hold_nothing_and_a_huge_one_is_capped() {
    let (origin, fg, a) = route_and_worker("max_retry_after = \"7s\"").await;
    let url = fg.url("/billing/x");
    let past = httpdate::fmt_http_date(std::time::SystemTime::now() - Duration::from_secs(60));
    for (i, (status, v)) in [
        ("200", "60"),
        ("429", "soon"),
        ("503", "1.5"),
        ("503", "-1"),
        ("429", past.as_str()),
        ("503", "0"),
        ("429", " 0 "),
    ]
    .iter()
    .enumerate()
    {
        let r = send(
            worker_req(&url, a.epoch.get(), &a.token)
                .header("idempotency-key", format!("odd-{i}"))
                .header("x-test-status", *status)
                .header("x-test-retry-after", *v)
                .body(body("x"))
                .unwrap(),
        )
        .await;
        assert_eq!(r.status.as_str(), *status);
        let view = route_view(&fg).await;
        assert!(view["held_for_ms"].is_null(), "{status} {v:?}: {view}");
    }
    let r = send(
        worker_req(&url, a.epoch.get(), &a.token)
            .header("x-test-status", "429")
            .header("x-test-retry-after", "99999999999999999999999999")
            .body(body("huge"))
            .unwrap(),
    )
    .await;
    assert_eq!(r.headers["retry-after"], "99999999999999999999999999");
    let refused = send(keyed(&fg, "/billing/x", &a, "after", "x")).await;
    refused.assert_error(503, "upstream_held");
    let secs = refused.retry_after_secs();
    assert!((1..=7).contains(&secs), "{secs}");
    assert_eq!(origin.count(), 8);
}

/// A half-open breaker whose probe turns out to be a replay of a `done` key
/// (nothing forwarded) hands the probe to the next request, which closes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_that_is_a_replay_hands_the_probe_on() {
    let (origin, fg, a) = route_and_worker("breaker = { failures = 1, cool_down = \"1s\" }").await;
    assert_eq!(
        send(keyed(&fg, "/billing/x", &a, "done", "D")).await.status,
        200
    );
    failed_until_half_open(&fg, &a, "fail").await;
    let replay = send(keyed(&fg, "/billing/x", &a, "done", "D")).await;
    assert_eq!(replay.status, 200);
    assert_eq!(origin.count(), 2, "the replay forwarded nothing");
    assert_eq!(post(&fg, "/billing/x", &a, "probe").await.status, 200);
    assert_eq!(route_view(&fg).await["breaker"]["state"], "closed");
}

/// SPEC §7 ("the worker's own body failing is not" a failure): an upload
/// waiting on the worker's bytes when the exchange fails is not the upstream's
/// failure. A worker streams an upload and stalls midway (its connection open,
/// no error); the origin, still waiting for the body, does not answer, and the
/// route's timeout ends the exchange. With `failures = 1` the next request is
/// still forwarded (breaker closed). Failed when the breaker counted the
/// `upstream_timeout` as the *upstream's* failure (`incomplete` only covered
/// TooLarge/ClientFailed, not an upload still `Sending`): one slow worker opened
/// the breaker and every other worker on the route was refused `breaker_open`
/// for the cool-down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stalling_its_upload_does_not_open_the_breaker() {
    let (origin, fg, a) = route_and_worker(
        "derive_key = \"none\"\ntimeout_ms = 300\nbreaker = { failures = 1, cool_down = \"10m\" }",
    )
    .await;
    let (feed, answer, _conn) = stalled_upload(&fg, &a, &[]).await;
    let resp = answer.await.unwrap().unwrap();
    let code = resp
        .headers()
        .get("x-fencegate-error")
        .map(|v| v.to_str().unwrap().to_owned());
    eprintln!("the stalled upload got {} {code:?}", resp.status());
    drop(feed);
    let view = route_view(&fg).await;
    let next = post(&fg, "/billing/x", &a, "another worker's request").await;
    assert_eq!(
        (next.status.as_u16(), view["breaker"]["state"].as_str()),
        (200, Some("closed")),
        "one worker's stalled upload opened the route's breaker: {view} {:?}",
        next.error_code()
    );
    assert_eq!(origin.count(), 2);
}

/// Liveness: the origin answers an upload early; the worker reads the whole
/// answer and then stalls its upload with the connection open. The route
/// (`max_in_flight = 1`) is full meanwhile, but the slot comes back on its own
/// (observed ~10 s here, from fencegate's worker-connection idle handling).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_upload_after_an_early_answer_frees_the_route_eventually() {
    let (origin, fg, a) =
        route_and_worker("derive_key = \"none\"\ntimeout_ms = 300\nmax_in_flight = 1").await;
    let (feed, answer, _conn) = stalled_upload(&fg, &a, &[("x-test-answer-early", "1")]).await;
    let resp = answer.await.unwrap().unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.into_body().collect().await.unwrap().to_bytes(),
        "accepted"
    );
    let refused = post(&fg, "/billing/x", &a, "B").await;
    refused.assert_error(503, "upstream_held");
    eventually("the stalled exchange to give its slot back", || async {
        route_view(&fg).await["in_flight"] == 0
    })
    .await;
    drop(feed);
    assert_eq!(origin.count(), 1);
}

/// Each closed run of the breaker is numbered and counts only requests it let
/// through ("results of requests let through while closed that end after the
/// breaker opened are ignored: only the probe decides"). A slow request S let
/// through while closed fails *after* a probe has closed the breaker again: its
/// late 500 is ignored, and the breaker stays closed (`failures = 1`). Failed
/// when that rule held only while the breaker was open or half-open: S was
/// counted against the new closed run (`(Entry::Normal, Inner::Closed)`, no
/// generation check) and reopened the breaker at once, although the probe had
/// just succeeded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_from_before_the_breaker_opened_is_ignored_after_the_probe_closed_it() {
    let (origin, fg, a) =
        route_and_worker("timeout_ms = 60000\nbreaker = { failures = 1, cool_down = \"1s\" }")
            .await;
    let url = fg.url("/billing/x");
    let slow = tokio::spawn(try_send(
        worker_req(&url, a.epoch.get(), &a.token)
            .header("x-test-hold", "slow")
            .header("x-test-status", "500")
            .body(body("S"))
            .unwrap(),
    ));
    origin.wait_for(1).await;
    failed_until_half_open(&fg, &a, "F").await;
    assert_eq!(post(&fg, "/billing/x", &a, "probe").await.status, 200);
    assert_eq!(route_view(&fg).await["breaker"]["state"], "closed");
    origin.release("slow");
    assert_eq!(slow.await.unwrap().unwrap().status, 500);
    let view = route_view(&fg).await;
    assert_eq!(
        view["breaker"]["state"], "closed",
        "S, let through before the breaker opened, reopened it: {view}"
    );
}

/// The protection durations are bounded at validation (at most "1d";
/// `Breaker::open` and a hold saturate as well, unit-tested in `src/protect`):
/// `cool_down` or `max_retry_after` of "300000000000y" is refused, and at the
/// bound the first upstream failure's 500 is passed back, the key is `done` and
/// the breaker open. Failed when `breaker.cool_down = "300000000000y"` passed
/// validation (and check-config): the first upstream failure panicked in
/// `Breaker::open` (`now + cool_down` overflowed `Instant`) on the request path
/// — no answer, the key left `in_flight`, the breaker mutex poisoned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_cool_down_is_refused_and_the_largest_allowed_opens_the_breaker() {
    let base =
        "[[route]]\nname = \"r\"\npath_prefix = \"/r/\"\nupstream = \"http://u/\"\nlease = \"l\"\n";
    for extra in [
        "breaker = { failures = 1, cool_down = \"300000000000y\" }",
        "max_retry_after = \"300000000000y\"",
    ] {
        let e = fencegate::config::Config::parse(&format!("{base}{extra}\n"))
            .and_then(|c| c.validate())
            .unwrap_err();
        assert!(e.contains("at most \"1d\""), "{extra}: {e}");
    }
    let (_origin, fg, a) = route_and_worker("breaker = { failures = 1, cool_down = \"1d\" }").await;
    let r = try_send(
        worker_req(&fg.url("/billing/x"), a.epoch.get(), &a.token)
            .header("idempotency-key", "k")
            .header("x-test-status", "500")
            .body(body("F"))
            .unwrap(),
    )
    .await;
    let record = fg.admin_json("/v1/dedup/billing/k").await;
    let view = route_view(&fg).await;
    assert_eq!(
        (
            r.as_ref().map(|r| r.status.as_u16()).ok(),
            record["state"].as_str(),
            view["breaker"]["state"].as_str()
        ),
        (Some(500), Some("done"), Some("open")),
        "{r:?} {record} {view}"
    );
}
