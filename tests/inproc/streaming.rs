//! SPEC §6 streaming: a route that keeps no record streams the request body to
//! the upstream and the answer back as they arrive, with `max_body_bytes` counted
//! on the way; a recorded route reads the answer up to `max_replay_bytes`, then
//! streams it. Each test asserts what the origin received and what the worker got,
//! frame by frame where the order matters.

use std::time::Duration;

use bytes::Bytes;
use fencegate::lease::acquire::Holding;
use http::Request;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::sync::mpsc;

use crate::support::*;

const LEASE: &str = "billing";

/// A worker's own connection to fencegate, so that its request body can be fed
/// and its answer read frame by frame.
async fn connect(fg: &Fencegate) -> SendRequest<Fed> {
    let s = tokio::net::TcpStream::connect(fg.proxy_addr())
        .await
        .unwrap();
    let (tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s))
        .await
        .unwrap();
    tokio::spawn(conn);
    tx
}

/// A GET of an event stream whose second event waits for `release` of `hold`.
fn events(h: &Holding, hold: &str) -> Request<Fed> {
    let (_, rx) = mpsc::channel(1);
    Request::get("/billing/events")
        .header("host", "fencegate.test")
        .header("x-lease-epoch", h.epoch.get().to_string())
        .header("x-lease-token", &h.token)
        .header("x-test-events", hold)
        .body(Fed(rx))
        .unwrap()
}

fn request(path: &str, h: &Holding) -> http::request::Builder {
    Request::post(path)
        .header("host", "fencegate.test")
        .header("x-lease-epoch", h.epoch.get().to_string())
        .header("x-lease-token", &h.token)
}

/// The next data frame of `body`, bounded: a frame that never comes fails the
/// test instead of hanging it.
async fn next_data(body: &mut Incoming) -> Option<Result<Bytes, String>> {
    loop {
        let f = tokio::time::timeout(Duration::from_secs(20), body.frame())
            .await
            .expect("no frame within 20 s");
        match f? {
            Ok(f) => match f.into_data() {
                Ok(d) => return Some(Ok(d)),
                Err(_) => continue,
            },
            Err(e) => return Some(Err(e.to_string())),
        }
    }
}

/// Reads the rest of `body`, counting bytes without keeping them.
async fn drain_count(mut body: Incoming) -> Result<usize, String> {
    let mut n = 0;
    while let Some(d) = next_data(&mut body).await {
        n += d?.len();
    }
    Ok(n)
}

on_both_backends! {
/// The origin sees the request (head and first bytes) while the worker is still
/// sending its body: nothing waits for the whole body. Fails when fencegate
/// buffers the request body of a route that keeps no record.
async fn a_request_body_reaches_the_origin_while_the_worker_still_sends_it() {
    let (origin, fg) = billing_route(60_000, "derive_key = \"none\"").await;
    let a = acquire(&fg.epochs, LEASE, "worker-a", Duration::from_secs(30)).await;
    let mut conn = connect(&fg).await;
    let (feed, rx) = mpsc::channel(1);
    let req = request("/billing/upload", &a)
        .header("x-test-hold-body", "upload")
        .body(Fed(rx))
        .unwrap();
    let answer = tokio::spawn(async move { conn.send_request(req).await });
    feed.send(Bytes::from_static(b"first ")).await.unwrap();
    origin.wait_for(1).await;
    assert!(!origin.log()[0].body_whole, "the worker has not finished its body");
    origin.release("upload");
    feed.send(Bytes::from_static(b"second")).await.unwrap();
    drop(feed);
    let resp = answer.await.unwrap().unwrap();
    assert_eq!(resp.status(), 200);
    let log = origin.log();
    assert_eq!((log[0].body_read, log[0].body_whole), (12, true));
}

/// `max_body_bytes` holds for a body without a declared length, counted while it
/// streams: the worker gets 413 `body_too_large` and the origin never gets a
/// whole body. Fails when the limit is only checked on `Content-Length`.
async fn max_body_bytes_is_enforced_while_the_body_streams() {
    let (origin, fg) =
        billing_route(60_000, "derive_key = \"none\"\nmax_body_bytes = 1000").await;
    let a = acquire(&fg.epochs, LEASE, "worker-a", Duration::from_secs(30)).await;
    origin.release("big");
    let mut conn = connect(&fg).await;
    let (feed, rx) = mpsc::channel(4);
    let req = request("/billing/upload", &a)
        .header("x-test-hold-body", "big")
        .body(Fed(rx))
        .unwrap();
    for _ in 0..3 {
        feed.send(Bytes::from(vec![b'b'; 600])).await.unwrap();
    }
    drop(feed);
    let resp = conn.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 413);
    assert_eq!(resp.headers()["x-fencegate-error"], "body_too_large");
    eventually("the origin finished with the request, if it got one", || async {
        origin.log().iter().all(|r| r.completed.is_some())
    })
    .await;
    assert!(
        origin.log().iter().all(|r| !r.body_whole && r.body_read <= 1000),
        "{:?}",
        origin.log().iter().map(|r| (r.body_read, r.body_whole)).collect::<Vec<_>>()
    );
}

