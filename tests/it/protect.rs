//! Protecting the destination (issue 29 §3, SPEC §7 `upstream_held`, §9): a
//! route's `max_in_flight`, its hold on a destination's `Retry-After`, and its
//! circuit breaker — each a refusal before forwarding: nothing reaches the origin,
//! nothing is recorded, and the worker's key stays free for its retry. A real
//! fencegate process, the `dir` lease store and the recording origin, which counts
//! how many requests it handles at once.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use fencegate::lease::acquire::Holding;
use http::Request;
use http_body_util::Full;
use serde_json::Value;

use crate::support::egress::reload_with;
use crate::support::*;

struct Setup {
    _store: tempfile::TempDir,
    origin: Origin,
    fg: Fencegate,
    h: Holding,
}

/// Route `billing` on lease `billing` with `route_extra`, and `more` routes.
async fn setup(route_extra: &str, more: &str) -> Setup {
    let store = tempfile::tempdir().unwrap();
    let origin = Origin::start().await;
    let fg = Fencegate::start(&format!(
        "{}{}{more}",
        dir_store_toml(store.path()),
        route_toml("billing", "billing", &origin, route_extra),
    ));
    let epochs = dir_epochs(store.path());
    let h = acquire(&epochs, "billing", "worker", Duration::from_secs(120)).await;
    Setup {
        _store: store,
        origin,
        fg,
        h,
    }
}

/// A keyed POST to `path` with extra headers.
fn req(s: &Setup, path: &str, key: &str, headers: &[(&str, &str)]) -> Request<Full<Bytes>> {
    let mut r =
        worker_req(&s.fg.url(path), s.h.epoch.get(), &s.h.token).header("idempotency-key", key);
    for (n, v) in headers {
        r = r.header(*n, *v);
    }
    r.body(body(&format!("payload of {key}"))).unwrap()
}

/// Keyed requests `k1` and `k2` to `/billing/x`, held at the origin (under
/// `h`) once both have arrived.
async fn two_held(s: &Setup) -> Vec<tokio::task::JoinHandle<Result<Reply, String>>> {
    let held = ["k1", "k2"]
        .iter()
        .map(|k| tokio::spawn(try_send(req(s, "/billing/x", k, &[("x-test-hold", "h")]))))
        .collect();
    s.origin.wait_for(2).await;
    held
}

/// `/v1/routes`' entry for `route`.
async fn route_view(fg: &Fencegate, route: &str) -> Value {
    let all = fg.admin_json("/v1/routes").await;
    all["routes"]
        .as_array()
        .and_then(|rs| rs.iter().find(|r| r["route"] == route).cloned())
        .unwrap_or_else(|| panic!("no route {route} in {all}"))
}

/// A 503 `upstream_held` for `detail`, its `Retry-After` in whole seconds.
fn assert_held(r: &Reply, detail: &str) -> u64 {
    r.assert_error(503, "upstream_held");
    assert_eq!(r.json()["detail"], detail, "{}", r.json());
    let secs = r.retry_after_secs();
    assert!(secs >= 1, "Retry-After {secs}");
    secs
}

/// With `max_in_flight = 2` and two requests held at the origin, a third is
/// refused 503 `upstream_held` (`in_flight_limit`, `Retry-After`) and never
/// reaches the origin; once the two are answered, its retry with the same key is
/// forwarded — the refusal recorded nothing. The admin API and the metrics show
/// the count and the refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_max_in_flight_is_refused_and_the_key_stays_free() {
    let s = Arc::new(setup("max_in_flight = 2", "").await);
    let held = two_held(&s).await;
    let view = route_view(&s.fg, "billing").await;
    assert_eq!(view["in_flight"], 2, "{view}");
    assert_eq!(view["max_in_flight"], 2, "{view}");

    let refused = send(req(&s, "/billing/x", "k3", &[])).await;
    assert_eq!(assert_held(&refused, "in_flight_limit"), 1);
    assert!(refused.json()["message"]
        .as_str()
        .unwrap()
        .contains("max_in_flight"));
    assert_eq!(
        s.origin.count(),
        2,
        "nothing of the refused request reached the origin"
    );
    let record = s.fg.admin_json("/v1/dedup/billing/k3").await;
    assert_eq!(
        record["error"], "dedup_record_not_found",
        "nothing recorded: {record}"
    );
    assert_eq!(
        route_view(&s.fg, "billing").await["refused"]["in_flight_limit"],
        1
    );
    assert_eq!(
        s.fg.series("fencegate_upstream_held_total{route=\"billing\",reason=\"in_flight_limit\"}")
            .await,
        1.0
    );
    assert_eq!(
        s.fg.series("fencegate_route_in_flight{route=\"billing\"}")
            .await,
        2.0
    );

    s.origin.release("h");
    for h in held {
        assert_eq!(h.await.unwrap().unwrap().status, 200);
    }
    eventually("the route's in-flight count back at 0", || async {
        route_view(&s.fg, "billing").await["in_flight"] == 0
    })
    .await;
    let retry = send(req(&s, "/billing/x", "k3", &[])).await;
    assert_eq!(retry.status, 200, "{:?}", retry.body);
    let log = s.origin.log();
    assert_eq!(log.len(), 3);
    assert_eq!(log[2].header("idempotency-key").as_deref(), Some("k3"));
    assert_eq!(s.origin.max_concurrent(), 2);
}

