//! The store's health, the in-doubt keys with the forms that resolve them, and
//! one key's detail view (SPEC §6, §8).

use super::*;

pub(super) fn store_section(out: &mut Html, v: &PageView) {
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
pub(super) fn detail_href(route: &str, key: &str) -> Html {
    html!(
        "/?detail=1&amp;route={}&amp;key={}#key",
        esc(&form::encode(route)),
        esc(&form::encode(key))
    )
}

/// The two resolve buttons, behind a disclosure and a confirmation.
pub(super) fn resolve_form(out: &mut Html, route: &str, key: &str, csrf: &str) {
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
pub(super) fn answered(r: &KeyRecord) -> Html {
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

pub(super) fn detail_section(out: &mut Html, v: &PageView, d: &KeyDetail) {
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

pub(super) fn keys_section(out: &mut Html, v: &PageView) {
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