/// A response larger than the old fixed 64 MiB cap passes whole, streamed.
/// Fails on any fixed cap on the response body.
async fn a_response_larger_than_any_buffer_streams_whole() {
    let (origin, fg) = billing_route(60_000, "derive_key = \"none\"").await;
    let a = acquire(&fg.epochs, LEASE, "worker-a", Duration::from_secs(30)).await;
    let size = 70 << 20;
    let mut conn = connect(&fg).await;
    let (_feed, rx) = mpsc::channel(1);
    drop(_feed);
    let req = request("/billing/download", &a)
        .header("x-test-stream-bytes", size.to_string())
        .body(Fed(rx))
        .unwrap();
    let resp = conn.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(drain_count(resp.into_body()).await, Ok(size));
    assert_eq!(origin.count(), 1);
}

/// Server-sent events reach the worker one by one: the first is read while the
/// origin has not yet sent the second. Fails when the answer is buffered whole.
async fn server_sent_events_reach_the_worker_event_by_event() {
    let (origin, fg) = billing_route(60_000, "").await;
    let a = acquire(&fg.epochs, LEASE, "worker-a", Duration::from_secs(30)).await;
    let mut conn = connect(&fg).await;
    let req = events(&a, "second");
    let resp = conn.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    assert_eq!(next_data(&mut body).await, Some(Ok(Bytes::from_static(b"data: one\n\n"))));
    assert!(origin.log()[0].completed.is_none(), "the origin is still answering");
    origin.release("second");
    assert_eq!(next_data(&mut body).await, Some(Ok(Bytes::from_static(b"data: two\n\n"))));
    assert_eq!(next_data(&mut body).await, None);
}

/// SPEC §5 at the destination, for an upload the destination answers before it
/// has read it: A (the older epoch) is in flight until its exchange is over at both
/// ends — its answer read to the last byte *and* its request body sent whole — so
/// B (the newer epoch) reaches the origin only after the last of A's body has been
/// sent to it. Fails when the pass ends with the answer: the origin then gets B
/// while the worker has not even sent the rest of A's body, which arrives after B
/// (the late bytes of an old epoch after the new one).
async fn an_older_upload_ends_at_the_destination_before_a_newer_epoch_arrives() {
    let (origin, fg) = billing_route(60_000, "derive_key = \"none\"").await;
    let a = acquire(&fg.epochs, LEASE, "worker-a", Duration::from_secs(30)).await;
    let mut conn = connect(&fg).await;
    let (feed, rx) = mpsc::channel(1);
    let req = request("/billing/upload", &a)
        .header("x-test-answer-early", "1")
        .body(Fed(rx))
        .unwrap();
    let answer = tokio::spawn(async move { (conn.send_request(req).await, conn) });
    feed.send(Bytes::from_static(b"first ")).await.unwrap();
    // A's answer is complete while the worker is still sending A's body.
    let (resp, _conn) = answer.await.unwrap();
    let resp = resp.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "accepted");
    origin.wait_until("A's first bytes", |log| log[0].body_read == 6).await;
    let b = force_next_epoch(&fg.epochs, LEASE, "worker-b", Duration::from_secs(30)).await;
    let newer = spawn_post(&fg, &b, &[], b"B".to_vec());
    eventually("B is forwarded, or waits for A", || async {
        origin.count() >= 2 || drains_started(&fg).await
    })
    .await;
    let rest_sent = std::time::Instant::now();
    feed.send(Bytes::from_static(b"second")).await.unwrap();
    drop(feed);
    assert_eq!(newer.await.unwrap().unwrap().status, 200);
    origin
        .wait_until("A's body read to its end", |log| log[0].completed.is_some())
        .await;
    let log = origin.log();
    assert_eq!((&log[0].body[..], log[0].body_whole), (&b"first second"[..], true));
    assert_eq!(log[1].epoch(), Some(b.epoch.get()));
    assert!(
        log[1].arrived > rest_sent,
        "epoch {} reached the origin before the rest of epoch {}'s body was sent",
        b.epoch,
        a.epoch,
    );
}

