//! The routes table and what protects each upstream (SPEC §9).

use super::*;

/// Whole seconds, rounded up: how long a hold or a cool-down still runs.
pub(super) fn secs(d: std::time::Duration) -> u128 {
    d.as_millis().div_ceil(1000)
}

/// Each route's protection of its destination (SPEC §9): requests in flight
/// against `max_in_flight`, a `Retry-After` hold, the circuit breaker.
pub(super) fn routes_section(out: &mut Html, v: &PageView) {
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
