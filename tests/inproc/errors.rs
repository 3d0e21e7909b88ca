//! SPEC §7: every 4xx/5xx fencegate makes, with its JSON body and header; bad input
//! changes nothing (the origin sees nothing, the mark does not move).

use std::time::Duration;

use http::Request;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_clear_error_and_changes_nothing() {
    let origin = Origin::start().await;
    let routes = format!(
        "{}{}",
        route_toml("billing", "billing", &origin, "max_body_bytes = 16"),
        // Nothing listens on port 1: connect fails before any byte is sent.
        "[[route]]\nname = \"dead\"\npath_prefix = \"/dead/\"\nupstream = \"http://127.0.0.1:1/\"\nlease = \"billing\"\ntimeout_ms = 2000\n"
    );
    let fg = Fencegate::start(200, &routes).await;
    let a = acquire(&fg.epochs, "billing", "worker-a", Duration::from_secs(30)).await;
    let (e, tok) = (a.epoch.get(), a.token.as_str());
    let url = fg.url("/billing/x");

    let no_epoch = send(
        Request::post(&url)
            .header("x-lease-token", tok)
            .body(body("x"))
            .unwrap(),
    )
    .await;
    no_epoch.assert_error(428, "epoch_missing");

    // A protocol switch is refused, not downgraded to a plain request.
    let upgrade = send(
        Request::get(&url)
            .header("x-lease-epoch", e.to_string())
            .header("x-lease-token", tok)
            .header("connection", "upgrade")
            .header("upgrade", "websocket")
            .body(body(""))
            .unwrap(),
    )
    .await;
    upgrade.assert_error(501, "upgrade_unsupported");

    // (Surrounding spaces are optional whitespace in HTTP and never reach us.)
    for bad in [
        "",
        "+7",
        "-1",
        "7 7",
        "0x10",
        "18446744073709551616",
        "1.0",
        "٧",
        "01",
        "007",
    ] {
        let r = send(
            Request::post(&url)
                .header("x-lease-epoch", bad)
                .header("x-lease-token", tok)
                .body(body("x"))
                .unwrap(),
        )
        .await;
        r.assert_error(400, "epoch_malformed");
        let message = r.json()["message"].as_str().unwrap().to_owned();
        assert_eq!(
            message,
            "X-Lease-Epoch must be a plain decimal u64: digits only, no sign, no spaces, no leading zero",
            "says what is wrong once"
        );
    }
    let repeated = send(
        Request::post(&url)
            .header("x-lease-epoch", e.to_string())
            .header("x-lease-epoch", e.to_string())
            .header("x-lease-token", tok)
            .body(body("x"))
            .unwrap(),
    )
    .await;
    repeated.assert_error(400, "epoch_malformed");
    assert!(
        repeated.json()["message"]
            .as_str()
            .unwrap()
            .contains("repeated"),
        "{}",
        repeated.json()
    );
    // Two tokens, even one of them right: refused, and told they are repeated
    // (not that a token "does not match").
    let two_tokens = send(
        worker_req(&url, e, tok)
            .header("x-lease-token", tok)
            .body(body("x"))
            .unwrap(),
    )
    .await;
    two_tokens.assert_error(403, "token_invalid");
    assert_eq!(
        two_tokens.json()["message"],
        "X-Lease-Token is repeated: send exactly one"
    );

    for bad in [
        String::new(),
        "a".repeat(256),
        "has space".into(),
        "tab\tkey".into(),
    ] {
        let r = send(
            worker_req(&url, e, tok)
                .header("idempotency-key", bad.as_str())
                .body(body("x"))
                .unwrap(),
        )
        .await;
        r.assert_error(400, "dedup_key_malformed");
    }

    let r = send(
        Request::post(&url)
            .header("x-lease-epoch", e.to_string())
            .body(body("x"))
            .unwrap(),
    )
    .await;
    r.assert_error(401, "token_missing");
    assert_eq!(
        r.headers["www-authenticate"], "X-Lease-Token realm=\"fencegate\"",
        "a 401 names how to authenticate"
    );
    send(worker_req(&url, e, "wrong").body(body("x")).unwrap())
        .await
        .assert_error(403, "token_invalid");
    send(worker_req(&url, e + 7, tok).body(body("x")).unwrap())
        .await
        .assert_error(403, "epoch_unknown");

    for path in [
        "/",
        "/nope/x",
        "/billingx",
        "/billing/../admin",
        "/billing/%2e%2e/admin",
        "/billing/a%2Fb",
    ] {
        let r = send(worker_req(&fg.url(path), e, tok).body(body("x")).unwrap()).await;
        r.assert_error(404, "route_not_found");
        // Says why when the path is the reason, not that no route matches.
        let message = r.json()["message"].as_str().unwrap().to_owned();
        let unroutable = path.contains("..") || path.contains('%');
        assert_eq!(
            message.contains("encoded slash"),
            unroutable,
            "{path}: {message}"
        );
    }

    let big = send(
        worker_req(&url, e, tok)
            .body(body("seventeen bytes!!"))
            .unwrap(),
    )
    .await;
    big.assert_error(413, "body_too_large");
    assert_eq!(big.json()["limit_bytes"], 16);

    // Nothing above reached the origin or moved the mark (no request was admitted).
    assert_eq!(origin.count(), 0);
    let leases = fg.admin_json("/v1/leases").await;
    assert_eq!(leases["leases"][0]["high_water_mark"], 0);

    // Upstream failures are classified.
    let r = send(
        worker_req(&fg.url("/dead/x"), e, tok)
            .body(body("x"))
            .unwrap(),
    )
    .await;
    r.assert_error(502, "upstream_unreachable");
    let r = send(
        worker_req(&url, e, tok)
            .header("x-test-hold", "forever")
            .header("idempotency-key", "t1")
            .body(body("x"))
            .unwrap(),
    )
    .await;
    r.assert_error(504, "upstream_timeout");
    origin.release("forever");
    // The process is still serving.
    assert_eq!(post(&fg, "/billing/x", &a, "fine").await.status, 200);
}

