//! The operator's page (SPEC §8, issue 16): one server-rendered HTML page on the
//! admin listener — leases and their marks, the store, the members and the shard
//! map (with each shard's leases), the in-doubt keys with the two buttons that
//! resolve them (after a confirmation), one key's detail view, and — when a
//! route is queued — the queue panel (SPEC §11: depth, oldest pending, the
//! messages not delivered with Retry and Drop buttons). Nothing is
//! fetched from elsewhere; one small inline script ([`SCRIPT`], allowed by its
//! hash alone) reloads the page every [`REFRESH_SECS`] unless the pointer is on
//! it or a form is open, and asks before a resolve, a retry or a drop. Without script, a meta
//! refresh reloads it.
//!
//! Rendering is a pure function of a [`PageView`], gathered by the admin API, so
//! tests and benches build views directly. The render functions write
//! [`Html`] ([`super::markup`]): every value from outside (lease and holder
//! names, keys, paths, error texts) goes through [`esc`], or it does not
//! compile.

use std::time::SystemTime;

use crate::clock::rfc3339;

use super::form;
use super::markup::{esc, html, Html};

/// Leases shown per page of the lease table.
pub const LEASES_PER_PAGE: usize = 100;
/// In-doubt keys shown per page.
pub const KEYS_PER_PAGE: usize = 50;
/// Leases named per shard in the shard map (the rest are counted).
pub const SHARD_LEASES_SHOWN: usize = 20;
/// Routes shown in the routes table (those with something to say first).
pub const ROUTES_SHOWN: usize = 100;
/// Seconds between the page's reloads.
pub const REFRESH_SECS: u32 = 10;
/// Queued messages shown per page of the queue panel.
pub const MESSAGES_PER_PAGE: usize = 100;
/// Pages of queued messages the panel goes to (each is read from the first
/// message on); `GET /v1/deliveries` lists by status and lease beyond.
pub const MESSAGE_PAGES: usize = 100;

/// One lease as the page shows it.
#[derive(Debug, Clone)]
pub struct LeaseRow {
    /// The lease's name.
    pub lease: String,
    /// Its durable high-water mark.
    pub mark: u64,
    /// The greatest epoch known in the store.
    pub latest: u64,
    /// The latest epoch's holder, if it is a live acquire.
    pub holder: Option<String>,
    /// On the store's clock.
    pub expires_at: Option<SystemTime>,
    /// Requests admitted whose exchange with the upstream is not over (SPEC §5).
    pub in_flight: usize,
    /// Dedup records in doubt for the lease's routes.
    pub in_doubt: usize,
    /// Drains begun since start-up.
    pub drains_started: u64,
    /// Drains that timed out and aborted requests.
    pub drains_aborted: u64,
    /// The last store call's failure, if it failed.
    pub store_error: Option<String>,
}

/// One route's protection of its destination (SPEC §9), as the page shows it.
#[derive(Debug, Clone)]
pub struct RouteRow {
    /// The route's name.
    pub route: String,
    /// Its upstream, without credentials.
    pub upstream: String,
    /// Requests at the upstream now.
    pub in_flight: usize,
    /// `max_in_flight`, if set.
    pub max_in_flight: Option<usize>,
    /// How long a `Retry-After` still holds it.
    pub held_for: Option<std::time::Duration>,
    /// The breaker's state (`closed`, `open`, `half_open`) and how long it stays
    /// open, if the route has one.
    pub breaker: Option<(&'static str, Option<std::time::Duration>)>,
    /// Requests refused `upstream_held` since start-up.
    pub refused: u64,
}

impl RouteRow {
    /// Whether the row says something an operator should see first.
    pub fn notable(&self) -> bool {
        self.held_for.is_some()
            || self.breaker.is_some_and(|(s, _)| s != "closed")
            || self.max_in_flight.is_some_and(|m| self.in_flight >= m)
    }
}

/// One instance of the cluster (or the single instance), as this one knows it.
#[derive(Debug, Clone)]
pub struct MemberRow {
    /// The instance id.
    pub id: String,
    /// Seen alive at the last heartbeat.
    pub alive: bool,
    /// When this instance last saw it alive (for a gone one).
    pub last_seen: Option<SystemTime>,
    /// Whether it is this instance.
    pub this_instance: bool,
    /// The shards it owns, as last seen.
    pub shards: Vec<u32>,
}

/// One shard of the shard map. A single instance has one, shard 0 of 1, which
/// it holds by its instance guard, a gate lease in the store (SPEC §10.1); a
/// cluster has `shards` of them, each owned through a row of `fencegate_owners`
/// in PostgreSQL (§10.2).
#[derive(Debug, Clone)]
pub struct ShardRow {
    /// The shard's number.
    pub shard: u32,
    /// How many shards there are.
    pub shards: u32,
    /// The instance that owns the shard, if one does: in a cluster the owner of
    /// its row while that tenure may still run; a single instance while it
    /// holds its guard.
    pub owner: Option<String>,
    /// What the owner holds the shard by, if anything.
    pub tenure: Option<Tenure>,
    /// When the tenure ends, as last seen: a cluster's row's `expires_at`, on
    /// the database's clock (shown, never judged on); a single instance's
    /// guard's expiry, on the store's clock.
    pub expires_at: Option<SystemTime>,
    /// Whether the owner is this instance.
    pub this_instance: bool,
    /// Whether this instance forwards the shard's requests now.
    pub serving: bool,
    /// The leases hashed to the shard (of the configured routes).
    pub leases: Vec<String>,
}

/// What a shard's owner holds it by: a number that rises with every new tenure,
/// which means one thing in a cluster and another in a single instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tenure {
    /// A cluster's shard: the `generation` of its row of `fencegate_owners`,
    /// raised by every take and carried by every state write (SPEC §10.2).
    Generation(u64),
    /// A single instance's shard: the epoch of its instance guard, the gate
    /// lease under `{prefix}.gate/0000/` (SPEC §10.1).
    GuardEpoch(u64),
}

/// One dedup key in full: the detail view (`/?detail=1&route=R&key=K`).
#[derive(Debug, Clone)]
pub struct KeyDetail {
    /// The route asked for.
    pub route: String,
    /// The key asked for.
    pub key: String,
    /// Its record, or why there is none to show.
    pub record: Result<KeyRecord, String>,
}

/// A dedup record as the detail view shows it.
#[derive(Debug, Clone)]
pub struct KeyRecord {
    /// `in_flight`, `done` or `in_doubt` (shown as "in flight", "done", "in doubt").
    pub state: &'static str,
    /// The route's lease.
    pub lease: Option<String>,
    /// The epoch the request was admitted at.
    pub epoch: u64,
    /// When the key was first claimed.
    pub created: SystemTime,
    /// When the record last changed.
    pub updated: SystemTime,
    /// The request's method and path, when kept.
    pub method: Option<String>,
    /// See `method`.
    pub path: Option<String>,
    /// The upstream's status, when it answered.
    pub status: Option<u16>,
    /// The stored body's size, when stored.
    pub body_bytes: Option<usize>,
}

/// One in-doubt key.
#[derive(Debug, Clone)]
pub struct KeyRow {
    /// The route whose dedup scope holds the key.
    pub route: String,
    /// The dedup key.
    pub key: String,
    /// The epoch the request was admitted at.
    pub epoch: u64,
    /// When the request arrived (fencegate's clock).
    pub created: SystemTime,
    /// When it went in doubt.
    pub updated: SystemTime,
    /// The request's method and path, when the record keeps them.
    pub method: Option<String>,
    /// See `method`.
    pub path: Option<String>,
}

/// Whether the viewer may resolve keys.
#[derive(Debug, Clone)]
pub enum Access {
    /// No admin token configured: the page is read-only.
    ReadOnly,
    /// Logged in: forms carry this token.
    Resolve {
        /// The CSRF token, checked on every form post.
        csrf: String,
    },
}

