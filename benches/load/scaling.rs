//! `--scaling`: how fencegate's costs grow with what it holds.
//!
//! - leases: 1, 100 and 10,000 routes (one lease each), requests spread over all;
//!   idle CPU (the refreshers) and c=64 throughput, interleaved.
//! - dedup records: 1M `done` records written into sled before start vs. none,
//!   durable dedup at c=64, interleaved.
//! - idle connections: 10,000 keep-alive connections held open; VmRSS before, 0.3 s
//!   and 2.5 s after the last opened (fencegate parks a connection after 1 s at
//!   rest) and after 64 busy connections ran beside them (the allocator returns
//!   freed pages to the OS only while it is in use), their throughput, and how
//!   long the idle ones live.
//! - epoch changes under load: a new epoch every second while 64 connections send;
//!   latency of each connection's first request at a new epoch.
//! - store calls: 10,000 leases of which 100 are in use (`refresh_interval_ms` =
//!   1000), the lease store calls counted over a window and priced per hour at S3's
//!   list rates, beside what listing every lease each interval would cost.
//!
//! - streaming: a 1 GiB answer through fencegate (fencing only) and through the
//!   bare pass-through, alternating: MB/s and each proxy's VmRSS growth (sampled
//!   every 20 ms); and a server-sent event stream: time to its first event, direct
//!   from the origin and through each proxy.
//!
//! `--only leases,dedup,idle,epochs,store,stream` picks parts; `--quick` shrinks them
//! (1,000 leases, 100k records, 2,000 connections, 5 epochs, 1,000 leases of which
//! 10 in use).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use http::Uri;
use serde_json::{json, Value};

use super::loadgen::{self, Creds, MakeReq, Plan};
use super::procs::{self, Proc, RouteSpec};
use super::{quantile, scratch, Args};

pub async fn run(args: &Args) -> Result<(), String> {
    let load_before = procs::loadavg();
    let idle_conns: u64 = if args.quick { 2_000 } else { 10_000 };
    // Our connections, and fencegate's (children inherit the limit).
    let nofile = procs::raise_nofile(idle_conns + 2_000);
    let dir = scratch("bench-scaling-")?;
    let store_root = dir.path().join("leases");
    let origin = procs::spawn_role("origin", &["origin"], dir.path(), false)?;
    eprintln!(
        "bench scaling: origin {}; pinned to CPU {:?}; RLIMIT_NOFILE soft {nofile}; load average {load_before}",
        origin.addr, args.cpu
    );
    let part = |k: &str| args.only.as_ref().is_none_or(|o| o.iter().any(|x| x == k));
    let mut md = String::from("### fencegate scaling\n");
    let mut js = serde_json::Map::new();
    if part("leases") {
        let (m, j) = leases(args, dir.path(), &store_root, &origin).await?;
        md.push_str(&m);
        js.insert("leases".into(), j);
    }
    if part("dedup") {
        let (m, j) = dedup_records(args, dir.path(), &store_root, &origin).await?;
        md.push_str(&m);
        js.insert("dedup_records".into(), j);
    }
    if part("idle") {
        let (m, j) = idle(args, dir.path(), &store_root, &origin, idle_conns, nofile).await?;
        md.push_str(&m);
        js.insert("idle_connections".into(), j);
    }
    if part("stream") {
        let (m, j) = streaming(args, dir.path(), &store_root, &origin).await?;
        md.push_str(&m);
        js.insert("streaming".into(), j);
    }
    if part("store") {
        let (m, j) = store_calls(args, dir.path(), &store_root, &origin).await?;
        md.push_str(&m);
        js.insert("store_calls".into(), j);
    }
    if part("epochs") {
        let (m, j) = epochs_under_load(args, dir.path(), &store_root, &origin).await?;
        md.push_str(&m);
        js.insert("epoch_changes_under_load".into(), j);
    }
    let load_after = procs::loadavg();
    md.push_str(&format!(
        "\nMachine: nproc {}, {}; all processes on CPU {:?}; load average before {load_before}, after {load_after}.\n",
        super::nproc(),
        procs::cpu_model(),
        args.cpu
    ));
    js.insert("machine".into(), super::machine());
    js.insert(
        "load_average".into(),
        json!({"before": load_before, "after": load_after}),
    );
    let path = super::target_dir().join("bench-load-scaling.json");
    std::fs::write(
        &path,
        serde_json::to_vec_pretty(&Value::Object(js)).unwrap_or_default(),
    )
    .map_err(|e| e.to_string())?;
    println!("{md}");
    println!("JSON: {}", path.display());
    Ok(())
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) on a child we started and still own.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// This build's fencegate, or `--fencegate-b PATH`'s when given (scaling and
/// the backlog's queued fencegate run one build).
pub(super) fn fencegate_exe() -> std::path::PathBuf {
    std::env::args()
        .skip_while(|a| a != "--fencegate-b")
        .nth(1)
        .map_or_else(
            || std::path::PathBuf::from(env!("CARGO_BIN_EXE_fencegate")),
            std::path::PathBuf::from,
        )
}

fn fencing_route(name: &str, lease: &str) -> RouteSpec {
    RouteSpec {
        name: name.into(),
        prefix: "/bench/".into(),
        lease: lease.into(),
        derive_key: "none",
        extra: String::new(),
        upstream: None,
    }
}

fn rounds(args: &Args) -> usize {
    if args.quick {
        1
    } else {
        3
    }
}

fn measure(args: &Args) -> Duration {
    if args.quick {
        Duration::from_secs(1)
    } else {
        Duration::from_secs(4)
    }
}

