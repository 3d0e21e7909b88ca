//! What operators plug in (issue 45): every metric the alerting rules
//! (deploy/prometheus) and the dashboard (deploy/grafana) query is one a live
//! fencegate exports — a single instance on sled with a queued route and a
//! route with a breaker, and a cluster member on PostgreSQL for the cluster's
//! own. (`promtool` checks and unit-tests the rules: scripts/alerts-test.sh.)

use std::collections::BTreeSet;
use std::path::Path;

use http::Request;
use http_body_util::Full;

use crate::support::members::start_member;
use crate::support::postgres::PgServer;
use crate::support::*;

/// The metric names in `text`: words starting `fencegate_` or `process_`.
fn names_in(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
        .filter(|w| w.starts_with("fencegate_") || w.starts_with("process_"))
        .map(str::to_owned)
        .collect()
}

/// Every series name a scrape of `fg` can hold: its samples, and each family
/// it declares (a labelled family with no child yet has no sample) with the
/// suffixes its type gives.
async fn exported(fg: &Fencegate) -> BTreeSet<String> {
    let r = send(
        Request::get(fg.admin_url("/metrics"))
            .body(Full::default())
            .unwrap(),
    )
    .await;
    let text = String::from_utf8_lossy(&r.body).into_owned();
    let mut out = BTreeSet::new();
    for line in text.lines() {
        if let Some(decl) = line.strip_prefix("# TYPE ") {
            let mut it = decl.split_whitespace();
            let (Some(name), Some(kind)) = (it.next(), it.next()) else {
                continue;
            };
            let suffixes: &[&str] = match kind {
                "counter" => &["_total"],
                "histogram" => &["_bucket", "_sum", "_count"],
                _ => &[""],
            };
            out.extend(suffixes.iter().map(|s| format!("{name}{s}")));
            // A histogram named as a family (in a description).
            if kind == "histogram" {
                out.insert(name.to_owned());
            }
        } else if !line.starts_with('#') && !line.is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            out.insert(line[..end].to_owned());
        }
    }
    out
}

fn deploy(path: &str) -> String {
    std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("deploy")
            .join(path),
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_alerts_and_the_dashboard_query_only_metrics_fencegate_exports() {
    skip_without_python!();
    let rules = deploy("prometheus/fencegate-alerts.yml");
    let dashboard = deploy("grafana/fencegate-dashboard.json");
    serde_json::from_str::<serde_json::Value>(&dashboard).expect("the dashboard is JSON");
    let mut queried = names_in(&rules);
    queried.extend(names_in(&dashboard));
    assert!(queried.len() > 30, "{queried:?}");

    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let single = Fencegate::start(&format!(
        "{}{}{}",
        s3.store_toml(200),
        route_toml("pay", "billing", &origin, "breaker = { failures = 3 }\n"),
        route_toml("hook", "hook", &origin, "delivery = \"queued\"\n"),
    ));
    let mut have = exported(&single).await;
    let cluster_only =
        |n: &String| n.starts_with("fencegate_cluster_") || n.starts_with("fencegate_peer_");
    if crate::support::postgres::available_or_skip() {
        let pg = PgServer::shared();
        let (_db, url) = pg.new_database();
        // A lease store of its own: a cluster never shares one with a single
        // instance.
        let s3 = S3Server::start();
        let member = start_member(&s3, &url, &origin, "m1", 4, ("10s", "2s"));
        eventually("the member to own its shards", || async {
            member.metric_sum("fencegate_cluster_shards_owned").await >= 4.0
        })
        .await;
        have.extend(exported(&member).await);
    } else {
        queried.retain(|n| !cluster_only(n));
    }
    let missing: Vec<_> = queried.difference(&have).collect();
    assert!(
        missing.is_empty(),
        "queried by deploy/ but not exported: {missing:?}"
    );
}
