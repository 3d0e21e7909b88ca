//! The members and the shard map (SPEC §10).

use super::*;

pub(super) fn members_section(out: &mut Html, v: &PageView) {
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

pub(super) fn shards_section(out: &mut Html, v: &PageView) {
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