/// The message of a refusal.
fn message(r: &Reply) -> String {
    r.json()["message"].as_str().unwrap_or_default().to_owned()
}

fn assert_says(r: &Reply, needles: &[&str]) {
    let m = message(r);
    for n in needles {
        assert!(m.contains(n), "{:?} lacks {n:?}: {m}", r.error_code());
    }
}

/// Issue 32: each SPEC §7 message says what to do next. `epoch_missing` names the
/// lease and what to send; `dedup_key_reused` what differed and when the key
/// frees; `upstream_timeout` that the key is now in doubt and where an operator
/// resolves it; `dedup_in_doubt` the admin API's path and the page. Codes and
/// statuses are those of SPEC §7. Fails on the old messages ("X-Lease-Epoch is
/// required", "this idempotency key was used for a different request", …).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_error_message_says_the_next_step() {
    let origin = Origin::start().await;
    let fg = Fencegate::start(
        200,
        &route_toml("billing", "billing", &origin, "timeout_ms = 300"),
    )
    .await;
    let a = acquire(&fg.epochs, "billing", "worker-a", Duration::from_secs(30)).await;
    let (e, tok) = (a.epoch.get(), a.token.as_str());
    let url = fg.url("/billing/charges");

    let r = send(Request::post(&url).body(body("x")).unwrap()).await;
    r.assert_error(428, "epoch_missing");
    assert_eq!(r.json()["lease"], "billing");
    assert_says(
        &r,
        &[
            "lease billing",
            "fencegate lease acquire --lease billing",
            "X-Lease-Epoch: N",
            "X-Lease-Token: T",
        ],
    );

    // A key used again for another request: what differed, and when it frees.
    assert_eq!(
        send(keyed(&fg, "/billing/charges", &a, "k-1", "a"))
            .await
            .status,
        200
    );
    let r = send(keyed(&fg, "/billing/charges", &a, "k-1", "b")).await;
    r.assert_error(422, "dedup_key_reused");
    assert_says(
        &r,
        &[
            "the query or the body differs",
            "Use a new key",
            "frees at 20",
            "[dedup] ttl",
        ],
    );
    let r = send(keyed(&fg, "/billing/refunds", &a, "k-1", "a")).await;
    r.assert_error(422, "dedup_key_reused");
    assert_says(
        &r,
        &["its path differs (the first request's was /billing/charges)"],
    );
    let r = send(
        worker_req(&url, e, tok)
            .method("PUT")
            .header("idempotency-key", "k-1")
            .body(body("a"))
            .unwrap(),
    )
    .await;
    r.assert_error(422, "dedup_key_reused");
    assert_says(&r, &["its method differs (the first request was POST)"]);

    // A timeout leaves the key in doubt: the worker is told, and where it is resolved.
    let held = || {
        worker_req(&url, e, tok)
            .header("x-test-hold", "forever")
            .header("idempotency-key", "k/2")
            .body(body("x"))
            .unwrap()
    };
    let r = send(held()).await;
    r.assert_error(504, "upstream_timeout");
    assert_eq!(r.json()["dedup_key"], "k/2");
    assert_says(
        &r,
        &[
            "k/2 is now in doubt",
            "409 dedup_in_doubt",
            "POST /v1/dedup/billing/k%2F2/resolve",
            "operator's page",
        ],
    );
    let r = send(held()).await;
    r.assert_error(409, "dedup_in_doubt");
    assert_says(
        &r,
        &[
            "POST /v1/dedup/billing/k%2F2/resolve",
            "GET / in a browser",
            "\"not_delivered\" frees it",
        ],
    );
    let r = send(keyed(&fg, "/billing/charges", &a, "k/2", "other")).await;
    r.assert_error(422, "dedup_key_reused");
    assert_says(
        &r,
        &[
            "is in doubt and frees only when an operator resolves it",
            "/v1/dedup/billing/k%2F2/resolve",
        ],
    );
    // The admin API answers at the path the message names.
    let record = fg.admin_json("/v1/dedup/billing/k%2F2").await;
    assert_eq!(record["state"], "in_doubt", "{record}");

    // A timed-out poll kept no record: the worker checks the destination itself.
    let r = send(
        Request::get(&url)
            .header("x-lease-epoch", e.to_string())
            .header("x-lease-token", tok)
            .header("x-test-hold", "forever")
            .body(body(""))
            .unwrap(),
    )
    .await;
    r.assert_error(504, "upstream_timeout");
    assert_says(&r, &["Nothing was recorded", "check the destination"]);
    origin.release("forever");
}

