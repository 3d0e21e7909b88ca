//! SPEC §11, queued delivery, asserted at the recording origin: acceptance
//! order is arrival order per lease, no message of an older epoch arrives
//! after a newer one (a failing head, an operator's drop), a receiver down and
//! back gets every message once, kill -9 at each durable boundary, and the
//! §7 refusals.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use fencegate::lease::acquire::Holding;
use http::Request;
use http_body_util::Full;

use crate::support::relay::Relay;
use crate::support::*;

/// Two tests of `$run(Backend)`, as `$run::on_sled` and `$run::on_postgres`
/// (skipped where PostgreSQL is not installed, unless the run requires it).
macro_rules! on_sled_and_postgres {
    ($run:ident) => {
        mod $run {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn on_sled() {
                skip_without_python!();
                $run(Backend::Sled).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn on_postgres() {
                skip_without_python!();
                if !crate::support::postgres::available_or_skip() {
                    return;
                }
                $run(Backend::Postgres).await;
            }
        }
    };
}

const ADMIN: &str = "queue-admin";
const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// A queued route `hook` on lease `hook`, signed, with short retries.
fn queued_route(upstream: &str, extra: &str) -> String {
    format!(
        "[[route]]\nname = \"hook\"\npath_prefix = \"/hook/\"\nupstream = \"{upstream}\"\nlease = \"hook\"\ntimeout_ms = 3000\ndelivery = \"queued\"\nsigning_secrets = [\"{SECRET}\"]\n{extra}\n"
    )
}

async fn start(s3: &S3Server, upstream: &str, extra: &str) -> Fencegate {
    Fencegate::start_with_server(
        &format!("admin_token = \"{ADMIN}\""),
        &format!("{}{}", s3.store_toml(200), queued_route(upstream, extra)),
        &[],
    )
}

/// A fencegate with the queued route `hook` to a recording origin, and a
/// worker holding lease `hook` at its first epoch.
struct Queued {
    s3: S3Server,
    origin: Origin,
    fg: Fencegate,
    epochs: fencegate::lease::Epochs,
    a: Holding,
}

impl Queued {
    async fn start(extra: &str) -> Queued {
        let s3 = S3Server::start();
        let origin = Origin::start().await;
        let fg = start(&s3, &origin.url("/v1/"), extra).await;
        let epochs = s3.epochs().await;
        let a = acquire(&epochs, "hook", "worker-a", Duration::from_secs(60)).await;
        Queued {
            s3,
            origin,
            fg,
            epochs,
            a,
        }
    }
}

/// A keyed message; `status`: what the origin answers it (x-test-status).
fn message(
    fg: &Fencegate,
    h: &Holding,
    key: &str,
    payload: &str,
    status: u16,
) -> Request<Full<Bytes>> {
    let mut r = keyed(fg, "/hook/events", h, key, payload);
    if status != 200 {
        r.headers_mut()
            .insert("x-test-status", status.to_string().parse().unwrap());
    }
    r
}

async fn admin_post(fg: &Fencegate, path: &str) -> Reply {
    send(
        Request::post(fg.admin_url(path))
            .header("authorization", format!("Bearer {ADMIN}"))
            .body(Full::default())
            .unwrap(),
    )
    .await
}

/// fencegate with the queued route `hook` and a queued route `old` (lease
/// `old`) that the tests remove by a reload, on `state` (`""`: sled); and
/// `old`'s config text, to remove.
fn beside_old_route(s3: &S3Server, origin: &Origin, state: &str) -> (Fencegate, String) {
    let up = origin.url("/v1/");
    let old = format!(
        "[[route]]\nname = \"old\"\npath_prefix = \"/old/\"\nupstream = \"{up}\"\nlease = \"old\"\ndelivery = \"queued\"\n"
    );
    let fg = Fencegate::start_with_server(
        &format!("admin_token = \"{ADMIN}\""),
        &format!(
            "{}{state}\n{}{old}",
            s3.store_toml(200),
            queued_route(&up, "")
        ),
        &[],
    );
    (fg, old)
}

/// Edits the config, sends SIGHUP and waits until the reload is applied.
async fn reload_applied(fg: &Fencegate, edit: impl FnOnce(String) -> String) {
    let applied = "fencegate_config_reloads_total{result=\"applied\"}";
    let before = fg.series(applied).await;
    fg.edit_config(edit);
    fg.hup();
    eventually("the reload to apply", || async {
        fg.series(applied).await > before
    })
    .await;
}

async fn status_of(fg: &Fencegate, key: &str) -> serde_json::Value {
    let r = send(
        Request::get(fg.admin_url(&format!("/v1/deliveries/hook/{key}")))
            .body(Full::default())
            .unwrap(),
    )
    .await;
    r.json()
}

/// A relay in front of `origin` refusing every connection (the receiver is
/// down until `refuse(false)`), and the upstream URL through it.
async fn receiver_down(origin: &Origin) -> (Relay, String) {
    let relay = Relay::start(origin.addr.port()).await;
    relay.refuse(true);
    let upstream = format!("http://127.0.0.1:{}/v1/", relay.addr.port());
    (relay, upstream)
}

/// The bodies the origin received, in arrival order.
fn arrived(origin: &Origin) -> Vec<String> {
    origin
        .log()
        .iter()
        .map(|a| String::from_utf8_lossy(&a.body).into_owned())
        .collect()
}

fn accepted(r: &Reply) {
    assert_eq!(r.status, 202, "body: {}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.headers["x-fencegate-delivery"], "queued");
    assert!(r.headers.contains_key("location"));
}

/// The head of a lease's queue fails (503 every attempt) in front of newer
/// messages, then is dead-lettered; the order rule holds across an epoch
/// change; an operator's drop releases what waits behind a head with a long
/// schedule; every attempt carries the same `webhook-id`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_lease_order_is_acceptance_order_and_never_older_after_newer() {
    skip_without_python!();
    let Queued {
        s3: _s3,
        origin,
        fg,
        epochs,
        a,
    } = Queued::start("retry = { schedule = [\"100ms\", \"100ms\", \"100ms\"] }").await;
    // m1 fails every attempt; m2 waits behind it.
    accepted(&send(message(&fg, &a, "m1", "a-m1", 503)).await);
    accepted(&send(message(&fg, &a, "m2", "a-m2", 200)).await);
    let b = force_next_epoch(&epochs, "hook", "worker-b", Duration::from_secs(60)).await;
    accepted(&send(message(&fg, &b, "m3", "b-m3", 200)).await);
    // A stale worker is refused at admission, never queued.
    send(message(&fg, &a, "late", "a-late", 200))
        .await
        .assert_error(409, "epoch_stale");
    origin
        .wait_until("m1 four times, then m2, m3", |log| log.len() >= 6)
        .await;
    assert_eq!(
        arrived(&origin),
        vec!["a-m1", "a-m1", "a-m1", "a-m1", "a-m2", "b-m3"],
        "m1's 1 + 3 retries, then the rest in acceptance order"
    );
    let ids: Vec<_> = origin
        .log()
        .iter()
        .map(|x| x.header("webhook-id").unwrap())
        .collect();
    assert!(ids[..4].iter().all(|i| i == "hook:m1"), "{ids:?}");
    assert_eq!(ids[4..], ["hook:m2", "hook:m3"]);
    let m1 = status_of(&fg, "m1").await;
    assert_eq!(m1["status"], "failed", "{m1}");
    assert_eq!(m1["attempts"], 4);
    assert_eq!(m1["last_status"], 503);
    // A retry of m1 now would deliver epoch 1 after epoch 2's m3: refused.
    admin_post(&fg, "/v1/deliveries/hook/m1/retry")
        .await
        .assert_error(409, "delivery_superseded");
    // A retry of a failed key (by the current holder: the stale one is
    // refused at admission first) is told so.
    send(message(&fg, &b, "m1", "a-m1", 503))
        .await
        .assert_error(409, "delivery_failed");

    // A head with a long schedule blocks what follows until an operator drops it.
    let c = force_next_epoch(&epochs, "hook", "worker-c", Duration::from_secs(60)).await;
    let slow = "retry = { schedule = [\"1h\"] }";
    fg.edit_config(|t| {
        t.replace(
            "retry = { schedule = [\"100ms\", \"100ms\", \"100ms\"] }",
            slow,
        )
    });
    fg.hup();
    wait_log(&fg, "config reloaded", 1).await;
    accepted(&send(message(&fg, &c, "m4", "c-m4", 503)).await);
    accepted(&send(message(&fg, &c, "m5", "c-m5", 200)).await);
    origin
        .wait_until("m4's first attempt", |log| log.len() >= 7)
        .await;
    wait_status(&fg, "m4", |v| {
        v["status"] == "pending" && v["attempts"] == 1
    })
    .await;
    assert_eq!(origin.count(), 7, "m5 waits behind m4");
    let dropped = admin_post(&fg, "/v1/deliveries/hook/m4/drop").await;
    assert_eq!(
        dropped.status,
        200,
        "{}",
        String::from_utf8_lossy(&dropped.body)
    );
    origin.wait_until("m5", |log| log.len() >= 8).await;
    assert_eq!(arrived(&origin)[6..], ["c-m4", "c-m5"]);
    send(message(&fg, &c, "m4", "c-m4", 503))
        .await
        .assert_error(409, "delivery_dropped");
    // Settled messages cannot be dropped or retried.
    admin_post(&fg, "/v1/deliveries/hook/m5/drop")
        .await
        .assert_error(409, "delivery_conflict");
    admin_post(&fg, "/v1/deliveries/hook/nope/retry")
        .await
        .assert_error(404, "delivery_not_found");
}

/// This process has written `n` deliveries durably (the counter follows the
/// group commit).
async fn durably_delivered(fg: &Fencegate, n: u64) {
    let series = "fencegate_queue_attempts_total{route=\"hook\",outcome=\"delivered\"}";
    for _ in 0..400 {
        if fg.series(series).await >= n as f64 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("{n} deliveries: {}", fg.stderr());
}

async fn wait_status(fg: &Fencegate, key: &str, done: impl Fn(&serde_json::Value) -> bool) {
    for _ in 0..400 {
        let v = status_of(fg, key).await;
        if done(&v) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("{key}: {}", status_of(fg, key).await);
}

/// The receiver refuses connections for a while, then comes back: every
/// accepted message arrives once, in order, none sent while it was down
/// counted as delivered. A retry of a delivered key is answered from its
/// stored answer; of a pending one, 202 again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_down_then_back_gets_every_message_once_in_order() {
    skip_without_python!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let (relay, upstream) = receiver_down(&origin).await;
    let fg = start(&s3, &upstream, "retry = { schedule = [\"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\", \"200ms\"] }").await;
    let epochs = s3.epochs().await;
    let a = acquire(&epochs, "hook", "worker-a", Duration::from_secs(60)).await;
    for i in 0..5 {
        accepted(&send(message(&fg, &a, &format!("k{i}"), &format!("e{i}"), 200)).await);
    }
    wait_status(&fg, "k0", |v| v["attempts"].as_u64() >= Some(2)).await;
    // A retry while pending: 202 again, nothing new queued.
    accepted(&send(message(&fg, &a, "k3", "e3", 200)).await);
    send(message(&fg, &a, "k3", "another body", 200))
        .await
        .assert_error(422, "dedup_key_reused");
    assert_eq!(origin.count(), 0);
    relay.refuse(false);
    origin.wait_until("all five", |log| log.len() >= 5).await;
    wait_status(&fg, "k4", |v| v["status"] == "delivered").await;
    assert_eq!(arrived(&origin), ["e0", "e1", "e2", "e3", "e4"]);
    let replay = send(message(&fg, &a, "k2", "e2", 200)).await;
    assert_eq!(replay.status, 200);
    assert_eq!(replay.headers["x-fencegate-replayed"], "true");
    assert_eq!(origin.count(), 5, "each once");
    // The relay accepted and closed each connection while "down": fencegate
    // cannot tell that from a destination that got the request, so each such
    // attempt is counted as an unknown outcome (and resent with its id).
    assert!(
        fg.metric_sum("fencegate_queue_unknown_outcomes_total")
            .await
            >= 1.0
    );
    assert_eq!(
        fg.series("fencegate_queue_depth{route=\"hook\"}").await,
        0.0
    );
}

/// SPEC §7 on a queued route: no key with `derive_key = "none"` (400), an
/// unknown key's status (404), the status URL's token (401, 403); nothing
/// reaches the origin and nothing is queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_on_a_queued_route_is_refused_and_changes_nothing() {
    skip_without_python!();
    let Queued {
        s3: _s3,
        origin,
        fg,
        epochs,
        a,
    } = Queued::start("derive_key = \"none\"").await;
    post(&fg, "/hook/events", &a, "no key")
        .await
        .assert_error(400, "dedup_key_missing");
    let ok = send(message(&fg, &a, "k1", "one", 200)).await;
    accepted(&ok);
    // Refused before admission: a newer epoch's keyless request does not
    // raise the mark.
    let mark = "fencegate_high_water_mark{lease=\"hook\"}";
    assert_eq!(fg.series(mark).await, 1.0);
    let b = force_next_epoch(&epochs, "hook", "worker-b", Duration::from_secs(60)).await;
    post(&fg, "/hook/events", &b, "no key, newer epoch")
        .await
        .assert_error(400, "dedup_key_missing");
    assert_eq!(fg.series(mark).await, 1.0, "the refusal changed the mark");
    let location = ok.headers["location"].to_str().unwrap().to_owned();
    origin.wait_until("k1", |log| log.len() == 1).await;
    // The worker's status URL: its token, or nothing.
    let get = |token: Option<&str>, path: &str| {
        let mut b = Request::get(fg.url(path));
        if let Some(t) = token {
            b = b.header("x-lease-token", t);
        }
        send(b.body(Full::default()).unwrap())
    };
    get(None, &location)
        .await
        .assert_error(401, "token_missing");
    get(Some("wrong"), &location)
        .await
        .assert_error(403, "token_invalid");
    let st = get(Some(&a.token), &location).await;
    assert_eq!(st.status, 200);
    assert!(["delivering", "delivered"].contains(&st.json()["status"].as_str().unwrap()));
    get(Some(&a.token), "/.fencegate/deliveries/hook/unknown")
        .await
        .assert_error(404, "delivery_not_found");
    let listed = send(
        Request::get(fg.admin_url("/v1/deliveries?route=hook"))
            .header("authorization", format!("Bearer {ADMIN}"))
            .body(Full::default())
            .unwrap(),
    )
    .await;
    assert_eq!(listed.json()["total"], 1, "only k1 was queued");
    // The admin listing's own refusals (SPEC §7, §11): each a clear error.
    let admin = |path: &str, token: Option<&str>| {
        let mut b = Request::get(fg.admin_url(path));
        if let Some(t) = token {
            b = b.header("authorization", format!("Bearer {t}"));
        }
        send(b.body(Full::default()).unwrap())
    };
    for (path, status, code) in [
        ("/v1/deliveries?route=nope", 404, "route_not_found"),
        ("/v1/deliveries?status=lost", 400, "bad_request"),
        ("/v1/deliveries?limit=0", 400, "bad_request"),
        ("/v1/deliveries?limit=1001", 400, "bad_request"),
        ("/v1/deliveries?limit=x", 400, "bad_request"),
        ("/v1/deliveries?colour=red", 400, "bad_request"),
        ("/v1/deliveries/hook/unknown", 404, "delivery_not_found"),
    ] {
        admin(path, Some(ADMIN)).await.assert_error(status, code);
    }
    admin("/v1/deliveries", None)
        .await
        .assert_error(401, "unauthorized");
    admin("/v1/deliveries", Some("wrong"))
        .await
        .assert_error(401, "unauthorized");
    assert_eq!(origin.count(), 1);
}

/// Config mistakes a queued route refuses at start-up (exit 2), by name.
#[test]
fn queued_routes_refuse_what_they_cannot_keep() {
    let route = |name: &str, lease: &str, extra: &str| {
        format!("[[route]]\nname = \"{name}\"\npath_prefix = \"/{name}/\"\nupstream = \"http://127.0.0.1:9/\"\nlease = \"{lease}\"\n{extra}\n")
    };
    let store = "[store]\nkind = \"dir\"\npath = \"leases\"\n";
    for (toml, says) in [
        (
            format!(
                "{store}{}{}",
                route("q", "l", "delivery = \"queued\""),
                route("d", "l", "")
            ),
            "all queued or all direct",
        ),
        (
            format!(
                "{store}{}{}",
                route("q", "l", "delivery = \"queued\"\nordering = \"none\""),
                route("p", "l", "delivery = \"queued\"")
            ),
            "a lease's queue has one ordering",
        ),
        (
            format!(
                "{store}{}",
                route(
                    "q",
                    "l",
                    "delivery = \"queued\"\nretry = { schedule = [\"0s\"] }"
                )
            ),
            "must be positive",
        ),
    ] {
        let (code, stderr) = serve_expecting_exit(&toml);
        assert_eq!(code, Some(2), "{stderr}");
        assert!(stderr.contains(says), "{says}: {stderr}");
    }
}

/// kill -9 at each durable boundary of a message (SPEC §11): accepted,
/// attempt started, attempt answered, delivered. Asserted at the origin:
/// no accepted message is lost, and one is sent twice only where an
/// attempt's outcome was unknown (counted, with the same `webhook-id`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_at_each_boundary_loses_nothing_and_repeats_only_the_unknown() {
    skip_without_python!();
    let Queued {
        s3: _s3,
        origin,
        mut fg,
        epochs: _epochs,
        a,
    } = Queued::start("retry = { schedule = [\"100ms\"] }").await;
    accepted(&send(message(&fg, &a, "warm", "warm", 200)).await);
    origin.wait_until("warm", |log| log.len() == 1).await;
    durably_delivered(&fg, 1).await;
    // (failpoint, does the worker get its 202, arrivals of this message in all,
    // unknown outcomes counted after the restart)
    let cases = [
        ("queue_accept_written", false, 1, 0),
        ("queue_accepted", false, 1, 0),
        ("queue_attempt_started", true, 1, 1),
        ("queue_attempt_answered", true, 2, 1),
        ("queue_delivered", true, 1, 0),
    ];
    for (failpoint, answered, arrivals, unknown) in cases {
        let key = format!("at-{failpoint}");
        let before = origin.count();
        fg.kill9();
        fg.spawn(Some(failpoint)).unwrap();
        let r = try_send(message(&fg, &a, &key, &key, 200)).await;
        assert_eq!(r.is_ok(), answered, "{failpoint}: {r:?}");
        if let Ok(r) = &r {
            accepted(r);
        }
        let status = fg.wait_exit();
        assert!(!status.success(), "{failpoint}: aborted");
        fg.spawn(None).unwrap();
        // The worker retries what it was not told (its key may be free again:
        // the acceptance did not reach the disk).
        if !answered {
            let retry = send(message(&fg, &a, &key, &key, 200)).await;
            assert!(
                retry.status == 202 || retry.status == 200,
                "{failpoint}: {}",
                String::from_utf8_lossy(&retry.body)
            );
        }
        wait_status(&fg, &key, |v| v["status"] == "delivered").await;
        if failpoint != "queue_delivered" {
            // Delivered by this process: durable once counted.
            durably_delivered(&fg, 1).await;
        }
        let got: Vec<_> = origin.log()[before..]
            .iter()
            .map(|x| x.header("webhook-id").unwrap())
            .collect();
        assert_eq!(got.len(), arrivals, "{failpoint}: {got:?}");
        assert!(got.iter().all(|i| *i == format!("hook:{key}")), "{got:?}");
        assert_eq!(
            status_of(&fg, &key).await["unknown_outcomes"],
            unknown,
            "{failpoint}"
        );
    }
}

