//! SPEC §8 reload: SIGHUP re-reads the config file. Routes, upstream headers, the
//! admin token and the log level change without dropping a connection or an
//! in-flight request; a lease no route uses any more is drained before its fence
//! stops; a file that does not load, or that changes a key that cannot change
//! live, keeps the running config and says why (log and metric).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fencegate::lease::acquire::Holding;
use http::Request;

use crate::support::*;

/// Sends SIGHUP and waits until the reload it caused is counted as `result`.
async fn reload(fg: &Fencegate, result: &str) {
    let metric = format!("fencegate_config_reloads_total{{result=\"{result}\"}}");
    let before = fg.series(&metric).await;
    fg.hup();
    eventually(&format!("a reload counted as {result}"), || async {
        fg.series(&metric).await > before
    })
    .await;
}

/// A POST to `path` for `h`.
async fn post_to(fg: &Fencegate, path: &str, h: &Holding, payload: &str) -> Reply {
    post(fg, path, h, payload).await
}

struct Setup {
    _store: tempfile::TempDir,
    origin: Origin,
    fg: Fencegate,
    billing: Holding,
    ledger: Holding,
    payments: Holding,
}

/// Routes `billing` (with an upstream credential "v1") and `ledger`, each on its
/// own lease; `payments` is configured later. Each lease is held by a worker.
async fn setup(server_extra: &str, env: &[(&str, &str)]) -> Setup {
    let store = tempfile::tempdir().unwrap();
    let origin = Origin::start().await;
    let fg = Fencegate::start_with_server(
        server_extra,
        &format!(
            "{}{}{}",
            dir_store_toml(store.path()),
            route_toml(
                "billing",
                "billing",
                &origin,
                "upstream_headers = { X-Api-Key = \"v1\" }"
            ),
            route_toml("ledger", "ledger", &origin, "timeout_ms = 20000")
        ),
        env,
    );
    let epochs = dir_epochs(store.path());
    let hold = |lease: &'static str| acquire(&epochs, lease, "worker", Duration::from_secs(60));
    let (billing, ledger, payments) = (
        hold("billing").await,
        hold("ledger").await,
        hold("payments").await,
    );
    Setup {
        _store: store,
        origin,
        fg,
        billing,
        ledger,
        payments,
    }
}