/// Issue 29 §3: 503 `upstream_held` (here: the route's `max_in_flight = 1` is
/// taken by a request held at the origin) says which protection refused it
/// (`detail`), when to retry (`Retry-After`, and in the message), and that
/// nothing was recorded for it (not that its key is free: another request may
/// hold it, `protect::upstream_held_never_calls_an_in_flight_key_free`) — and
/// so: nothing reached the origin, no record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_held_says_when_to_retry_and_records_nothing() {
    let origin = Origin::start().await;
    let fg = Fencegate::start(
        200,
        &route_toml("billing", "billing", &origin, "max_in_flight = 1"),
    )
    .await;
    let a = acquire(&fg.epochs, "billing", "worker-a", Duration::from_secs(30)).await;
    let url = fg.url("/billing/x");
    let held = tokio::spawn(try_send(
        worker_req(&url, a.epoch.get(), &a.token)
            .header("x-test-hold", "full")
            .body(body("first"))
            .unwrap(),
    ));
    origin.wait_for(1).await;
    let r = send(keyed(&fg, "/billing/x", &a, "k-held", "second")).await;
    r.assert_error(503, "upstream_held");
    assert_eq!(r.json()["detail"], "in_flight_limit");
    assert_eq!(r.headers["retry-after"], "1");
    assert_says(
        &r,
        &[
            "route billing has 1 requests at its upstream already (its max_in_flight)",
            "Nothing was forwarded",
            "nothing recorded for this request",
            "after Retry-After (1 s)",
        ],
    );
    assert_eq!(origin.count(), 1);
    let record = fg.admin_json("/v1/dedup/billing/k-held").await;
    assert_eq!(record["error"], "dedup_record_not_found", "{record}");
    origin.release("full");
    assert_eq!(held.await.unwrap().unwrap().status, 200);
    eventually("the slot freed", || async {
        fg.admin_json("/v1/routes").await["routes"][0]["in_flight"] == 0
    })
    .await;
    let retry = send(keyed(&fg, "/billing/x", &a, "k-held", "second")).await;
    assert_eq!(retry.status, 200);
    assert_eq!(origin.count(), 2);
}