/// kill -9 once a delivered message's settlement is on disk together with
/// the next message's attempt start (sled: one flush for both, SPEC §11):
/// the destination gets the first once, then the next — found `delivering`
/// at the restart, so counted unknown, but sent once: it had not gone out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_after_a_settlement_flushed_with_the_next_start_repeats_nothing() {
    skip_without_python!();
    let Queued {
        s3: _s3,
        origin,
        mut fg,
        epochs: _epochs,
        a,
    } = Queued::start("retry = { schedule = [\"100ms\"] }").await;
    accepted(&send(message(&fg, &a, "warm", "warm", 200)).await);
    origin.wait_until("warm", |log| log.len() == 1).await;
    durably_delivered(&fg, 1).await;
    fg.kill9();
    fg.spawn(Some("queue_delivered")).unwrap();
    let mut first = message(&fg, &a, "n1", "n1", 200);
    first
        .headers_mut()
        .insert("x-test-hold", "n1".parse().unwrap());
    accepted(&send(first).await);
    origin.wait_until("n1 held", |log| log.len() == 2).await;
    accepted(&send(message(&fg, &a, "n2", "n2", 200)).await);
    origin.release("n1");
    assert!(!fg.wait_exit().success(), "aborted at queue_delivered");
    fg.spawn(None).unwrap();
    wait_status(&fg, "n2", |v| v["status"] == "delivered").await;
    let got: Vec<_> = origin.log()[1..]
        .iter()
        .map(|x| x.header("webhook-id").unwrap())
        .collect();
    assert_eq!(got, ["hook:n1", "hook:n2"]);
    assert_eq!(status_of(&fg, "n1").await["unknown_outcomes"], 0);
    assert_eq!(status_of(&fg, "n2").await["unknown_outcomes"], 1);
}