/// 16 workers each send 5 requests (distinct keys) as fast as they can, retrying
/// a refused one with the same key at once, against an origin that takes 20 ms per
/// request. The origin never handles more than `max_in_flight = 3` at once
/// (counted there), every request is delivered exactly once, and what was refused
/// was refused as `upstream_held`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_more_than_max_in_flight_at_the_origin_under_load() {
    let s = Arc::new(setup("max_in_flight = 3", "").await);
    let workers: Vec<_> = (0..16)
        .map(|w| {
            let s = s.clone();
            tokio::spawn(async move {
                let mut refusals = 0;
                for i in 0..5 {
                    let key = format!("w{w}-{i}");
                    loop {
                        let r = try_send(req(&s, "/billing/x", &key, &[("x-test-delay-ms", "20")]))
                            .await
                            .unwrap();
                        if r.status == 200 {
                            break;
                        }
                        assert_held(&r, "in_flight_limit");
                        refusals += 1;
                        assert!(refusals < 100_000, "never forwarded");
                        tokio::task::yield_now().await;
                    }
                }
                refusals
            })
        })
        .collect();
    let mut refusals = 0;
    for w in workers {
        refusals += w.await.unwrap();
    }
    let log = s.origin.log();
    let mut keys: Vec<String> = log
        .iter()
        .filter_map(|a| a.header("idempotency-key"))
        .collect();
    keys.sort();
    keys.dedup();
    assert_eq!(log.len(), 80, "each request delivered once");
    assert_eq!(keys.len(), 80);
    let max = s.origin.max_concurrent();
    assert!(max <= 3, "the origin handled {max} requests at once");
    assert!(refusals > 0, "16 workers on 3 slots: some were refused");
    eprintln!("origin's most at once: {max}; refusals: {refusals}");
}

/// A 503 with `Retry-After: 3` (seconds) goes back to the worker as it came, and
/// holds the route: the next request is refused `retry_after` with a
/// `Retry-After` of at most 3, and reaches nothing. Once the hold is over (the
/// admin API says so), the refused request's retry with its key is forwarded.
/// The same with a 429 whose `Retry-After` is an HTTP date.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_holds_the_route_until_it_passes() {
    let s = setup("", "").await;
    for n in 0..2 {
        let (status, retry_after) = match n {
            0 => ("503", "3".to_owned()),
            // A date: read against the origin's own `Date`.
            _ => (
                "429",
                httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(4)),
            ),
        };
        let asked = send(req(
            &s,
            "/billing/x",
            &format!("ask-{n}"),
            &[
                ("x-test-status", status),
                ("x-test-retry-after", &retry_after),
            ],
        ))
        .await;
        assert_eq!(asked.status.as_str(), status);
        assert_eq!(
            asked.headers["retry-after"],
            retry_after.as_str(),
            "passed back as it came"
        );
        assert!(
            asked.error_code().is_none(),
            "the upstream's answer, not fencegate's"
        );
        let arrived = s.origin.count();

        let key = format!("next-{n}");
        let refused = send(req(&s, "/billing/x", &key, &[])).await;
        let secs = assert_held(&refused, "retry_after");
        assert!(secs <= 5, "Retry-After {secs}");
        assert_eq!(s.origin.count(), arrived, "nothing reached the origin");
        let view = route_view(&s.fg, "billing").await;
        assert!(
            view["held_for_ms"].as_u64().is_some_and(|ms| ms <= 5000),
            "{view}"
        );
        assert!(
            s.fg.series("fencegate_route_held_seconds{route=\"billing\"}")
                .await
                > 0.0
        );

        eventually("the hold to pass", || async {
            route_view(&s.fg, "billing").await["held_for_ms"].is_null()
        })
        .await;
        let retry = send(req(&s, "/billing/x", &key, &[])).await;
        assert_eq!(retry.status, 200, "{:?}", retry.body);
        assert_eq!(s.origin.count(), arrived + 1);
        assert_eq!(
            s.origin
                .log()
                .last()
                .unwrap()
                .header("idempotency-key")
                .as_deref(),
            Some(key.as_str())
        );
    }
    assert_eq!(
        s.fg.series("fencegate_upstream_held_total{route=\"billing\",reason=\"retry_after\"}")
            .await,
        2.0
    );
}

