//! Review of issue 29 §1–2 (signing, client certificates): attacks on the
//! "a TLS certificate alert means nothing was sent" rule (502, key freed).

use std::path::Path;
use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};

use crate::support::egress::PyServer;
use crate::support::*;

/// A test CA and one server certificate for 127.0.0.1 it issued: (ca, cert, key).
fn server_pki() -> (String, String, String) {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "review CA");
    let ca_pem = ca.self_signed(&ca_key).unwrap().pem();
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()]).unwrap();
    p.distinguished_name.push(DnType::CommonName, "localhost");
    let cert = p.signed_by(&key, &issuer).unwrap().pem();
    (ca_pem, cert, key.serialize_pem())
}

fn arrivals(log: &Path, key: &str) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["key"] == key)
        .count()
}

/// A TLS 1.3 destination that completes the handshake, reads the request whole
/// (its application has it: recorded in its log), then ends the connection with
/// a fatal `alert` — after a 200 answer in the same write (`answer_then_alert`)
/// or instead of one (`alert`). The request reached the destination, so the
/// outcome is unknown to fencegate at best: SPEC §6 says 504 in doubt and the key
/// stays taken. Fixed (was: `client_auth::handshake_refused` treats any of its
/// listed alerts as "the server never accepted the connection", whenever it comes
/// — 502 `upstream_unreachable`, the key freed, and the worker's retry delivers
/// the request a second time (two arrivals of one key at the destination)); now only `certificate_required` is "nothing sent".
async fn an_alert_after_the_request_arrived_keeps_the_key(mode: &str, alert: &str) {
    skip_without_python!();
    let (ca, cert, key) = server_pki();
    let sdir = tempfile::tempdir().unwrap();
    for (n, t) in [("server.pem", &cert), ("server.key", &key)] {
        std::fs::write(sdir.path().join(n), t).unwrap();
    }
    let log = sdir.path().join("events.jsonl");
    let p = |n: &str| sdir.path().join(n).display().to_string();
    let server = PyServer::start(
        "alert_origin.py",
        &[
            &p("server.pem"),
            &p("server.key"),
            &log.display().to_string(),
            mode,
            alert,
        ],
        &[],
    );
    let (_store, fg, h) = partner_gate(server.port, &ca).await;

    let first = send(keyed(&fg, "/partner/charge", &h, "charge-1", r#"{"n":1}"#)).await;
    assert_eq!(arrivals(&log, "charge-1"), 1, "the destination read it");
    let retry = send(keyed(&fg, "/partner/charge", &h, "charge-1", r#"{"n":1}"#)).await;
    assert_eq!(
        arrivals(&log, "charge-1"),
        1,
        "delivered twice: first answer {} {:?} ({}), retry {} {:?}",
        first.status,
        first.error_code(),
        String::from_utf8_lossy(&first.body),
        retry.status,
        retry.error_code()
    );
    assert_ne!(first.error_code().as_deref(), Some("upstream_unreachable"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_access_denied_alert_after_a_200_answer_is_not_nothing_sent() {
    an_alert_after_the_request_arrived_keeps_the_key("answer_then_alert", "access_denied").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_certificate_alert_after_the_request_was_read_is_not_nothing_sent() {
    an_alert_after_the_request_arrived_keeps_the_key("alert", "bad_certificate").await;
}

fn whsec(byte: u8) -> String {
    use base64::Engine;
    format!(
        "whsec_{}",
        base64::engine::general_purpose::STANDARD.encode([byte; 32])
    )
}

/// An operator writes one secret as a string, not a list (`signing_secrets =
/// "whsec_…"` — the issue speaks of "the route's secret"). The reload is refused
/// whole and deliveries go on signed with the old secret (that held) — but the
/// refusal quotes the secret: TOML's type error prints the value, so it lands in
/// fencegate's log at every SIGHUP and in `check-config`'s output. Fixed; it failed
/// on the log and on check-config (SPEC: secrets are never logged or shown).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_written_as_a_string_is_refused_without_being_printed() {
    skip_without_python!();
    let (a, b) = (whsec(0x11), whsec(0x22));
    let origin = PyServer::start(
        "origin.py",
        &[],
        &[("FG_ORIGIN_SECRETS", &format!("A={a} B={b}"))],
    );
    let store = tempfile::tempdir().unwrap();
    let fg = Fencegate::start_with_env(
        &format!(
            "{}\n[[route]]\nname = \"hooks\"\npath_prefix = \"/hooks/\"\n\
             upstream = \"http://127.0.0.1:{}/in/\"\nlease = \"hooks\"\n\
             signing_secrets = [\"${{FG_TEST_WHSEC_A}}\"]\n",
            dir_store_toml(store.path()),
            origin.port
        ),
        &[("FG_TEST_WHSEC_A", &a)],
    );
    let h = acquire(
        &dir_epochs(store.path()),
        "hooks",
        "worker",
        Duration::from_secs(120),
    )
    .await;
    assert_eq!(
        post(&fg, "/hooks/orders", &h, r#"{"n":1}"#).await.status,
        200
    );

    fg.edit_config(|t| {
        t.replace(
            "signing_secrets = [\"${FG_TEST_WHSEC_A}\"]",
            &format!("signing_secrets = \"{b}\""),
        )
    });
    let rejected = "fencegate_config_reloads_total{result=\"refused\"}";
    let before = fg.series(rejected).await;
    fg.hup();
    eventually("the reload to be refused", || async {
        fg.series(rejected).await > before
    })
    .await;
    // Held: the old signer is kept.
    let after = post(&fg, "/hooks/orders", &h, r#"{"n":2}"#).await;
    assert_eq!(after.status, 200, "{:?}", after.body);

    let out = std::process::Command::new(bin())
        .args(["check-config", "--config"])
        .arg(&fg.config)
        .output()
        .unwrap();
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(2), "{printed}");
    let secret_b64 = b.strip_prefix("whsec_").unwrap();
    let log = fg.stderr();
    assert!(
        !log.contains(secret_b64),
        "the secret in fencegate's log: {}",
        log.lines().find(|l| l.contains(secret_b64)).unwrap()
    );
    assert!(
        !printed.contains(secret_b64),
        "the secret in check-config: {printed}"
    );
}

/// A raw POST to fencegate: `head_extra` headers, then `body`, then the write
/// side shut (so a short body ends); the whole answer as text.
async fn raw_post(
    fg: &Fencegate,
    h: &fencegate::lease::acquire::Holding,
    head_extra: &str,
    body: &[u8],
) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(fg.proxy).await.unwrap();
    let head = format!(
        "POST /hooks/orders HTTP/1.1\r\nHost: fencegate\r\nX-Lease-Epoch: {}\r\nX-Lease-Token: {}\r\n\
         {head_extra}Connection: close\r\n\r\n",
        h.epoch.get(),
        h.token
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let _ = s.write_all(body).await;
    if head_extra.contains("Content-Length: 100\r\n") {
        // A body shorter than declared: it ends only when the connection does.
        let _ = s.shutdown().await;
    }
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

fn chunked(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    for c in body.chunks(300) {
        out.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
        out.extend_from_slice(c);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

/// Held under attack (passes today): on a signing route (limit 1024) a chunked
/// body of exactly 1024 bytes and an empty body arrive signed over exactly the
/// bytes received (the `standardwebhooks` PyPI library in the origin verifies);
/// a chunked 1025-byte body under key `big-1` is 413 and neither forwarded nor
/// recorded (the key's next send is delivered, id `big-1`); a body shorter than
/// its Content-Length forwards nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signing_covers_exactly_the_bytes_sent_at_the_edges() {
    skip_without_python!();
    let a = whsec(0x33);
    let origin = PyServer::start(
        "origin.py",
        &[],
        &[("FG_ORIGIN_SECRETS", &format!("A={a}"))],
    );
    let store = tempfile::tempdir().unwrap();
    let fg = Fencegate::start_with_env(
        &format!(
            "{}\n[[route]]\nname = \"hooks\"\npath_prefix = \"/hooks/\"\n\
             upstream = \"http://127.0.0.1:{}/in/\"\nlease = \"hooks\"\nmax_body_bytes = 1024\n\
             signing_secrets = [\"${{FG_TEST_WHSEC_A}}\"]\n",
            dir_store_toml(store.path()),
            origin.port
        ),
        &[("FG_TEST_WHSEC_A", &a), ("FENCEGATE_LOG", "trace")],
    );
    let h = acquire(
        &dir_epochs(store.path()),
        "hooks",
        "worker",
        Duration::from_secs(120),
    )
    .await;
    let log = || async {
        let r = send(
            http::Request::get(format!("http://127.0.0.1:{}/_log", origin.port))
                .body(body(""))
                .unwrap(),
        )
        .await;
        serde_json::from_slice::<Vec<serde_json::Value>>(&r.body).unwrap()
    };
    let exact: Vec<u8> = (0..1024u32).map(|i| b'a' + (i % 26) as u8).collect();
    let r = raw_post(&fg, &h, "Transfer-Encoding: chunked\r\n", &chunked(&exact)).await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    let r = raw_post(
        &fg,
        &h,
        "Idempotency-Key: empty-1\r\nContent-Length: 0\r\n",
        b"",
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    let r = raw_post(
        &fg,
        &h,
        "Idempotency-Key: big-1\r\nTransfer-Encoding: chunked\r\n",
        &chunked(&[b'z'; 1025]),
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 413"), "{r}");
    let r = raw_post(
        &fg,
        &h,
        "Idempotency-Key: short-1\r\nContent-Length: 100\r\n",
        b"0123456789",
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 4"), "{r}");
    let got = log().await;
    assert_eq!(got.len(), 2, "{got:?}");
    let r = raw_post(
        &fg,
        &h,
        "Idempotency-Key: big-1\r\nContent-Length: 2\r\n",
        b"{}",
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    let got = log().await;
    assert_eq!(got.len(), 3, "{got:?}");
    use base64::Engine;
    let b64 = |v: &serde_json::Value| {
        base64::engine::general_purpose::STANDARD
            .decode(v["body_b64"].as_str().unwrap())
            .unwrap()
    };
    assert_eq!(b64(&got[0]), exact);
    assert_eq!(b64(&got[1]), b"");
    assert_eq!(got[1]["headers"]["webhook-id"], "hooks:empty-1");
    assert_eq!(got[2]["headers"]["webhook-id"], "hooks:big-1");
    for g in &got {
        assert_eq!(g["verified"]["A"], true, "{g}");
    }
    // Logged at trace level: the secret is in no line.
    let secret = a.strip_prefix("whsec_").unwrap();
    let log = fg.stderr();
    assert!(!log.contains(secret), "the secret in the log");
    assert!(log.contains("TRACE"), "logged at trace level");
}

/// SPEC §6 scopes keys by route, but §3 sends the worker's key as `webhook-id`
/// unscoped, and a receiver deduplicates on `webhook-id` alone (Standard
/// Webhooks: "unique across all messages"). Two signing routes to one receiver
/// (`orders`, `refunds`), a worker using its row id `42` as the key on each:
/// fencegate forwards both (different routes, different records), and they
/// arrive under one `webhook-id` — the receiver drops the refund as a duplicate
/// of the order. Fixed (`webhook-id` is `{route}:{key}`); it failed when the two deliveries shared an id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_on_two_routes_is_two_webhook_ids() {
    skip_without_python!();
    let a = whsec(0x44);
    let origin = PyServer::start(
        "origin.py",
        &[],
        &[("FG_ORIGIN_SECRETS", &format!("A={a}"))],
    );
    let store = tempfile::tempdir().unwrap();
    let route = |name: &str| {
        format!(
            "[[route]]\nname = \"{name}\"\npath_prefix = \"/{name}/\"\n\
             upstream = \"http://127.0.0.1:{}/in/\"\nlease = \"hooks\"\n\
             signing_secrets = [\"${{FG_TEST_WHSEC_A}}\"]\n\n",
            origin.port
        )
    };
    let fg = Fencegate::start_with_env(
        &format!(
            "{}\n{}{}",
            dir_store_toml(store.path()),
            route("orders"),
            route("refunds")
        ),
        &[("FG_TEST_WHSEC_A", &a)],
    );
    let h = acquire(
        &dir_epochs(store.path()),
        "hooks",
        "worker",
        Duration::from_secs(120),
    )
    .await;
    let order = send(keyed(&fg, "/orders/42", &h, "42", r#"{"order":42}"#)).await;
    let refund = send(keyed(&fg, "/refunds/42", &h, "42", r#"{"refund":42}"#)).await;
    assert_eq!((order.status.as_u16(), refund.status.as_u16()), (200, 200));
    let r = send(
        http::Request::get(format!("http://127.0.0.1:{}/_log", origin.port))
            .body(body(""))
            .unwrap(),
    )
    .await;
    let got: Vec<serde_json::Value> = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(got.len(), 2, "both delivered: {got:?}");
    assert_ne!(
        got[0]["headers"]["webhook-id"], got[1]["headers"]["webhook-id"],
        "two messages, one webhook-id: a receiver drops one"
    );
}

/// Held under attack (passes today): a request in flight on an mTLS route (the
/// destination holds its answer) while the client certificate files are
/// swapped and SIGHUP applied completes 200 on its connection, shown as
/// `client-one`; the next request shows `client-two`. Then a reload whose key
/// file is gone, together with a new route, is refused whole: the new route is
/// not served and the old certificate is still shown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cert_swap_keeps_in_flight_requests_and_a_broken_one_is_refused_whole() {
    use crate::client_cert::{origin_events, write, Ca};
    use crate::support::egress::reload_with;
    skip_without_python!();
    let ca = Ca::new();
    let sdir = tempfile::tempdir().unwrap();
    let (srv_cert, srv_key) = ca.issue("localhost", &["localhost", "127.0.0.1"]);
    write(sdir.path(), "server.pem", &srv_cert);
    write(sdir.path(), "server.key", &srv_key);
    write(sdir.path(), "ca.pem", &ca.pem);
    let log = sdir.path().join("events.jsonl");
    let p = |n: &str| sdir.path().join(n).display().to_string();
    let server = PyServer::start(
        "mtls_origin.py",
        &[
            &p("server.pem"),
            &p("server.key"),
            &p("ca.pem"),
            &log.display().to_string(),
        ],
        &[],
    );
    let store = tempfile::tempdir().unwrap();
    let mut fg = Fencegate::unstarted(
        "127.0.0.1:0",
        "",
        &format!(
            "{}\n[[route]]\nname = \"mtls\"\npath_prefix = \"/mtls/\"\n\
             upstream = \"https://127.0.0.1:{}/api/\"\nlease = \"partner\"\nca_file = \"ca.pem\"\n\
             client_cert = \"client.pem\"\nclient_key = \"client.key\"\n",
            dir_store_toml(store.path()),
            server.port
        ),
        &[],
    );
    let (one_cert, one_key) = ca.issue("client-one", &["client-one.test"]);
    let (two_cert, two_key) = ca.issue("client-two", &["client-two.test"]);
    write(fg.dir.path(), "ca.pem", &ca.pem);
    write(fg.dir.path(), "client.pem", &one_cert);
    write(fg.dir.path(), "client.key", &one_key);
    fg.spawn(None).expect("fencegate did not start");
    let h = acquire(
        &dir_epochs(store.path()),
        "partner",
        "worker",
        Duration::from_secs(120),
    )
    .await;

    let release = sdir.path().join("release");
    let held = tokio::spawn(send(
        worker_req(&fg.url("/mtls/held"), h.epoch.get(), &h.token)
            .header("x-test-hold-until", release.display().to_string())
            .body(body("{}"))
            .unwrap(),
    ));
    eventually("the held request to arrive", || async {
        origin_events(&log).iter().any(|e| e["path"] == "/api/held")
    })
    .await;
    write(fg.dir.path(), "client.pem", &two_cert);
    write(fg.dir.path(), "client.key", &two_key);
    reload_with(&fg, |t| t).await;
    std::fs::write(&release, "").unwrap();
    let held = held.await.unwrap();
    assert_eq!(held.status, 200, "{:?}", held.body);
    assert_eq!(held.json()["client_cn"], "client-one");
    let next = post(&fg, "/mtls/next", &h, "{}").await;
    assert_eq!(next.json()["client_cn"], "client-two", "{:?}", next.body);

    std::fs::remove_file(fg.dir.path().join("client.key")).unwrap();
    let refused = "fencegate_config_reloads_total{result=\"refused\"}";
    let before = fg.series(refused).await;
    fg.edit_config(|t| {
        format!("{t}\n[[route]]\nname = \"added\"\npath_prefix = \"/added/\"\nupstream = \"http://127.0.0.1:9/\"\nlease = \"partner\"\n")
    });
    fg.hup();
    eventually("the reload to be refused", || async {
        fg.series(refused).await > before
    })
    .await;
    let still = post(&fg, "/mtls/after", &h, "{}").await;
    assert_eq!(still.json()["client_cn"], "client-two", "{:?}", still.body);
    post(&fg, "/added/x", &h, "{}")
        .await
        .assert_error(404, "route_not_found");
    let log = fg.stderr();
    assert!(
        log.lines()
            .any(|l| l.contains("reload refused") && l.contains("client.key")),
        "refused for the key file: {log}"
    );
    assert!(!log.contains(two_key.lines().nth(1).unwrap()));
}

/// The same rule against a stock server: OpenSSL's `s_server`, TLS 1.2, reads
/// the request whole and then asks for renegotiation — what Apache's per-location
/// `SSLVerifyClient require` and IIS's "negotiate client certificate" do after
/// reading a request. rustls declines (a `no_renegotiation` warning), OpenSSL
/// answers a fatal `handshake_failure`, and fencegate calls it "nothing was
/// sent" (502, key freed) — on a route without any client certificate — though
/// the destination holds the whole request. Fixed (needs `openssl`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renegotiation_refused_after_the_request_is_not_nothing_sent() {
    use std::io::Write;
    use std::process::{Command, Stdio};
    if Command::new("openssl").arg("version").output().is_err() {
        eprintln!("skipped: no openssl command");
        return;
    }
    let (ca, cert, key) = server_pki();
    let sdir = tempfile::tempdir().unwrap();
    for (n, t) in [("server.pem", &cert), ("server.key", &key)] {
        std::fs::write(sdir.path().join(n), t).unwrap();
    }
    let port = crate::cluster::free_port();
    let out = sdir.path().join("s_server.out");
    let mut srv = Command::new("openssl")
        .args(["s_server", "-tls1_2", "-accept", &port.to_string()])
        .args(["-cert", "server.pem", "-key", "server.key"])
        .current_dir(sdir.path())
        .stdin(Stdio::piped())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let printed = || std::fs::read_to_string(&out).unwrap_or_default();
    eventually("s_server to listen", || async {
        printed().contains("ACCEPT")
    })
    .await;
    let (_store, fg, h) = partner_gate(port, &ca).await;
    let reply = tokio::spawn(send(keyed(
        &fg,
        "/partner/charge",
        &h,
        "charge-r",
        r#"{"charge":1}"#,
    )));
    eventually("s_server to read the request", || async {
        printed().contains(r#"{"charge":1}"#)
    })
    .await;
    srv.stdin.as_mut().unwrap().write_all(b"R\n").unwrap();
    let reply = reply.await.unwrap();
    let _ = srv.kill();
    let _ = srv.wait();
    assert_ne!(
        reply.error_code().as_deref(),
        Some("upstream_unreachable"),
        "the destination read the request, yet: {}",
        String::from_utf8_lossy(&reply.body)
    );
}

/// fencegate with one route, `partner`, to the https origin on `port` (trusted
/// through `ca`, PEM), on a `dir` store, and a worker holding lease `partner`.
async fn partner_gate(
    port: u16,
    ca: &str,
) -> (
    tempfile::TempDir,
    Fencegate,
    fencegate::lease::acquire::Holding,
) {
    let store = tempfile::tempdir().unwrap();
    let mut fg = Fencegate::unstarted(
        "127.0.0.1:0",
        "",
        &format!(
            "{}\n[[route]]\nname = \"partner\"\npath_prefix = \"/partner/\"\n\
             upstream = \"https://127.0.0.1:{port}/api/\"\nlease = \"partner\"\nca_file = \"ca.pem\"\n",
            dir_store_toml(store.path()),
        ),
        &[],
    );
    std::fs::write(fg.dir.path().join("ca.pem"), ca).unwrap();
    fg.spawn(None).expect("fencegate did not start");
    let h = acquire(
        &dir_epochs(store.path()),
        "partner",
        "worker",
        Duration::from_secs(120),
    )
    .await;
    (store, fg, h)
}