fn ms(us: f64) -> String {
    format!("{:.2}", us / 1e3)
}

/// Spreads requests over `paths[i]` with that lease's credentials.
fn spread(paths: Arc<Vec<(Uri, Creds)>>, tag: u64) -> MakeReq {
    Arc::new(move |conn, seq| {
        let i = (conn as u64 * 7919 + seq * 104_729) as usize % paths.len();
        let (uri, creds) = &paths[i];
        loadgen::request(uri.clone(), creds, loadgen::body(tag, conn, seq), None)
    })
}

/// Sends one request to every path once, 64 at a time (each lease's first request
/// raises its mark).
async fn touch_all(addr: SocketAddr, paths: &Arc<Vec<(Uri, Creds)>>) -> Result<(), String> {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for w in 0..64usize.min(paths.len()) {
        let (paths, next) = (paths.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut s = loadgen::connect(addr).await?;
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some((uri, creds)) = paths.get(i) else {
                    return Ok::<_, String>(());
                };
                let a = loadgen::exchange(
                    &mut s,
                    loadgen::request(uri.clone(), creds, loadgen::body(1, w, i as u64), None),
                )
                .await?;
                if !a.status.is_success() {
                    return Err(format!("{uri}: {} {:?}", a.status, a.code));
                }
            }
        }));
    }
    for t in tasks {
        t.await.map_err(|e| e.to_string())??;
    }
    Ok(())
}

/// Each lease's path and the credentials to reach it.
type Paths = Vec<(Uri, Creds)>;

/// `n` fencing-only routes `/r{i}/`, one lease `{tag}-{i}` each with epoch 1
/// written, and the path and credentials to reach each.
fn lease_routes(
    store_root: &std::path::Path,
    tag: &str,
    n: usize,
) -> Result<(Paths, Vec<RouteSpec>), String> {
    let mut paths = Vec::with_capacity(n);
    let mut routes = Vec::with_capacity(n);
    for i in 0..n {
        let lease = format!("{tag}-{i}");
        let token = procs::write_epoch_one(store_root, &lease)?;
        let prefix = format!("/r{i}/");
        paths.push((
            Uri::try_from(format!("{prefix}charge")).map_err(|e| e.to_string())?,
            Creds::new(1, &token),
        ));
        routes.push(RouteSpec {
            name: format!("r{i}"),
            prefix,
            lease,
            derive_key: "none",
            extra: String::new(),
            upstream: None,
        });
    }
    Ok((paths, routes))
}