/// `honor_retry_after = false`: the 503 and its `Retry-After` still go back to the
/// worker, but the route is not held: the next request is forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn honor_retry_after_false_does_not_hold() {
    let s = setup("honor_retry_after = false", "").await;
    let asked = send(req(
        &s,
        "/billing/x",
        "a",
        &[("x-test-status", "503"), ("x-test-retry-after", "60")],
    ))
    .await;
    assert_eq!(asked.status, 503);
    assert_eq!(asked.headers["retry-after"], "60");
    assert!(route_view(&s.fg, "billing").await["held_for_ms"].is_null());
    let next = send(req(&s, "/billing/x", "b", &[])).await;
    assert_eq!(next.status, 200);
    assert_eq!(s.origin.count(), 2);
}

/// The breaker (`failures = 3`, `cool_down = "3s"`): three 500s from the origin
/// open it, and a request is then refused `breaker_open` without reaching the
/// origin. After the cool-down (half-open, as the admin API says) one request
/// probes: while it is at the origin another is refused; its 500 opens the
/// breaker again. After the next cool-down a probe answered 200 closes it, and
/// the request refused earlier is forwarded with its key. The states are in the
/// metrics and the admin API throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_breaker_opens_probes_once_reopens_and_closes() {
    let s = Arc::new(
        setup(
            "breaker = { failures = 3, window = \"30s\", cool_down = \"3s\" }",
            "",
        )
        .await,
    );
    let state = |s: Arc<Setup>| async move {
        route_view(&s.fg, "billing").await["breaker"]["state"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    assert_eq!(state(s.clone()).await, "closed");
    for i in 0..3 {
        let r = send(req(
            &s,
            "/billing/x",
            &format!("f{i}"),
            &[("x-test-status", "500")],
        ))
        .await;
        assert_eq!(r.status, 500, "the upstream's 500 is passed back");
    }
    assert_eq!(s.origin.count(), 3);
    let refused = send(req(&s, "/billing/x", "later", &[])).await;
    let secs = assert_held(&refused, "breaker_open");
    assert!(secs <= 3, "Retry-After {secs}: the rest of the cool-down");
    assert_eq!(s.origin.count(), 3, "nothing reached the origin");
    // Still open or already half-open, never closed.
    assert_ne!(state(s.clone()).await, "closed");
    assert_eq!(
        s.fg.series("fencegate_route_breaker_opened_total{route=\"billing\"}")
            .await,
        1.0
    );

    eventually("half-open after the cool-down", || {
        let s = s.clone();
        async move { state(s).await == "half_open" }
    })
    .await;
    assert_eq!(
        s.fg.series("fencegate_route_breaker_state{route=\"billing\",state=\"half_open\"}")
            .await,
        1.0
    );
    // One probe at a time: it is held at the origin while another is refused.
    let probe = tokio::spawn(try_send(req(
        &s,
        "/billing/x",
        "probe-1",
        &[("x-test-hold", "probe"), ("x-test-status", "500")],
    )));
    s.origin.wait_for(4).await;
    assert_held(
        &send(req(&s, "/billing/x", "later", &[])).await,
        "breaker_open",
    );
    assert_eq!(s.origin.count(), 4);
    s.origin.release("probe");
    assert_eq!(probe.await.unwrap().unwrap().status, 500);
    let view = route_view(&s.fg, "billing").await;
    assert_eq!(
        view["breaker"]["opened"], 2,
        "a failed probe opens it again: {view}"
    );
    assert_held(
        &send(req(&s, "/billing/x", "later", &[])).await,
        "breaker_open",
    );

    eventually("half-open again", || {
        let s = s.clone();
        async move { state(s).await == "half_open" }
    })
    .await;
    let probe = send(req(&s, "/billing/x", "probe-2", &[])).await;
    assert_eq!(probe.status, 200);
    assert_eq!(state(s.clone()).await, "closed");
    assert_eq!(
        s.fg.series("fencegate_route_breaker_state{route=\"billing\",state=\"closed\"}")
            .await,
        1.0
    );
    let later = send(req(&s, "/billing/x", "later", &[])).await;
    assert_eq!(
        later.status, 200,
        "the refused key was free: {:?}",
        later.body
    );
    let log = s.origin.log();
    assert_eq!(log.len(), 6);
    assert_eq!(log[5].header("idempotency-key").as_deref(), Some("later"));
    assert_eq!(
        s.fg.series("fencegate_upstream_held_total{route=\"billing\",reason=\"breaker_open\"}")
            .await,
        3.0
    );
}

/// Connection failures count too: a route whose upstream refuses connections
/// (nothing listens on port 1) answers 502 `upstream_unreachable` twice, then its
/// breaker (`failures = 2`) is open and the next request is refused before any
/// connection is tried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_failures_open_the_breaker() {
    let s = setup(
        "",
        "[[route]]\nname = \"dead\"\npath_prefix = \"/dead/\"\nupstream = \"http://127.0.0.1:1/\"\nlease = \"billing\"\ntimeout_ms = 2000\nbreaker = { failures = 2, cool_down = \"60s\" }\n",
    )
    .await;
    for i in 0..2 {
        send(req(&s, "/dead/x", &format!("d{i}"), &[]))
            .await
            .assert_error(502, "upstream_unreachable");
    }
    let refused = send(req(&s, "/dead/x", "d2", &[])).await;
    let secs = assert_held(&refused, "breaker_open");
    assert!((1..=60).contains(&secs), "Retry-After {secs}");
    let view = route_view(&s.fg, "dead").await;
    assert_eq!(view["breaker"]["state"], "open", "{view}");
    assert_eq!(view["breaker"]["config"]["failures"], 2, "{view}");
    // The other route is not affected.
    assert_eq!(send(req(&s, "/billing/x", "b", &[])).await.status, 200);
}