/// A queued route's figures (SPEC §11), as the metrics give them.
#[derive(Debug, Clone)]
pub struct QueueRoute {
    /// The route's name.
    pub route: String,
    /// Its lease (whose queue its messages are in).
    pub lease: String,
    /// Messages not settled, pending or being delivered
    /// (`fencegate_queue_depth`).
    pub depth: u64,
    /// Failed messages, kept until an operator retries or drops them or the
    /// `[dedup] ttl` sweeps them.
    pub failed: u64,
    /// When the oldest message not settled was accepted (its lease's head, as
    /// `fencegate_queue_oldest_pending_seconds`), if there is one.
    pub oldest: Option<SystemTime>,
}

/// A queued message not delivered: pending, delivering or failed.
#[derive(Debug, Clone)]
pub struct MessageRow {
    /// The route it was accepted on.
    pub route: String,
    /// Its dedup key.
    pub key: String,
    /// The lease whose queue it is in.
    pub lease: String,
    /// The epoch it was accepted at.
    pub epoch: u64,
    /// Its place in its lease's queue.
    pub seq: u64,
    /// `pending`, `delivering` or `failed`.
    pub status: &'static str,
    /// Attempts started.
    pub attempts: u32,
    /// The destination's last status, if it answered.
    pub last_status: Option<u16>,
    /// Why the last attempt failed.
    pub last_error: Option<String>,
    /// When a pending message's next attempt may start.
    pub next_attempt: Option<SystemTime>,
}

/// The queue panel: shown only when a route is queued.
#[derive(Debug, Clone, Default)]
pub struct QueuePanel {
    /// Each queued route's figures, by name.
    pub routes: Vec<QueueRoute>,
    /// This page of their messages not delivered: route by route, failed
    /// ones first, then the one being delivered, then the pending ones.
    pub messages: Vec<MessageRow>,
    /// How many such messages there are in all.
    pub messages_total: u64,
    /// Index of the first row in `messages`.
    pub offset: usize,
    /// Why the queue could not be read, if it could not.
    pub error: Option<String>,
}

/// A line about what the viewer just did.
#[derive(Debug, Clone)]
pub struct Notice {
    /// What to say.
    pub text: String,
    /// The action was refused (shown as an alert).
    pub refused: bool,
}

impl Notice {
    /// An action done.
    pub fn done(text: String) -> Notice {
        Notice {
            text,
            refused: false,
        }
    }
}

/// The store and the state backend.
#[derive(Debug, Clone)]
pub struct StoreHealth {
    /// The lease store, as configured (kind and location).
    pub store: String,
    /// Store minus local clock (upper end of the estimate), ms.
    pub clock_offset_ms: i64,
    /// Whether the state backend answered.
    pub state_ok: bool,
    /// Leases whose last store call failed.
    pub leases_failing: usize,
}

/// Everything the page shows.
#[derive(Debug, Clone)]
pub struct PageView {
    /// This instance's id (or host) in the page title.
    pub instance: String,
    /// fencegate's version.
    pub version: &'static str,
    /// This instance's clock (record times).
    pub now: SystemTime,
    /// The store's clock (lease and instance guard expiries).
    pub store_now: SystemTime,
    /// The store and state backend's health.
    pub health: StoreHealth,
    /// This page of the lease table, and where it starts.
    pub leases: Vec<LeaseRow>,
    /// How many leases there are in all.
    pub leases_total: usize,
    /// Index of the first row in `leases`.
    pub leases_offset: usize,
    /// Routes and how they protect their destinations (at most
    /// [`ROUTES_SHOWN`], notable ones first), and how many there are.
    pub routes: Vec<RouteRow>,
    /// See `routes`.
    pub routes_total: usize,
    /// The shard map.
    pub shards: Vec<ShardRow>,
    /// The instances: this one, and in a cluster every one seen since start-up.
    pub members: Vec<MemberRow>,
    /// In a cluster: requests this instance relayed to their shard's owner.
    pub relayed: Option<u64>,
    /// The key asked for in the detail view.
    pub detail: Option<KeyDetail>,
    /// This page of the in-doubt keys, oldest first.
    pub keys: Vec<KeyRow>,
    /// How many in-doubt keys there are in all.
    pub keys_total: u64,
    /// The cursor of the next page, if there may be one.
    pub keys_next: Option<String>,
    /// Whether this is a later page (a link back to the first).
    pub keys_paged: bool,
    /// Why the keys could not be listed, if they could not.
    pub keys_error: Option<String>,
    /// Why this instance forwards nothing, or trusts no owner of some shard
    /// (another set-up on the prefix, an untrusted gate object: SPEC §10).
    pub fence_problems: Vec<String>,
    /// The queued routes and their messages; `None` when no route is queued
    /// (the page then says nothing of queues).
    pub queue: Option<QueuePanel>,
    /// Whether the resolve, retry and drop buttons are shown.
    pub access: Access,
    /// A line about what the viewer just did.
    pub notice: Option<Notice>,
}

fn signed_ms(t: SystemTime, now: SystemTime) -> i128 {
    match t.duration_since(now) {
        Ok(d) => d.as_millis() as i128,
        Err(e) => -(e.duration().as_millis() as i128),
    }
}

/// "in 12 s", "3 min ago", "now": how a person reads a time near now.
pub fn relative(t: SystemTime, now: SystemTime) -> String {
    let ms = signed_ms(t, now);
    let s = ms.abs() / 1000;
    let amount = match s {
        0 => return "now".into(),
        1..=119 => format!("{s} s"),
        120..=7199 => format!("{} min", s / 60),
        7200..=172_799 => format!("{} h", s / 3600),
        _ => format!("{} d", s / 86_400),
    };
    if ms > 0 {
        format!("in {amount}")
    } else {
        format!("{amount} ago")
    }
}

/// A `<time>` element: relative text, the absolute time on hover.
fn time(out: &mut Html, t: SystemTime, now: SystemTime) {
    html!(
        out,
        r#"<time datetime="{0}" title="{0}">{1}</time>"#,
        esc(&rfc3339(t)),
        esc(&relative(t, now))
    );
}

/// Text, or "—" for none.
fn opt(s: &Option<String>) -> Html {
    s.as_deref().map_or_else(|| Html::raw_static("—"), esc)
}

/// Paths wrap only after a slash, never inside a segment.
fn path(p: &str) -> Html {
    Html::join(p.split('/').map(esc), "/<wbr>")
}

/// A path, or "—" for none.
fn opt_path(p: &Option<String>) -> Html {
    p.as_deref().map_or_else(|| Html::raw_static("—"), path)
}

/// A record's state as the page says it (the API's `in_doubt` is "in doubt").
fn state_words(state: &str) -> &'static str {
    match state {
        "in_doubt" => "in doubt",
        "in_flight" => "in flight",
        "done" => "done",
        _ => "unknown",
    }
}