/// A reload that would forward a queued lease's requests directly is refused
/// whole (a key delivered from the queue would be forwarded again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_switching_a_lease_between_queued_and_direct_is_refused() {
    skip_without_python!();
    let Queued {
        s3: _s3,
        origin,
        fg,
        epochs: _epochs,
        a,
    } = Queued::start("").await;
    accepted(&send(message(&fg, &a, "k1", "one", 200)).await);
    durably_delivered(&fg, 1).await;
    fg.edit_config(|t| t.replace("delivery = \"queued\"\n", ""));
    fg.hup();
    wait_log(&fg, "config reload refused", 1).await;
    assert!(
        fg.stderr()
            .contains("whether lease hook's requests are queued"),
        "{}",
        fg.stderr()
    );
    let replay = send(message(&fg, &a, "k1", "one", 200)).await;
    assert_eq!(replay.status, 200);
    assert_eq!(replay.headers["x-fencegate-replayed"], "true");
    assert_eq!(origin.count(), 1);
}

/// `[telemetry]`: each attempt is a span (INTERNAL) in the worker's trace, with
/// the upstream call (CLIENT) under it; the destination's `traceparent` names
/// that upstream span. The acceptance is the request's span as any request's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_attempt_is_a_span_in_the_workers_trace() {
    use crate::support::otlp::{one, Receiver};
    skip_without_python!();
    const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    const PARENT: &str = "00f067aa0ba902b7";
    let receiver = Receiver::start(false);
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let fg = Fencegate::start(&format!(
        "{}{}{}",
        s3.store_toml(200),
        receiver.toml(""),
        queued_route(&origin.url("/v1/"), "retry = { schedule = [\"100ms\"] }"),
    ));
    let epochs = s3.epochs().await;
    let a = acquire(&epochs, "hook", "worker-a", Duration::from_secs(60)).await;
    let mut r = message(&fg, &a, "t1", "traced", 503);
    r.headers_mut().insert(
        "traceparent",
        format!("00-{TRACE}-{PARENT}-01").parse().unwrap(),
    );
    accepted(&send(r).await);
    let spans = receiver.wait_until("two attempts", |s| {
        s.iter().filter(|s| s.name() == "attempt /hook/").count() >= 2
    });
    let attempts: Vec<_> = spans
        .iter()
        .filter(|s| s.name() == "attempt /hook/")
        .collect();
    for (i, at) in attempts.iter().enumerate() {
        assert_eq!(at.trace_id(), TRACE);
        assert_eq!(at.parent(), PARENT);
        assert_eq!(at.kind(), "SPAN_KIND_INTERNAL");
        assert_eq!(at.attr("fencegate.attempt"), (i + 1) as u64);
        assert_eq!(at.attr("fencegate.route"), "hook");
        let up: Vec<_> = spans
            .iter()
            .filter(|s| s.name() == "upstream" && s.parent() == at.span_id())
            .collect();
        assert_eq!(up.len(), 1, "{spans:#?}");
        assert_eq!(up[0].kind(), "SPAN_KIND_CLIENT");
        assert_eq!(up[0].attr("http.response.status_code"), 503);
    }
    let accept = one(&spans, "POST /hook/");
    assert_eq!(accept.attr("fencegate.outcome"), "queued");
    let sent: Vec<_> = origin
        .log()
        .iter()
        .map(|x| x.header("traceparent").unwrap())
        .collect();
    assert!(sent[0].starts_with(&format!("00-{TRACE}-")), "{sent:?}");
    assert_ne!(sent[0], sent[1], "each attempt names its own upstream span");
}

/// An attempt that went out makes its epoch the newest sent, whatever becomes
/// of its message: after an epoch-2 message was attempted (500) and then
/// dropped, an operator's retry of a failed epoch-1 message is superseded —
/// it would reach the destination after epoch 2's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_is_superseded_by_a_newer_attempt_even_one_dropped_since() {
    skip_without_python!();
    let Queued {
        s3: _s3,
        origin,
        fg,
        epochs,
        a,
    } = Queued::start("retry = { schedule = [\"1h\"] }").await;
    accepted(&send(message(&fg, &a, "m1", "a-m1", 400)).await);
    wait_status(&fg, "m1", |v| v["status"] == "failed").await;
    let b = force_next_epoch(&epochs, "hook", "worker-b", Duration::from_secs(60)).await;
    accepted(&send(message(&fg, &b, "m2", "b-m2", 500)).await);
    wait_status(&fg, "m2", |v| {
        v["status"] == "pending" && v["attempts"] == 1
    })
    .await;
    assert_eq!(
        admin_post(&fg, "/v1/deliveries/hook/m2/drop").await.status,
        200
    );
    admin_post(&fg, "/v1/deliveries/hook/m1/retry")
        .await
        .assert_error(409, "delivery_superseded");
    assert_eq!(arrived(&origin), ["a-m1", "b-m2"]);
    assert_eq!(status_of(&fg, "m1").await["status"], "failed");
}

/// A direct route on a lease whose queue still holds messages is refused, by
/// a reload and at start-up — even in steps (the queued route removed first,
/// the direct one added next): it could overtake them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_route_on_a_lease_with_queued_messages_is_refused() {
    skip_without_python!();
    let Queued {
        s3: _s3,
        origin,
        mut fg,
        epochs,
        a,
    } = Queued::start("retry = { schedule = [\"1h\"] }").await;
    accepted(&send(message(&fg, &a, "m1", "a-m1", 500)).await);
    wait_status(&fg, "m1", |v| {
        v["status"] == "pending" && v["attempts"] == 1
    })
    .await;
    let queued = queued_route(&origin.url("/v1/"), "retry = { schedule = [\"1h\"] }");
    let direct = format!(
        "[[route]]\nname = \"d\"\npath_prefix = \"/d/\"\nupstream = \"{}\"\nlease = \"hook\"\n",
        origin.url("/v1/")
    );
    let filler = format!(
        "[[route]]\nname = \"z\"\npath_prefix = \"/z/\"\nupstream = \"{}\"\nlease = \"other\"\n",
        origin.url("/v1/")
    );
    // Step 1, allowed: the queued route goes (its message is kept).
    fg.edit_config(|t| format!("{}{filler}", t.replace(&queued, "")));
    fg.hup();
    wait_log(&fg, "config reloaded", 1).await;
    // Step 2, refused: a direct route on the lease.
    fg.edit_config(|t| format!("{t}{direct}"));
    fg.hup();
    wait_log(&fg, "config reload refused", 1).await;
    assert!(fg
        .stderr()
        .contains("would forward lease hook's requests directly"));
    let b = force_next_epoch(&epochs, "hook", "worker-b", Duration::from_secs(60)).await;
    send(keyed(&fg, "/d/x", &b, "d1", "b-direct"))
        .await
        .assert_error(404, "route_not_found");
    // At start-up too (exit 2).
    fg.kill9();
    assert!(fg.spawn(None).is_err(), "{}", fg.stderr());
    assert_eq!(fg.last_exit.and_then(|s| s.code()), Some(2));
    assert!(fg
        .stderr()
        .contains("would forward lease hook's requests directly"));
    // A direct route under the queued route's name, on another lease: refused
    // too (a worker's retry of one of its keys would be forwarded beside the
    // queued message).
    let renamed = format!(
        "[[route]]\nname = \"hook\"\npath_prefix = \"/h2/\"\nupstream = \"{}\"\nlease = \"h2\"\n",
        origin.url("/v1/")
    );
    fg.edit_config(|t| format!("{}{renamed}", t.replace(&direct, "")));
    assert!(fg.spawn(None).is_err(), "{}", fg.stderr());
    assert_eq!(fg.last_exit.and_then(|s| s.code()), Some(2));
    assert!(
        fg.stderr().contains(
            "route \"hook\" holds messages of lease hook that may still be sent, and would forward requests directly"
        ),
        "{}",
        fg.stderr()
    );
    assert_eq!(arrived(&origin), ["a-m1"]);
}

async fn wait_log(fg: &Fencegate, line: &str, n: usize) {
    for _ in 0..400 {
        if fg.stderr().matches(line).count() >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("{n} × {line:?}: {}", fg.stderr());
}

/// SPEC §10.1 for the queue: an attempt out when the instance guard lapses
/// (the store unreachable past `gate_ttl`) is cut with the forwarded
/// requests; the destination never gets it from the deposed instance, and the
/// attempt counts as an unknown outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_out_when_the_guard_lapses_is_cut() {
    skip_without_python!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let relay = Relay::start(origin.addr.port()).await;
    let upstream = format!("http://127.0.0.1:{}/v1/", relay.addr.port());
    let route = queued_route(&upstream, "").replace("timeout_ms = 3000", "timeout_ms = 30000");
    let fg = Fencegate::start_with_server(
        &format!("admin_token = \"{ADMIN}\""),
        &format!("{}gate_ttl = 4500\n{route}", s3.store_toml(200)),
        &[],
    );
    let epochs = s3.epochs().await;
    let a = acquire(&epochs, "hook", "worker-a", Duration::from_secs(60)).await;
    relay.hold_requests(true);
    accepted(&send(message(&fg, &a, "m1", "a-m1", 200)).await);
    wait_status(&fg, "m1", |v| v["status"] == "delivering").await;
    s3.pause();
    wait_log(&fg, "requests in flight are aborted", 1).await;
    wait_status(&fg, "m1", |v| {
        v["status"] == "pending" && v["unknown_outcomes"] == 1
    })
    .await;
    // The cut attempt's bytes never leave the relay (fencegate closing its
    // socket is asynchronous: released, they would reach the origin).
    relay.cut_keeping_holds();
    s3.resume();
    // Sent again once the instance holds its guard again: held like the first.
    eventually("the attempt after the guard is held again", || async {
        relay.held_requests() > 0
    })
    .await;
    relay.hold_requests(false);
    origin.wait_until("m1", |l| !l.is_empty()).await;
    durably_delivered(&fg, 1).await;
    assert_eq!(arrived(&origin), ["a-m1"]);
}