/// A reload that leaves the route's name and upstream alone keeps its state (an
/// open breaker stays open); one that turns the breaker off lifts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_the_state_of_an_unchanged_route() {
    let s = setup("breaker = { failures = 1, cool_down = \"10m\" }", "").await;
    let r = send(req(&s, "/billing/x", "f", &[("x-test-status", "502")])).await;
    assert_eq!(r.status, 502);
    assert_held(&send(req(&s, "/billing/x", "n", &[])).await, "breaker_open");

    // Unchanged except another key of the route: still open.
    s.fg.edit_config(|t| t.replace("timeout_ms = 3000", "timeout_ms = 4000"));
    reloaded(&s, 0.0).await;
    assert_held(&send(req(&s, "/billing/x", "n", &[])).await, "breaker_open");
    // The breaker removed: forwarding again.
    s.fg.edit_config(|t| t.replace("breaker = { failures = 1, cool_down = \"10m\" }\n", ""));
    reloaded(&s, 1.0).await;
    assert!(route_view(&s.fg, "billing").await["breaker"].is_null());
    assert_eq!(send(req(&s, "/billing/x", "n", &[])).await.status, 200);
}

/// SPEC §7 ("at most `max_retry_after`"): a request reports under the route's
/// current keys. A request in flight across a reload that lowers
/// `max_retry_after` to 2 s, whose 503 `Retry-After: 300` comes back after it,
/// holds the route for at most 2 s. Failed when a `Ticket` kept the settings of
/// its admission: the hold was capped by the *old* 5 min, and the route refused
/// for ~300 s while `/v1/routes` said `max_retry_after_ms: 2000` (the same stale
/// snapshot set a hold after a reload to `honor_retry_after = false`: not
/// enforced, but shown as `held_for_ms`, and enforced again if honouring was
/// turned back on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_in_flight_across_a_reload_holds_no_longer_than_the_new_max_retry_after() {
    let s = Arc::new(setup("", "").await);
    let asked = tokio::spawn(try_send(req(
        &s,
        "/billing/x",
        "ask",
        &[
            ("x-test-hold", "h"),
            ("x-test-status", "503"),
            ("x-test-retry-after", "300"),
        ],
    )));
    s.origin.wait_for(1).await;
    reload_with(&s.fg, |t| {
        t.replace(
            "timeout_ms = 3000",
            "timeout_ms = 3000\nmax_retry_after = \"2s\"",
        )
    })
    .await;
    assert_eq!(
        route_view(&s.fg, "billing").await["max_retry_after_ms"],
        2000
    );
    s.origin.release("h");
    assert_eq!(asked.await.unwrap().unwrap().status, 503);
    let refused = send(req(&s, "/billing/x", "next", &[])).await;
    refused.assert_error(503, "upstream_held");
    let secs = refused.retry_after_secs();
    let v = route_view(&s.fg, "billing").await;
    assert!(secs <= 2, "held {secs} s with max_retry_after = 2s: {v}");
}

