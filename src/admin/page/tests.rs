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
    assert!(html.contains(r#"101–101 of 250"#) && html.contains(r#"href="/?leases=101#leases""#));
    assert!(html.contains("Nothing to resolve."));
}

#[test]
fn a_state_store_that_does_not_answer_is_shown_not_a_failed_page() {
    let html = render(&PageView {
        keys_error: Some("state write failed: <timeout>".into()),
        ..view()
    });
    assert!(
        html.contains(
            r#"role="alert">The state store did not answer: state write failed: &lt;timeout&gt;"#
        ),
        "{html}"
    );
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
        fence_problems: vec!["forwarding stopped: a single instance <x> uses this prefix".into()],
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
            paused: Some(("lease", v.now - Duration::from_secs(60))),
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
        jobs: vec![JobRow {
            id: "00ff".into(),
            action: "retry",
            route: Some("<i>hook</i>".into()),
            state: "running",
            matched: 7,
            done: 3,
            refused: 1,
        }],
    };
    let html = render(&PageView {
        queue: Some(panel.clone()),
        access: Access::Resolve { csrf: "tok".into() },
        ..v.clone()
    });
    // A route with failed messages has its "Retry all" (a bulk job), with
    // the page's CSRF token; the jobs are listed, escaped.
    assert!(
        html.contains(r#"action="/v1/delivery-jobs/retry?route=hook""#)
            && html.contains(r#"<button class="del">Retry all</button>"#),
        "{html}"
    );
    let jobs = &html[html.find(r#"<tr class="job">"#).unwrap()..];
    let jobs = &jobs[..jobs.find("</tr>").unwrap()];
    assert!(
        jobs.contains("<code>00ff</code>")
            && jobs.contains("&lt;i&gt;hook&lt;/i&gt;")
            && jobs.contains(r#"data-label="done" class="n">3<"#),
        "{jobs}"
    );
    assert!(!html.contains("<script>alert") && !html.contains("<b>no</b>"));
    let figures = &html[html.find(r#"<tr class="queue">"#).unwrap()..];
    let figures = &figures[..figures.find("</tr>").unwrap()];
    assert!(
        figures.contains(
            r#"data-label="depth" class="n" title="not settled: pending or being delivered">2<"#
        ) && figures.contains(r#"<span class="bad">1</span>"#)
            && figures.contains(">5 min ago</time>")
            && figures.contains(r#"paused (by its lease) since "#)
            && figures.contains(">60 s ago</time></span>"),
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
        rows[2].contains(">in 30 s</time>") && rows[2].contains("/v1/deliveries/hook/m%2F3/drop")
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