/// `ordering = "none"`: an epoch's messages go in parallel (up to
/// `max_in_flight`), and the next epoch's only once none of this one is left —
/// a failing one included, until it is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordering_none_is_parallel_within_an_epoch_and_ordered_across() {
    skip_without_python!();
    let Queued {
        s3: _s3,
        origin,
        fg,
        epochs,
        a,
    } = Queued::start(
        "ordering = \"none\"\nmax_in_flight = 3\nretry = { schedule = [\"100ms\", \"100ms\"] }",
    )
    .await;
    let slow = |h: &Holding, key: &str, payload: &str, status: u16| {
        let mut r = message(&fg, h, key, payload, status);
        r.headers_mut()
            .insert("x-test-delay-ms", "200".parse().unwrap());
        r
    };
    for i in 0..6 {
        accepted(&send(slow(&a, &format!("a{i}"), &format!("a-{i}"), 200)).await);
    }
    accepted(&send(slow(&a, "a-fail", "a-fail", 503)).await);
    let b = force_next_epoch(&epochs, "hook", "worker-b", Duration::from_secs(60)).await;
    for i in 0..3 {
        accepted(&send(slow(&b, &format!("b{i}"), &format!("b-{i}"), 200)).await);
    }
    // 6 + 3 attempts of a-fail + 3.
    origin.wait_until("everything", |l| l.len() >= 12).await;
    wait_status(&fg, "b2", |v| v["status"] == "delivered").await;
    let got = arrived(&origin);
    let last_a = got.iter().rposition(|b| b.starts_with("a-")).unwrap();
    let first_b = got.iter().position(|b| b.starts_with("b-")).unwrap();
    assert!(last_a < first_b, "epoch 1 before epoch 2: {got:?}");
    assert_eq!(got.iter().filter(|b| *b == "a-fail").count(), 3, "{got:?}");
    assert_eq!(status_of(&fg, "a-fail").await["status"], "failed");
    let most = origin.max_concurrent();
    assert!(
        (2..=3).contains(&most),
        "parallel, within max_in_flight: {most}"
    );
}

/// A queued route moved by a reload to another lease while it holds messages
/// of its old lease is refused: that lease's workers would be answered from
/// them, and they would go in the old lease's order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_holding_messages_cannot_move_to_another_lease() {
    skip_without_python!();
    let Queued {
        s3: _s3,
        origin,
        fg,
        epochs: _epochs,
        a,
    } = Queued::start("retry = { schedule = [\"1h\"] }").await;
    accepted(&send(message(&fg, &a, "m1", "a-m1", 503)).await);
    wait_status(&fg, "m1", |v| {
        v["status"] == "pending" && v["attempts"] == 1
    })
    .await;
    fg.edit_config(|t| t.replace("lease = \"hook\"", "lease = \"other\""));
    fg.hup();
    wait_log(&fg, "config reload refused", 1).await;
    assert!(
        fg.stderr().contains("would move to lease other"),
        "{}",
        fg.stderr()
    );
    assert_eq!(arrived(&origin), ["a-m1"]);
}

/// SPEC §11's attempt rules, at the origin: a 4xx other than 408, 409, 425
/// and 429 fails the message at once; those four are retried; a
/// `Retry-After` lengthens the wait (never shortens it), up to the
/// schedule's last step. `ordering = "none"` lets the three first attempts go
/// together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_refusal_fails_at_once_and_retry_after_lengthens_the_wait() {
    skip_without_python!();
    let Queued {
        s3: _s3,
        origin,
        fg,
        epochs: _epochs,
        a,
    } = Queued::start("ordering = \"none\"\nretry = { schedule = [\"100ms\", \"60s\"] }").await;
    accepted(&send(message(&fg, &a, "gone", "gone", 410)).await);
    accepted(&send(message(&fg, &a, "conflict", "conflict", 409)).await);
    let mut slow = message(&fg, &a, "busy", "busy", 429);
    slow.headers_mut()
        .insert("x-test-retry-after", "2".parse().unwrap());
    accepted(&send(slow).await);
    let at = |v: &serde_json::Value, field: &str| {
        humantime::parse_rfc3339(v[field].as_str().unwrap_or_default()).unwrap()
    };
    // 429 with Retry-After: 2 → the next attempt 2 s after, not 100 ms
    // (read at once: it is due 2 s after its answer).
    wait_status(&fg, "busy", |v| v["last_status"] == 429).await;
    let busy = status_of(&fg, "busy").await;
    assert_eq!(
        (busy["status"].as_str(), busy["attempts"].as_u64()),
        (Some("pending"), Some(1))
    );
    let wait = at(&busy, "next_attempt_at")
        .duration_since(at(&busy, "updated_at"))
        .unwrap();
    assert!(wait >= Duration::from_millis(1990), "{busy}");
    assert!(wait < Duration::from_secs(60), "{busy}");
    wait_status(&fg, "gone", |v| v["status"] == "failed").await;
    let gone = status_of(&fg, "gone").await;
    assert_eq!(
        (gone["attempts"].as_u64(), gone["last_status"].as_u64()),
        (Some(1), Some(410))
    );
    // 409: retried after the schedule's first step (100 ms ± 20%).
    wait_status(&fg, "conflict", |v| {
        v["attempts"].as_u64() >= Some(2) && v["status"] == "pending"
    })
    .await;
    assert_eq!(status_of(&fg, "conflict").await["last_status"], 409);
    let gone_arrivals = origin
        .log()
        .iter()
        .filter(|x| x.body.as_ref() == b"gone")
        .count();
    assert_eq!(gone_arrivals, 1, "a final refusal is not retried");
}

/// The resident memory of process `pid`, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").parse().ok())
        .unwrap();
    kb * 1024
}

/// Waits until `key` is delivered: a queue of hundreds of MiB drains in
/// minutes on a busy machine, longer than [`wait_status`] waits.
async fn delivered(fg: &Fencegate, key: &str) {
    let deadline = Instant::now() + Duration::from_secs(900);
    while Instant::now() < deadline {
        if status_of(fg, key).await["status"] == "delivered" {
            return;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    panic!("{key}: {}", status_of(fg, key).await);
}

/// Issue 50, repro 2: with the receiver down, 512 MiB of 1 MiB bodies fill
/// the queue up to its bound and no further (503 `queue_full` with `Retry-After`, the key
/// left free, nothing recorded); once the receiver drains the queue, the
/// memory the bodies took is given back and the refused message is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_is_bounded_and_its_memory_comes_back_after_a_drain() {
    skip_without_python!();
    const MIB: usize = 1 << 20;
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let (relay, upstream) = receiver_down(&origin).await;
    // Retries every 15 s for 5 min: none fails for good while 512 MiB are
    // accepted on a busy machine, and the first after the receiver is back
    // comes within 18 s.
    let fg = Fencegate::start_with_server(
        "access_log = false",
        &format!(
            "{}[state]\nqueue_max_bytes = {}\n\n{}",
            s3.store_toml(200),
            // Each message is its 1 MiB body and a head well under 2 KiB: 512
            // fit, the 513th does not.
            512 * MIB + 512 * 2048,
            queued_route(
                &upstream,
                &format!(
                    "max_body_bytes = 2097152\nretry = {{ schedule = [{}] }}",
                    vec!["\"15s\""; 20].join(", ")
                )
            )
        ),
        &[],
    );
    let a = acquire(
        &s3.epochs().await,
        "hook",
        "worker-a",
        Duration::from_secs(1800),
    )
    .await;
    let before = rss(fg.pid());
    let big = "x".repeat(MIB);
    for i in 0..512 {
        accepted(&send(message(&fg, &a, &format!("k{i}"), &big, 200)).await);
    }
    let full = send(message(&fg, &a, "k512", &big, 200)).await;
    full.assert_error(503, "queue_full");
    assert!(full.retry_after_secs() >= 1);
    assert_eq!(full.json()["detail"], "total_bytes", "{}", full.json());
    assert_eq!(status_of(&fg, "k512").await["error"], "delivery_not_found");
    let queued = rss(fg.pid());
    relay.refuse(false);
    delivered(&fg, "k511").await;
    assert_eq!(origin.count(), 512);
    // The key was left free: the same message is accepted now.
    accepted(&send(message(&fg, &a, "k512", &big, 200)).await);
    delivered(&fg, "k512").await;
    // Another 100 MiB through the queue, the receiver down again: memory
    // does not grow with the bytes that passed through (before, each round
    // added its bytes to RSS for good), only with what is kept.
    relay.refuse(true);
    relay.cut();
    for i in 513..613 {
        accepted(&send(message(&fg, &a, &format!("k{i}"), &big, 200)).await);
    }
    let again = rss(fg.pid());
    assert_eq!(origin.count(), 513, "the receiver was down meanwhile");
    relay.refuse(false);
    delivered(&fg, "k612").await;
    let drained = rss(fg.pid());
    eprintln!(
        "RSS {} MiB before, {} MiB with 512 MiB queued, {} MiB with the next 100 MiB queued after a drain, {} MiB drained",
        before >> 20,
        queued >> 20,
        again >> 20,
        drained >> 20
    );
    assert!(
        again < queued + 40 * MIB as u64 && drained < queued + 40 * MIB as u64,
        "RSS {} MiB before, {} MiB queued, {} MiB queued again, {} MiB drained",
        before >> 20,
        queued >> 20,
        again >> 20,
        drained >> 20
    );
    // Within the documented bound afterwards (docs/queued-delivery.md: about
    // 1.2 × queue_max_bytes plus ~50 MB).
    let bound = (512 * MIB) as u64 * 6 / 5 + 50 * MIB as u64;
    assert!(drained < bound, "RSS {} MiB drained", drained >> 20);
    assert_eq!(
        fg.series(
            "fencegate_requests_total{route=\"hook\",outcome=\"refused\",code=\"queue_full\"}"
        )
        .await,
        1.0
    );
}

/// A route's own bound on messages: past it, `queue_full` (`route_messages`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routes_message_bound_refuses_past_it() {
    skip_without_python!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let (_receiver, upstream) = receiver_down(&origin).await;
    let fg = start(&s3, &upstream, "queue_max_messages = 3").await;
    let a = acquire(
        &s3.epochs().await,
        "hook",
        "worker-a",
        Duration::from_secs(60),
    )
    .await;
    for i in 0..3 {
        accepted(&send(message(&fg, &a, &format!("k{i}"), "e", 200)).await);
    }
    // A retry of an accepted message is still answered from its record.
    accepted(&send(message(&fg, &a, "k1", "e", 200)).await);
    let full = send(message(&fg, &a, "k3", "e", 200)).await;
    full.assert_error(503, "queue_full");
    assert_eq!(full.json()["detail"], "route_messages");
    assert_eq!(full.json()["limit"], 3);
    assert_eq!(origin.count(), 0);
}