/// A reload lowering `max_in_flight` from 2 to 1 with two requests in flight:
/// no underflow, the count drains to 0, a third is refused until both are over
/// and then forwarded, and the origin never saw more than 2 at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_lowering_max_in_flight_below_the_count_in_flight_drains_it() {
    let s = Arc::new(setup("max_in_flight = 2", "").await);
    let held = two_held(&s).await;
    reload_with(&s.fg, |t| {
        t.replace("max_in_flight = 2", "max_in_flight = 1")
    })
    .await;
    let v = route_view(&s.fg, "billing").await;
    assert_eq!(
        (v["in_flight"].as_u64(), v["max_in_flight"].as_u64()),
        (Some(2), Some(1)),
        "{v}"
    );
    send(req(&s, "/billing/x", "k3", &[]))
        .await
        .assert_error(503, "upstream_held");
    s.origin.release("h");
    for h in held {
        assert_eq!(h.await.unwrap().unwrap().status, 200);
    }
    eventually("in flight back at 0", || async {
        route_view(&s.fg, "billing").await["in_flight"] == 0
    })
    .await;
    assert_eq!(send(req(&s, "/billing/x", "k3", &[])).await.status, 200);
    assert_eq!(route_view(&s.fg, "billing").await["in_flight"], 0);
    assert_eq!(s.origin.count(), 3);
    assert!(s.origin.max_concurrent() <= 2);
}

/// The counters are shared by a route's successive guards: a reload that
/// changes a breaker key, or the route's upstream, leaves
/// `fencegate_route_breaker_opened_total` (a Prometheus counter, "times it
/// opened") and `fencegate_upstream_held_total` where they were. Failed when
/// such a reload replaced the `Breaker` (`opened` back to 0) or the `Guard`, so
/// the counters (and `/v1/routes` `refused`, documented "since start-up") went
/// down without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_of_the_breaker_or_upstream_keeps_the_counters() {
    let s = setup("breaker = { failures = 1, cool_down = \"1m\" }", "").await;
    let r = send(req(&s, "/billing/x", "f", &[("x-test-status", "500")])).await;
    assert_eq!(r.status, 500);
    send(req(&s, "/billing/x", "g", &[]))
        .await
        .assert_error(503, "upstream_held");
    let name = "fencegate_route_breaker_opened_total{route=\"billing\"}";
    let held = "fencegate_upstream_held_total{route=\"billing\",reason=\"breaker_open\"}";
    assert_eq!(s.fg.series(name).await, 1.0);
    assert_eq!(s.fg.series(held).await, 1.0);
    reload_with(&s.fg, |t| {
        t.replace("cool_down = \"1m\"", "cool_down = \"2m\"")
    })
    .await;
    assert_eq!(
        s.fg.series(name).await,
        1.0,
        "a counter went down on a reload"
    );
    // A new upstream (another base path): a fresh state, the same counters.
    reload_with(&s.fg, |t| t.replace("/v1/", "/v2/")).await;
    assert_eq!(
        (s.fg.series(name).await, s.fg.series(held).await),
        (1.0, 1.0),
        "a counter went down on a reload changing the upstream"
    );
    assert_eq!(s.origin.count(), 1);
}

/// Sends SIGHUP and waits until it is counted as applied (`before`: the count so far).
async fn reloaded(s: &Setup, before: f64) {
    s.fg.hup();
    eventually("the reload applied", || async {
        s.fg.series("fencegate_config_reloads_total{result=\"applied\"}")
            .await
            > before
    })
    .await;
}

