//! The queue panel (SPEC §11): each queued route's depth and oldest pending
//! message, the messages not delivered, with Retry and Drop.

use super::*;

/// A queued message's Retry and Drop buttons, each a form with a confirmation.
pub(super) fn message_forms(out: &mut Html, m: &MessageRow, csrf: &str) {
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
/// message, then its messages not delivered, with Retry and Drop. A
/// template: the section's markup in the order it is shown.
pub(super) fn queue_section(out: &mut Html, v: &PageView, q: &QueuePanel) {
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
            match (&v.access, r.failed) {
                (_, 0) => html!("0"),
                (Access::Resolve { csrf }, n) => html!(
                    r#"<span class="bad">{}</span> <form class="inline" method="post" action="/v1/delivery-jobs/retry?route={}" data-confirm="Retry every failed message of {}? Each goes to the end of its lease's queue, in order."><input type="hidden" name="csrf" value="{}"><button class="del">Retry all</button></form>"#,
                    n,
                    esc(&form::encode(&r.route)),
                    esc(&r.route),
                    esc(csrf)
                ),
                (Access::ReadOnly, n) => html!(r#"<span class="bad">{}</span>"#, n),
            }
        );
        match r.oldest {
            Some(t) => time(out, t, v.now),
            None => out.push_static("—"),
        }
        if let Some((by, since)) = r.paused {
            html!(
                out,
                r#" <span class="bad">paused (by its {}) since "#,
                esc(by)
            );
            time(out, since, v.now);
            out.push_static("</span>");
        }
        out.push_static("</td></tr>");
    }
    out.push_static("</tbody></table>");
    if !q.jobs.is_empty() {
        out.push_static("<h3>Bulk jobs</h3><table><thead><tr><th>job</th><th>action</th><th>route</th><th>state</th><th>matched</th><th>done</th><th>refused</th></tr></thead><tbody>");
        for j in &q.jobs {
            html!(
                out,
                r#"<tr class="job"><td data-label="job"><code>{}</code></td><td data-label="action">{}</td><td data-label="route">{}</td><td data-label="state">{}</td><td data-label="matched" class="n">{}</td><td data-label="done" class="n">{}</td><td data-label="refused" class="n">{}</td></tr>"#,
                esc(&j.id),
                esc(j.action),
                opt(&j.route),
                esc(j.state),
                j.matched,
                j.done,
                j.refused
            );
        }
        out.push_static("</tbody></table>");
    }
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