const STYLE: &str = r#"
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1c1e21;background:#f6f7f9}
header{background:#1f2937;color:#fff;padding:.7rem 1rem;display:flex;flex-wrap:wrap;gap:.4rem 1.2rem;align-items:baseline}
header h1{font-size:1.15rem;margin:0}header span{opacity:.85;font-size:.9rem}
main{padding:.5rem 1rem 2rem;max-width:80rem;margin:0 auto}
section{background:#fff;border:1px solid #dde1e6;border-radius:8px;padding:.6rem .9rem;margin:.9rem 0}
h2{font-size:1.05rem;margin:.2rem 0 .5rem}
table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:.35rem .5rem;border-bottom:1px solid #eceef1;vertical-align:top}
th{font-size:.8rem;text-transform:uppercase;letter-spacing:.03em;color:#5b6370}
td.n{font-variant-numeric:tabular-nums}
code{font:13px ui-monospace,SFMono-Regular,Menlo,monospace;word-break:break-all}
code.path{word-break:normal;overflow-wrap:normal}
.ok{color:#137333}.bad{color:#b3261e;font-weight:600}.warn{color:#8a5300}
.notice{background:#e8f0fe;border-color:#aac4f6}.notice.refused{background:#fdecea;border-color:#f1b0aa}.note{color:#5b6370;font-size:.9rem}
h3{font-size:.95rem;margin:.7rem 0 .3rem}
form.inline{display:inline}
details.resolve summary{cursor:pointer;color:#1a56c4}
details.resolve form{margin:.3rem 0}
button{font:inherit;padding:.3rem .7rem;border-radius:6px;border:1px solid #8c96a3;background:#fff;cursor:pointer;margin:.1rem .2rem .1rem 0}
button.del{border-color:#2e7d32;color:#1b5e20}button.nd{border-color:#b3261e;color:#b3261e}
nav a{margin-right:1rem}
input[type=password]{font:inherit;padding:.35rem;width:min(22rem,90%)}
input[type=text]{font:inherit;padding:.25rem;width:min(14rem,40%)}
@media (max-width:700px){
 table,thead,tbody,tr,th,td{display:block}
 thead{display:none}
 tr{border:1px solid #eceef1;border-radius:6px;margin:.5rem 0;padding:.2rem .4rem}
 td{border:none;padding:.15rem .2rem}
 td[data-label]::before{content:attr(data-label) ": ";color:#5b6370;font-size:.8rem}
}
"#;

/// The page's one script: reloads every [`REFRESH_SECS`] — not while the pointer
/// is on the page or a form is open or in use (the countdown starts again when
/// they end) — and asks before a form with `data-confirm` is sent. Allowed by
/// its hash ([`script_hash`]); nothing else may run.
pub const SCRIPT: &str = r#"(function () {
  var every = REFRESH, left = every, over = false;
  var root = document.documentElement, shown = document.getElementById("refresh");
  var target = root.getAttribute("data-reload") || location.href;
  function why() {
    if (document.querySelector("details[open]")) return "a form is open";
    var a = document.activeElement;
    if (a && a.form) return "a form is in use";
    if (over) return "the pointer is on the page";
    return "";
  }
  function tick(step) {
    var w = why();
    if (w) { left = every; shown.textContent = "reload paused: " + w; return; }
    if (step) left -= 1;
    if (left <= 0) { location.replace(target); return; }
    shown.textContent = "reloads in " + left + " s";
  }
  root.addEventListener("mouseenter", function () { over = true; tick(false); });
  root.addEventListener("mousemove", function () { if (!over) { over = true; tick(false); } });
  root.addEventListener("mouseleave", function () { over = false; tick(false); });
  document.addEventListener("toggle", function () { tick(false); }, true);
  document.addEventListener("submit", function (e) {
    var q = e.target.getAttribute("data-confirm"), b = e.submitter;
    if (q && !window.confirm(q.replace("{}", b ? b.textContent : ""))) e.preventDefault();
  });
  setInterval(function () { tick(true); }, 1000);
  tick(false);
})();"#;

/// [`SCRIPT`] as the page embeds it (built once).
fn script() -> &'static str {
    static EMBEDDED: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    EMBEDDED.get_or_init(|| SCRIPT.replace("REFRESH", &REFRESH_SECS.to_string()))
}

/// `'sha256-…'` of the embedded script, for the page's Content-Security-Policy.
pub fn script_hash() -> String {
    use base64::Engine as _;
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(script().as_bytes());
    format!(
        "'sha256-{}'",
        base64::engine::general_purpose::STANDARD.encode(digest)
    )
}

/// `refresh`: reload every [`REFRESH_SECS`], at `Some(url)` or in place (by the
/// script, or a meta refresh without script).
fn head(out: &mut Html, title: &str, refresh: Option<Option<&str>>) {
    out.push_static("<!doctype html>\n<html lang=\"en\"");
    if let Some(Some(url)) = refresh {
        html!(out, " data-reload=\"{}\"", esc(url));
    }
    out.push_static("><head><meta charset=\"utf-8\">");
    out.push_static("<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">");
    match refresh {
        Some(None) => html!(
            out,
            "<noscript><meta http-equiv=\"refresh\" content=\"{}\"></noscript>",
            REFRESH_SECS
        ),
        Some(Some(url)) => html!(
            out,
            "<noscript><meta http-equiv=\"refresh\" content=\"{}; url={}\"></noscript>",
            REFRESH_SECS,
            esc(url)
        ),
        None => {}
    }
    html!(
        out,
        "<title>{}</title><style>{}</style></head><body>",
        esc(title),
        Html::raw_static(STYLE)
    );
}

/// The page.
pub fn render(v: &PageView) -> Html {
    let mut out = Html::with_capacity(16 * 1024 + 400 * (v.leases.len() + v.keys.len()));
    // After a resolve, the reload drops the notice.
    head(&mut out, "fencegate", Some(v.notice.as_ref().map(|_| "/")));
    html!(
        out,
        r#"<header><h1>fencegate</h1><span>instance <code>{}</code></span><span>version {}</span><span id="refresh" role="status">reloads every {} s</span>"#,
        esc(&v.instance),
        esc(v.version),
        REFRESH_SECS
    );
    if let Access::Resolve { csrf } = &v.access {
        html!(
            out,
            r#"<form class="inline" method="post" action="/logout"><input type="hidden" name="csrf" value="{}"><button>log out</button></form>"#,
            esc(csrf)
        );
    }
    out.push_static("</header><main>");
    if let Some(n) = &v.notice {
        if n.refused {
            html!(
                out,
                r#"<section class="notice refused" role="alert">{}</section>"#,
                esc(&n.text)
            );
        } else {
            html!(
                out,
                r#"<section class="notice" role="status">{}</section>"#,
                esc(&n.text)
            );
        }
    }
    if let Some(d) = &v.detail {
        detail_section(&mut out, v, d);
    }
    store_section(&mut out, v);
    keys_section(&mut out, v);
    if let Some(q) = &v.queue {
        queue_section(&mut out, v, q);
    }
    leases_section(&mut out, v);
    routes_section(&mut out, v);
    members_section(&mut out, v);
    shards_section(&mut out, v);
    html!(
        out,
        "</main><script>{}</script></body></html>\n",
        Html::raw_static(script())
    );
    out
}

fn store_section(out: &mut Html, v: &PageView) {
    let h = &v.health;
    html!(
        out,
        r#"<section id="store"><h2>Store</h2><table><tbody><tr><th>lease store</th><td><code class="path">{}</code> {}</td></tr><tr><th>clock offset</th><td class="n" title="the store's clock minus this machine's (upper end of the estimate)">{:+} ms</td></tr><tr><th>state</th><td>{}</td></tr></tbody></table></section>"#,
        path(&h.store),
        if h.leases_failing == 0 {
            Html::raw_static(r#"<span class="ok">reachable</span>"#)
        } else {
            html!(
                r#"<span class="bad">last call failed for {} lease(s)</span>"#,
                h.leases_failing
            )
        },
        h.clock_offset_ms,
        Html::raw_static(if h.state_ok {
            r#"<span class="ok">writing</span>"#
        } else {
            r#"<span class="bad">the last write failed</span>"#
        }),
    );
}

/// The link to a key's detail view.
fn detail_href(route: &str, key: &str) -> Html {
    html!(
        "/?detail=1&amp;route={}&amp;key={}#key",
        esc(&form::encode(route)),
        esc(&form::encode(key))
    )
}

/// The two resolve buttons, behind a disclosure and a confirmation.
fn resolve_form(out: &mut Html, route: &str, key: &str, csrf: &str) {
    html!(
        out,
        r#"<details class="resolve"><summary>resolve…</summary><form method="post" action="/v1/dedup/{}/{}/resolve" data-confirm="Resolve {} / {} as {{}}? Only if you have checked the destination."><input type="hidden" name="csrf" value="{}"><p class="note">Checked the destination? Resolve <code>{}</code> as:</p><button class="del" name="outcome" value="delivered">delivered</button><button class="nd" name="outcome" value="not_delivered">not delivered</button></form></details>"#,
        esc(&form::encode(route)),
        esc(&form::encode(key)),
        esc(route),
        esc(key),
        esc(csrf),
        esc(key)
    );
}

/// What the destination answered, as the detail view says it.
fn answered(r: &KeyRecord) -> Html {
    match (r.state, r.status, r.body_bytes) {
        (_, Some(s), Some(n)) => {
            html!(
                "HTTP {}, body stored ({} bytes): a retry gets it replayed",
                s,
                n
            )
        }
        (_, Some(s), None) => {
            html!(
                "HTTP {}, body not stored (too large): a retry gets 409 dedup_done",
                s
            )
        }
        ("done", None, _) => Html::raw_static("not recorded: resolved as delivered by an operator"),
        ("in_doubt", None, _) => Html::raw_static(
            "nothing fencegate saw: the request timed out, was aborted, \
            or its connection failed after it was sent",
        ),
        _ => Html::raw_static("nothing yet: the request is still at the destination"),
    }
}

fn detail_section(out: &mut Html, v: &PageView, d: &KeyDetail) {
    html!(
        out,
        r#"<section id="key"><h2>Key <code>{}</code> of route <code>{}</code></h2>"#,
        esc(&d.key),
        esc(&d.route)
    );
    match &d.record {
        Err(why) => html!(out, r#"<p class="bad" role="alert">{}</p>"#, esc(why)),
        Ok(r) => {
            html!(
                out,
                r#"<table><tbody><tr><th>state</th><td class="state">{}</td></tr><tr><th>request</th><td><code class="path">{} {}</code></td></tr><tr><th>lease, epoch</th><td><code>{}</code>, epoch {}</td></tr><tr><th>first claimed</th><td>"#,
                Html::raw_static(state_words(r.state)),
                opt(&r.method),
                opt_path(&r.path),
                opt(&r.lease),
                r.epoch
            );
            time(out, r.created, v.now);
            out.push_static("</td></tr><tr><th>last change</th><td>");
            time(out, r.updated, v.now);
            html!(
                out,
                r#"</td></tr><tr><th>destination answered</th><td class="answer">{}</td></tr></tbody></table>"#,
                answered(r)
            );
            if let (Access::Resolve { csrf }, "in_doubt") = (&v.access, r.state) {
                resolve_form(out, &d.route, &d.key, csrf);
            }
        }
    }
    out.push_static(r#"<p><a href="/">Back to the page</a></p></section>"#);
}

fn keys_section(out: &mut Html, v: &PageView) {
    html!(
        out,
        r#"<section id="in-doubt"><h2>In-doubt keys <span class="note">({} in all, oldest first)</span></h2>"#,
        v.keys_total
    );
    match &v.access {
        Access::ReadOnly => out.push_static(
            r#"<p class="note">Read-only: resolving needs an admin token. Set <code>admin_token</code> in <code>[server]</code> (or <code>FENCEGATE_ADMIN_TOKEN</code>) and restart, then log in here.</p>"#,
        ),
        Access::Resolve { .. } => out.push_static(
            r#"<p class="note">Check the destination first. <b>delivered</b>: retries get 409 dedup_done. <b>not delivered</b>: the key is forgotten and the next retry is forwarded.</p>"#,
        ),
    }
    if let Some(e) = &v.keys_error {
        html!(
            out,
            r#"<p class="bad" role="alert">The state store did not answer: {}</p>"#,
            esc(e)
        );
    } else if v.keys.is_empty() {
        out.push_static(r#"<p class="ok">Nothing to resolve.</p>"#);
    } else {
        out.push_static("<table><thead><tr><th>route</th><th>key</th><th>epoch</th><th>when</th><th>request</th>");
        if matches!(v.access, Access::Resolve { .. }) {
            out.push_static("<th>resolve</th>");
        }
        out.push_static("</tr></thead><tbody>");
        for k in &v.keys {
            html!(
                out,
                r#"<tr class="key"><td data-label="route">{}</td><td data-label="key"><a href="{}" title="details"><code>{}</code></a></td><td data-label="epoch" class="n">{}</td><td data-label="when">"#,
                esc(&k.route),
                detail_href(&k.route, &k.key),
                esc(&k.key),
                k.epoch
            );
            time(out, k.created, v.now);
            if k.updated != k.created {
                out.push_static(r#" <span class="note">(in doubt "#);
                time(out, k.updated, v.now);
                out.push_static(")</span>");
            }
            html!(
                out,
                r#"</td><td data-label="request"><code class="path">{} {}</code></td>"#,
                opt(&k.method),
                opt_path(&k.path)
            );
            if let Access::Resolve { csrf } = &v.access {
                out.push_static(r#"<td data-label="resolve">"#);
                resolve_form(out, &k.route, &k.key, csrf);
                out.push_static("</td>");
            }
            out.push_static("</tr>");
        }
        out.push_static("</tbody></table>");
    }
    out.push_static("<nav>");
    if v.keys_paged {
        out.push_static(r##"<a href="/#in-doubt">« oldest</a>"##);
    }
    if let Some(next) = &v.keys_next {
        html!(
            out,
            r##"<a href="/?after={}#in-doubt">newer »</a>"##,
            esc(&form::encode(next))
        );
    }
    out.push_static(r#"</nav><form class="lookup" method="get" action="/"><input type="hidden" name="detail" value="1"><label>Look up a key: <input type="text" name="route" placeholder="route" required></label> <input type="text" name="key" placeholder="key" required aria-label="key"> <button>show</button></form></section>"#);
}

/// A queued message's Retry and Drop buttons, each a form with a confirmation.
fn message_forms(out: &mut Html, m: &MessageRow, csrf: &str) {
    let (route, key) = (esc(&form::encode(&m.route)), esc(&form::encode(&m.key)));
    html!(
        out,
        r#"<form class="inline" method="post" action="/v1/deliveries/{0}/{1}/retry" data-confirm="Retry {2} / {3}?"><input type="hidden" name="csrf" value="{4}"><button class="del">Retry</button></form><form class="inline" method="post" action="/v1/deliveries/{0}/{1}/drop" data-confirm="Drop {2} / {3}? It will not be delivered; the messages behind it go on."><input type="hidden" name="csrf" value="{4}"><button class="nd">Drop</button></form>"#,
        route,
        key,
        esc(&m.route),
        esc(&m.key),
        esc(csrf)
    );
}

/// Queued delivery (SPEC §11): each queued route's depth and oldest pending
/// message, then its messages not delivered, with Retry and Drop.
fn queue_section(out: &mut Html, v: &PageView, q: &QueuePanel) {
    html!(
        out,
        r#"<section id="queued"><h2>Queued delivery <span class="note">({} route(s), {} message(s) not delivered)</span></h2>"#,
        q.routes.len(),
        q.messages_total
    );
    match &v.access {
        Access::ReadOnly => out.push_static(
            r#"<p class="note">Read-only: retrying and dropping need an admin token.</p>"#,
        ),
        Access::Resolve { .. } => out.push_static(
            r#"<p class="note"><b>Retry</b>: a pending message is due now; a failed one goes back to the end of its lease's queue (refused when a newer epoch's message of its lease was sent or waits: it would arrive after it). <b>Drop</b>: the message is not delivered; the ones behind it go on.</p>"#,
        ),
    }
    if let Some(e) = &q.error {
        html!(
            out,
            r#"<p class="bad" role="alert">The queue could not be read: {}</p></section>"#,
            esc(e)
        );
        return;
    }
    out.push_static("<table><thead><tr><th>route</th><th>lease</th><th>depth</th><th>failed</th><th>oldest pending</th></tr></thead><tbody>");
    for r in &q.routes {
        html!(
            out,
            r#"<tr class="queue"><td data-label="route"><code>{}</code></td><td data-label="lease"><code>{}</code></td><td data-label="depth" class="n" title="not settled: pending or being delivered">{}</td><td data-label="failed" class="n">{}</td><td data-label="oldest pending">"#,
            esc(&r.route),
            esc(&r.lease),
            r.depth,
            if r.failed > 0 {
                html!(r#"<span class="bad">{}</span>"#, r.failed)
            } else {
                html!("{}", r.failed)
            }
        );
        match r.oldest {
            Some(t) => time(out, t, v.now),
            None => out.push_static("—"),
        }
        out.push_static("</td></tr>");
    }
    out.push_static("</tbody></table>");
    if q.messages.is_empty() {
        out.push_static(if q.offset == 0 {
            r#"<p class="ok">No message waits or failed.</p></section>"#
        } else {
            r##"<p class="note">No messages on this page. <a href="/#queued">« first page</a></p></section>"##
        });
        return;
    }
    out.push_static("<h3>Messages not delivered <span class=\"note\">(failed first)</span></h3><table><thead><tr><th>route</th><th>key</th><th>lease</th><th>epoch</th><th>seq</th><th>status</th><th>attempts</th><th>last status</th><th>last error</th><th>next attempt</th>");
    let actions = match &v.access {
        Access::Resolve { csrf } => Some(csrf.as_str()),
        Access::ReadOnly => None,
    };
    if actions.is_some() {
        out.push_static("<th>action</th>");
    }
    out.push_static("</tr></thead><tbody>");
    for m in &q.messages {
        html!(
            out,
            r#"<tr class="message"><td data-label="route"><code>{}</code></td><td data-label="key"><code>{}</code></td><td data-label="lease"><code>{}</code></td><td data-label="epoch" class="n">{}</td><td data-label="seq" class="n">{}</td><td data-label="status" class="status">{}</td><td data-label="attempts" class="n">{}</td><td data-label="last status" class="n">{}</td><td data-label="last error" class="error">{}</td><td data-label="next attempt">"#,
            esc(&m.route),
            esc(&m.key),
            esc(&m.lease),
            m.epoch,
            m.seq,
            match m.status {
                "failed" => Html::raw_static(r#"<span class="bad">failed</span>"#),
                "delivering" => Html::raw_static(r#"<span class="warn">delivering</span>"#),
                other => esc(other),
            },
            m.attempts,
            m.last_status
                .map_or(Html::raw_static("—"), |s| html!("{}", s)),
            opt(&m.last_error)
        );
        match m.next_attempt {
            Some(t) if signed_ms(t, v.now) > 0 => time(out, t, v.now),
            Some(t) => html!(out, r#"<span title="{}">due</span>"#, esc(&rfc3339(t))),
            None => out.push_static("—"),
        }
        out.push_static("</td>");
        if let Some(csrf) = actions {
            out.push_static(r#"<td data-label="action">"#);
            if m.status == "pending" || m.status == "failed" {
                message_forms(out, m, csrf);
            }
            out.push_static("</td>");
        }
        out.push_static("</tr>");
    }
    out.push_static("</tbody></table><nav>");
    if q.offset > 0 {
        html!(
            out,
            r##"<a href="/?queued={}#queued">« previous</a>"##,
            q.offset.saturating_sub(MESSAGES_PER_PAGE)
        );
    }
    let shown_to = q.offset + q.messages.len();
    if (shown_to as u64) < q.messages_total {
        html!(
            out,
            r#"<span class="note">{}–{} of {}</span> "#,
            q.offset + 1,
            shown_to,
            q.messages_total
        );
        if shown_to < MESSAGES_PER_PAGE * MESSAGE_PAGES {
            html!(
                out,
                r##"<a href="/?queued={}#queued">next »</a>"##,
                shown_to
            );
        } else {
            out.push_static(r#"<span class="note">the rest: <code>GET /v1/deliveries?route=R&amp;status=S</code></span>"#);
        }
    }
    out.push_static("</nav></section>");
}

fn leases_section(out: &mut Html, v: &PageView) {
    match v.relayed {
        None => html!(
            out,
            r#"<section id="leases"><h2>Leases <span class="note">({} in all)</span></h2>"#,
            v.leases_total
        ),
        Some(relayed) => html!(
            out,
            r#"<section id="leases"><h2>Leases served here <span class="note">({})</span></h2><p class="note relayed">{} This instance relayed {} request(s) to their shard's owner since it started; the shard map names the instance that serves each lease.</p>"#,
            v.leases_total,
            Html::raw_static(if v.leases_total == 0 {
                "This instance owns no shard now: it serves no lease itself, and relays every request to the owner of the lease's shard."
            } else {
                "The leases of the shards this instance owns; requests for the others are relayed to their owners."
            }),
            relayed
        ),
    }
    if v.leases.is_empty() {
        if v.relayed.is_none() {
            out.push_static(r#"<p class="note">No leases on this page.</p>"#);
        }
    } else {
        out.push_static("<table><thead><tr><th>lease</th><th>mark</th><th>latest epoch</th><th>holder</th><th>time left</th><th>in flight</th><th>drains</th></tr></thead><tbody>");
        for l in &v.leases {
            lease_row(out, v, l);
        }
        out.push_static("</tbody></table>");
    }
    out.push_static("<nav>");
    if v.leases_offset > 0 {
        html!(
            out,
            r##"<a href="/?leases={}#leases">« previous</a>"##,
            v.leases_offset.saturating_sub(LEASES_PER_PAGE)
        );
    }
    let shown_to = v.leases_offset + v.leases.len();
    if shown_to < v.leases_total {
        html!(
            out,
            r##"<span class="note">{}–{} of {}</span> <a href="/?leases={1}#leases">next »</a>"##,
            v.leases_offset + 1,
            shown_to,
            v.leases_total
        );
    }
    out.push_static("</nav></section>");
}

/// An expiry on the store's clock: "in 12 s", or "expired 45 min ago" (never
/// "time left: 45 min ago").
fn expiry(out: &mut Html, t: SystemTime, store_now: SystemTime) {
    if signed_ms(t, store_now) <= 0 {
        out.push_static(r#"<span class="bad">expired "#);
    } else {
        out.push_static(r#"<span class="ok">"#);
    }
    time(out, t, store_now);
    out.push_static("</span>");
}

fn lease_row(out: &mut Html, v: &PageView, l: &LeaseRow) {
    let raised = Html::raw_static(if l.latest > l.mark {
        r#" <span class="warn" title="a newer epoch exists than any request has carried">(newer known)</span>"#
    } else {
        ""
    });
    html!(
        out,
        r#"<tr class="lease"><td data-label="lease"><code>{}</code></td><td data-label="mark" class="n">{}</td><td data-label="latest epoch" class="n">{}{}</td><td data-label="holder">{}</td><td data-label="time left">"#,
        esc(&l.lease),
        l.mark,
        l.latest,
        raised,
        opt(&l.holder)
    );
    match l.expires_at {
        Some(t) => expiry(out, t, v.store_now),
        None => out.push_static("—"),
    }
    if let Some(e) = &l.store_error {
        html!(
            out,
            r#" <span class="bad" title="{}">store error</span>"#,
            esc(e)
        );
    }
    html!(
        out,
        r#"</td><td data-label="in flight" class="n">{}{}</td><td data-label="drains" class="n">{} started, {} aborted</td></tr>"#,
        l.in_flight,
        if l.in_doubt > 0 {
            html!(
                r#" <span class="warn" title="outcome unknown: still counted by a drain">({} in doubt)</span>"#,
                l.in_doubt
            )
        } else {
            Html::new()
        },
        l.drains_started,
        l.drains_aborted
    );
}

/// Whole seconds, rounded up: how long a hold or a cool-down still runs.
fn secs(d: std::time::Duration) -> u128 {
    d.as_millis().div_ceil(1000)
}

/// Each route's protection of its destination (SPEC §9): requests in flight
/// against `max_in_flight`, a `Retry-After` hold, the circuit breaker.
fn routes_section(out: &mut Html, v: &PageView) {
    html!(
        out,
        r#"<section id="routes"><h2>Routes <span class="note">({} in all; protecting the destination)</span></h2>"#,
        v.routes_total
    );
    out.push_static("<table><thead><tr><th>route</th><th>upstream</th><th>in flight</th><th>held</th><th>breaker</th><th>refused</th></tr></thead><tbody>");
    for r in &v.routes {
        let limit = r.max_in_flight.map_or(Html::new(), |m| html!(" of {}", m));
        let full = Html::raw_static(if r.max_in_flight.is_some_and(|m| r.in_flight >= m) {
            r#" <span class="warn">(full)</span>"#
        } else {
            ""
        });
        let held = match r.held_for {
            Some(d) => html!(
                r#"<span class="bad">for {} s</span> <span class="note">(upstream's Retry-After)</span>"#,
                secs(d)
            ),
            None => Html::raw_static("—"),
        };
        let breaker = match r.breaker {
            None => Html::raw_static("—"),
            Some(("closed", _)) => Html::raw_static(r#"<span class="ok">closed</span>"#),
            Some(("open", Some(d))) => {
                html!(r#"<span class="bad">open</span> (probes in {} s)"#, secs(d))
            }
            Some((state, _)) => html!(
                r#"<span class="warn">{}</span> (one probe at a time)"#,
                esc(&state.replace('_', "-"))
            ),
        };
        html!(
            out,
            r#"<tr class="route"><td data-label="route"><code>{}</code></td><td data-label="upstream"><code class="path">{}</code></td><td data-label="in flight" class="n">{}{}{}</td><td data-label="held">{}</td><td data-label="breaker">{}</td><td data-label="refused" class="n">{}</td></tr>"#,
            esc(&r.route),
            path(&r.upstream),
            r.in_flight,
            limit,
            full,
            held,
            breaker,
            r.refused
        );
    }
    out.push_static("</tbody></table>");
    if v.routes.len() < v.routes_total {
        html!(
            out,
            r#"<p class="note">{} of {} routes shown, the held and open ones first; <code>GET /v1/routes</code> lists them all.</p>"#,
            v.routes.len(),
            v.routes_total
        );
    }
    out.push_static("</section>");
}

fn members_section(out: &mut Html, v: &PageView) {
    let alive = v.members.iter().filter(|m| m.alive).count();
    html!(
        out,
        r#"<section id="members"><h2>Members <span class="note">({} alive, {} gone)</span></h2><table><thead><tr><th>instance</th><th>state</th><th>shards</th></tr></thead><tbody>"#,
        alive,
        v.members.len() - alive
    );
    for m in &v.members {
        html!(
            out,
            r#"<tr class="member"><td data-label="instance"><code>{}</code>{}</td><td data-label="state">"#,
            esc(&m.id),
            Html::raw_static(if m.this_instance {
                " (this instance)"
            } else {
                ""
            })
        );
        if m.alive {
            out.push_static(r#"<span class="ok">alive</span>"#);
        } else {
            out.push_static(r#"<span class="bad">gone</span>"#);
            if let Some(t) = m.last_seen {
                out.push_static(r#" <span class="note">(last seen "#);
                time(out, t, v.now);
                out.push_static(")</span>");
            }
        }
        html!(
            out,
            r#"</td><td data-label="shards" class="n">{}</td></tr>"#,
            if m.shards.is_empty() {
                Html::raw_static("—")
            } else {
                Html::join(m.shards.iter().map(|s| html!("{}", s)), ", ")
            }
        );
    }
    out.push_static("</tbody></table></section>");
}

fn shards_section(out: &mut Html, v: &PageView) {
    out.push_static(r#"<section id="shards"><h2>Shard map</h2>"#);
    for p in &v.fence_problems {
        html!(out, r#"<p class="bad" role="alert">{}</p>"#, esc(p));
    }
    out.push_static(r#"<table><thead><tr><th>shard</th><th>owner</th><th>leases</th><th>tenure</th><th>expires</th><th>here</th></tr></thead><tbody>"#);
    for s in &v.shards {
        let mut leases: Vec<Html> = s
            .leases
            .iter()
            .take(SHARD_LEASES_SHOWN)
            .map(|l| html!("<code>{}</code>", esc(l)))
            .collect();
        if s.leases.len() > SHARD_LEASES_SHOWN {
            leases.push(html!(
                r#"<span class="note">and {} more</span>"#,
                s.leases.len() - SHARD_LEASES_SHOWN
            ));
        }
        html!(
            out,
            r#"<tr class="shard"><td data-label="shard" class="n">{} of {}</td><td data-label="owner"><code>{}</code></td><td data-label="leases" class="leases">{}</td><td data-label="tenure" class="n">{}</td><td data-label="expires">"#,
            s.shard,
            s.shards,
            opt(&s.owner),
            if leases.is_empty() {
                Html::raw_static("—")
            } else {
                Html::join(leases, " ")
            },
            match s.tenure {
                None => Html::raw_static("—"),
                Some(Tenure::Generation(g)) => html!("generation {}", g),
                Some(Tenure::GuardEpoch(e)) => html!("guard epoch {}", e),
            }
        );
        match s.expires_at {
            Some(t) => expiry(out, t, v.store_now),
            None => out.push_static("—"),
        }
        html!(
            out,
            r#"</td><td data-label="here">{}</td></tr>"#,
            Html::raw_static(match (s.this_instance, s.serving) {
                (true, true) => r#"<span class="ok">this instance, serving</span>"#,
                (true, false) => r#"<span class="bad">this instance, not serving</span>"#,
                (false, _) => "another instance",
            })
        );
    }
    out.push_static("</tbody></table></section>");
}

/// The login form (the admin token is configured and the browser has no session).
pub fn render_login(message: Option<&str>) -> Html {
    let mut out = Html::with_capacity(4096);
    head(&mut out, "fencegate: log in", None);
    out.push_static("<header><h1>fencegate</h1></header><main><section><h2>Log in</h2>");
    if let Some(m) = message {
        html!(out, r#"<p class="bad" role="alert">{}</p>"#, esc(m));
    }
    out.push_static(r#"<form method="post" action="/login"><p><label>Admin token<br><input type="password" name="token" autocomplete="current-password" autofocus required></label></p><p><button>log in</button></p></form><p class="note">The token is the <code>admin_token</code> of <code>[server]</code> (or <code>FENCEGATE_ADMIN_TOKEN</code>). It is sent once; the browser keeps a session cookie for this listener until it closes or fencegate restarts.</p></section></main></body></html>
"#);
    out
}

/// A short page for an action that failed.
pub fn render_message(title: &str, message: &str) -> Html {
    let mut out = Html::with_capacity(2048);
    head(&mut out, title, None);
    html!(
        out,
        "<header><h1>fencegate</h1></header><main><section><h2>{}</h2><p>{}</p><p><a href=\"/\">Back to the page</a></p></section></main></body></html>\n",
        esc(title),
        esc(message)
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// The page as text.
    fn render(v: &PageView) -> String {
        super::render(v).into_string()
    }

    fn view() -> PageView {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        PageView {
            instance: "fg-1".into(),
            version: "0.0.0",
            now,
            store_now: now,
            health: StoreHealth {
                store: "dir store at /x".into(),
                clock_offset_ms: -1200,
                state_ok: true,
                leases_failing: 0,
            },
            leases: vec![LeaseRow {
                lease: "billing".into(),
                mark: 4,
                latest: 6,
                holder: Some("<w>".into()),
                expires_at: Some(now - Duration::from_secs(3)),
                in_flight: 2,
                in_doubt: 0,
                drains_started: 1,
                drains_aborted: 0,
                store_error: Some("store \"down\"".into()),
            }],
            leases_total: 250,
            leases_offset: 100,
            routes: vec![RouteRow {
                route: "billing".into(),
                upstream: "http://up:8/v1/".into(),
                in_flight: 3,
                max_in_flight: Some(3),
                held_for: Some(Duration::from_millis(4200)),
                breaker: Some(("open", Some(Duration::from_millis(1500)))),
                refused: 7,
            }],
            routes_total: 1,
            shards: vec![],
            members: vec![],
            relayed: None,
            detail: None,
            keys: vec![],
            keys_total: 0,
            keys_next: None,
            keys_paged: false,
            keys_error: None,
            fence_problems: vec![],
            queue: None,
            access: Access::ReadOnly,
            notice: None,
        }
    }

    #[test]
    fn a_route_row_says_it_is_full_held_and_open() {
        let html = render(&view());
        let row = &html[html.find(r#"<tr class="route">"#).unwrap()..];
        let row = &row[..row.find("</tr>").unwrap()];
        for want in [
            "<code>billing</code>",
            "3 of 3",
            "(full)",
            "for 5 s",
            "Retry-After",
            "open</span> (probes in 2 s)",
            ">7<",
        ] {
            assert!(row.contains(want), "{want}: {row}");
        }
    }

    #[test]
    fn a_lease_row_says_what_is_wrong_and_pages_link_both_ways() {
        let html = render(&view());
        assert!(html.contains("-1200 ms"), "{html}");
        assert!(
            html.contains(r#"class="n">6 <span class="warn""#),
            "newer epoch flagged"
        );
        assert!(html.contains("&lt;w&gt;") && !html.contains("<w>"));
        // Expired: said so, never "time left: 3 s ago".
        assert!(
            html.contains(r#"<span class="bad">expired <time"#) && html.contains(">3 s ago</time>")
        );
        assert!(
            html.contains(r#"title="store &quot;down&quot;">store error"#),
            "{html}"
        );
        assert!(html.contains(r#"href="/?leases=0#leases">« previous"#));
        assert!(
            html.contains(r#"101–101 of 250"#) && html.contains(r#"href="/?leases=101#leases""#)
        );
        assert!(html.contains("Nothing to resolve."));
    }

    #[test]
    fn a_state_store_that_does_not_answer_is_shown_not_a_failed_page() {
        let html = render(&PageView {
            keys_error: Some("state write failed: <timeout>".into()),
            ..view()
        });
        assert!(html.contains(r#"role="alert">The state store did not answer: state write failed: &lt;timeout&gt;"#), "{html}");
        assert!(!html.contains("Nothing to resolve."));
    }

    /// A cluster's map: one row per shard, with its owner, its tenure (the owner
    /// row's generation) and when that ends, and whether this instance serves it
    /// (an owned shard past its self-fence window shows as not serving); a
    /// single instance's one shard shows its guard's epoch.
    #[test]
    fn the_shard_map_shows_each_shard_its_owner_and_who_serves_it() {
        let v = view();
        let in_8s = v.store_now + Duration::from_secs(8);
        let row = |shard, owner: Option<&str>, this_instance, serving| ShardRow {
            shard,
            shards: 3,
            owner: owner.map(str::to_owned),
            tenure: owner.map(|_| Tenure::Generation(40 + u64::from(shard))),
            expires_at: owner.map(|_| in_8s),
            this_instance,
            serving,
            leases: vec![format!("lease-{shard}")],
        };
        let html = render(&PageView {
            shards: vec![
                row(0, Some("fg-1"), true, true),
                row(1, Some("fg-2"), false, false),
                row(2, None, false, false),
            ],
            ..v
        });
        let rows: Vec<&str> = html.split(r#"<tr class="shard">"#).skip(1).collect();
        assert_eq!(rows.len(), 3, "{html}");
        assert!(rows[0].contains(">0 of 3<") && rows[0].contains("<code>fg-1</code>"));
        assert!(html.contains("<th>tenure</th><th>expires</th>"), "{html}");
        assert!(
            rows[0].contains(r#"data-label="tenure" class="n">generation 40<"#)
                && rows[0].contains(">in 8 s</time>"),
            "{}",
            rows[0]
        );
        assert!(rows[0].contains("this instance, serving"), "{}", rows[0]);
        // Each shard names its leases.
        assert!(
            rows[1].contains(r#"class="leases"><code>lease-1</code>"#),
            "{}",
            rows[1]
        );
        assert!(rows[1].contains("<code>fg-2</code>") && rows[1].contains("another instance"));
        assert!(
            rows[2].contains(">2 of 3<") && rows[2].contains(">—<"),
            "{}",
            rows[2]
        );
        let stalled = render(&PageView {
            shards: vec![row(0, Some("fg-1"), true, false)],
            ..view()
        });
        assert!(stalled.contains(r#"<span class="bad">this instance, not serving</span>"#));
        let single = render(&PageView {
            shards: vec![ShardRow {
                shards: 1,
                tenure: Some(Tenure::GuardEpoch(7)),
                ..row(0, Some("fg-1"), true, true)
            }],
            ..view()
        });
        assert!(
            single.contains(r#"data-label="tenure" class="n">guard epoch 7<"#),
            "{single}"
        );
    }

    /// Another set-up on the prefix, or an untrusted gate object, is said above
    /// the shard map (SPEC §10).
    #[test]
    fn the_shard_map_says_why_nothing_is_forwarded() {
        let html = render(&PageView {
            fence_problems: vec![
                "forwarding stopped: a single instance <x> uses this prefix".into()
            ],
            ..view()
        });
        assert!(
            html.contains(r#"<p class="bad" role="alert">forwarding stopped: a single instance &lt;x&gt; uses this prefix</p>"#),
            "{html}"
        );
    }

    /// Issue 32: an instance of a cluster that owns no shard says it relays (not
    /// a bare "Leases (0 in all)"); a member that stopped is shown gone with
    /// when it was last seen; a lease's in-doubt requests are "in doubt" (not
    /// "lingering"); paths wrap at slashes only.
    #[test]
    fn a_cluster_member_that_relays_says_so_and_a_gone_member_stays_listed() {
        let v = view();
        let html = render(&PageView {
            leases: vec![],
            leases_total: 0,
            leases_offset: 0,
            relayed: Some(7),
            members: vec![
                MemberRow {
                    id: "fg-a".into(),
                    alive: true,
                    last_seen: Some(v.now),
                    this_instance: true,
                    shards: vec![],
                },
                MemberRow {
                    id: "fg-b".into(),
                    alive: false,
                    last_seen: Some(v.now - std::time::Duration::from_secs(90)),
                    this_instance: false,
                    shards: vec![0, 2],
                },
            ],
            ..v.clone()
        });
        assert!(html.contains("Leases served here"), "{html}");
        assert!(html.contains("owns no shard now") && html.contains("relayed 7 request(s)"));
        assert!(!html.contains("No leases on this page."));
        assert!(html.contains("(1 alive, 1 gone)"), "{html}");
        let gone = html.split(r#"<tr class="member">"#).nth(2).unwrap();
        assert!(
            gone.contains("<code>fg-b</code>")
                && gone.contains(r#"<span class="bad">gone</span>"#)
                && gone.contains(">90 s ago</time>")
                && gone.contains(">0, 2<"),
            "{gone}"
        );
        let doubt = render(&PageView {
            leases: vec![LeaseRow {
                in_doubt: 2,
                ..v.leases[0].clone()
            }],
            keys: vec![KeyRow {
                route: "billing".into(),
                key: "k/1".into(),
                epoch: 3,
                created: v.now,
                updated: v.now,
                method: Some("POST".into()),
                path: Some("/billing/charges/settlements".into()),
            }],
            keys_total: 1,
            access: Access::Resolve { csrf: "c".into() },
            ..v
        });
        assert!(doubt.contains("(2 in doubt)") && !doubt.contains("lingering"));
        assert!(
            doubt.contains(
                r#"<code class="path">POST /<wbr>billing/<wbr>charges/<wbr>settlements</code>"#
            ),
            "{doubt}"
        );
        // Resolving takes a disclosure and a confirmation; the key links to its view.
        assert!(doubt.contains(r#"<details class="resolve"><summary>resolve…</summary>"#));
        assert!(doubt.contains(r#"data-confirm="Resolve billing / k/1 as {}? Only if you have checked the destination.""#), "{doubt}");
        assert!(doubt.contains(r#"href="/?detail=1&amp;route=billing&amp;key=k%2F1#key""#));
    }

    /// A key's detail view: the request, its lease and epoch, and what the
    /// destination answered.
    #[test]
    fn a_key_detail_says_what_the_destination_answered() {
        let v = view();
        let record = |state, status, body_bytes| KeyRecord {
            state,
            lease: Some("billing".into()),
            epoch: 9,
            created: v.now,
            updated: v.now,
            method: Some("POST".into()),
            path: Some("/billing/charges".into()),
            status,
            body_bytes,
        };
        let page = |r: Result<KeyRecord, String>| {
            render(&PageView {
                detail: Some(KeyDetail {
                    route: "billing".into(),
                    key: "order-9".into(),
                    record: r,
                }),
                ..view()
            })
        };
        let done = page(Ok(record("done", Some(201), Some(12))));
        assert!(
            done.contains(
                r#"<section id="key"><h2>Key <code>order-9</code> of route <code>billing</code>"#
            ),
            "{done}"
        );
        assert!(done.contains(r#"<td class="state">done</td>"#));
        assert!(done.contains("<code>billing</code>, epoch 9"));
        assert!(done.contains("HTTP 201, body stored (12 bytes)"));
        let doubt = page(Ok(record("in_doubt", None, None)));
        assert!(doubt.contains(r#"<td class="state">in doubt</td>"#));
        assert!(doubt.contains("timed out, was aborted"));
        assert!(page(Err("no record for that key".into()))
            .contains(r#"role="alert">no record for that key"#));
    }

    /// SPEC §11 on the page: each queued route's depth and oldest pending
    /// message; the messages not delivered with what came of their last
    /// attempt, everything escaped; Retry and Drop for a pending or failed one
    /// (for a logged-in operator only); nothing of queues when none is queued.
    #[test]
    fn the_queue_panel_lists_messages_escaped_with_retry_and_drop() {
        let v = view();
        let row = |key: &str, status, last_error: Option<&str>| MessageRow {
            route: "hook".into(),
            key: key.into(),
            lease: "hook".into(),
            epoch: 3,
            seq: 7,
            status,
            attempts: 4,
            last_status: last_error.map(|_| 400),
            last_error: last_error.map(str::to_owned),
            next_attempt: (status == "pending").then(|| v.now + Duration::from_secs(30)),
        };
        let panel = QueuePanel {
            routes: vec![QueueRoute {
                route: "hook".into(),
                lease: "hook".into(),
                depth: 2,
                failed: 1,
                oldest: Some(v.now - Duration::from_secs(300)),
            }],
            messages: vec![
                row(
                    "<script>alert(1)</script>",
                    "failed",
                    Some("the destination refused it (400): <b>no</b>"),
                ),
                row("m-2", "delivering", None),
                row("m/3", "pending", None),
            ],
            messages_total: 3,
            offset: 0,
            error: None,
        };
        let html = render(&PageView {
            queue: Some(panel.clone()),
            access: Access::Resolve { csrf: "tok".into() },
            ..v.clone()
        });
        assert!(!html.contains("<script>alert") && !html.contains("<b>no</b>"));
        let figures = &html[html.find(r#"<tr class="queue">"#).unwrap()..];
        let figures = &figures[..figures.find("</tr>").unwrap()];
        assert!(
            figures.contains(
                r#"data-label="depth" class="n" title="not settled: pending or being delivered">2<"#
            ) && figures.contains(r#"<span class="bad">1</span>"#)
                && figures.contains(">5 min ago</time>"),
            "{figures}"
        );
        let rows: Vec<&str> = html.split(r#"<tr class="message">"#).skip(1).collect();
        assert_eq!(rows.len(), 3, "{html}");
        let failed = &rows[0][..rows[0].find("</tr>").unwrap()];
        for want in [
            "<code>&lt;script&gt;alert(1)&lt;/script&gt;</code>",
            r#"<span class="bad">failed</span>"#,
            r#"data-label="attempts" class="n">4<"#,
            r#"data-label="last status" class="n">400<"#,
            "refused it (400): &lt;b&gt;no&lt;/b&gt;",
            r#"action="/v1/deliveries/hook/%3Cscript%3Ealert%281%29%3C%2Fscript%3E/retry""#,
            r#"action="/v1/deliveries/hook/%3Cscript%3Ealert%281%29%3C%2Fscript%3E/drop""#,
            r#"data-confirm="Drop hook / &lt;script&gt;alert(1)&lt;/script&gt;? It will not"#,
            r#"<input type="hidden" name="csrf" value="tok"><button class="del">Retry</button>"#,
        ] {
            assert!(failed.contains(want), "{want}: {failed}");
        }
        // Being delivered: nothing to do to it; pending: when it is next tried.
        assert!(rows[1].contains("delivering") && !rows[1].contains("<form"));
        assert!(
            rows[2].contains(">in 30 s</time>")
                && rows[2].contains("/v1/deliveries/hook/m%2F3/drop")
        );
        // Read-only: the same figures and rows, no forms.
        let read_only = render(&PageView {
            queue: Some(panel),
            ..v.clone()
        });
        assert!(
            read_only.contains(r#"<tr class="message">"#) && !read_only.contains("/v1/deliveries/")
        );
        // No queued route: no panel.
        assert!(!render(&v).contains("Queued delivery"));
        // A refusal is the page's alert.
        let refused = render(&PageView {
            notice: Some(Notice {
                text: "Not retried: hook / <k>: a message of epoch 2".into(),
                refused: true,
            }),
            ..v
        });
        assert!(refused.contains(r#"<section class="notice refused" role="alert">Not retried: hook / &lt;k&gt;: a message of epoch 2</section>"#), "{refused}");
    }

    /// The script that runs is the one the Content-Security-Policy allows.
    #[test]
    fn the_page_script_is_the_one_its_hash_allows() {
        let html = render(&view());
        let start = html.find("<script>").unwrap() + "<script>".len();
        let end = html.find("</script>").unwrap();
        use base64::Engine as _;
        use sha2::{Digest, Sha256};
        assert_eq!(
            script_hash(),
            format!(
                "'sha256-{}'",
                base64::engine::general_purpose::STANDARD
                    .encode(Sha256::digest(&html.as_bytes()[start..end]))
            )
        );
        assert!(!html[start..end].contains("REFRESH"));
    }

    #[test]
    fn relative_times_read_like_a_person_would_say_them() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let at = |s: i64| {
            if s >= 0 {
                now + Duration::from_secs(s as u64)
            } else {
                now - Duration::from_secs(s.unsigned_abs())
            }
        };
        assert_eq!(relative(now + Duration::from_millis(400), now), "now");
        assert_eq!(relative(at(12), now), "in 12 s");
        assert_eq!(relative(at(-12), now), "12 s ago");
        assert_eq!(relative(at(600), now), "in 10 min");
        assert_eq!(relative(at(-3 * 3600), now), "3 h ago");
        assert_eq!(relative(at(3 * 86_400), now), "in 3 d");
    }
}
