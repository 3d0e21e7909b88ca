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

mod cluster;
mod keys;
mod leases;
mod queue;
mod routes;
#[cfg(test)]
mod tests;
mod view;

use cluster::{members_section, shards_section};
use keys::{detail_section, keys_section, store_section};
use leases::{expiry, leases_section};
use queue::queue_section;
use routes::routes_section;
pub use view::{
    Access, JobRow, KeyDetail, KeyRecord, KeyRow, LeaseRow, MemberRow, MessageRow, Notice,
    PageView, QueuePanel, QueueRoute, RouteRow, ShardRow, StoreHealth, Tenure,
};

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
