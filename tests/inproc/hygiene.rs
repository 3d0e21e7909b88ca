//! SPEC §3: what reaches the upstream, and that fencegate is never an open proxy.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_headers_follow_the_rules() {
    let origin = Origin::start().await;
    // The upstream credential as written in the config; reading it from the
    // environment (`${NAME}`) is a process's business: tests/it/ops.rs.
    let fg = Fencegate::start(
        200,
        &route_toml(
            "billing",
            "billing",
            &origin,
            "dedup_header = \"X-Dedup\"\nupstream_headers = { Authorization = \"Bearer upstream-secret\", X-Static = \"s\" }",
        ),
    )
    .await;
    let a = acquire(&fg.epochs, "billing", "worker-a", Duration::from_secs(30)).await;
    let r = send(
        worker_req(
            &fg.url("/billing/charges/42?currency=eur&x=1"),
            a.epoch.get(),
            &a.token,
        )
        .header("connection", "x-hop-secret")
        .header("x-hop-secret", "must not pass")
        .header("keep-alive", "timeout=5")
        .header("proxy-authorization", "Basic Zm9vOmJhcg==")
        .header("authorization", "Bearer worker-own-credential")
        .header("x-forwarded-for", "10.1.2.3")
        .header("x-end-to-end", "kept")
        .header("cookie", "app=1; fencegate_admin=operator-session")
        .header("idempotency-key", "worker-key-1")
        .body(body("{\"amount\":1}"))
        .unwrap(),
    )
    .await;
    assert_eq!(r.status, 200);
    let log = origin.log();
    assert_eq!(log.len(), 1);
    let got = &log[0];
    assert_eq!(got.method, "POST");
    assert_eq!(got.path, "/v1/charges/42?currency=eur&x=1");
    assert_eq!(&got.body[..], b"{\"amount\":1}");
    for gone in [
        "x-hop-secret",
        "keep-alive",
        "proxy-authorization",
        "x-lease-token",
    ] {
        assert_eq!(got.header(gone), None, "{gone} must not be forwarded");
    }
    assert_eq!(got.header("x-lease-epoch"), Some(a.epoch.get().to_string()));
    // The worker's Host named fencegate; the destination gets its own.
    assert_eq!(got.header("host"), Some(origin.addr.to_string()));
    assert_eq!(got.header("x-end-to-end").as_deref(), Some("kept"));
    // The operator page's session (a browser sends it to every port of the host)
    // is removed; the application's own cookie passes.
    assert_eq!(got.header("cookie").as_deref(), Some("app=1"));
    assert_eq!(got.header("x-dedup").as_deref(), Some("worker-key-1"));
    assert_eq!(
        got.header("x-forwarded-for").as_deref(),
        Some("10.1.2.3, 127.0.0.1")
    );
    assert!(got
        .header("forwarded")
        .unwrap()
        .starts_with("for=127.0.0.1;proto=http"));
    // fencegate alone holds the upstream credential; the worker's is replaced.
    assert_eq!(
        got.header("authorization").as_deref(),
        Some("Bearer upstream-secret")
    );
    assert_eq!(got.header("x-static").as_deref(), Some("s"));
    assert!(!fg.logs.text().contains("upstream-secret"));
    assert!(!fg.logs.text().contains(&a.token));
}

async fn raw(addr: std::net::SocketAddr, request: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(request.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_an_open_proxy() {
    let origin = Origin::start().await;
    let fg = Fencegate::start(200, &route_toml("billing", "billing", &origin, "")).await;
    let elsewhere = Origin::start().await; // somewhere a worker would like to reach
    let target = elsewhere.addr;
    for req in [
        format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nConnection: close\r\n\r\n"),
        format!("GET http://{target}/other HTTP/1.1\r\nHost: {target}\r\nx-lease-epoch: 1\r\nConnection: close\r\n\r\n"),
        format!("GET /other HTTP/1.1\r\nHost: {target}\r\nx-lease-epoch: 1\r\nConnection: close\r\n\r\n"),
    ] {
        let resp = raw(fg.proxy, &req).await;
        assert!(resp.starts_with("HTTP/1.1 404") || resp.starts_with("HTTP/1.1 400") || resp.is_empty(), "{req:?} -> {resp}");
    }
    // An absolute-form target naming another host reaches only the route's upstream.
    let a = acquire(&fg.epochs, "billing", "w", Duration::from_secs(30)).await;
    let req = format!(
        "POST http://{target}/billing/x HTTP/1.1\r\nHost: {target}\r\nx-lease-epoch: {}\r\nx-lease-token: {}\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi",
        a.epoch.get(),
        a.token
    );
    let resp = raw(fg.proxy, &req).await;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert_eq!(elsewhere.count(), 0);
    assert_eq!(origin.count(), 1);
    assert_eq!(origin.log()[0].path, "/v1/x");
}

/// SPEC §10.2: `X-Fencegate-Owner` is fencegate's alone. A destination that
/// sets it on its answer would steer the worker's next request — and its
/// lease token — to a URL of its choosing; a single instance sends none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destinations_owner_hint_never_reaches_the_worker() {
    let origin = Origin::start().await;
    let fg = Fencegate::start(200, &route_toml("billing", "billing", &origin, "")).await;
    let a = acquire(&fg.epochs, "billing", "worker-a", Duration::from_secs(30)).await;
    let r = send(
        worker_req(&fg.url("/billing/x"), a.epoch.get(), &a.token)
            .header("x-test-claims-owner", "http://evil.example")
            .body(body("x"))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(origin.count(), 1);
    assert!(
        !r.headers.contains_key("x-fencegate-owner"),
        "{:?}",
        r.headers
    );
}
