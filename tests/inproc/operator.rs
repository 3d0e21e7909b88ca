//! SPEC §8 for operators: the admin listener's HTTP conventions, the listing of
//! in-doubt keys, and the operator's page — what it shows and who may resolve
//! from it. (The same page in a real browser: `scripts/browser-test.sh`.)

use std::time::Duration;

use bytes::Bytes;
use fencegate::lease::acquire::Holding;
use http::Request;
use http_body_util::Full;

use crate::support::*;

const TOKEN: &str = "admin-secret";

async fn setup(server: &str) -> (Origin, Fencegate, Holding) {
    let origin = Origin::start().await;
    let fg = Fencegate::start_with(
        Setup {
            server,
            ..Setup::default()
        },
        &format!(
            "{}{}",
            route_toml("pay", "pay", &origin, "timeout_ms = 300"),
            route_toml("other", "other", &origin, ""),
        ),
    )
    .await;
    let a = acquire(&fg.epochs, "pay", "worker-a", Duration::from_secs(60)).await;
    (origin, fg, a)
}

fn with_token() -> String {
    format!("admin_token = \"{TOKEN}\"")
}

/// A request the origin holds past the route's timeout: its key goes in doubt.
async fn leave_in_doubt(fg: &Fencegate, h: &Holding, path: &str, key: &str) {
    send(
        worker_req(&fg.url(path), h.epoch.get(), &h.token)
            .header("idempotency-key", key)
            .header("x-test-hold", "stuck")
            .body(body("charge"))
            .unwrap(),
    )
    .await
    .assert_error(504, "upstream_timeout");
}

fn admin(fg: &Fencegate, method: &str, path: &str) -> http::request::Builder {
    Request::builder().method(method).uri(fg.admin_url(path))
}

