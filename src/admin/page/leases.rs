//! The lease table: marks, epochs, holders and expiry (SPEC §4–§5).

use super::*;

pub(super) fn leases_section(out: &mut Html, v: &PageView) {
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
pub(super) fn expiry(out: &mut Html, t: SystemTime, store_now: SystemTime) {
    if signed_ms(t, store_now) <= 0 {
        out.push_static(r#"<span class="bad">expired "#);
    } else {
        out.push_static(r#"<span class="ok">"#);
    }
    time(out, t, store_now);
    out.push_static("</span>");
}

pub(super) fn lease_row(out: &mut Html, v: &PageView, l: &LeaseRow) {
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