/// Issue 44's defect: a queued route's `max_replay_bytes` holds for an answer
/// that arrives in one read, as a direct route's does (SPEC §6, §11): the same
/// key again gets 409 `dedup_done`, not the whole answer replayed.
async fn max_replay_bytes_holds_for_an_answer_in_one_read(backend: Backend) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s3 = S3Server::start();
    // A destination that writes its whole answer, head and 5,000 bytes, at once.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let arrivals = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = arrivals.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                let mut got = Vec::new();
                loop {
                    let Ok(n) = s.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    got.extend_from_slice(&buf[..n]);
                    let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") else {
                        continue;
                    };
                    let head = String::from_utf8_lossy(&got[..end]).to_lowercase();
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .map_or(0, |v| v.trim().parse().unwrap_or(0));
                    if got.len() < end + 4 + len {
                        continue;
                    }
                    got.drain(..end + 4 + len);
                    seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 5000\r\n\r\n{}",
                        "z".repeat(5000)
                    );
                    if s.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    let origin_url = |p: &str| format!("http://127.0.0.1:{port}{p}");
    let routes = format!(
        "{}[[route]]\nname = \"direct\"\npath_prefix = \"/direct/\"\nupstream = \"{}\"\nlease = \"direct\"\nmax_replay_bytes = 1000\n",
        queued_route(&origin_url("/v1/"), "max_replay_bytes = 1000"),
        origin_url("/v1/")
    );
    let fg = Fencegate::start_with_server(
        &format!("admin_token = \"{ADMIN}\""),
        &format!("{}{}\n{routes}", s3.store_toml(200), backend.state_toml()),
        &[],
    );
    let epochs = s3.epochs().await;
    let a = acquire(&epochs, "hook", "worker-a", Duration::from_secs(60)).await;
    let d = acquire(&epochs, "direct", "worker-d", Duration::from_secs(60)).await;
    let big = |fg: &Fencegate, path: &str, h: &Holding, key: &str| keyed(fg, path, h, key, "{}");
    accepted(&send(big(&fg, "/hook/events", &a, "q1")).await);
    wait_status(&fg, "q1", |v| v["status"] == "delivered").await;
    send(big(&fg, "/hook/events", &a, "q1"))
        .await
        .assert_error(409, "dedup_done");
    let first = send(big(&fg, "/direct/x", &d, "d1")).await;
    assert_eq!((first.status.as_u16(), first.body.len()), (200, 5000));
    send(big(&fg, "/direct/x", &d, "d1"))
        .await
        .assert_error(409, "dedup_done");
    assert_eq!(
        arrivals.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "neither was sent twice"
    );
}

on_sled_and_postgres!(max_replay_bytes_holds_for_an_answer_in_one_read);

/// The review's case (issue 44): a request of a queued route whose body is
/// still coming while reloads rename the route and give its old name to a
/// direct route. Nothing is written under the name that is direct now (its
/// deliverer would never send it, and a retry of its key would go direct):
/// `503 route_changed`, and the worker's retry meets the routes as they are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_route_a_reload_changed_queues_nothing() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    skip_without_python!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let fg = start(&s3, &origin.url("/v1/"), "").await;
    let a = acquire(
        &s3.epochs().await,
        "hook",
        "worker-a",
        Duration::from_secs(60),
    )
    .await;
    let mut slow = tokio::net::TcpStream::connect(fg.proxy).await.unwrap();
    slow.write_all(
        format!(
            "POST /hook/events HTTP/1.1\r\nHost: a\r\nX-Lease-Epoch: {}\r\nX-Lease-Token: {}\r\n\
             Idempotency-Key: slow\r\nContent-Length: 10\r\nConnection: close\r\n\r\n01234",
            a.epoch.get(),
            a.token
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let reload = |edit: Box<dyn FnOnce(String) -> String>| reload_applied(&fg, edit);
    // The route renamed (still queued, same lease), then its old name direct.
    reload(Box::new(|t| {
        t.replace("name = \"hook\"", "name = \"hook2\"")
    }))
    .await;
    let direct = format!(
        "\n[[route]]\nname = \"hook\"\npath_prefix = \"/other/\"\nupstream = \"{}\"\nlease = \"other\"\n",
        origin.url("/v1/")
    );
    reload(Box::new(move |t| format!("{t}{direct}"))).await;
    slow.write_all(b"56789").await.unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), slow.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");
    assert!(
        answer.contains("x-fencegate-error: route_changed"),
        "{answer}"
    );
    let kept = send(
        Request::get(fg.admin_url("/v1/deliveries?route=hook"))
            .header("authorization", format!("Bearer {ADMIN}"))
            .body(Full::default())
            .unwrap(),
    )
    .await;
    assert_eq!(kept.json()["total"], 0, "{}", kept.json());
    assert_eq!(origin.count(), 0);
    // Sent again, it is queued under the route's new name.
    accepted(&send(message(&fg, &a, "slow", "0123456789", 200)).await);
}

/// The review's second case (issue 44): on PostgreSQL an acceptance that found
/// its route unchanged waits for its lease's transaction (another session
/// holds the lease's row) while a reload gives the route's name to a direct
/// route on another lease. The reload waits for the acceptance's write to end;
/// the message is then kept under the name, so the reload is refused (SPEC
/// §11: a direct route whose name holds messages that may still be sent).
/// Whichever order the two meet in, no message is ever kept under a name that
/// is direct.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acceptance_waiting_for_its_lease_holds_off_a_reload_of_its_route() {
    skip_without_python!();
    if !crate::support::postgres::available_or_skip() {
        return;
    }
    let pg = crate::support::postgres::PgServer::shared();
    let (db, url) = pg.new_database();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let warm = queued_route(&origin.url("/v1/"), "")
        .replace("name = \"hook\"", "name = \"warm\"")
        .replace("/hook/", "/warm/");
    let hook = queued_route(&origin.url("/v1/"), "");
    let fg = Fencegate::start_with_server(
        &format!("admin_token = \"{ADMIN}\""),
        &format!(
            "{}{}{warm}{hook}",
            s3.store_toml(200),
            state_toml(&url, "timeout_ms = 20000")
        ),
        &[],
    );
    let a = acquire(
        &s3.epochs().await,
        "hook",
        "worker-a",
        Duration::from_secs(60),
    )
    .await;
    accepted(&send(keyed(&fg, "/warm/events", &a, "warm", "w")).await);
    // Another session holds the lease's row: the next acceptance waits for it.
    let (mut other, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let tx = other.transaction().await.unwrap();
    tx.query(
        "SELECT * FROM fencegate_queue_leases WHERE lease = 'hook' FOR UPDATE",
        &[],
    )
    .await
    .unwrap();
    let held = tokio::spawn(send(message(&fg, &a, "late", "late", 200)));
    eventually("the acceptance to wait for the lease's row", || async {
        pg.psql(
            &db,
            // The acceptance's statement (the deliverer's start of the warm
            // message, if still out, waits for the row too).
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND query LIKE '%fencegate_queue_leases AS l (lease, next_seq) VALUES%'",
        ) == "1"
    })
    .await;
    // Two reloads (one is refused: a lease's kind cannot change in one): the
    // queued route removed, then its name given to a direct route on another
    // lease — no message is kept under the name yet.
    let series = |r: &str| format!("fencegate_config_reloads_total{{result=\"{r}\"}}");
    let (applied, refused) = (
        fg.series(&series("applied")).await,
        fg.series(&series("refused")).await,
    );
    let waits = "the reload waits for queued acceptances under way to end";
    fg.edit_config(move |t| t.replace(&hook, ""));
    fg.hup();
    eventually(
        "the first reload to apply, or to wait for the acceptance",
        || async { fg.series(&series("applied")).await > applied || fg.stderr().contains(waits) },
    )
    .await;
    let direct = format!(
        "\n[[route]]\nname = \"hook\"\npath_prefix = \"/other/\"\nupstream = \"{}\"\nlease = \"other\"\n",
        origin.url("/v1/")
    );
    fg.edit_config(move |t| format!("{t}{direct}"));
    fg.hup();
    eventually(
        "the second reload to apply, or the first to wait",
        || async {
            fg.series(&series("applied")).await > applied + 1.0 || fg.stderr().contains(waits)
        },
    )
    .await;
    tx.rollback().await.unwrap();
    let late = held.await.unwrap();
    eventually("both reloads to be decided", || async {
        fg.series(&series("applied")).await + fg.series(&series("refused")).await
            >= applied + refused + 2.0
    })
    .await;
    let made_direct = fg.series(&series("applied")).await >= applied + 2.0;
    let kept = send(
        Request::get(fg.admin_url("/v1/deliveries"))
            .header("authorization", format!("Bearer {ADMIN}"))
            .body(Full::default())
            .unwrap(),
    )
    .await
    .json();
    let kept = kept["messages"]
        .as_array()
        .unwrap_or_else(|| panic!("{kept}"))
        .iter()
        .filter(|m| m["route"] == "hook")
        .count();
    match late.status.as_u16() {
        202 => {
            assert_eq!(kept, 1);
            assert!(
                !made_direct,
                "202 for a message kept under a name made direct"
            );
        }
        503 => {
            assert_eq!(late.error_code().as_deref(), Some("route_changed"));
            assert_eq!(kept, 0);
        }
        other => panic!("{other}: {}", String::from_utf8_lossy(&late.body)),
    }
}