fn empty() -> Full<Bytes> {
    Full::default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_endpoints_answer_head_405_and_an_index() {
    let (_origin, fg, _a) = setup("").await;
    for path in ["/healthz", "/livez", "/readyz", "/metrics", "/v1/leases"] {
        let get = send(admin(&fg, "GET", path).body(empty()).unwrap()).await;
        let head = send(admin(&fg, "HEAD", path).body(empty()).unwrap()).await;
        assert_eq!(
            (get.status.as_u16(), head.status.as_u16()),
            (200, 200),
            "{path}"
        );
        assert!(head.body.is_empty(), "{path}");
        assert_eq!(head.headers["content-type"], get.headers["content-type"]);
    }
    let r = send(admin(&fg, "POST", "/healthz").body(empty()).unwrap()).await;
    r.assert_error(405, "method_not_allowed");
    assert_eq!(r.headers["allow"], "GET, HEAD");
    let r = send(
        admin(&fg, "GET", "/v1/dedup/pay/k/resolve")
            .body(empty())
            .unwrap(),
    )
    .await;
    r.assert_error(405, "method_not_allowed");
    assert_eq!(r.headers["allow"], "POST");
    send(admin(&fg, "DELETE", "/v1/leases").body(empty()).unwrap())
        .await
        .assert_error(405, "method_not_allowed");
    send(admin(&fg, "GET", "/nope").body(empty()).unwrap())
        .await
        .assert_error(404, "not_found");
    // A client that does not ask for HTML gets the endpoint index.
    let index = fg.admin_json("/").await;
    let paths: Vec<&str> = index["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["path"].as_str().unwrap())
        .collect();
    for p in ["/healthz", "/livez", "/readyz", "/metrics", "/v1/leases"] {
        assert!(paths.contains(&p), "{paths:?}");
    }
    assert!(paths
        .iter()
        .any(|p| p.starts_with("/v1/dedup?state=in_doubt")));
    let json = send(
        admin(&fg, "GET", "/")
            .header("accept", "application/json")
            .body(empty())
            .unwrap(),
    )
    .await;
    assert_eq!(json.headers["content-type"], "application/json");
}

on_both_backends! {
async fn in_doubt_keys_are_listed_oldest_first_page_by_page() {
    let (origin, fg, a) = setup(&with_token()).await;
    // Created in this order, one second apart: not the keys' order.
    for key in ["k-c", "k-a", "k-b"] {
        leave_in_doubt(&fg, &a, "/pay/charge?card=secret", key).await;
        fg.clock.advance(Duration::from_secs(1));
    }
    let list = |query: &str, token: Option<&str>| {
        let mut b = admin(&fg, "GET", &format!("/v1/dedup?{query}"));
        if let Some(t) = token {
            b = b.header("authorization", format!("Bearer {t}"));
        }
        send(b.body(empty()).unwrap())
    };
    list("state=in_doubt", None).await.assert_error(401, "unauthorized");
    list("state=in_doubt", Some("wrong")).await.assert_error(401, "unauthorized");
    for bad in ["", "state=lost", "state=in_doubt&limit=0", "state=in_doubt&limit=1001",
                "state=in_doubt&after=garbage", "state=in_doubt&page=2"] {
        list(bad, Some(TOKEN)).await.assert_error(400, "bad_request");
    }
    list("state=in_doubt&route=nope", Some(TOKEN)).await.assert_error(404, "route_not_found");

    let first = list("state=in_doubt&limit=2", Some(TOKEN)).await;
    assert_eq!(first.status, 200);
    let j = first.json();
    assert_eq!(j["total"], 3);
    let keys: Vec<&str> = j["keys"].as_array().unwrap().iter().map(|k| k["key"].as_str().unwrap()).collect();
    assert_eq!(keys, ["k-c", "k-a"]);
    let k = &j["keys"][0];
    assert_eq!((k["route"].as_str(), k["epoch"].as_u64()), (Some("pay"), Some(a.epoch.get())));
    assert_eq!((k["method"].as_str(), k["path"].as_str()), (Some("POST"), Some("/pay/charge")));
    assert!(!first.body.windows(6).any(|w| w == b"secret"), "the query is not kept");
    // The last key of the page is resolved meanwhile: the next page still follows.
    let next = j["next"].as_str().unwrap().to_owned();
    let r = send(
        admin(&fg, "POST", "/v1/dedup/pay/k-a/resolve")
            .header("authorization", format!("Bearer {TOKEN}"))
            .body(body(r#"{"outcome": "not_delivered"}"#))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 200);
    let second = list(&format!("state=in_doubt&limit=2&after={}", urlencode(&next)), Some(TOKEN)).await.json();
    let keys: Vec<&str> = second["keys"].as_array().unwrap().iter().map(|k| k["key"].as_str().unwrap()).collect();
    assert_eq!(keys, ["k-b"]);
    assert_eq!(second["total"], 2);
    assert_eq!(second["next"], serde_json::Value::Null);
    // Scoped by route.
    let other = list("state=in_doubt&route=other", Some(TOKEN)).await.json();
    assert_eq!((other["total"].as_u64(), other["keys"].as_array().map(Vec::len)), (Some(0), Some(0)));
    origin.release("stuck");
    assert_eq!(origin.count(), 3);
}
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// GET / as a browser, with `cookie` if given.
async fn page(fg: &Fencegate, cookie: Option<&str>) -> Reply {
    page_at(fg, "/", cookie).await
}

/// The page at `path` (`/` with a query).
async fn page_at(fg: &Fencegate, path: &str, cookie: Option<&str>) -> Reply {
    let mut b = admin(fg, "GET", path).header("accept", "text/html,application/xhtml+xml");
    if let Some(c) = cookie {
        b = b.header("cookie", c);
    }
    send(b.body(empty()).unwrap()).await
}

fn text(r: &Reply) -> String {
    String::from_utf8_lossy(&r.body).into_owned()
}

/// Logs in through the form; the session cookie (`name=value`).
async fn login(fg: &Fencegate, token: &str) -> Reply {
    send(
        admin(fg, "POST", "/login")
            .header("content-type", "application/x-www-form-urlencoded")
            .header("origin", format!("http://{}", fg.admin))
            .body(body(&format!("token={}", urlencode(token))))
            .unwrap(),
    )
    .await
}

fn cookie_of(r: &Reply) -> String {
    let set = r.headers["set-cookie"].to_str().unwrap();
    set.split(';').next().unwrap().to_owned()
}

fn csrf_of(html: &str) -> String {
    let at = html.find(r#"name="csrf" value=""#).expect("a form token") + 19;
    html[at..].split('"').next().unwrap().to_owned()
}

/// The page's resolve form as a browser posts it.
fn resolve_form(
    fg: &Fencegate,
    key: &str,
    outcome: &str,
    cookie: Option<&str>,
    csrf: Option<&str>,
    origin: &str,
) -> Request<Full<Bytes>> {
    let mut b = admin(
        fg,
        "POST",
        &format!("/v1/dedup/pay/{}/resolve", urlencode(key)),
    )
    .header("content-type", "application/x-www-form-urlencoded")
    .header("origin", origin);
    if let Some(c) = cookie {
        b = b.header("cookie", c);
    }
    let mut form = format!("outcome={outcome}");
    if let Some(t) = csrf {
        form.push_str(&format!("&csrf={t}"));
    }
    b.body(body(&form)).unwrap()
}

on_both_backends! {
async fn the_page_shows_a_held_lease_a_raised_mark_and_the_in_doubt_keys() {
    let (origin, fg, a) = setup(&with_token()).await;
    assert_eq!(post(&fg, "/pay/one", &a, "x").await.status, 200);
    // A newer worker raises the mark.
    let b = force_next_epoch(&fg.epochs, "pay", "worker-b", Duration::from_secs(60)).await;
    assert_eq!(post(&fg, "/pay/two", &b, "y").await.status, 200);
    let nasty = r#"<i>k</i>&"'"#;
    leave_in_doubt(&fg, &b, "/pay/tom&jerry's?q=1", nasty).await;
    fg.clock.advance(Duration::from_secs(5));
    leave_in_doubt(&fg, &b, "/pay/refund", "k-later").await;

    let cookie = cookie_of(&login(&fg, TOKEN).await);
    let r = page(&fg, Some(&cookie)).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.headers["content-type"], "text/html; charset=utf-8");
    let csp = r.headers["content-security-policy"].to_str().unwrap();
    assert!(csp.contains("default-src 'none'"), "{csp}");
    // One inline script, allowed by its hash and nothing else.
    let script_src = csp.split(';').map(str::trim).find(|d| d.starts_with("script-src")).unwrap();
    assert!(script_src.contains("'sha256-") && !script_src.contains("unsafe"), "{csp}");
    // `no-referrer` would make browsers send `Origin: null` on the page's own
    // forms (seen in Chromium), which the same-origin check refuses.
    assert_eq!(r.headers["referrer-policy"], "same-origin");
    let html = text(&r);
    assert!(html.contains(r#"<noscript><meta http-equiv="refresh""#));
    assert_eq!(html.matches("<script").count(), 1, "one script");
    assert!(!html.contains("<script src"), "nothing loaded");
    assert!(!html.contains("http://") && !html.contains("https://"), "nothing from elsewhere");

    // The lease row: raised mark, latest epoch, holder, time left (store clock).
    let row = row_of(&html, r#"<tr class="lease"><td data-label="lease"><code>pay</code>"#);
    assert!(row.contains(&format!(r#"data-label="mark" class="n">{}<"#, b.epoch.get())), "{row}");
    assert!(row.contains(&format!(r#"data-label="latest epoch" class="n">{}<"#, b.epoch.get())), "{row}");
    assert!(row.contains("worker-b"), "{row}");
    assert!(row.contains(r#"<span class="ok"><time datetime=""#) && row.contains(">in 5"), "{row}");
    // The untouched lease: no mark yet.
    let idle = row_of(&html, r#"<tr class="lease"><td data-label="lease"><code>other</code>"#);
    assert!(idle.contains(r#"data-label="mark" class="n">0<"#), "{idle}");

    // In-doubt keys, oldest first, everything escaped.
    let keys: Vec<&str> = html.match_indices(r#"<tr class="key">"#).map(|(i, _)| &html[i..]).collect();
    assert_eq!(keys.len(), 2, "{html}");
    let first = &keys[0][..keys[0].find("</tr>").unwrap()];
    assert!(first.contains("<code>&lt;i&gt;k&lt;/i&gt;&amp;&quot;&#39;</code>"), "{first}");
    assert!(first.contains("POST /<wbr>pay/<wbr>tom&amp;jerry&#39;s</code>"), "{first}");
    assert!(first.contains(&format!(r#"data-label="epoch" class="n">{}<"#, b.epoch.get())), "{first}");
    assert!(first.contains(">5 s ago</time>"), "{first}");
    assert!(first.contains(r#"action="/v1/dedup/pay/%3Ci%3Ek%3C%2Fi%3E%26%22%27/resolve""#), "{first}");
    assert!(first.contains(r#"value="not_delivered">not delivered</button>"#), "{first}");
    assert!(!html.contains("<i>k</i>") && !html.contains("jerry's"));
    assert!(keys[1].contains("k-later") && keys[1].contains("POST /<wbr>pay/<wbr>refund"));
    assert!(html.contains("(2 in all, oldest first)"));

    // The shard map: this instance's guard, shard 0 of 1, held at the guard's epoch.
    let shard = row_of(&html, r#"<tr class="shard">"#);
    assert!(shard.contains("0 of 1") && shard.contains("this instance, serving"), "{shard}");
    assert!(shard.contains(r#"data-label="tenure" class="n">guard epoch "#), "{shard}");
    assert!(shard.contains("fg-"), "{shard}");
    // … naming its leases; the members: this instance, alive, on shard 0.
    assert!(shard.contains(r#"class="leases"><code>other</code> <code>pay</code>"#), "{shard}");
    let member = row_of(&html, r#"<tr class="member">"#);
    assert!(member.contains("(this instance)") && member.contains("alive") && member.contains(">0<"), "{member}");

    // A key's detail view: its request, lease and epoch, and what the
    // destination answered (nothing: it is in doubt).
    let detail = text(&page_at(&fg, "/?detail=1&route=pay&key=k-later", Some(&cookie)).await);
    let section = &detail[detail.find(r#"<section id="key">"#).unwrap()..];
    let section = &section[..section.find("</section>").unwrap()];
    assert!(section.contains(r#"<td class="state">in doubt</td>"#), "{section}");
    assert!(section.contains("POST /<wbr>pay/<wbr>refund"), "{section}");
    assert!(section.contains(&format!("<code>pay</code>, epoch {}", b.epoch.get())), "{section}");
    assert!(section.contains("timed out"), "{section}");
    assert!(section.contains(r#"<details class="resolve">"#), "resolvable from there: {section}");
    let done = text(&page_at(&fg, "/?detail=1&route=pay&key=nope", Some(&cookie)).await);
    assert!(done.contains("no record for that key"), "{done}");
    origin.release("stuck");
}
}

fn row_of<'a>(html: &'a str, start: &str) -> &'a str {
    let at = html
        .find(start)
        .unwrap_or_else(|| panic!("no row {start}\n{html}"));
    let row = &html[at..];
    &row[..row.find("</tr>").unwrap()]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reading_needs_a_login_and_resolving_a_same_origin_form() {
    let (origin, fg, a) = setup(&with_token()).await;
    leave_in_doubt(&fg, &a, "/pay/x", "k-stuck").await;
    let me = format!("http://{}", fg.admin);

    // No session: the login form, and nothing of the state.
    let r = page(&fg, None).await;
    let html = text(&r);
    assert!(
        html.contains(r#"<form method="post" action="/login">"#),
        "{html}"
    );
    assert!(html.contains(r#"type="password""#));
    assert!(!html.contains("k-stuck"));
    // A made-up cookie is no session.
    assert!(
        text(&page(&fg, Some("fencegate_admin=admin-secret")).await).contains("action=\"/login\"")
    );

    // A wrong token is refused, and sets nothing.
    let wrong = login(&fg, "admin-secreT").await;
    assert_eq!(wrong.status, 403);
    assert!(wrong.headers.get("set-cookie").is_none());
    assert!(text(&wrong).contains("not the admin token"));
    // A login posted from another site is refused.
    let cross = send(
        admin(&fg, "POST", "/login")
            .header("content-type", "application/x-www-form-urlencoded")
            .header("origin", "http://evil.example")
            .body(body(&format!("token={TOKEN}")))
            .unwrap(),
    )
    .await;
    cross.assert_error(403, "cross_site_refused");
    assert!(cross.headers.get("set-cookie").is_none());

    // The right token: a redirect to the page, a cookie that keeps no token.
    let ok = login(&fg, TOKEN).await;
    assert_eq!(ok.status, 303);
    assert_eq!(ok.headers["location"], "/");
    let set = ok.headers["set-cookie"].to_str().unwrap();
    for attr in ["HttpOnly", "SameSite=Strict", "Path=/"] {
        assert!(set.contains(attr), "{set}");
    }
    assert!(!set.contains(TOKEN));
    let cookie = cookie_of(&ok);
    let html = text(&page(&fg, Some(&cookie)).await);
    assert!(html.contains("k-stuck"));
    let csrf = csrf_of(&html);

    // Cross-site posts are refused, and change nothing.
    let still = || async { fg.admin_json("/v1/dedup/pay/k-stuck").await["state"].clone() };
    let form = |cookie: Option<&str>, csrf: Option<&str>, origin: &str| {
        resolve_form(&fg, "k-stuck", "not_delivered", cookie, csrf, origin)
    };
    let evil = "http://evil.example";
    let refused = [
        (form(Some(&cookie), Some(&csrf), evil), 403),
        (form(Some(&cookie), None, &me), 403),
        (form(Some(&cookie), Some("0000"), &me), 403),
        (form(None, Some(&csrf), &me), 401),
    ];
    for (req, status) in refused {
        let r = send(req).await;
        assert_eq!(r.status, status, "{}", text(&r));
        assert_eq!(still().await, "in_doubt");
    }
    let from_page = || form(Some(&cookie), Some(&csrf), &me);
    let mut fetch_site = from_page();
    fetch_site.headers_mut().insert(
        "sec-fetch-site",
        http::HeaderValue::from_static("cross-site"),
    );
    assert_eq!(send(fetch_site).await.status, 403);
    assert_eq!(still().await, "in_doubt");
    assert_eq!(origin.count(), 1);

    // From the page itself: resolved, and the worker's retry is forwarded.
    let r = send(from_page()).await;
    assert_eq!(r.status, 303, "{}", text(&r));
    let back = r.headers["location"].to_str().unwrap().to_owned();
    assert!(back.starts_with("/?resolved=not_delivered"), "{back}");
    assert!(!back.contains(TOKEN) && !back.contains(&csrf));
    let after = send(
        admin(&fg, "GET", &back)
            .header("accept", "text/html")
            .header("cookie", &cookie)
            .body(empty())
            .unwrap(),
    )
    .await;
    let html = text(&after);
    assert!(
        html.contains("Resolved pay / k-stuck as not delivered."),
        "{html}"
    );
    assert!(
        html.contains(r#"content="10; url=/""#),
        "the reload drops the notice"
    );
    assert!(!html.contains(r#"<tr class="key">"#));
    assert_eq!(
        fg.admin_json("/v1/dedup/pay/k-stuck").await["error"],
        "dedup_record_not_found"
    );
    origin.release("stuck");
    let retry = send(
        worker_req(&fg.url("/pay/x"), a.epoch.get(), &a.token)
            .header("idempotency-key", "k-stuck")
            .body(body("charge"))
            .unwrap(),
    )
    .await;
    assert_eq!(retry.status, 200);
    assert_eq!(origin.count(), 2);

    // Logging out ends the session in this browser.
    let out = send(
        admin(&fg, "POST", "/logout")
            .header("cookie", &cookie)
            .body(empty())
            .unwrap(),
    )
    .await;
    assert_eq!(out.status, 303);
    assert!(out.headers["set-cookie"]
        .to_str()
        .unwrap()
        .contains("Max-Age=0"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_admin_token_the_page_is_read_only_and_says_how_to_enable() {
    let (origin, fg, a) = setup("").await;
    leave_in_doubt(&fg, &a, "/pay/x", "k-ro").await;
    let html = text(&page(&fg, None).await);
    assert!(html.contains("k-ro"), "{html}");
    assert!(
        html.contains("Read-only") && html.contains("admin_token"),
        "{html}"
    );
    assert!(!html.contains(r#"method="post""#), "no buttons, no login");
    let r = send(resolve_form(
        &fg,
        "k-ro",
        "not_delivered",
        None,
        None,
        &format!("http://{}", fg.admin),
    ))
    .await;
    assert_eq!(r.status, 403);
    assert_eq!(
        fg.admin_json("/v1/dedup/pay/k-ro").await["state"],
        "in_doubt"
    );
    // The listing needs the token too: disabled without one.
    send(
        admin(&fg, "GET", "/v1/dedup?state=in_doubt")
            .body(empty())
            .unwrap(),
    )
    .await
    .assert_error(403, "admin_disabled");
    origin.release("stuck");
}

/// A form of the page's queue panel as a browser posts it: `action` is `retry`
/// or `drop`.
fn delivery_form(
    fg: &Fencegate,
    key: &str,
    action: &str,
    cookie: Option<&str>,
    csrf: Option<&str>,
    origin: &str,
) -> Request<Full<Bytes>> {
    let mut b = admin(
        fg,
        "POST",
        &format!("/v1/deliveries/hook/{}/{action}", urlencode(key)),
    )
    .header("content-type", "application/x-www-form-urlencoded")
    .header("origin", origin);
    if let Some(c) = cookie {
        b = b.header("cookie", c);
    }
    b.body(body(&csrf.map_or(String::new(), |t| format!("csrf={t}"))))
        .unwrap()
}

/// The queued message `hook`/`key`, from the admin API.
async fn message_of(fg: &Fencegate, key: &str) -> serde_json::Value {
    fg.admin_json(&format!("/v1/deliveries/hook/{}", urlencode(key)))
        .await
}

async fn wait_for(fg: &Fencegate, key: &str, want: &str) {
    for _ in 0..500 {
        if message_of(fg, key).await["status"] == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{key} never {want}: {}", message_of(fg, key).await);
}

/// SPEC §11 on the page: a queued route's depth, oldest pending message and
/// its messages not delivered — a failed one with its last error, its key
/// escaped — with Retry and Drop forms that pass the page's session and form
/// token checks, change the message, and come back to the page with a notice
/// (a refusal too); the JSON API with the admin token works as before; a page
/// without a queued route says nothing of queues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_panel_lists_messages_and_retries_and_drops_them_from_the_page() {
    let origin = Origin::start().await;
    let fg = Fencegate::start_with(
        Setup {
            server: &with_token(),
            ..Setup::default()
        },
        &route_toml(
            "hook",
            "hook",
            &origin,
            "delivery = \"queued\"\nretry = { schedule = [\"1h\"] }",
        ),
    )
    .await;
    let a = acquire(&fg.epochs, "hook", "worker-a", Duration::from_secs(60)).await;
    let queue = |key: &str, status: u16| {
        let mut r = keyed(&fg, "/hook/events", &a, key, key);
        r.headers_mut()
            .insert("x-test-status", status.to_string().parse().unwrap());
        r
    };
    // The destination refuses the first for good (400): failed at once. The
    // second fails (503), to be tried again in an hour; the third waits.
    let nasty = "<script>alert(1)</script>";
    assert_eq!(send(queue(nasty, 400)).await.status, 202);
    wait_for(&fg, nasty, "failed").await;
    assert_eq!(send(queue("m2", 503)).await.status, 202);
    for _ in 0..500 {
        if message_of(&fg, "m2").await["attempts"] == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(send(queue("m3", 200)).await.status, 202);
    fg.clock.advance(Duration::from_secs(5));

    let cookie = cookie_of(&login(&fg, TOKEN).await);
    let html = text(&page(&fg, Some(&cookie)).await);
    let csrf = csrf_of(&html);
    assert!(!html.contains("<script>alert"), "{html}");
    let figures = row_of(&html, r#"<tr class="queue">"#);
    assert!(
        figures.contains("<code>hook</code>")
            && figures.contains(r#"title="not settled: pending or being delivered">2<"#)
            && figures.contains(r#"<span class="bad">1</span>"#)
            && figures.contains(">5 s ago</time>"),
        "{figures}"
    );
    let failed = row_of(&html, r#"<tr class="message">"#);
    for want in [
        "<code>&lt;script&gt;alert(1)&lt;/script&gt;</code>",
        r#"<span class="bad">failed</span>"#,
        r#"data-label="last status" class="n">400<"#,
        "the destination refused it (400): not retried",
        r#"action="/v1/deliveries/hook/%3Cscript%3Ealert%281%29%3C%2Fscript%3E/retry""#,
    ] {
        assert!(failed.contains(want), "{want}: {failed}");
    }
    let m2 = row_of(&html, r#"<code>m2</code>"#);
    assert!(
        m2.contains(r#"data-label="last status" class="n">503<"#) && m2.contains(">in "),
        "{m2}"
    );
    assert!(html.contains("<code>m3</code>"));

    // Cross-site, without the form token, or without the session: refused,
    // and nothing changes.
    let me = format!("http://{}", fg.admin);
    let refused = [
        (
            delivery_form(&fg, "m3", "drop", Some(&cookie), None, &me),
            403,
        ),
        (
            delivery_form(
                &fg,
                "m3",
                "drop",
                Some(&cookie),
                Some(&csrf),
                "http://evil.example",
            ),
            403,
        ),
        (
            delivery_form(&fg, "m3", "drop", Some(&cookie), Some("0000"), &me),
            403,
        ),
        (
            delivery_form(&fg, "m3", "drop", None, Some(&csrf), &me),
            401,
        ),
    ];
    for (req, status) in refused {
        let r = send(req).await;
        assert_eq!(r.status, status, "{}", text(&r));
        assert_eq!(message_of(&fg, "m3").await["status"], "pending");
    }

    // From the page: dropped, and back to the page with a notice.
    let follow = |r: &Reply| {
        assert_eq!(r.status, 303, "{}", text(r));
        let to = r.headers["location"].to_str().unwrap();
        assert!(to.ends_with("#queued") && !to.contains(&csrf), "{to}");
        to.trim_end_matches("#queued").to_owned()
    };
    let r = send(delivery_form(
        &fg,
        "m3",
        "drop",
        Some(&cookie),
        Some(&csrf),
        &me,
    ))
    .await;
    let back = follow(&r);
    assert_eq!(message_of(&fg, "m3").await["status"], "dropped");
    let html = text(&page_at(&fg, &back, Some(&cookie)).await);
    assert!(
        html.contains(
            r#"<section class="notice" role="status">Dropped hook / m3: it will not be delivered"#
        ),
        "{html}"
    );
    assert!(
        !html.contains("<code>m3</code>"),
        "a dropped message is no longer listed"
    );

    // A newer epoch's message waits: retrying the failed one would deliver it
    // after that one. Refused, said on the page.
    let b = force_next_epoch(&fg.epochs, "hook", "worker-b", Duration::from_secs(60)).await;
    assert_eq!(
        send(keyed(&fg, "/hook/events", &b, "m4", "m4"))
            .await
            .status,
        202
    );
    let r = send(delivery_form(
        &fg,
        nasty,
        "retry",
        Some(&cookie),
        Some(&csrf),
        &me,
    ))
    .await;
    let html = text(&page_at(&fg, &follow(&r), Some(&cookie)).await);
    assert!(
        html.contains(&format!(
            r#"<section class="notice refused" role="alert">Not retried: hook / &lt;script&gt;alert(1)&lt;/script&gt;: a message of epoch {} of its lease was sent or waits"#,
            b.epoch.get()
        )),
        "{html}"
    );
    assert_eq!(message_of(&fg, nasty).await["status"], "failed");
    // A message in another state, and none: refusals on the page too.
    let r = send(delivery_form(
        &fg,
        "m3",
        "retry",
        Some(&cookie),
        Some(&csrf),
        &me,
    ))
    .await;
    let html = text(&page_at(&fg, &follow(&r), Some(&cookie)).await);
    assert!(
        html.contains("Not retried: hook / m3: the message is dropped"),
        "{html}"
    );
    let r = send(delivery_form(
        &fg,
        "nope",
        "drop",
        Some(&cookie),
        Some(&csrf),
        &me,
    ))
    .await;
    let html = text(&page_at(&fg, &follow(&r), Some(&cookie)).await);
    assert!(
        html.contains("Not dropped: hook / nope: no queued message has this route and key"),
        "{html}"
    );

    // Drop the failed one from the page; retry the pending head (due now: it
    // is sent again at once, and fails again).
    let r = send(delivery_form(
        &fg,
        nasty,
        "drop",
        Some(&cookie),
        Some(&csrf),
        &me,
    ))
    .await;
    follow(&r);
    assert_eq!(message_of(&fg, nasty).await["status"], "dropped");
    // The JSON API, with the admin token, as before — on m4 while it still
    // waits behind m2 (m2's retry below fails for good, then m4 would go).
    let r = send(
        admin(&fg, "POST", "/v1/deliveries/hook/m4/drop")
            .header("authorization", format!("Bearer {TOKEN}"))
            .body(empty())
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", text(&r));
    assert_eq!(r.json()["status"], "dropped");
    send(
        admin(&fg, "POST", "/v1/deliveries/hook/m4/retry")
            .header("authorization", format!("Bearer {TOKEN}"))
            .body(empty())
            .unwrap(),
    )
    .await
    .assert_error(409, "delivery_conflict");
    send(
        admin(&fg, "POST", "/v1/deliveries/hook/m4/retry")
            .body(empty())
            .unwrap(),
    )
    .await
    .assert_error(401, "unauthorized");

    let sent = origin.count();
    let r = send(delivery_form(
        &fg,
        "m2",
        "retry",
        Some(&cookie),
        Some(&csrf),
        &me,
    ))
    .await;
    let html = text(&page_at(&fg, &follow(&r), Some(&cookie)).await);
    assert!(html.contains("Retried hook / m2"), "{html}");
    origin.wait_until("m2 again", |log| log.len() > sent).await;

    // "Retry all" (a bulk job, SPEC §11) from the page: the same checks as
    // every form of the page, then a notice and the job listed.
    wait_for(&fg, "m2", "failed").await;
    let retry_all = |csrf: Option<&str>| {
        admin(&fg, "POST", "/v1/delivery-jobs/retry?route=hook")
            .header("content-type", "application/x-www-form-urlencoded")
            .header("origin", &me)
            .header("cookie", &cookie)
            .body(body(&csrf.map_or(String::new(), |t| format!("csrf={t}"))))
            .unwrap()
    };
    // Without the form's token: refused, no job.
    assert_eq!(send(retry_all(None)).await.status, 403);
    let jobs = send(
        admin(&fg, "GET", "/v1/delivery-jobs")
            .header("authorization", format!("Bearer {TOKEN}"))
            .body(empty())
            .unwrap(),
    )
    .await;
    assert_eq!(jobs.json()["jobs"], serde_json::json!([]));
    let r = send(retry_all(Some(&csrf))).await;
    let html = text(&page_at(&fg, &follow(&r), Some(&cookie)).await);
    assert!(html.contains("Bulk retry "), "{html}");
    assert!(html.contains(r#"<tr class="job">"#), "{html}");
    let sent = origin.count();
    origin
        .wait_until("m2 retried by the job", |log| log.len() > sent)
        .await;
}

/// No queued route: nothing of queues on the page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_queued_route_the_page_says_nothing_of_queues() {
    let (origin, fg, _a) = setup(&with_token()).await;
    let cookie = cookie_of(&login(&fg, TOKEN).await);
    let html = text(&page(&fg, Some(&cookie)).await);
    assert!(html.contains("In-doubt keys"), "{html}");
    assert!(
        !html.contains("Queued") && !html.contains("queued"),
        "{html}"
    );
    drop(origin);
}