/// The idempotency keys the origin received, in arrival order.
fn keys_at(origin: &Origin) -> Vec<String> {
    origin
        .log()
        .iter()
        .filter_map(|a| a.header("idempotency-key"))
        .collect()
}

/// Issue 48, a rate per destination (SPEC §9 `rate`, `rate_burst`): past its
/// burst a direct request is refused 503 `upstream_held` (`rate`, with the next
/// token's `Retry-After`) and reaches nothing, its key left free; the admin API
/// and the metrics count it. A reload to another rate starts a full bucket, and
/// the refused key's retry is forwarded, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_its_rate_a_request_is_refused_and_its_key_stays_free() {
    let s = setup("rate = \"1/h\"\nrate_burst = 2", "").await;
    for k in ["r1", "r2"] {
        assert_eq!(send(req(&s, "/billing/x", k, &[])).await.status, 200);
    }
    let refused = send(req(&s, "/billing/x", "r3", &[])).await;
    // One token an hour, none left: the next in about an hour (the refill
    // since the bucket filled takes a second off for every second the three
    // requests took, on a slow machine).
    let secs = assert_held(&refused, "rate");
    assert!((3500..=3600).contains(&secs), "Retry-After {secs}");
    assert!(refused.json()["message"].as_str().unwrap().contains("rate"));
    assert_eq!(s.origin.count(), 2, "the refused request reached nothing");
    let record = s.fg.admin_json("/v1/dedup/billing/r3").await;
    assert_eq!(record["error"], "dedup_record_not_found", "{record}");
    assert_eq!(route_view(&s.fg, "billing").await["refused"]["rate"], 1);
    assert_eq!(
        s.fg.series("fencegate_upstream_held_total{route=\"billing\",reason=\"rate\"}")
            .await,
        1.0
    );
    s.fg.edit_config(|t| t.replace("rate = \"1/h\"\nrate_burst = 2", "rate = \"100/s\""));
    reloaded(&s, 0.0).await;
    assert_eq!(send(req(&s, "/billing/x", "r3", &[])).await.status, 200);
    assert_eq!(keys_at(&s.origin), ["r1", "r2", "r3"]);
}

/// A queued route's attempts wait for the rate's next token (SPEC §11: a
/// held route delays an attempt and spends none): with `rate = "10/m"` and a
/// burst of 1, the second message waits ~6 s and both arrive, in order, each
/// once, after one attempt each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_routes_attempts_wait_for_the_rate() {
    let s = setup("delivery = \"queued\"\nrate = \"10/m\"\nrate_burst = 1", "").await;
    for k in ["q1", "q2"] {
        assert_eq!(send(req(&s, "/billing/x", k, &[])).await.status, 202);
    }
    s.origin.wait_for(2).await;
    assert_eq!(keys_at(&s.origin), ["q1", "q2"]);
    assert!(
        s.fg.series("fencegate_upstream_held_total{route=\"billing\",reason=\"rate\"}")
            .await
            >= 1.0,
        "the second attempt waited for the rate"
    );
    // Counted once durable: a wait for the rate spends no attempt.
    eventually("both attempts counted", || async {
        s.fg.metric_sum("fencegate_queue_attempts_total").await >= 2.0
    })
    .await;
    assert_eq!(s.fg.metric_sum("fencegate_queue_attempts_total").await, 2.0);
}

/// A rate that cannot be read, or a burst without a rate, is refused at start
/// (exit 2) naming the key.
#[test]
fn a_bad_rate_is_refused_naming_the_key() {
    for (extra, said) in [
        ("rate = \"fast\"", "is not a rate"),
        ("rate = \"0/s\"", "at least 1"),
        ("rate_burst = 3", "rate_burst needs rate"),
        (
            "rate = \"5/s\"\nrate_burst = 0",
            "rate_burst must be at least 1",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = format!(
            "{}[[route]]\nname = \"b\"\npath_prefix = \"/b/\"\nupstream = \"http://127.0.0.1:9/\"\nlease = \"b\"\n{extra}\n",
            dir_store_toml(dir.path())
        );
        let path = dir.path().join("f.toml");
        std::fs::write(&path, cfg).unwrap();
        let o = std::process::Command::new(bin())
            .args(["check-config", "--config", path.to_str().unwrap()])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{extra}: {err}");
        assert!(err.contains(said), "{extra}: {err}");
    }
}