/// What schemathesis's run against docs/openapi.json led to (issue 45): a
/// route or key that no message can have (a NUL, not a route name), a lease
/// that is no lease name and a listing cursor naming such a key are answered
/// as bad input — 404 `delivery_not_found`, 400 `bad_request` — on both
/// backends. On PostgreSQL each was a 503 (`state_unavailable`, the proxy's
/// `store_unavailable`): the database refuses text holding a NUL.
async fn names_no_message_can_have_are_4xx_not_5xx(backend: Backend) {
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let fg = Fencegate::start_with_server(
        &format!("admin_token = \"{ADMIN}\""),
        &format!(
            "{}{}\n{}",
            s3.store_toml(200),
            backend.state_toml(),
            queued_route(&origin.url("/v1/"), "")
        ),
        &[],
    );
    let a = acquire(
        &s3.epochs().await,
        "hook",
        "worker-a",
        Duration::from_secs(60),
    )
    .await;
    accepted(&send(keyed(&fg, "/hook/events", &a, "q1", "{}")).await);
    wait_status(&fg, "q1", |v| v["status"] == "delivered").await;
    let admin_get = |path: &str| {
        Request::get(fg.admin_url(path))
            .header("authorization", format!("Bearer {ADMIN}"))
            .body(Full::default())
            .unwrap()
    };

    for key in ["a%00b", "%00", "%FF", "a%20b"] {
        send(admin_get(&format!("/v1/deliveries/hook/{key}")))
            .await
            .assert_error(404, "delivery_not_found");
        for action in ["retry", "drop"] {
            admin_post(&fg, &format!("/v1/deliveries/hook/{key}/{action}"))
                .await
                .assert_error(404, "delivery_not_found");
        }
        let status = Request::get(fg.url(&format!("/.fencegate/deliveries/hook/{key}")))
            .header("x-lease-token", &a.token)
            .body(Full::default())
            .unwrap();
        send(status).await.assert_error(404, "delivery_not_found");
    }
    for route in ["%00", "ho%00ok", "Hook"] {
        let status = Request::get(fg.url(&format!("/.fencegate/deliveries/{route}/q1")))
            .header("x-lease-token", &a.token)
            .body(Full::default())
            .unwrap();
        send(status).await.assert_error(404, "delivery_not_found");
    }
    for lease in ["%00", "a%00", "Hook"] {
        send(admin_get(&format!("/v1/deliveries?lease={lease}")))
            .await
            .assert_error(400, "bad_request");
    }
    for after in ["1/hook/%00", "1/h%00ok/x", "1/hook/a%20b"] {
        send(admin_get(&format!("/v1/dedup?state=done&after={after}")))
            .await
            .assert_error(400, "bad_request");
    }

    // What can exist still answers.
    let listed = send(admin_get("/v1/deliveries?lease=hook")).await;
    assert_eq!(
        (listed.status.as_u16(), &listed.json()["total"]),
        (200, &serde_json::json!(1))
    );
    let page = send(admin_get("/v1/dedup?state=done&after=1/hook/x")).await;
    assert_eq!(page.status, 200, "{:?}", page.body);
    assert_eq!(status_of(&fg, "q1").await["status"], "delivered");
    let ready = send(
        Request::get(fg.admin_url("/readyz"))
            .body(Full::default())
            .unwrap(),
    )
    .await;
    assert_eq!(ready.status, 200);
}

on_sled_and_postgres!(names_no_message_can_have_are_4xx_not_5xx);

/// Issue 48, the history by time: `GET /v1/deliveries` pages through every
/// message once by `next`, keeps `total` for every page, and takes `since` and
/// `until` on the acceptance time (`by=updated`: the last change); bad values
/// are 400 `bad_request`, naming what to write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_delivery_history_pages_by_cursor_and_filters_by_time() {
    skip_without_python!();
    let q = Queued::start("").await;
    let get = |query: String| {
        let url = q.fg.admin_url(&format!("/v1/deliveries{query}"));
        async move {
            send(
                Request::get(url)
                    .header("authorization", format!("Bearer {ADMIN}"))
                    .body(Full::default())
                    .unwrap(),
            )
            .await
        }
    };
    let before = fencegate::clock::rfc3339(std::time::SystemTime::now() - Duration::from_secs(1));
    for k in ["k1", "k2", "k3", "k4", "k5"] {
        accepted(&send(message(&q.fg, &q.a, k, k, 200)).await);
    }
    let mut seen = Vec::new();
    let mut query = "?limit=2".to_owned();
    loop {
        let page = get(query.clone()).await.json();
        assert_eq!(page["total"], 5, "{page}");
        for m in page["messages"].as_array().unwrap() {
            seen.push(m["dedup_key"].as_str().unwrap().to_owned());
        }
        match page["next"].as_str() {
            Some(next) => {
                query = format!("?limit=2&after={}", fencegate::dedup::escape_segment(next))
            }
            None => break,
        }
    }
    assert_eq!(seen, ["k1", "k2", "k3", "k4", "k5"]);
    let later = fencegate::clock::rfc3339(std::time::SystemTime::now() + Duration::from_secs(60));
    let inside = get(format!("?since={before}&until={later}")).await.json();
    assert_eq!(inside["total"], 5, "{inside}");
    let after = get(format!("?since={later}&by=updated")).await.json();
    assert_eq!(after["total"], 0, "{after}");
    for (query, said) in [
        ("?since=yesterday", "RFC 3339"),
        ("?by=settled", "accepted or updated"),
        ("?after=no-slash", "next of the page before"),
    ] {
        let r = get(query.to_owned()).await;
        r.assert_error(400, "bad_request");
        assert!(
            r.json()["message"].as_str().unwrap().contains(said),
            "{query}: {}",
            r.json()
        );
    }
}

/// Lease `hook` has two queued routes, `hook` and `side`; lease `other` one,
/// `other`; lease `plain` a direct route.
fn pause_routes(upstream: &str) -> String {
    let route = |name: &str, lease: &str, queued: bool| {
        format!(
            "[[route]]\nname = \"{name}\"\npath_prefix = \"/{name}/\"\nupstream = \"{upstream}\"\nlease = \"{lease}\"\n{}\n",
            if queued { "delivery = \"queued\"\nretry = { schedule = [\"100ms\"] }" } else { "" }
        )
    };
    [
        route("hook", "hook", true),
        route("side", "hook", true),
        route("other", "other", true),
        route("plain", "plain", false),
    ]
    .concat()
}

fn paused_json(fg_routes: &serde_json::Value, route: &str) -> serde_json::Value {
    fg_routes["routes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["route"] == route)
        .unwrap()["paused"]
        .clone()
}

/// SPEC §11, pause and resume, asserted at the destination: a paused route's
/// messages — and those of its lease's other route behind them — wait while
/// another lease's go on; the pause holds across kill -9 and a restart;
/// resume delivers them in acceptance order; a lease's pause holds that
/// lease only. Bad input is refused by code and changes nothing.
async fn a_pause_holds_across_a_restart_and_resume_delivers_in_order(backend: Backend) {
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let mut fg = Fencegate::start_with_server(
        &format!("admin_token = \"{ADMIN}\""),
        &format!(
            "{}{}\n{}",
            s3.store_toml(200),
            backend.state_toml(),
            pause_routes(&origin.url("/v1/"))
        ),
        &[],
    );
    let epochs = s3.epochs().await;
    let a = acquire(&epochs, "hook", "worker-a", Duration::from_secs(120)).await;
    let b = acquire(&epochs, "other", "worker-b", Duration::from_secs(120)).await;
    let at = |path: &str, h: &Holding, key: &str| keyed(&fg, path, h, key, key);

    // Bad input: each refusal by its code, nothing paused.
    for (path, status, code) in [
        ("/v1/routes/nope/pause", 404, "route_not_found"),
        ("/v1/routes/plain/pause", 409, "route_not_queued"),
        ("/v1/leases/plain/pause", 404, "lease_not_found"),
        ("/v1/leases/nope/resume", 404, "lease_not_found"),
    ] {
        let r = admin_post(&fg, path).await;
        assert_eq!(
            r.status,
            status,
            "{path}: {}",
            String::from_utf8_lossy(&r.body)
        );
        assert_eq!(r.json()["error"], code, "{path}");
    }
    let anonymous = send(
        Request::post(fg.admin_url("/v1/routes/hook/pause"))
            .body(Full::default())
            .unwrap(),
    )
    .await;
    assert_eq!(anonymous.status, 401);
    let get = send(
        Request::get(fg.admin_url("/v1/routes/hook/pause"))
            .body(Full::default())
            .unwrap(),
    )
    .await;
    assert_eq!(get.status, 405);
    let routes = fg.admin_json("/v1/routes").await;
    assert_eq!(
        paused_json(&routes, "hook")["route"],
        serde_json::Value::Null
    );
    assert_eq!(paused_json(&routes, "plain"), serde_json::Value::Null);

    // Pause `hook`: its message and `side`'s behind it wait; `other` goes on.
    let p = admin_post(&fg, "/v1/routes/hook/pause").await;
    assert_eq!(p.status, 200, "{}", String::from_utf8_lossy(&p.body));
    assert_eq!(p.json()["paused"], true);
    let since = p.json()["since"].clone();
    assert!(since.is_string(), "{}", p.json());
    // Pausing again keeps when it began.
    assert_eq!(
        admin_post(&fg, "/v1/routes/hook/pause").await.json()["since"],
        since
    );
    accepted(&send(at("/hook/e", &a, "m1")).await);
    accepted(&send(at("/side/e", &a, "m2")).await);
    accepted(&send(at("/other/e", &b, "o1")).await);
    origin
        .wait_until("o1", |log| log.iter().any(|x| x.body == "o1"))
        .await;
    assert_eq!(arrived(&origin), ["o1"]);
    let routes = fg.admin_json("/v1/routes").await;
    assert_eq!(paused_json(&routes, "hook")["route"], since);
    assert_eq!(
        paused_json(&routes, "side")["route"],
        serde_json::Value::Null
    );
    assert_eq!(
        fg.series("fencegate_queue_paused{route=\"hook\"}").await,
        1.0
    );
    // On PostgreSQL the depth is read in the background, each second.
    eventually("hook's depth counts its paused message", || async {
        fg.series("fencegate_queue_depth{route=\"hook\"}").await == 1.0
    })
    .await;

    // kill -9 and a restart: still paused; `other` still goes on. o1 settled
    // first: killed between its arrival and its outcome's write, it would be
    // sent again (SPEC §11: an unknown outcome, at-least-once) — legal, and
    // not what this test is about (CI saw o1 twice once).
    eventually("o1 delivered, durably", || async {
        fg.admin_json("/v1/deliveries/other/o1").await["status"] == "delivered"
    })
    .await;
    fg.restart();
    accepted(&send(keyed(&fg, "/other/e", &b, "o2", "o2")).await);
    origin
        .wait_until("o2", |log| log.iter().any(|x| x.body == "o2"))
        .await;
    assert_eq!(arrived(&origin), ["o1", "o2"]);
    assert_eq!(
        paused_json(&fg.admin_json("/v1/routes").await, "hook")["route"],
        since
    );

    // Resume: m1 then m2, in acceptance order.
    let r = admin_post(&fg, "/v1/routes/hook/resume").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["paused"], false);
    assert_eq!(r.json()["since"], serde_json::Value::Null);
    origin
        .wait_until("m2", |log| log.iter().any(|x| x.body == "m2"))
        .await;
    assert_eq!(arrived(&origin), ["o1", "o2", "m1", "m2"]);
    assert_eq!(
        fg.series("fencegate_queue_paused{route=\"hook\"}").await,
        0.0
    );

    // A lease's pause holds that lease, whatever the route.
    assert_eq!(admin_post(&fg, "/v1/leases/other/pause").await.status, 200);
    accepted(&send(keyed(&fg, "/other/e", &b, "o3", "o3")).await);
    accepted(&send(keyed(&fg, "/side/e", &a, "m3", "m3")).await);
    origin
        .wait_until("m3", |log| log.iter().any(|x| x.body == "m3"))
        .await;
    assert_eq!(arrived(&origin), ["o1", "o2", "m1", "m2", "m3"]);
    assert!(paused_json(&fg.admin_json("/v1/routes").await, "other")["lease"].is_string());
    assert_eq!(admin_post(&fg, "/v1/leases/other/resume").await.status, 200);
    origin
        .wait_until("o3", |log| log.iter().any(|x| x.body == "o3"))
        .await;
    assert_eq!(arrived(&origin), ["o1", "o2", "m1", "m2", "m3", "o3"]);
}

