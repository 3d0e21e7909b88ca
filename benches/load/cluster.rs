//! `--cluster`: what a cluster costs its members (issue 51). Two members on one
//! PostgreSQL (SPEC §10.2), 8 shards, each member's routes `/fencing/` (lease
//! `bench-fencing`, `derive_key = "none"`) and `/dedup/` (lease `bench-dedup`,
//! the default content key, every body unique). Which member owns each lease
//! is read from the `X-Fencegate-Owner` hint of a first answer; then, rounds
//! interleaved as the main table's are:
//!
//! - `*-owner`: the requests sent to the lease's owner (what a worker that
//!   follows the hint does after its first answer, and a load balancer that
//!   routes by lease);
//! - `*-relayed`: the same requests sent to the other member, which relays
//!   each to the owner (a uniform load balancer sends (N−1)/N of them so);
//! - `passthrough`: the bare hyper pass-through, the reference.
//!
//! Per request: fencegate's CPU split into the relaying member's and the
//! owner's, PostgreSQL's CPU (the postmaster's tree), its WAL bytes and
//! records and commits (`pg_stat_wal`, `pg_stat_database`). With
//! `pg_stat_statements` loaded (this mode sets
//! `FENCEGATE_TEST_PG_SETTINGS=shared_preload_libraries=pg_stat_statements`
//! unless it is set), a last window of `dedup-owner` lists the statements a
//! dedup request costs the database: calls, execution time, rows and WAL per
//! request.
//!
//! Everything is pinned to one CPU, as in the main table (the database too).
//! `cargo bench --bench load -- --cluster [--rounds N --secs S --conc 64]`.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use http::Uri;
use serde_json::{json, Value};

use super::loadgen::{self, Creds, MakeReq, Plan};
use super::procs::{self, Proc};
use super::{scratch, start_postgres, target_dir, Args};

const SHARDS: u32 = 8;
const PEER_TOKEN: &str = "bench-peer-token-0123456789";

/// A member: its process and its `advertise` URL.
struct Member {
    proc_: Proc,
    url: String,
}

/// One target of the table.
struct Target {
    key: &'static str,
    /// Where the requests go.
    addr: std::net::SocketAddr,
    path: &'static str,
    creds: Creds,
}

/// Per-request figures of one window.
#[derive(Default, Clone)]
struct Row {
    rps: f64,
    /// CPU µs/req of the member the requests were sent to, and of the other.
    sent_to: f64,
    other: f64,
    origin: f64,
    pg: f64,
    wal_bytes: f64,
    wal_records: f64,
    commits: f64,
    p50_ms: f64,
    errors: u64,
}