async fn leases(
    args: &Args,
    dir: &std::path::Path,
    store_root: &std::path::Path,
    origin: &Proc,
) -> Result<(String, Value), String> {
    let counts: Vec<usize> = if args.quick {
        vec![1, 100, 1_000]
    } else {
        vec![1, 100, 10_000]
    };
    let mut gates = Vec::new();
    for &n in &counts {
        let t0 = std::time::Instant::now();
        let (paths, routes) = lease_routes(store_root, &format!("s{n}"), n)?;
        let p = procs::spawn_fencegate(
            &fencegate_exe(),
            &format!("leases-{n}"),
            dir,
            store_root,
            &dir.join(format!("state-leases-{n}")),
            origin.addr,
            &routes,
            "",
            &[],
        )?;
        let started = t0.elapsed();
        let paths = Arc::new(paths);
        let t1 = std::time::Instant::now();
        touch_all(p.addr, &paths).await?;
        let touched = t1.elapsed();
        eprintln!(
            "  {n} leases: started in {:.1} s, first request of every lease in {:.1} s",
            started.as_secs_f64(),
            touched.as_secs_f64()
        );
        gates.push((n, p, paths, started, touched));
    }
    // Idle: what the refreshers cost with nothing to serve (one instance at a time
    // is not needed here: this is each process's own CPU time).
    let mut idle_cpu = BTreeMap::new();
    tokio::time::sleep(Duration::from_secs(1)).await;
    for (n, p, ..) in &gates {
        let c0 = procs::cpu_secs(p.pid);
        let t = std::time::Instant::now();
        tokio::time::sleep(Duration::from_secs(3)).await;
        let frac = (procs::cpu_secs(p.pid) - c0) / t.elapsed().as_secs_f64();
        idle_cpu.insert(*n, frac);
    }
    let mut samples: BTreeMap<usize, Vec<loadgen::Outcome>> = BTreeMap::new();
    let mut tag = 1_000;
    for _ in 0..rounds(args) {
        for (n, p, paths, ..) in &gates {
            tag += 1;
            // Only the measured instance runs: the others' refreshers would take
            // CPU from it (they are frozen with SIGSTOP, then resumed).
            for (_, other, ..) in &gates {
                signal(
                    other.pid,
                    if other.pid == p.pid {
                        libc::SIGCONT
                    } else {
                        libc::SIGSTOP
                    },
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            let out = loadgen::run(&Plan {
                addr: p.addr,
                conns: 64,
                warmup: Duration::from_millis(500),
                measure: measure(args),
                make: spread(paths.clone(), tag),
                pids: vec![p.pid],
                trees: vec![],
                probe: None,
            })
            .await;
            eprintln!(
                "  {n} leases c=64: {:.0} req/s, p99 {} ms, {:.1} µs CPU/req, errors {}",
                out.rps(),
                ms(out.hist.value_at_quantile(0.99) as f64),
                out.cpu_us(0),
                out.counts.errors
            );
            samples.entry(*n).or_default().push(out);
        }
    }
    for (_, p, ..) in &gates {
        signal(p.pid, libc::SIGCONT);
    }
    let mut md = String::from(
        "\n#### Leases (one route per lease, fencing only, c=64, requests spread over every lease)\n\n\
         | leases | start-up s | req/s | p50 ms | p99 ms | CPU µs/req | idle CPU (% of a core) | VmRSS MiB | errors |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let mut rows = Vec::new();
    for (n, p, _, started, _) in &gates {
        let r = agg_refs(samples[n].iter());
        let rss = procs::rss_kib(p.pid).0 as f64 / 1024.0;
        md.push_str(&format!(
            "| {n} | {:.1} | {:.0} | {} | {} | {:.1} | {:.1} | {:.0} | {} |\n",
            started.as_secs_f64(),
            r.rps,
            ms(r.p50),
            ms(r.p99),
            r.cpu_us,
            idle_cpu[n] * 100.0,
            rss,
            r.errors
        ));
        rows.push(json!({
            "leases": n, "startup_s": started.as_secs_f64(), "rps": r.rps,
            "p50_us": r.p50, "p99_us": r.p99, "cpu_us_per_request": r.cpu_us,
            "idle_cpu_fraction": idle_cpu[n], "rss_mib": rss, "errors": r.errors,
        }));
    }
    Ok((md, json!(rows)))
}

/// One GET with `header: value`; the answer is read frame by frame without being
/// kept. Returns (time to the first data frame, total time, bytes).
async fn download(
    addr: SocketAddr,
    creds: &Creds,
    header: &'static str,
    value: u64,
) -> Result<(Duration, Duration, u64), String> {
    use http_body_util::BodyExt;
    let mut s = loadgen::connect(addr).await?;
    let mut req = loadgen::request(
        Uri::from_static("/bench/download"),
        creds,
        bytes::Bytes::new(),
        Some((header, http::HeaderValue::from(value))),
    );
    *req.method_mut() = http::Method::GET;
    let t0 = std::time::Instant::now();
    let resp = s.send_request(req).await.map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        return Err(format!("download: {}", resp.status()));
    }
    let mut body = resp.into_body();
    let (mut first, mut n) = (None, 0u64);
    while let Some(f) = body.frame().await {
        if let Ok(d) = f.map_err(|e| e.to_string())?.into_data() {
            first.get_or_insert_with(|| t0.elapsed());
            n += d.len() as u64;
        }
    }
    Ok((first.unwrap_or_default(), t0.elapsed(), n))
}

/// The largest VmRSS (KiB) of `pid` seen every 20 ms while `work` runs.
async fn peak_rss<T>(pid: u32, work: impl std::future::Future<Output = T>) -> (T, u64) {
    let peak = Arc::new(std::sync::atomic::AtomicU64::new(procs::rss_kib(pid).0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (p, st) = (peak.clone(), stop.clone());
    let sampler = tokio::spawn(async move {
        while !st.load(std::sync::atomic::Ordering::Relaxed) {
            p.fetch_max(procs::rss_kib(pid).0, std::sync::atomic::Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    let out = work.await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = sampler.await;
    (out, peak.load(std::sync::atomic::Ordering::Relaxed))
}

async fn streaming(
    args: &Args,
    dir: &std::path::Path,
    store_root: &std::path::Path,
    origin: &Proc,
) -> Result<(String, Value), String> {
    let size: u64 = if args.quick { 256 << 20 } else { 1 << 30 };
    let epochs = procs::store(store_root)?;
    let (e, t) = procs::acquire(&epochs, "bench-stream").await?;
    let creds = Creds::new(e, &t);
    let fg = procs::spawn_fencegate(
        &fencegate_exe(),
        "stream-fencing",
        dir,
        store_root,
        &dir.join("state-stream"),
        origin.addr,
        &[fencing_route("bench", "bench-stream")],
        "",
        &[],
    )?;
    let up = origin.addr.to_string();
    let pt = procs::spawn_role(
        "stream-passthrough",
        &["passthrough", "--upstream", &up],
        dir,
        true,
    )?;
    // Warm both (fencegate's first request reads the store and raises the mark).
    for p in [&fg, &pt] {
        download(p.addr, &creds, "x-bench-bytes", 1 << 20).await?;
    }
    let mut md = format!(
        "\n#### Streaming: a {} MiB answer (fencing only; {} rounds), and time to the first server-sent event\n\n\
         | proxy | MB/s (median) | VmRSS before MiB | VmRSS growth MiB (peak − before) | first event ms (median of 20) |\n\
         |---|---:|---:|---:|---:|\n",
        size >> 20,
        rounds(args)
    );
    let mut rows = Vec::new();
    let mut mbps: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut growth: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for _ in 0..rounds(args) {
        for (name, p) in [("fencegate", &fg), ("bare pass-through", &pt)] {
            let before = procs::rss_kib(p.pid).0;
            let (r, peak) = peak_rss(p.pid, download(p.addr, &creds, "x-bench-bytes", size)).await;
            let (_, total, n) = r?;
            if n != size {
                return Err(format!("{name}: {n} of {size} bytes"));
            }
            mbps.entry(name)
                .or_default()
                .push(n as f64 / total.as_secs_f64() / 1e6);
            let g = growth.entry(name).or_insert((before, 0));
            g.1 = g.1.max(peak.saturating_sub(before));
        }
    }
    let mut first: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for _ in 0..20 {
        for (name, addr) in [
            ("origin, direct", origin.addr),
            ("fencegate", fg.addr),
            ("bare pass-through", pt.addr),
        ] {
            let (f, _, _) = download(addr, &creds, "x-bench-events", 2).await?;
            first.entry(name).or_default().push(f.as_secs_f64() * 1e3);
        }
    }
    let med = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    for name in ["origin, direct", "fencegate", "bare pass-through"] {
        let (rate, (before, grew)) = match (mbps.get(name), growth.get(name)) {
            (Some(r), Some(g)) => (Some(med(r)), *g),
            _ => (None, (0, 0)),
        };
        let f = med(&first[name]);
        md.push_str(&format!(
            "| {name} | {} | {} | {} | {f:.2} |\n",
            rate.map_or("—".into(), |r| format!("{r:.0}")),
            if rate.is_some() {
                format!("{:.1}", before as f64 / 1024.0)
            } else {
                "—".into()
            },
            if rate.is_some() {
                format!("{:.1}", grew as f64 / 1024.0)
            } else {
                "—".into()
            },
        ));
        rows.push(
            json!({"proxy": name, "mb_per_s": rate, "rss_before_kib": before,
            "rss_growth_kib": grew, "first_event_ms": f}),
        );
    }
    if let (Some(a), Some(b)) = (mbps.get("fencegate"), mbps.get("bare pass-through")) {
        md.push_str(&format!(
            "\nfencegate ÷ bare pass-through throughput: {:.2} (target ≥ 0.9); RSS growth target < 32 MiB.\n",
            med(a) / med(b)
        ));
    }
    eprintln!("{md}");
    Ok((md, json!(rows)))
}

/// S3 list prices (us-east-1, standard): LIST (and PUT) per 1,000 requests, GET per
/// 1,000 requests, in dollars.
const S3_LIST_PER_1000: f64 = 0.005;
const S3_GET_PER_1000: f64 = 0.0004;

/// The sum of counter `name`'s samples whose labels contain `label`.
fn metric_sum(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
        .sum()
}

/// Store calls with many leases of which few are in use: counted over a window of
/// traffic to the used ones, per hour and priced (module doc).
async fn store_calls(
    args: &Args,
    dir: &std::path::Path,
    store_root: &std::path::Path,
    origin: &Proc,
) -> Result<(String, Value), String> {
    let (n, used) = if args.quick {
        (1_000, 10)
    } else {
        (10_000, 100)
    };
    let window = if args.quick {
        Duration::from_secs(5)
    } else {
        Duration::from_secs(20)
    };
    let (mut paths, routes) = lease_routes(store_root, &format!("c{n}"), n)?;
    paths.truncate(used);
    let p = procs::spawn_fencegate(
        &fencegate_exe(),
        &format!("store-calls-{n}"),
        dir,
        store_root,
        &dir.join(format!("state-store-calls-{n}")),
        origin.addr,
        &routes,
        "",
        &[],
    )?;
    let admin = p.admin.ok_or("fencegate without an admin address")?;
    let paths = Arc::new(paths);
    touch_all(p.addr, &paths).await?;
    let calls = |text: &str| {
        (
            metric_sum(text, "fencegate_store_calls_total", "\"list\""),
            metric_sum(text, "fencegate_store_calls_total", "\"get\""),
        )
    };
    let before = calls(&loadgen::get_text(admin, "/metrics").await?);
    let t0 = std::time::Instant::now();
    let out = loadgen::run(&Plan {
        addr: p.addr,
        conns: 4,
        warmup: Duration::ZERO,
        measure: window,
        make: spread(paths.clone(), 77),
        pids: vec![p.pid],
        trees: vec![],
        probe: None,
    })
    .await;
    let after = calls(&loadgen::get_text(admin, "/metrics").await?);
    let secs = t0.elapsed().as_secs_f64();
    let per_hour = |c: f64| c / secs * 3600.0;
    let (lists, gets) = (per_hour(after.0 - before.0), per_hour(after.1 - before.1));
    let price = |l: f64, g: f64| l / 1000.0 * S3_LIST_PER_1000 + g / 1000.0 * S3_GET_PER_1000;
    // Listing every lease once a second, as the refresher did before calls followed
    // traffic (GETs only on a new epoch: none here).
    let every = n as f64 * 3600.0;
    let mut md = format!(
        "\n#### Lease store calls ({n} leases, {used} in use by 4 connections at {:.0} req/s, \
         `refresh_interval_ms` = 1000, measured over {secs:.0} s; S3 list prices: \
         LIST ${S3_LIST_PER_1000} and GET ${S3_GET_PER_1000} per 1,000)\n\n\
         | listing | LIST per hour | GET per hour | $ per hour | $ per 30-day month |\n\
         |---|---:|---:|---:|---:|\n",
        out.rps()
    );
    for (what, l, g) in [
        ("every lease each interval (before)", every, 0.0),
        ("leases in use only (this build, measured)", lists, gets),
    ] {
        md.push_str(&format!(
            "| {what} | {l:.0} | {g:.0} | {:.2} | {:.0} |\n",
            price(l, g),
            price(l, g) * 24.0 * 30.0
        ));
    }
    md.push_str(&format!(
        "\nPer lease in use: {:.2} listings per interval (at most 1 is the target); errors {}.\n",
        lists / 3600.0 / used as f64,
        out.counts.errors
    ));
    eprintln!("{md}");
    Ok((
        md,
        json!({
            "leases": n, "in_use": used, "window_s": secs, "rps": out.rps(),
            "list_per_hour": lists, "get_per_hour": gets,
            "dollars_per_hour": price(lists, gets),
            "every_lease_list_per_hour": every,
            "every_lease_dollars_per_hour": price(every, 0.0),
            "errors": out.counts.errors,
        }),
    ))
}

struct Agg {
    rps: f64,
    cpu_us: f64,
    p50: f64,
    p99: f64,
    errors: u64,
}

/// Writes `n` realistic `done` records (content-derived keys, a 100-byte stored
/// answer) straight into sled, as fencegate would have left them.
async fn prepopulate(data_dir: &std::path::Path, n: u64) -> Result<(), String> {
    use fencegate::dedup::{DedupKey, Record, State, StoredResponse};
    use fencegate::state::StateStore;
    let d = fencegate::state::sled::SledState::open(data_dir).map_err(|e| e.to_string())?;
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let body = bytes::Bytes::from_static(super::roles::ORIGIN_BODY);
    for i in 0..n {
        let key = DedupKey::derive("bench", "POST", "/bench/charge", &i.to_be_bytes());
        let k = fencegate::state::RecordKey {
            route: "bench".into(),
            key: key.as_str().to_owned(),
        };
        let rec = Record {
            state: State::Done,
            fingerprint: fencegate::dedup::fingerprint("POST", "/bench/charge", &i.to_be_bytes()),
            epoch: fencegate::epoch::Epoch::new(1),
            created_ms: now,
            updated_ms: now,
            response: Some(StoredResponse {
                status: 200,
                headers: vec![
                    ("content-type".into(), b"application/json".to_vec()),
                    ("date".into(), b"Sat, 29 Nov 2025 10:00:00 GMT".to_vec()),
                ],
                body: Some(body.clone()),
            }),
            request: Some(fencegate::dedup::RequestLine::new("POST", "/bench/charge")),
        };
        d.put_record(&k, &rec).map_err(|e| e.to_string())?;
    }
    d.commit().await.map_err(|e| e.to_string())?;
    d.close().await.map_err(|e| e.to_string())
}

fn du_mib(path: &std::path::Path) -> f64 {
    fn walk(p: &std::path::Path) -> u64 {
        let Ok(m) = std::fs::symlink_metadata(p) else {
            return 0;
        };
        if m.is_dir() {
            std::fs::read_dir(p)
                .into_iter()
                .flatten()
                .filter_map(Result::ok)
                .map(|e| walk(&e.path()))
                .sum()
        } else {
            use std::os::unix::fs::MetadataExt;
            m.blocks() * 512
        }
    }
    walk(path) as f64 / (1024.0 * 1024.0)
}

async fn dedup_records(
    args: &Args,
    dir: &std::path::Path,
    store_root: &std::path::Path,
    origin: &Proc,
) -> Result<(String, Value), String> {
    let n: u64 = if args.quick { 100_000 } else { 1_000_000 };
    let epochs = procs::store(store_root)?;
    let full_dir = dir.join("state-dedup-full");
    let t0 = std::time::Instant::now();
    prepopulate(&full_dir, n).await?;
    let populate_s = t0.elapsed().as_secs_f64();
    let size = du_mib(&full_dir);
    eprintln!("  wrote {n} dedup records in {populate_s:.1} s ({size:.0} MiB)");
    let mut gates = Vec::new();
    for (name, records) in [("empty", 0), ("full", n)] {
        let lease = format!("bench-dedup-{name}");
        let (e, t) = procs::acquire(&epochs, &lease).await?;
        let t0 = std::time::Instant::now();
        // The filled data_dir's records were written here, not by a set-up:
        // claimed (SPEC §10, one data_dir, one set-up).
        let p = procs::spawn_fencegate_with(
            &fencegate_exe(),
            &format!("dedup-{name}"),
            dir,
            store_root,
            &dir.join(format!("state-dedup-{name}")),
            origin.addr,
            &[RouteSpec {
                derive_key: "content",
                ..fencing_route("bench", &lease)
            }],
            "",
            &[],
            &["--claim-state"],
        )?;
        let startup = t0.elapsed().as_secs_f64();
        let rss = procs::rss_kib(p.pid).0;
        gates.push((name, records, p, Creds::new(e, &t), startup, rss));
    }
    let mut samples: BTreeMap<&str, Vec<(loadgen::Outcome, f64, f64)>> = BTreeMap::new();
    let mut tag = 2_000;
    for _ in 0..rounds(args) {
        for (name, _, p, creds, ..) in &gates {
            tag += 1;
            let before = super::flush_stats(p).await.unwrap_or_default();
            let out = loadgen::run(&Plan {
                addr: p.addr,
                conns: 64,
                warmup: Duration::from_millis(500),
                measure: measure(args),
                make: super::factory(creds.clone(), tag),
                pids: vec![p.pid],
                trees: vec![],
                probe: None,
            })
            .await;
            let after = super::flush_stats(p).await.unwrap_or_default();
            eprintln!(
                "  dedup {name} c=64: {:.0} req/s, p99 {} ms, {:.1} µs CPU/req, errors {}",
                out.rps(),
                ms(out.hist.value_at_quantile(0.99) as f64),
                out.cpu_us(0),
                out.counts.errors
            );
            samples
                .entry(name)
                .or_default()
                .push((out, after.0 - before.0, after.1 - before.1));
        }
    }
    let mut md = format!(
        "\n#### Existing dedup records (durable dedup, c=64; {n} records written into sled in {populate_s:.1} s, {size:.0} MiB on disk)\n\n\
         | records before start | start-up s | req/s | p50 ms | p99 ms | CPU µs/req | records/flush | VmRSS MiB after | errors |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    );
    let mut rows = Vec::new();
    let mut rps = BTreeMap::new();
    for (name, records, p, _, startup, _) in &gates {
        let ss = &samples[name];
        let r = agg_refs(ss.iter().map(|s| &s.0));
        let (rec, bat) = ss.iter().fold((0.0, 0.0), |a, s| (a.0 + s.1, a.1 + s.2));
        let rss = procs::rss_kib(p.pid).0 as f64 / 1024.0;
        rps.insert(*name, r.rps);
        md.push_str(&format!(
            "| {records} | {startup:.1} | {:.0} | {} | {} | {:.1} | {:.1} | {rss:.0} | {} |\n",
            r.rps,
            ms(r.p50),
            ms(r.p99),
            r.cpu_us,
            rec / bat.max(1.0),
            r.errors
        ));
        rows.push(json!({
            "records": records, "startup_s": startup, "rps": r.rps, "p50_us": r.p50,
            "p99_us": r.p99, "cpu_us_per_request": r.cpu_us, "records_per_flush": rec / bat.max(1.0),
            "rss_mib": rss, "errors": r.errors,
        }));
    }
    md.push_str(&format!(
        "\nThroughput with {n} records ÷ without: {:.2}.\n",
        rps["full"] / rps["empty"]
    ));
    Ok((
        md,
        json!({"records": n, "populate_s": populate_s, "size_mib": size, "rows": rows}),
    ))
}

fn agg_refs<'a>(it: impl Iterator<Item = &'a loadgen::Outcome>) -> Agg {
    let mut h = loadgen::histogram();
    let (mut ok, mut secs, mut cpu, mut errors) = (0u64, 0.0, 0.0, 0u64);
    for o in it {
        let _ = h.add(&o.hist);
        ok += o.counts.ok;
        secs += o.secs;
        cpu += o.cpu.first().copied().unwrap_or(0.0);
        errors += o.counts.errors;
    }
    Agg {
        rps: ok as f64 / secs.max(1e-9),
        cpu_us: cpu * 1e6 / ok.max(1) as f64,
        p50: h.value_at_quantile(0.5) as f64,
        p99: h.value_at_quantile(0.99) as f64,
        errors,
    }
}

/// When the idle connections' memory is read a second time, in seconds after the
/// last one opened: past fencegate's park wait (1 s) and its next check.
const SETTLED_S: f64 = 2.5;

async fn idle(
    args: &Args,
    dir: &std::path::Path,
    store_root: &std::path::Path,
    origin: &Proc,
    n: u64,
    nofile: u64,
) -> Result<(String, Value), String> {
    let n = n.min(nofile.saturating_sub(1_000));
    let epochs = procs::store(store_root)?;
    let (e, t) = procs::acquire(&epochs, "bench-idle").await?;
    let creds = Creds::new(e, &t);
    let fg = procs::spawn_fencegate(
        &fencegate_exe(),
        "idle-fencing",
        dir,
        store_root,
        &dir.join("state-idle"),
        origin.addr,
        &[fencing_route("bench", "bench-idle")],
        "",
        &[],
    )?;
    let up = origin.addr.to_string();
    let pt = procs::spawn_role(
        "idle-passthrough",
        &["passthrough", "--upstream", &up],
        dir,
        true,
    )?;
    let mut md = format!(
        "\n#### {n} idle keep-alive connections (each made one request, then idles)\n\n\
         KiB per connection 0.3 s after the last one opened, and again {SETTLED_S} s after (fencegate parks a \
         plain HTTP/1 connection that has rested for 1 s: src/server/park.rs).\n\n\
         | proxy | VmRSS before MiB | VmRSS with idle MiB (0.3 s / {SETTLED_S} s) | KiB per connection at 0.3 s | KiB per connection at {SETTLED_S} s | KiB per connection after the c=64 run beside them | open s | c=64 req/s beside them | c=64 req/s after closing | p99 ms beside / after | still open after 12 s |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    );
    let mut rows = Vec::new();
    let mut tag = 3_000;
    for (name, p) in [
        ("fencegate (fencing only)", &fg),
        ("bare pass-through", &pt),
    ] {
        let busy = |tag: u64| Plan {
            addr: p.addr,
            conns: 64,
            warmup: Duration::from_millis(300),
            measure: if args.quick {
                Duration::from_secs(1)
            } else {
                Duration::from_secs(3)
            },
            make: super::factory(creds.clone(), tag),
            pids: vec![p.pid],
            trees: vec![],
            probe: None,
        };
        tag += 1;
        loadgen::run(&busy(tag)).await; // warm-up
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (rss0, _) = procs::rss_kib(p.pid);
        let t0 = std::time::Instant::now();
        let senders = Arc::new(Mutex::new(Vec::with_capacity(n as usize)));
        let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut tasks = Vec::new();
        for w in 0..128 {
            let (senders, next, creds, addr) =
                (senders.clone(), next.clone(), creds.clone(), p.addr);
            tasks.push(tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= n {
                        return Ok::<_, String>(());
                    }
                    let mut s = loadgen::connect(addr).await?;
                    let a = loadgen::exchange(
                        &mut s,
                        loadgen::request(
                            Uri::from_static("/bench/charge"),
                            &creds,
                            loadgen::body(4, w, i),
                            None,
                        ),
                    )
                    .await?;
                    if !a.status.is_success() {
                        return Err(format!("{} {:?}", a.status, a.code));
                    }
                    senders.lock().expect("senders").push(s);
                }
            }));
        }
        for t in tasks {
            t.await.map_err(|e| e.to_string())??;
        }
        let open_s = t0.elapsed().as_secs_f64();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (rss1, threads) = procs::rss_kib(p.pid);
        tokio::time::sleep(Duration::from_secs_f64(SETTLED_S - 0.3)).await;
        let (rss2, _) = procs::rss_kib(p.pid);
        tag += 1;
        let beside = loadgen::run(&busy(tag)).await;
        let (rss3, _) = procs::rss_kib(p.pid);
        // hyper's header read timeout (fencegate: 10 s) also runs while a
        // keep-alive connection waits for its next request.
        let wait = Duration::from_secs(12).saturating_sub(t0.elapsed());
        tokio::time::sleep(wait).await;
        let still_open = senders
            .lock()
            .expect("senders")
            .iter()
            .filter(|s| !s.is_closed())
            .count();
        senders.lock().expect("senders").clear();
        tokio::time::sleep(Duration::from_millis(500)).await;
        tag += 1;
        let after = loadgen::run(&busy(tag)).await;
        let per_conn = (rss1 as f64 - rss0 as f64) / n as f64;
        let settled = (rss2 as f64 - rss0 as f64) / n as f64;
        let beside_kib = (rss3 as f64 - rss0 as f64) / n as f64;
        eprintln!(
            "  {name}: VmRSS {rss0} → {rss1} KiB ({per_conn:.1} KiB/conn, {threads} threads), after {SETTLED_S} s {rss2} KiB ({settled:.1} KiB/conn), after the busy run beside them {rss3} KiB ({beside_kib:.1} KiB/conn), opened in {open_s:.1} s; \
             c=64 {:.0} req/s beside, {:.0} after; {still_open}/{n} open after 12 s",
            beside.rps(),
            after.rps()
        );
        md.push_str(&format!(
            "| {name} | {:.1} | {:.1} / {:.1} | {per_conn:.1} | {settled:.1} | {beside_kib:.1} | {open_s:.1} | {:.0} | {:.0} | {} / {} | {still_open} |\n",
            rss0 as f64 / 1024.0,
            rss1 as f64 / 1024.0,
            rss2 as f64 / 1024.0,
            beside.rps(),
            after.rps(),
            ms(beside.hist.value_at_quantile(0.99) as f64),
            ms(after.hist.value_at_quantile(0.99) as f64),
        ));
        rows.push(json!({
            "proxy": name, "connections": n, "rss_before_kib": rss0, "rss_with_idle_kib": rss1,
            "kib_per_connection": per_conn, "kib_per_connection_settled": settled,
            "rss_settled_kib": rss2, "rss_after_busy_beside_kib": rss3,
            "kib_per_connection_after_busy_beside": beside_kib, "open_s": open_s,
            "rps_beside_idle": beside.rps(), "rps_after_closing": after.rps(),
            "p99_beside_us": beside.hist.value_at_quantile(0.99), "p99_after_us": after.hist.value_at_quantile(0.99),
            "errors": beside.counts.errors + after.counts.errors,
            "still_open_after_12s": still_open,
        }));
    }
    Ok((md, json!(rows)))
}

/// One answered request of the epoch run.
struct Seen {
    conn: usize,
    epoch: u64,
    /// µs since the run started.
    sent_us: u64,
    latency_us: u64,
    status: u16,
    code: Option<String>,
}

async fn epochs_under_load(
    args: &Args,
    dir: &std::path::Path,
    store_root: &std::path::Path,
    origin: &Proc,
) -> Result<(String, Value), String> {
    let epochs = procs::store(store_root)?;
    let lease = "bench-epochs";
    let mut held = procs::acquire(&epochs, lease).await?;
    let p = procs::spawn_fencegate(
        &fencegate_exe(),
        "epochs",
        dir,
        store_root,
        &dir.join("state-epochs"),
        origin.addr,
        &[fencing_route("bench", lease)],
        "",
        &[],
    )?;
    let admin = p.admin.ok_or("no admin address")?;
    let changes = if args.quick { 5 } else { 20 };
    let current = Arc::new(Mutex::new((held.0, Creds::new(held.0, &held.1))));
    let start = tokio::time::Instant::now();
    let end = start + Duration::from_secs(changes as u64 + 2);
    let metrics_before = loadgen::get_text(admin, "/metrics").await?;
    let cpu0 = procs::cpu_secs(p.pid);
    let mut tasks = Vec::new();
    for conn in 0..64usize {
        let (current, addr) = (current.clone(), p.addr);
        tasks.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            let mut s = loadgen::connect(addr).await?;
            let mut seq = 0;
            while tokio::time::Instant::now() < end {
                let (epoch, creds) = {
                    let c = current.lock().expect("current epoch");
                    (c.0, c.1.clone())
                };
                seq += 1;
                let t0 = tokio::time::Instant::now();
                let a = loadgen::exchange(
                    &mut s,
                    loadgen::request(
                        Uri::from_static("/bench/charge"),
                        &creds,
                        loadgen::body(5, conn, seq),
                        None,
                    ),
                )
                .await?;
                seen.push(Seen {
                    conn,
                    epoch,
                    sent_us: (t0 - start).as_micros() as u64,
                    latency_us: t0.elapsed().as_micros() as u64,
                    status: a.status.as_u16(),
                    code: a.code,
                });
            }
            Ok::<_, String>(seen)
        }));
    }
    let first_epoch = held.0;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut renew_ms = Vec::new();
    for _ in 0..changes {
        let t = std::time::Instant::now();
        held = procs::renew(&epochs, lease, held.0, &held.1).await?;
        renew_ms.push(t.elapsed().as_secs_f64() * 1e3);
        *current.lock().expect("current epoch") = (held.0, Creds::new(held.0, &held.1));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let mut seen = Vec::new();
    for t in tasks {
        seen.extend(t.await.map_err(|e| e.to_string())??);
    }
    let cpu = procs::cpu_secs(p.pid) - cpu0;
    let metrics_after = loadgen::get_text(admin, "/metrics").await?;
    let leases_json: Value = serde_json::from_str(&loadgen::get_text(admin, "/v1/leases").await?)
        .map_err(|e| e.to_string())?;
    let drains = leases_json["leases"][0]["drains_started"]
        .as_u64()
        .unwrap_or(0);
    let hist_name = "fencegate_admission_duration_seconds";
    let (hb, ha) = (
        loadgen::buckets(&metrics_before, hist_name),
        loadgen::buckets(&metrics_after, hist_name),
    );

    // Per connection, its first request at each new epoch.
    seen.sort_by_key(|s| s.sent_us);
    let mut first: BTreeMap<(usize, u64), usize> = BTreeMap::new();
    let mut first_of_epoch: BTreeMap<u64, usize> = BTreeMap::new();
    for (i, s) in seen.iter().enumerate() {
        first.entry((s.conn, s.epoch)).or_insert(i);
        first_of_epoch.entry(s.epoch).or_insert(i);
    }
    let is_first: std::collections::HashSet<usize> = first
        .iter()
        .filter(|((_, e), _)| *e > first_epoch)
        .map(|(_, i)| *i)
        .collect();
    let ok = |s: &Seen| (200..300).contains(&s.status);
    let firsts: Vec<f64> = is_first
        .iter()
        .map(|i| &seen[*i])
        .filter(|s| ok(s))
        .map(|s| s.latency_us as f64)
        .collect();
    let very_first: Vec<f64> = first_of_epoch
        .iter()
        .filter(|(e, _)| **e > first_epoch)
        .map(|(_, i)| seen[*i].latency_us as f64)
        .collect();
    let steady: Vec<f64> = seen
        .iter()
        .enumerate()
        .filter(|(i, s)| !is_first.contains(i) && ok(s) && s.sent_us > 1_000_000)
        .map(|(_, s)| s.latency_us as f64)
        .collect();
    let stale = seen
        .iter()
        .filter(|s| s.code.as_deref() == Some("epoch_stale"))
        .count();
    let other_errors: BTreeMap<String, usize> = seen
        .iter()
        .filter(|s| !ok(s) && s.code.as_deref() != Some("epoch_stale"))
        .fold(BTreeMap::new(), |mut m, s| {
            *m.entry(format!(
                "{} {}",
                s.status,
                s.code.clone().unwrap_or_default()
            ))
            .or_default() += 1;
            m
        });
    let answered = seen.iter().filter(|s| ok(s)).count();
    let secs = (end - start).as_secs_f64();
    let adm = |q| loadgen::bucket_quantile(&hb, &ha, q).map_or(f64::NAN, |s| s * 1e6);
    let md = format!(
        "\n#### Epoch changes under load (fencing only, 64 connections, a new epoch every second, {changes} changes)\n\n\
         | requests | first request per connection at a new epoch: p50 / p99 / max ms | first request of each epoch: p50 / max ms | all other requests: p50 / p99 ms | 409 epoch_stale | other errors | drains | admission p99 / p99.9 / p99.99 (histogram bucket) | CPU µs/req |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|\n\
         | {answered} | {} / {} / {} | {} / {} | {} / {} | {stale} | {other_errors:?} | {drains} | ≤{:.0} / ≤{:.0} / ≤{:.0} µs | {:.1} |\n\
         \nA renew (new epoch object in the dir store, two fsyncs) took p50 {:.1} ms. The first request per connection at a new epoch waits for the on-demand store read, the mark flush and the drain of older requests still in flight; 409s are requests sent at the old epoch that arrived after the new one was admitted (expected). Throughput over the run: {:.0} req/s.\n",
        ms(quantile(&firsts, 0.5)),
        ms(quantile(&firsts, 0.99)),
        ms(quantile(&firsts, 1.0)),
        ms(quantile(&very_first, 0.5)),
        ms(quantile(&very_first, 1.0)),
        ms(quantile(&steady, 0.5)),
        ms(quantile(&steady, 0.99)),
        adm(0.99),
        adm(0.999),
        adm(0.9999),
        cpu * 1e6 / answered.max(1) as f64,
        quantile(&renew_ms, 0.5),
        answered as f64 / secs,
    );
    let j = json!({
        "changes": changes, "answered": answered,
        "first_per_connection_us": {"p50": quantile(&firsts, 0.5), "p99": quantile(&firsts, 0.99), "max": quantile(&firsts, 1.0), "n": firsts.len()},
        "first_of_epoch_us": {"p50": quantile(&very_first, 0.5), "max": quantile(&very_first, 1.0)},
        "steady_us": {"p50": quantile(&steady, 0.5), "p99": quantile(&steady, 0.99)},
        "epoch_stale_409": stale, "other_errors": other_errors, "drains_started": drains,
        "admission_bucket_us": {"p50": adm(0.5), "p99": adm(0.99), "p999": adm(0.999), "p9999": adm(0.9999)},
        "renew_ms_p50": quantile(&renew_ms, 0.5),
    });
    Ok((md, j))
}
