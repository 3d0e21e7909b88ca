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
            message, "X-Lease-Epoch must be a plain decimal u64: digits only, no sign, no spaces",
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
    ] {
        let r = send(worker_req(&fg.url(path), e, tok).body(body("x")).unwrap()).await;
        r.assert_error(404, "route_not_found");
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