pub async fn run(args: &Args) -> Result<(), String> {
    let load_before = procs::loadavg();
    if std::env::var_os("FENCEGATE_TEST_PG_SETTINGS").is_none() {
        // Before any thread of ours reads the environment: PostgreSQL starts next.
        std::env::set_var(
            "FENCEGATE_TEST_PG_SETTINGS",
            "shared_preload_libraries=pg_stat_statements",
        );
    }
    let Some((_pg, url, db)) = start_postgres(args).await? else {
        return Ok(());
    };
    let dir = scratch("bench-cluster-")?;
    let store_root = dir.path().join("leases");
    let epochs = procs::store(&store_root)?;
    let origin = procs::spawn_role("origin", &["origin"], dir.path(), false)?;
    let a = member("a", dir.path(), &store_root, &url, &origin)?;
    let b = member("b", dir.path(), &store_root, &url, &origin)?;
    let members = [&a, &b];
    settled(&members).await?;
    let passthrough = procs::spawn_role(
        "passthrough",
        &["passthrough", "--upstream", &origin.addr.to_string()],
        dir.path(),
        true,
    )?;

    let mut targets = Vec::new();
    for (lease, path, kind) in [
        ("bench-fencing", "/fencing/charge", "fencing"),
        ("bench-dedup", "/dedup/charge", "dedup"),
    ] {
        let (e, t) = procs::acquire(&epochs, lease).await?;
        let creds = Creds::new(e, &t);
        let owner = owner_of(&members, path, &creds).await?;
        let other = 1 - owner;
        let (k_owner, k_relayed) = if kind == "fencing" {
            ("fencing-owner", "fencing-relayed")
        } else {
            ("dedup-owner", "dedup-relayed")
        };
        targets.push(Target {
            key: k_owner,
            addr: members[owner].proc_.addr,
            path,
            creds: creds.clone(),
        });
        targets.push(Target {
            key: k_relayed,
            addr: members[other].proc_.addr,
            path,
            creds,
        });
    }
    let pt_creds = targets[0].creds.clone();
    targets.insert(
        0,
        Target {
            key: "passthrough",
            addr: passthrough.addr,
            path: "/fencing/charge",
            creds: pt_creds,
        },
    );
    targets.retain(|t| args.wants(t.key));
    eprintln!(
        "bench cluster: members {} (pid {}) and {} (pid {}), PostgreSQL pid {}; pinned to CPU {:?}; load average {load_before}",
        a.url, a.proc_.pid, b.url, b.proc_.pid, db.postmaster, args.cpu
    );

    let mut tag = 1_000u64;
    let mut plan = |t: &Target, c: usize, warm: Duration, measure: Duration| {
        tag += 1;
        Plan {
            addr: t.addr,
            conns: c,
            warmup: warm,
            measure,
            make: factory(t.path, t.creds.clone(), tag),
            pids: vec![a.proc_.pid, b.proc_.pid, origin.pid, passthrough.pid],
            trees: vec![db.postmaster],
            probe: Some(db.probe.clone()),
        }
    };
    if !args.smoke {
        for t in &targets {
            let c = args.conc.iter().copied().max().unwrap_or(64);
            loadgen::run(&plan(t, c, Duration::ZERO, Duration::from_millis(700))).await;
        }
    }
    let mut rows: BTreeMap<(&'static str, usize), Vec<Row>> = BTreeMap::new();
    for round in 0..args.rounds {
        for &c in &args.conc {
            for t in &targets {
                let out = loadgen::run(&plan(t, c, args.warm(), args.measure())).await;
                let row = row_of(t, &out, &members);
                eprintln!(
                    "  round {round} c={c:<3} {:<16} {:>8.0} req/s  cpu {:>5.1} (+ {:>5.1} other) µs/req  PostgreSQL {:>5.1} µs/req, WAL {:>6.0} B/req  errors {}",
                    t.key, row.rps, row.sent_to, row.other, row.pg, row.wal_bytes, row.errors
                );
                if row.errors > 0 {
                    eprintln!(
                        "    first error: {:?} {:?}",
                        out.counts.first_error, out.counts.by_code
                    );
                }
                rows.entry((t.key, c)).or_default().push(row);
            }
        }
    }
    // The statements one dedup request costs the database, over one more window.
    let statements = match targets.iter().find(|t| t.key == "dedup-owner") {
        Some(t) => {
            let c = args.conc.iter().copied().max().unwrap_or(64);
            statements(&url, &plan(t, c, args.warm(), args.measure())).await
        }
        .unwrap_or_else(|e| {
            eprintln!("bench cluster: no statement figures: {e}");
            vec![]
        }),
        None => vec![],
    };
    // The owners must not have moved during the run (a handover would mix
    // relayed and direct requests in one row).
    for t in targets.iter().filter(|t| t.key.ends_with("-owner")) {
        let now = owner_of(&members, t.path, &t.creds).await?;
        if members[now].proc_.addr != t.addr {
            eprintln!(
                "bench cluster: {}'s lease changed owner during the run: its figures mix direct and relayed requests",
                t.key
            );
        }
    }
    let (md, js) = report(args, &rows, &statements, &load_before);
    println!("{md}");
    let path = target_dir().join(if args.smoke {
        "bench-cluster-smoke.json"
    } else {
        "bench-cluster.json"
    });
    std::fs::write(&path, serde_json::to_vec_pretty(&js).unwrap_or_default())
        .map_err(|e| format!("{}: {e}", path.display()))?;
    println!("JSON: {}", path.display());
    if args.smoke {
        for ((k, c), rs) in &rows {
            let errors: u64 = rs.iter().map(|r| r.errors).sum();
            if errors > 0 || rs.iter().all(|r| r.rps == 0.0) {
                return Err(format!(
                    "cluster {k} at c={c}: {errors} errors; member logs:\n{}\n{}",
                    a.proc_.log_tail(),
                    b.proc_.log_tail()
                ));
            }
        }
    }
    Ok(())
}

/// A member's config and process: listening on the port its `advertise` names.
fn member(
    id: &str,
    dir: &Path,
    store: &Path,
    db_url: &str,
    origin: &Proc,
) -> Result<Member, String> {
    let port = super::ports::free_port();
    let url = format!("http://127.0.0.1:{port}");
    let cfg = format!(
        "[server]\nlisten = \"127.0.0.1:{port}\"\nadmin_listen = \"127.0.0.1:0\"\ndata_dir = {data:?}\n\n\
         [store]\nkind = \"dir\"\npath = {store:?}\nprefix = \"fencegate/\"\n\n\
         [state]\nkind = \"postgres\"\nurl = {db_url:?}\n\n\
         [cluster]\ninstance_id = \"bench-{id}\"\nadvertise = \"{url}\"\nshards = {SHARDS}\npeer_token = \"{PEER_TOKEN}\"\n\n\
         [[route]]\nname = \"fencing\"\npath_prefix = \"/fencing/\"\nupstream = \"http://{o}/v1/\"\nlease = \"bench-fencing\"\nderive_key = \"none\"\n\n\
         [[route]]\nname = \"dedup\"\npath_prefix = \"/dedup/\"\nupstream = \"http://{o}/v1/\"\nlease = \"bench-dedup\"\n",
        data = dir.join(format!("state-{id}")).display().to_string(),
        store = store.display().to_string(),
        o = origin.addr,
    );
    let path = dir.join(format!("member-{id}.toml"));
    std::fs::write(&path, cfg).map_err(|e| format!("{}: {e}", path.display()))?;
    let args = vec![
        "serve".to_string(),
        "--config".into(),
        path.display().to_string(),
    ];
    // As the main table's fencegate: default logging, the access line off.
    let proc_ = procs::spawn_listening(
        &format!("member-{id}"),
        Path::new(env!("CARGO_BIN_EXE_fencegate")),
        &args,
        dir,
        true,
        &[("FENCEGATE_LOG", "info,fencegate::access=off")],
    )?;
    Ok(Member { proc_, url })
}

/// Waits until both members see each other and the shards are split evenly
/// (SPEC §10.2's balance moves none after that: a shard moving during a
/// window would mix relayed and direct requests, and refuse some).
async fn settled(members: &[&Member; 2]) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let mut owned = Vec::new();
        let mut seen = Vec::new();
        for m in members {
            let admin = m.proc_.admin.ok_or("a member without an admin address")?;
            let text = loadgen::get_text(admin, "/metrics")
                .await
                .unwrap_or_default();
            owned.push(loadgen::metric(&text, "fencegate_cluster_shards_owned").unwrap_or(0.0));
            seen.push(loadgen::metric(&text, "fencegate_cluster_members").unwrap_or(0.0));
        }
        let total: f64 = owned.iter().sum();
        // SPEC §10.2's balance ends at ⌊n/l⌋ or ⌈n/l⌉ each: 4 and 4.
        let even = owned.iter().all(|o| *o == f64::from(SHARDS / 2));
        if total == f64::from(SHARDS) && even && seen.iter().all(|s| *s >= 2.0) {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!(
                "the members did not settle in 120 s: shards owned {owned:?}, members seen {seen:?}; logs:\n{}\n{}",
                members[0].proc_.log_tail(),
                members[1].proc_.log_tail()
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Which member owns the lease behind `path`: the owner hint of an answer
/// (asked again while the shard's new owner is still taking it: 503
/// `shard_unavailable`).
async fn owner_of(members: &[&Member; 2], path: &str, creds: &Creds) -> Result<usize, String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let hint = loop {
        let mut s = loadgen::connect(members[0].proc_.addr).await?;
        let req = loadgen::request(
            Uri::try_from(path).map_err(|e| e.to_string())?,
            creds,
            loadgen::body(77, 0, rand_seq()),
            None,
        );
        let a = loadgen::exchange(&mut s, req).await?;
        match a.owner {
            Some(h) if a.status.is_success() => break h,
            _ if tokio::time::Instant::now() > deadline => {
                return Err(format!(
                    "{path}: {} with no X-Fencegate-Owner ({:?}) for 60 s",
                    a.status, a.code
                ))
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    members
        .iter()
        .position(|m| m.url == hint)
        .ok_or_else(|| format!("{path}: X-Fencegate-Owner {hint:?} names neither member"))
}

/// A sequence number no other body of this run uses (content keys never repeat).
fn rand_seq() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn factory(path: &'static str, creds: Creds, tag: u64) -> MakeReq {
    let uri = Uri::from_static(path);
    Arc::new(move |conn, seq| {
        loadgen::request(uri.clone(), &creds, loadgen::body(tag, conn, seq), None)
    })
}

fn row_of(t: &Target, out: &loadgen::Outcome, members: &[&Member; 2]) -> Row {
    let ok = out.counts.ok.max(1) as f64;
    let per = |secs: f64| secs * 1e6 / ok;
    let (sent_to, other) = if t.key == "passthrough" {
        (out.cpu_us(3), 0.0)
    } else if members[0].proc_.addr == t.addr {
        (out.cpu_us(0), out.cpu_us(1))
    } else {
        (out.cpu_us(1), out.cpu_us(0))
    };
    let probe = |i: usize| out.probe.get(i).copied().unwrap_or(f64::NAN) / ok;
    Row {
        rps: out.rps(),
        sent_to,
        other,
        origin: out.cpu_us(2),
        pg: per(out.tree_cpu.first().map_or(0.0, |m| m.values().sum())),
        wal_records: probe(2),
        wal_bytes: probe(3),
        commits: probe(4),
        p50_ms: out.hist.value_at_quantile(0.5) as f64 / 1000.0,
        errors: out.counts.errors,
    }
}

/// One statement's cost per request, from `pg_stat_statements`.
struct Statement {
    query: String,
    calls: f64,
    exec_us: f64,
    rows: f64,
    wal_bytes: f64,
}

/// Resets `pg_stat_statements`, runs `window`, and reads what each statement
/// cost per request answered.
async fn statements(url: &str, window: &Plan) -> Result<Vec<Statement>, String> {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client
        .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .await
        .map_err(|e| e.to_string())?;
    client
        .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        .await
        .map_err(|e| e.to_string())?;
    client
        .batch_execute("SELECT pg_stat_statements_reset()")
        .await
        .map_err(|e| e.to_string())?;
    let lsn = "SELECT pg_current_wal_insert_lsn()::text";
    let from: String = client
        .query_one(lsn, &[])
        .await
        .map_err(|e| e.to_string())?
        .get(0);
    let out = loadgen::run(window).await;
    let to: String = client
        .query_one(lsn, &[])
        .await
        .map_err(|e| e.to_string())?
        .get(0);
    let total = out.counts.ok_total.max(1) as f64;
    let rows = client
        .query(
            "SELECT query, calls::float8, total_exec_time::float8, rows::float8, wal_bytes::float8 \
             FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) \
             ORDER BY total_exec_time DESC LIMIT 12",
            &[],
        )
        .await
        .map_err(|e| e.to_string())?;
    // The WAL written over the window by kind of record (`pg_walinspect`):
    // what each index and the heap cost.
    let wal = client
        .query(
            "SELECT \"resource_manager/record_type\", count::float8, record_size::float8, fpi_size::float8 \
             FROM pg_get_wal_stats($1::text::pg_lsn, $2::text::pg_lsn, true) WHERE count > 0 \
             ORDER BY record_size + fpi_size DESC LIMIT 12",
            &[&from, &to],
        )
        .await
        .map_err(|e| e.to_string())?;
    let mut stmts: Vec<Statement> = wal
        .iter()
        .map(|r| Statement {
            query: format!("WAL: {}", r.get::<_, String>(0)),
            calls: r.get::<_, f64>(1) / total,
            exec_us: f64::NAN,
            rows: r.get::<_, f64>(3) / total,
            wal_bytes: r.get::<_, f64>(2) / total,
        })
        .collect();
    stmts.extend(rows.iter().map(|r| Statement {
        query: r.get::<_, String>(0),
        calls: r.get::<_, f64>(1) / total,
        exec_us: r.get::<_, f64>(2) * 1e3 / total,
        rows: r.get::<_, f64>(3) / total,
        wal_bytes: r.get::<_, f64>(4) / total,
    }));
    Ok(stmts)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn report(
    args: &Args,
    rows: &BTreeMap<(&'static str, usize), Vec<Row>>,
    statements: &[Statement],
    load_before: &str,
) -> (String, Value) {
    let mut md = format!(
        "### fencegate cluster: two members on PostgreSQL ({} rounds × {} s, load average {load_before} → {})\n\n\
         | target | conns | req/s | p50 ms | CPU µs/req, member sent to | other member | fencegate total | ÷ direct | PostgreSQL CPU µs/req | WAL B/req | WAL records/req | commits/req |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        args.rounds,
        args.secs,
        procs::loadavg(),
    );
    let mut js = serde_json::Map::new();
    let med = |rs: &[Row], f: fn(&Row) -> f64| median(rs.iter().map(f).collect());
    for &c in &args.conc {
        for key in [
            "passthrough",
            "fencing-owner",
            "fencing-relayed",
            "dedup-owner",
            "dedup-relayed",
        ] {
            let Some(rs) = rows.get(&(key, c)) else {
                continue;
            };
            let total = |r: &Row| r.sent_to + r.other;
            let direct_key = key.replace("-relayed", "-owner");
            let ratio = rows.get(&(direct_key.as_str(), c)).map_or(f64::NAN, |d| {
                // Paired round by round, then the median.
                median(rs.iter().zip(d).map(|(r, d)| total(r) / total(d)).collect())
            });
            md.push_str(&format!(
                "| {key} | {c} | {:.0} | {:.2} | {:.1} | {:.1} | {:.1} | {:.2} | {:.1} | {:.0} | {:.1} | {:.2} |\n",
                med(rs, |r| r.rps),
                med(rs, |r| r.p50_ms),
                med(rs, |r| r.sent_to),
                med(rs, |r| r.other),
                med(rs, |r| r.sent_to + r.other),
                ratio,
                med(rs, |r| r.pg),
                med(rs, |r| r.wal_bytes),
                med(rs, |r| r.wal_records),
                med(rs, |r| r.commits),
            ));
            js.insert(
                format!("{key}@{c}"),
                json!({
                    "rps": med(rs, |r| r.rps),
                    "cpu_us_sent_to": med(rs, |r| r.sent_to),
                    "cpu_us_other": med(rs, |r| r.other),
                    "cpu_ratio_to_direct": ratio,
                    "origin_cpu_us": med(rs, |r| r.origin),
                    "pg_cpu_us": med(rs, |r| r.pg),
                    "wal_bytes": med(rs, |r| r.wal_bytes),
                    "wal_records": med(rs, |r| r.wal_records),
                    "commits": med(rs, |r| r.commits),
                    "errors": rs.iter().map(|r| r.errors).sum::<u64>(),
                }),
            );
        }
    }
    if !statements.is_empty() {
        md.push_str(
            "\nStatements per dedup request (`pg_stat_statements`, one window of dedup-owner):\n\n\
             (`WAL:` rows are `pg_walinspect`'s records by kind over the same window: records per\n\
             request, their bytes, and in the rows column the full-page images' bytes)\n\n\
             | calls/req | exec µs/req | rows/req | WAL B/req | statement |\n|---:|---:|---:|---:|---|\n",
        );
        let mut st = Vec::new();
        for s in statements {
            let q: String = s.query.split_whitespace().collect::<Vec<_>>().join(" ");
            let short: String = q.chars().take(110).collect();
            md.push_str(&format!(
                "| {:.3} | {:.1} | {:.2} | {:.0} | `{}` |\n",
                s.calls,
                s.exec_us,
                s.rows,
                s.wal_bytes,
                short.replace('|', "\\|")
            ));
            st.push(json!({"query": q, "calls": s.calls, "exec_us": s.exec_us, "rows": s.rows, "wal_bytes": s.wal_bytes}));
        }
        js.insert("statements_per_dedup_request".into(), Value::Array(st));
    }
    js.insert("machine".into(), super::machine());
    (md, Value::Object(js))
}