on_sled_and_postgres!(a_pause_holds_across_a_restart_and_resume_delivers_in_order);

/// SPEC §11: a pause holds at once on the instance that was asked. An
/// attempt that passed the deliverer's pause check but waits for a place in
/// the upstream budget (SPEC §9 "Limits") is not yet written as started when
/// the pause is answered 200; once a place frees it must not be sent (found by
/// review: it was). Another lease's message, accepted after the places free,
/// shows the deliverers are going.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_holds_an_attempt_waiting_for_the_upstream_budget() {
    skip_without_python!();
    const NOFILE: u64 = 400;
    fencegate::budget::Nofile::raise();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let mut fg = Fencegate::unstarted(
        "127.0.0.1:0",
        &format!("admin_token = \"{ADMIN}\""),
        &format!(
            "{}{}",
            s3.store_toml(200),
            pause_routes(&origin.url("/v1/"))
        ),
        &[],
    );
    fg.nofile = Some(NOFILE);
    fg.spawn(None).expect("fencegate did not start");
    let cfg = fencegate::config::Config::load(&fg.config).unwrap();
    let upstream = fencegate::budget::Budget::derive(&cfg, NOFILE)
        .unwrap()
        .upstream_requests;
    let epochs = s3.epochs().await;
    let a = acquire(&epochs, "hook", "worker-a", Duration::from_secs(120)).await;
    let b = acquire(&epochs, "other", "worker-b", Duration::from_secs(120)).await;
    let p = acquire(&epochs, "plain", "worker-p", Duration::from_secs(120)).await;
    // Every place of the upstream share is taken by a direct request held at
    // the destination.
    let mut held = Vec::new();
    for i in 0..upstream {
        let req = worker_req(&fg.url(&format!("/plain/fill{i}")), p.epoch.get(), &p.token)
            .header("x-test-hold", "fill")
            .body(body("fill"))
            .unwrap();
        held.push(tokio::spawn(send(req)));
    }
    origin.wait_for(upstream).await;
    // m1's deliverer finds hook not paused and waits for a place. (Given time
    // to get there; were it not there yet, the pause would hold it anyway.)
    accepted(&send(keyed(&fg, "/hook/e", &a, "m1", "m1")).await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let r = admin_post(&fg, "/v1/routes/hook/pause").await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let after = status_of(&fg, "m1").await;
    assert_eq!(after["status"], "pending", "{after}");
    assert_eq!(after["attempts"], 0, "{after}");
    origin.release("fill");
    for h in held {
        assert_eq!(h.await.unwrap().status, 200);
    }
    accepted(&send(keyed(&fg, "/other/e", &b, "o1", "o1")).await);
    origin
        .wait_until("o1", |log| log.iter().any(|x| x.body == "o1"))
        .await;
    assert!(
        !arrived(&origin).contains(&"m1".to_owned()),
        "m1 reached the destination after its route's pause was answered 200: {}",
        status_of(&fg, "m1").await
    );
    assert_eq!(status_of(&fg, "m1").await["attempts"], 0);
}

/// Ten queued routes `r0`..`r9`, each on its own lease `l0`..`l9`, to
/// `upstream` with one quick retry; and `r9b` on `l9` straight to `direct`.
fn bulk_routes(upstream: &str, direct: &str) -> String {
    let mut out = String::new();
    for i in 0..10 {
        out += &format!(
            "[[route]]\nname = \"r{i}\"\npath_prefix = \"/r{i}/\"\nupstream = \"{upstream}\"\nlease = \"l{i}\"\ndelivery = \"queued\"\nretry = {{ schedule = [\"10ms\"] }}\n"
        );
    }
    out += &format!(
        "[[route]]\nname = \"r9b\"\npath_prefix = \"/r9b/\"\nupstream = \"{direct}\"\nlease = \"l9\"\ndelivery = \"queued\"\nretry = {{ schedule = [\"10ms\"] }}\n"
    );
    out
}

async fn job_of(fg: &Fencegate, id: &str) -> serde_json::Value {
    send(
        Request::get(fg.admin_url(&format!("/v1/delivery-jobs/{id}")))
            .header("authorization", format!("Bearer {ADMIN}"))
            .body(Full::default())
            .unwrap(),
    )
    .await
    .json()
}