/// The same upload, stalled after its early answer: the newer epoch waits for it
/// only up to the drain timeout, then the old exchange is cut (the origin never
/// gets the rest of A's body, nor any byte of it after B) and B goes through.
/// Fails when nothing watches an exchange whose answer is already complete.
async fn a_drain_abort_cuts_an_upload_stalled_after_its_answer() {
    let (origin, fg) = billing_route(60_000, "derive_key = \"none\"\ndrain_timeout_ms = 300").await;
    let a = acquire(&fg.epochs, LEASE, "worker-a", Duration::from_secs(30)).await;
    let mut conn = connect(&fg).await;
    let (feed, rx) = mpsc::channel(1);
    let req = request("/billing/upload", &a)
        .header("x-test-answer-early", "1")
        .body(Fed(rx))
        .unwrap();
    // The worker keeps its connection and reads its answer: it is still sending.
    let answer = tokio::spawn(async move { (conn.send_request(req).await, conn) });
    feed.send(Bytes::from_static(b"first ")).await.unwrap();
    let (resp, _conn) = answer.await.unwrap();
    let resp = resp.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "accepted");
    let b = force_next_epoch(&fg.epochs, LEASE, "worker-b", Duration::from_secs(30)).await;
    let newer = spawn_post(&fg, &b, &[], b"B".to_vec());
    assert_eq!(newer.await.unwrap().unwrap().status, 200);
    assert_eq!(fg.metric_sum("fencegate_drains_aborted_total").await, 1.0);
    origin
        .wait_until("A's body ended", |log| log[0].completed.is_some())
        .await;
    let log = origin.log();
    assert_eq!((log[0].body_read, log[0].body_whole), (6, false), "A's exchange was cut");
    drop(feed);
}

/// SPEC §5 with a streamed answer: the pass is held while the answer streams, so
/// a newer epoch waits for it; after the drain timeout the stream is aborted (the
/// worker's answer ends with an error) and the newer epoch goes through. Fails
/// when the pass ends at the response head, or when an abort does not reach a
/// stream.
async fn a_drain_abort_ends_a_streamed_answer() {
    let (origin, fg) = billing_route(60_000, "drain_timeout_ms = 300").await;
    let a = acquire(&fg.epochs, LEASE, "worker-a", Duration::from_secs(30)).await;
    let mut conn = connect(&fg).await;
    let req = events(&a, "never");
    let resp = conn.send_request(req).await.unwrap();
    let mut body = resp.into_body();
    assert_eq!(next_data(&mut body).await, Some(Ok(Bytes::from_static(b"data: one\n\n"))));
    let b = force_next_epoch(&fg.epochs, LEASE, "worker-b", Duration::from_secs(30)).await;
    let newer = spawn_post(&fg, &b, &[], b"B".to_vec());
    eventually("the drain started", || drains_started(&fg)).await;
    assert_eq!(origin.count(), 1, "B waits while A's answer streams");
    assert!(matches!(next_data(&mut body).await, Some(Err(_)) | None));
    assert_eq!(newer.await.unwrap().unwrap().status, 200);
    assert_eq!(origin.count(), 2);
    assert_eq!(fg.metric_sum("fencegate_drains_aborted_total").await, 1.0);
    origin.release("never");
}
}

on_both_backends! {
/// SPEC §6 on a recorded route: an answer over `max_replay_bytes` (and over the
/// old 64 MiB cap) is recorded `done` without its body, durably, and streamed
/// whole; a retry gets 409 `dedup_done` with the upstream's status. Fails on a
/// fixed cap (504 and the key in doubt) or a record that waits for the whole body.
async fn a_recorded_answer_over_max_replay_bytes_is_recorded_then_streamed() {
    let (origin, fg) = billing_route(60_000, "max_replay_bytes = 1000").await;
    let a = acquire(&fg.epochs, LEASE, "worker-a", Duration::from_secs(30)).await;
    let size = 70 << 20;
    let req = || {
        let (_feed, rx) = mpsc::channel(1);
        request("/billing/export", &a)
            .header("idempotency-key", "k-export")
            .header("x-test-stream-bytes", size.to_string())
            .body(Fed(rx))
            .unwrap()
    };
    let mut conn = connect(&fg).await;
    let resp = conn.send_request(req()).await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    // The record is `done` before the worker has read past the first bytes.
    let first = next_data(&mut body).await.unwrap().unwrap();
    let record = fg.admin_json("/v1/dedup/billing/k-export").await;
    assert_eq!(record["state"], "done", "{record}");
    assert_eq!(drain_count(body).await.unwrap() + first.len(), size);
    conn.ready().await.unwrap();
    let retry = conn.send_request(req()).await.unwrap();
    assert_eq!(retry.status(), 409);
    let retry: serde_json::Value =
        serde_json::from_slice(&retry.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!((retry["error"].as_str(), retry["upstream_status"].as_u64()), (Some("dedup_done"), Some(200)));
    assert_eq!(origin.count(), 1);
}
}