/// Under a steady flow of billing requests, SIGHUP removes route `ledger` (one of
/// its requests still held at the destination), adds `payments`, and changes
/// billing's upstream credential and the admin token. Nothing is dropped: every
/// billing request is answered 200; the held ledger request completes; ledger's
/// fence stops only after that request finished; the new route and credential
/// are in use at once. Breaks if SIGHUP kills the process, if routes are fixed at
/// start, or if a removed lease is stopped before its requests finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_swaps_routes_under_load_and_a_removed_lease_drains_first() {
    let s = setup("admin_token = \"old-admin\"", &[]).await;
    let fg = Arc::new(s.fg);
    let held = tokio::spawn(try_send(
        worker_req(&fg.url("/ledger/x"), s.ledger.epoch.get(), &s.ledger.token)
            .header("x-test-hold", "ledger")
            .body(body("held across the reload"))
            .unwrap(),
    ));
    s.origin.wait_for(1).await;

    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let (fg, stop, h) = (fg.clone(), stop.clone(), s.billing.clone());
        tokio::spawn(async move {
            let mut statuses = Vec::new();
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) || i < 20 {
                let r = try_send(
                    worker_req(&fg.url("/billing/load"), h.epoch.get(), &h.token)
                        .body(body(&format!("load {i}")))
                        .unwrap(),
                )
                .await;
                statuses.push(r.map(|r| r.status.as_u16()));
                i += 1;
            }
            statuses
        })
    };

    fg.edit_config(|t| {
        let t = t
            .replace("X-Api-Key = \"v1\"", "X-Api-Key = \"v2\"")
            .replace("old-admin", "new-admin");
        let ledger = t.find("[[route]]\nname = \"ledger\"").unwrap();
        format!(
            "{}{}",
            &t[..ledger],
            route_toml("payments", "payments", &s.origin, "")
        )
    });
    reload(&fg, "applied").await;
    assert_eq!(
        fg.series("fencegate_config_last_reload_successful").await,
        1.0
    );

    let paid = post_to(&fg, "/payments/x", &s.payments, "new route").await;
    assert_eq!(paid.status, 200, "the added route serves at once");
    post_to(&fg, "/ledger/y", &s.ledger, "removed route")
        .await
        .assert_error(404, "route_not_found");
    let billed = post_to(&fg, "/billing/after", &s.billing, "new credential").await;
    assert_eq!(billed.status, 200);
    let last = s.origin.log().last().cloned().unwrap();
    assert_eq!(last.header("x-api-key").as_deref(), Some("v2"));

    // The admin token changed too.
    let resolve = |token: &str| {
        Request::post(fg.admin_url("/v1/dedup/billing/k/resolve"))
            .header("authorization", format!("Bearer {token}"))
            .body(body(r#"{"outcome":"delivered"}"#))
            .unwrap()
    };
    assert_eq!(send(resolve("old-admin")).await.status, 401);
    assert_eq!(send(resolve("new-admin")).await.status, 404, "authorized");

    assert!(
        !fg.stderr().contains("drained and stopped"),
        "ledger's fence must wait for its held request"
    );
    s.origin.release("ledger");
    let held = held.await.unwrap().expect("the held request was answered");
    assert_eq!(held.status, 200, "an in-flight request survives the reload");
    eventually("ledger's fence stopped after its drain", || async {
        fg.stderr().contains("drained and stopped")
    })
    .await;

    stop.store(true, Ordering::Relaxed);
    let statuses = load.await.unwrap();
    assert!(
        statuses.iter().all(|s| *s == Ok(200)),
        "every request during the reload answered 200: {statuses:?}"
    );
    let loglines = fg.stderr();
    assert!(loglines.contains("config reloaded"), "{loglines}");
    assert!(loglines.contains("routes_added=payments"), "{loglines}");
}

/// A file that does not parse, then one that changes a fixed key (`listen`, then
/// `[store]`), are refused: the old routes keep serving, the log says why, and
/// `fencegate_config_last_reload_successful` is 0 until a good file is applied.
/// Breaks if a bad file takes the process down or is half-applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_reload_keeps_the_running_config_and_says_why() {
    let s = setup("", &[]).await;
    let fg = &s.fg;
    let good = std::fs::read_to_string(&fg.config).unwrap();

    fg.edit_config(|t| {
        t.replace(
            "[[route]]\nname = \"billing\"",
            "[[route]\nname = \"billing\"",
        )
    });
    reload(fg, "refused").await;
    assert_eq!(
        fg.series("fencegate_config_last_reload_successful").await,
        0.0
    );
    assert_eq!(post(fg, "/billing/x", &s.billing, "a").await.status, 200);
    let log = fg.stderr();
    assert!(
        log.contains("config reload refused") && log.contains("line "),
        "{log}"
    );

    fg.edit_config(|_| {
        good.replace("127.0.0.1:0\"\nadmin", "127.0.0.1:1\"\nadmin")
            .replace("name = \"ledger\"", "name = \"ledger2\"")
    });
    reload(fg, "refused").await;
    assert!(
        fg.stderr()
            .contains("[server] listen cannot change while fencegate runs"),
        "{}",
        fg.stderr()
    );
    assert_eq!(post(fg, "/ledger/x", &s.ledger, "b").await.status, 200);

    fg.edit_config(|_| good.replace("grace_ms = 200", "grace_ms = 300"));
    reload(fg, "refused").await;
    assert!(
        fg.stderr().contains("[store] cannot change"),
        "{}",
        fg.stderr()
    );

    // A new route whose CA bundle is not PEM: refused after its lease's fence was
    // started, and that fence does not linger.
    let garbage = fg.dir.path().join("garbage-ca.pem");
    std::fs::write(&garbage, "not a certificate").unwrap();
    fg.edit_config(|_| {
        format!(
            "{good}{}",
            route_toml(
                "payments",
                "payments",
                &s.origin,
                &format!("ca_file = \"{}\"", garbage.display())
            )
        )
    });
    reload(fg, "refused").await;
    assert!(fg.stderr().contains("route payments"), "{}", fg.stderr());
    let leases = fg.admin_json("/v1/leases").await.to_string();
    assert!(!leases.contains("payments"), "{leases}");
    post(fg, "/payments/x", &s.payments, "c")
        .await
        .assert_error(404, "route_not_found");

    fg.edit_config(|_| good.clone());
    reload(fg, "applied").await;
    assert_eq!(
        fg.series("fencegate_config_last_reload_successful").await,
        1.0
    );
    assert_eq!(s.origin.count(), 2);
}

/// `[server] log_level` changes live: at "warn" no access line is written, after
/// a reload to "info" they are. Breaks if the filter is fixed at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_level_changes_live() {
    // An empty FENCEGATE_LOG leaves the config's log_level in charge.
    let s = setup("log_level = \"warn\"", &[("FENCEGATE_LOG", "")]).await;
    let fg = &s.fg;
    assert_eq!(
        post(fg, "/billing/x", &s.billing, "quiet").await.status,
        200
    );
    assert!(
        !fg.stderr().contains("fencegate::access"),
        "{}",
        fg.stderr()
    );
    fg.edit_config(|t| t.replace("log_level = \"warn\"", "log_level = \"info\""));
    reload(fg, "applied").await;
    assert_eq!(post(fg, "/billing/y", &s.billing, "loud").await.status, 200);
    assert!(fg.stderr().contains("fencegate::access"), "{}", fg.stderr());
}