/// SPEC §11, recovering in bulk, asserted at the destination: a receiver down
/// past the schedule, 1,000 messages of 10 leases failed; lease l9 then
/// delivers a message of a newer epoch. One bulk retry — killed with -9 in
/// its middle and restarted — delivers every other message exactly once, in
/// each lease's acceptance order, and refuses (counts and lists) l9's older
/// ones: delivered now, they would arrive after the newer epoch's.
async fn a_bulk_retry_after_an_outage_delivers_each_once_in_order(backend: Backend) {
    const PER_LEASE: usize = 100;
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let (relay, down) = receiver_down(&origin).await;
    let mut fg = Fencegate::start_with_server(
        &format!("admin_token = \"{ADMIN}\""),
        &format!(
            "{}{}\n{}",
            s3.store_toml(200),
            backend.state_toml(),
            bulk_routes(&down, &origin.url("/v1/"))
        ),
        &[],
    );
    let epochs = s3.epochs().await;
    let mut holders = Vec::new();
    for i in 0..10 {
        holders.push(acquire(&epochs, &format!("l{i}"), "w", Duration::from_secs(300)).await);
    }
    // 100 messages per lease, accepted in order, ten leases at once.
    let mut tasks = Vec::new();
    for (i, h) in holders.iter().enumerate() {
        let (url, h) = (fg.url(&format!("/r{i}/e")), h.clone());
        tasks.push(tokio::spawn(async move {
            for n in 0..PER_LEASE {
                let body_text = format!("l{i}-{n:03}");
                let r = send(
                    worker_req(&url, h.epoch.get(), &h.token)
                        .header("idempotency-key", &body_text)
                        .body(body(&body_text))
                        .unwrap(),
                )
                .await;
                assert_eq!(r.status, 202, "{body_text}");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let failed = || async {
        send(
            Request::get(fg.admin_url("/v1/deliveries?status=failed&limit=1"))
                .header("authorization", format!("Bearer {ADMIN}"))
                .body(Full::default())
                .unwrap(),
        )
        .await
        .json()["total"]
            .as_u64()
            .unwrap_or(0)
    };
    for _ in 0..2400 {
        if failed().await == 10 * PER_LEASE as u64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        failed().await,
        10 * PER_LEASE as u64,
        "every message failed"
    );
    assert_eq!(origin.count(), 0);
    // l9's newer epoch is delivered meanwhile (its other route is up).
    let newer = force_next_epoch(&epochs, "l9", "w2", Duration::from_secs(300)).await;
    accepted(&send(keyed(&fg, "/r9b/e", &newer, "l9-newer", "l9-newer")).await);
    origin
        .wait_until("l9-newer", |log| log.iter().any(|x| x.body == "l9-newer"))
        .await;
    relay.refuse(false);

    // One bulk retry; kill -9 once it has made progress, then restart.
    let r = admin_post(&fg, "/v1/delivery-jobs/retry").await;
    assert_eq!(r.status, 202, "{}", String::from_utf8_lossy(&r.body));
    let id = r.json()["job"].as_str().unwrap().to_owned();
    assert_eq!(r.json()["matched"], 10 * PER_LEASE as u64);
    eventually("the job makes progress", || async {
        job_of(&fg, &id).await["done"].as_u64().unwrap_or(0) >= 100
    })
    .await;
    fg.restart();
    let mut job = serde_json::Value::Null;
    for _ in 0..2400 {
        job = job_of(&fg, &id).await;
        if job["state"] == "finished" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(job["state"], "finished", "{job}");
    assert_eq!(job["refused"], PER_LEASE as u64, "l9's older epoch: {job}");
    let refused = job["refused_keys"].as_array().unwrap();
    assert!(
        refused
            .iter()
            .all(|k| k.as_str().unwrap().starts_with("r9/")),
        "{job}"
    );
    // Every retried message arrives once, each lease's in acceptance order.
    origin
        .wait_until("every retried message", |log| log.len() > 9 * PER_LEASE)
        .await;
    let got = arrived(&origin);
    for i in 0..9 {
        let mut lease: Vec<&String> = got
            .iter()
            .filter(|b| b.starts_with(&format!("l{i}-")))
            .collect();
        // The one repeat SPEC allows: an attempt out at the kill -9, sent
        // again first after the restart and counted an unknown outcome.
        let mut repeated = Vec::new();
        lease.dedup_by(|b, a| {
            let same = a == b;
            if same {
                repeated.push(a.to_string());
            }
            same
        });
        for key in repeated {
            let v = fg.admin_json(&format!("/v1/deliveries/r{i}/{key}")).await;
            assert!(
                v["unknown_outcomes"].as_u64() >= Some(1),
                "{key} sent twice: {v}"
            );
        }
        let want: Vec<String> = (0..PER_LEASE).map(|n| format!("l{i}-{n:03}")).collect();
        assert_eq!(
            lease,
            want.iter().collect::<Vec<_>>(),
            "lease l{i}: each once (an unknown outcome's repeat aside), in order"
        );
    }
    assert_eq!(
        got.iter()
            .filter(|b| b.starts_with("l9-"))
            .collect::<Vec<_>>(),
        ["l9-newer"],
        "no older epoch of l9 after its newer one"
    );
}

on_sled_and_postgres!(a_bulk_retry_after_an_outage_delivers_each_once_in_order);

async fn jobs_list(fg: &Fencegate) -> serde_json::Value {
    send(
        Request::get(fg.admin_url("/v1/delivery-jobs"))
            .header("authorization", format!("Bearer {ADMIN}"))
            .body(Full::default())
            .unwrap(),
    )
    .await
    .json()
}

async fn wait_job_finished(fg: &Fencegate, id: &str) -> serde_json::Value {
    let mut job = serde_json::Value::Null;
    for _ in 0..600 {
        job = job_of(fg, id).await;
        if job["state"] == "finished" {
            return job;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("job {id} never finished: {job}");
}

/// A bulk retry edits each message once (found by review: a message the
/// receiver refused for good was retried on every pass, about once a second,
/// and the job never finished). It finishes once it has retried what matched
/// when it was made; a message failing afterwards is not its business.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_retry_of_a_final_refusal_sends_it_once_and_finishes() {
    skip_without_python!();
    let Queued {
        s3: _s3,
        origin,
        fg,
        epochs: _e,
        a,
    } = Queued::start("retry = { schedule = [\"10ms\"] }").await;
    accepted(&send(message(&fg, &a, "poison", "poison", 400)).await);
    wait_status(&fg, "poison", |v| v["status"] == "failed").await;
    let r = admin_post(&fg, "/v1/delivery-jobs/retry").await;
    assert_eq!(r.status, 202);
    let id = r.json()["job"].as_str().unwrap().to_owned();
    let job = wait_job_finished(&fg, &id).await;
    assert_eq!(
        (job["matched"].as_u64(), job["done"].as_u64()),
        (Some(1), Some(1)),
        "{job}"
    );
    wait_status(&fg, "poison", |v| v["status"] == "failed").await;
    accepted(&send(message(&fg, &a, "later", "later", 400)).await);
    wait_status(&fg, "later", |v| v["status"] == "failed").await;
    let count = |b: &str| origin.log().iter().filter(|x| x.body == b).count();
    assert_eq!(
        count("poison"),
        2,
        "the worker's attempt, then the job's one retry"
    );
    assert_eq!(count("later"), 1);
    assert_eq!(job_of(&fg, &id).await["done"], 1);
}

/// Bad input to the jobs' endpoints is 4xx and makes no job (the review's matrix).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_to_the_bulk_jobs_is_4xx_and_makes_nothing() {
    skip_without_python!();
    let Queued {
        s3: _s3,
        origin: _o,
        fg,
        epochs: _e,
        a: _a,
    } = Queued::start("").await;
    let mut bad = Vec::new();
    for (method, path) in [
        ("GET", "/v1/delivery-jobs/retry"),
        ("PUT", "/v1/delivery-jobs/retry"),
        ("DELETE", "/v1/delivery-jobs/drop"),
        ("POST", "/v1/delivery-jobs"),
        ("POST", "/v1/delivery-jobs/0123456789abcdef0123456789abcdef"),
        ("GET", "/v1/delivery-jobs/zz"),
        ("GET", "/v1/delivery-jobs/%00"),
        ("GET", "/v1/delivery-jobs/a/b"),
        ("POST", "/v1/delivery-jobs/retry?status=pending"),
        ("POST", "/v1/delivery-jobs/retry?status=delivered"),
        ("POST", "/v1/delivery-jobs/retry?status=bogus"),
        ("POST", "/v1/delivery-jobs/retry?route=nope"),
        ("POST", "/v1/delivery-jobs/retry?route="),
        ("POST", "/v1/delivery-jobs/retry?route=%ff"),
        ("POST", "/v1/delivery-jobs/retry?lease=UPPER"),
        ("POST", "/v1/delivery-jobs/retry?lease=%00"),
        ("POST", "/v1/delivery-jobs/retry?since=yesterday"),
        ("POST", "/v1/delivery-jobs/retry?since=1960-01-01T00:00:00Z"),
        (
            "POST",
            "/v1/delivery-jobs/retry?until=99999-01-01T00:00:00Z",
        ),
        ("POST", "/v1/delivery-jobs/retry?by=x"),
        ("POST", "/v1/delivery-jobs/retry?after=hook/k"),
        ("POST", "/v1/delivery-jobs/retry?limit=5"),
        ("POST", "/v1/delivery-jobs/retry?foo=1"),
        ("POST", "/v1/delivery-jobs/drop"),
        ("POST", "/v1/delivery-jobs/drop?status=delivering"),
        ("POST", "/v1/delivery-jobs/drop?status=dropped"),
        ("POST", "/v1/delivery-jobs/drop?route=hook"),
        ("POST", "/v1/delivery-jobs/Retry"),
    ] {
        let r = send(
            Request::builder()
                .method(method)
                .uri(fg.admin_url(path))
                .header("authorization", format!("Bearer {ADMIN}"))
                .body(Full::default())
                .unwrap(),
        )
        .await;
        if !(400..500).contains(&r.status.as_u16()) {
            bad.push(format!("{method} {path} -> {}", r.status));
        }
    }
    let r = send(
        Request::post(fg.admin_url("/v1/delivery-jobs/drop?status=pending"))
            .body(Full::default())
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 401);
    assert!(bad.is_empty(), "{bad:?}");
    assert_eq!(jobs_list(&fg).await["jobs"], serde_json::json!([]));
}

/// A bulk drop over a removed route's messages (kept until the route is back)
/// finishes without them, and never drops what a worker sends after the job
/// was made (found by review: it stayed running and dropped a message
/// accepted 4 s after it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_drop_finishes_past_a_removed_route_and_spares_later_messages() {
    skip_without_python!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let (fg, old) = beside_old_route(&s3, &origin, "");
    let epochs = s3.epochs().await;
    let a = acquire(&epochs, "hook", "w", Duration::from_secs(60)).await;
    let o = acquire(&epochs, "old", "w", Duration::from_secs(60)).await;
    assert_eq!(admin_post(&fg, "/v1/routes/old/pause").await.status, 200);
    accepted(&send(keyed(&fg, "/old/e", &o, "o1", "o1")).await);
    let old2 = old.clone();
    reload_applied(&fg, move |t| t.replace(&old2, "")).await;
    assert_eq!(admin_post(&fg, "/v1/routes/hook/pause").await.status, 200);
    accepted(&send(keyed(&fg, "/hook/e", &a, "h1", "h1")).await);
    let r = admin_post(&fg, "/v1/delivery-jobs/drop?status=pending").await;
    assert_eq!(r.status, 202);
    let id = r.json()["job"].as_str().unwrap().to_owned();
    let job = wait_job_finished(&fg, &id).await;
    assert_eq!(
        job["done"], 1,
        "h1 dropped, old's o1 waits for its route: {job}"
    );
    assert_eq!(status_of(&fg, "h1").await["status"], "dropped");
    // A worker's message accepted after the job was made: not the job's.
    accepted(&send(keyed(&fg, "/hook/e", &a, "h2", "h2")).await);
    assert_eq!(admin_post(&fg, "/v1/routes/hook/resume").await.status, 200);
    wait_status(&fg, "h2", |v| v["status"] == "delivered").await;
    assert_eq!(arrived(&origin), ["h2"]);
}

/// SPEC §11: a route removed by a reload keeps its messages "until it is back
/// (or an operator drops them)". The single drop of such a message — its
/// lease named by no route now — settles it `dropped` (it answered 503
/// `shard_unavailable` before: nothing could drop it); a retry still needs its
/// lease served (it would wait for the route anyway), and the route added
/// back delivers the message left and never the dropped one.
async fn a_removed_routes_message_can_be_dropped_one_by_one(backend: Backend) {
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let (fg, old) = beside_old_route(&s3, &origin, &backend.state_toml());
    let epochs = s3.epochs().await;
    let o = acquire(&epochs, "old", "w", Duration::from_secs(120)).await;
    assert_eq!(admin_post(&fg, "/v1/routes/old/pause").await.status, 200);
    accepted(&send(keyed(&fg, "/old/e", &o, "o1", "o1")).await);
    accepted(&send(keyed(&fg, "/old/e", &o, "o2", "o2")).await);
    let reload = |edit: Box<dyn FnOnce(String) -> String + Send>| reload_applied(&fg, edit);
    let old2 = old.clone();
    reload(Box::new(move |t| t.replace(&old2, ""))).await;

    admin_post(&fg, "/v1/deliveries/old/o2/retry")
        .await
        .assert_error(503, "shard_unavailable");
    let dropped = admin_post(&fg, "/v1/deliveries/old/o1/drop").await;
    assert_eq!(
        dropped.status,
        200,
        "{}",
        String::from_utf8_lossy(&dropped.body)
    );
    assert_eq!(dropped.json()["status"], "dropped");
    // Dropped once: again is a conflict, not a second edit.
    admin_post(&fg, "/v1/deliveries/old/o1/drop")
        .await
        .assert_error(409, "delivery_conflict");

    // Back, resumed: o2 goes, o1 never does.
    let old3 = old.clone();
    reload(Box::new(move |t| t + "\n" + &old3)).await;
    assert_eq!(admin_post(&fg, "/v1/routes/old/resume").await.status, 200);
    eventually("o2 to arrive", || async { arrived(&origin) == ["o2"] }).await;
    let o1 = send(
        Request::get(fg.admin_url("/v1/deliveries/old/o1"))
            .body(Full::default())
            .unwrap(),
    )
    .await;
    assert_eq!(o1.json()["status"], "dropped");
    assert_eq!(
        arrived(&origin),
        ["o2"],
        "the dropped message never arrived"
    );
}

on_sled_and_postgres!(a_removed_routes_message_can_be_dropped_one_by_one);

/// Found by review of the drop above: a bulk drop job lists a pass's
/// messages, then edits them; a reload that removes their route in between
/// must leave the rest pending (SPEC §11: a job passes a route no longer
/// configured over) — the job's edits check the route again under the
/// edits lock. 1,500 messages, the route removed while the job works through
/// them: after the reload has applied, at most the one edit already under
/// way lands (the build before went on and dropped all 1,500).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_drop_stops_at_a_route_removed_under_it() {
    skip_without_python!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let (fg, old) = beside_old_route(&s3, &origin, "");
    let epochs = s3.epochs().await;
    let o = acquire(&epochs, "old", "w", Duration::from_secs(300)).await;
    assert_eq!(admin_post(&fg, "/v1/routes/old/pause").await.status, 200);
    const N: usize = 1500;
    for i in 0..N {
        let k = format!("o{i}");
        accepted(&send(keyed(&fg, "/old/e", &o, &k, &k)).await);
    }
    let dropped = || async {
        let r = send(
            Request::get(fg.admin_url("/v1/deliveries?status=dropped&limit=1"))
                .header("authorization", format!("Bearer {ADMIN}"))
                .body(Full::default())
                .unwrap(),
        )
        .await;
        let v = r.json();
        v["total"]
            .as_u64()
            .unwrap_or_else(|| panic!("{} {v}", r.status))
    };
    let r = admin_post(&fg, "/v1/delivery-jobs/drop?route=old&status=pending").await;
    assert_eq!(r.status, 202);
    let id = r.json()["job"].as_str().unwrap().to_owned();
    eventually("the job's first drops", || async { dropped().await > 0 }).await;
    let old2 = old.clone();
    reload_applied(&fg, move |t| t.replace(&old2, "")).await;
    let at_reload = dropped().await;
    wait_job_finished(&fg, &id).await;
    let after = dropped().await;
    assert!(
        after <= at_reload + 1,
        "{after} dropped in all, {at_reload} when the reload had applied: the job went on past the removed route"
    );
    assert!(origin.log().is_empty(), "nothing was delivered");
}
