//! `--queue-backlog [N]`: queued delivery (SPEC §11) with a backlog.
//!
//! For each lease count of `--leases` (default 1 and 16): a fencegate with that
//! many queued routes, one lease each, whose upstream is a port where nothing
//! listens. N messages are accepted over 64 connections, spread evenly over
//! the routes, while every delivery attempt fails (connection refused: the
//! first message of each lease is tried once and then waits for its next
//! attempt, an hour away); fencegate's RSS (`VmRSS`) and its data directory's
//! size are read every 10,000 accepted messages. Then an origin starts on that
//! port, an operator's retry makes each lease's first message due now, and the
//! bench counts arrivals at the origin until all N are there and
//! `fencegate_queue_depth` is 0 on every route: the drain rate. The direct routes
//! it is compared with — fencing only (`derive_key = "none"`) and durable dedup
//! (`derive_key = "content"`), each a fencegate of its own — are measured at
//! c=1 and c=64 just before and just after each drain (their mean is the
//! reference), in the same run, on the same CPU. `--fencegate-b PATH` runs
//! the queued fencegate from another build (the direct ones stay this one's):
//! an A/B is two runs, each drain read against its own run's direct routes.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};

use super::loadgen::{self, Creds, Plan};
use super::procs::{self, Proc, RouteSpec};
use super::{factory, flush_stats, fmt_ratio, nproc, queue_depth, scratch, target_dir, Args};

/// The queued routes' lines: the first message of each lease, refused by the
/// unreachable origin, waits an hour for its next attempt — until the bench's
/// operator retry.
const BACKLOG_ROUTE: &str = "delivery = \"queued\"\nretry = { schedule = [\"1h\"] }";

const ADMIN_TOKEN: &str = "bench-admin-token-0123456789abcdef";

/// Connections the messages are accepted over.
const ACCEPT_CONNS: usize = 64;

/// One RSS reading during the accept phase.
#[derive(Debug, Clone)]
struct RssSample {
    accepted: u64,
    secs: f64,
    rss_kib: u64,
    threads: u64,
    disk_bytes: u64,
}

/// A direct route's figures at one concurrency.
#[derive(Debug, Clone, Copy, Default)]
struct Direct {
    rps: f64,
    cpu_us: f64,
}

struct DirectTarget {
    key: &'static str,
    proc_: Proc,
    creds: Creds,
}

/// One lease count's run.
struct Run {
    leases: usize,
    messages: u64,
    accept_secs: f64,
    accept_cpu_us: f64,
    rss: Vec<RssSample>,
    rss_before_kib: u64,
    rss_after_drain_kib: u64,
    metrics_scrape_ms: f64,
    drain_secs: f64,
    last_arrival_secs: f64,
    /// Arrivals per second between 10% and 90% of the messages.
    steady_rate: f64,
    /// (seconds since the drain began, arrivals), about every second.
    timeline: Vec<(f64, u64)>,
    cpu_us_per_msg: f64,
    origin_cpu_us_per_msg: f64,
    perf: Option<Vec<(String, f64)>>,
    /// Keyed by (target, concurrency): before and after the drain.
    direct: Vec<(&'static str, usize, Direct, Direct)>,
    arrivals: u64,
    /// `--restart`: RSS KiB before and after, and the start-up's seconds.
    restart: Option<(u64, u64, f64)>,
    /// Over the drain: records per flush, flushes per message.
    flushes: Option<(f64, f64)>,
}

impl Run {
    fn drain_rate(&self) -> f64 {
        self.messages as f64 / self.drain_secs.max(1e-9)
    }
}

pub async fn run(args: &Args) -> Result<(), String> {
    let n = args.backlog.unwrap_or(100_000) as u64;
    let load_before = procs::loadavg();
    let dir = scratch("bench-backlog-")?;
    let conc: Vec<usize> = if args.smoke { vec![8] } else { vec![1, 64] };
    let origin = procs::spawn_role("origin", &["origin"], dir.path(), false)?;
    // The direct routes compared with, each a fencegate with a store of its own.
    let mut direct = Vec::new();
    for (key, derive_key) in [("fencing", "none"), ("dedup", "content")] {
        let lease = format!("bench-{key}");
        let store = dir.path().join(format!("leases-{key}"));
        let (e, t) = procs::acquire(&procs::store(&store)?, &lease).await?;
        let p = procs::spawn_fencegate(
            Path::new(env!("CARGO_BIN_EXE_fencegate")),
            key,
            dir.path(),
            &store,
            &dir.path().join(format!("state-{key}")),
            origin.addr,
            &[RouteSpec {
                name: "bench".into(),
                prefix: "/bench/".into(),
                lease,
                derive_key,
                extra: String::new(),
                upstream: None,
            }],
            "",
            &[],
        )?;
        direct.push(DirectTarget {
            key,
            proc_: p,
            creds: Creds::new(e, &t),
        });
    }
    eprintln!(
        "bench load: queue backlog of {n} messages, leases {:?}; direct routes at c={conc:?}; pinned to CPU {:?}; load average {load_before}",
        args.backlog_leases, args.cpu
    );
    // Warm the direct routes (pools, the first epoch's mark).
    if !args.smoke {
        for t in &direct {
            measure(
                t,
                &origin,
                64,
                Duration::ZERO,
                Duration::from_millis(700),
                0,
            )
            .await;
        }
    }
    let mut runs = Vec::new();
    for (i, &leases) in args.backlog_leases.iter().enumerate() {
        runs.push(
            one(
                args,
                dir.path(),
                n,
                leases,
                &direct,
                &origin,
                &conc,
                i as u64,
            )
            .await?,
        );
    }
    let load_after = procs::loadavg();
    let (md, js) = report(args, &runs, &conc, &load_before, &load_after);
    let path = target_dir().join(if args.smoke {
        "bench-queue-backlog-smoke.json"
    } else {
        "bench-queue-backlog.json"
    });
    std::fs::write(&path, serde_json::to_vec_pretty(&js).unwrap_or_default())
        .map_err(|e| format!("{}: {e}", path.display()))?;
    println!("{md}");
    println!("JSON: {}", path.display());
    for r in &runs {
        if r.arrivals < r.messages {
            return Err(format!(
                "{} leases: {} of {} messages arrived",
                r.leases, r.arrivals, r.messages
            ));
        }
    }
    Ok(())
}

/// A direct route's window at concurrency `c`.
async fn measure(
    t: &DirectTarget,
    origin: &Proc,
    c: usize,
    warm: Duration,
    window: Duration,
    tag: u64,
) -> Direct {
    let out = loadgen::run(&Plan {
        addr: t.proc_.addr,
        conns: c,
        warmup: warm,
        measure: window,
        make: factory(t.creds.clone(), tag),
        pids: vec![t.proc_.pid, origin.pid],
        trees: vec![],
        probe: None,
    })
    .await;
    Direct {
        rps: out.rps(),
        cpu_us: out.cpu_us(0),
    }
}

async fn measure_direct(
    args: &Args,
    direct: &[DirectTarget],
    origin: &Proc,
    conc: &[usize],
    tag: &mut u64,
) -> Vec<(&'static str, usize, Direct)> {
    let mut out = Vec::new();
    for &c in conc {
        for t in direct {
            *tag += 1;
            let d = measure(t, origin, c, args.warm(), args.measure(), 1_000_000 + *tag).await;
            eprintln!(
                "  direct {:<8} c={c:<3} {:>8.0} req/s  cpu {:>5.1} µs/req",
                t.key, d.rps, d.cpu_us
            );
            out.push((t.key, c, d));
        }
    }
    out
}

/// A port where nothing listens now, outside the ephemeral range (so no
/// outgoing connection takes it before the late origin binds it).
fn dead_port() -> Result<u16, String> {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let seed = std::process::id() as u16;
    let span = low.saturating_sub(10_000).max(1);
    for i in 0..2000u16 {
        let port = 10_000 + (seed.wrapping_add(i.wrapping_mul(7919))) % span;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Err("no free port below the ephemeral range".into())
}

/// Bytes of the files under `dir`.
fn disk_bytes(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => disk_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

/// `POST`s or `GET`s on the admin listener with the admin token.
async fn admin_call(admin: SocketAddr, method: &str, path: &str) -> Result<String, String> {
    let mut s = loadgen::connect(admin).await?;
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "bench.local")
        .header("authorization", format!("Bearer {ADMIN_TOKEN}"))
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    s.ready().await.map_err(|e| e.to_string())?;
    let resp = s.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    let body = String::from_utf8_lossy(&body).into_owned();
    if !status.is_success() {
        return Err(format!("{method} {path}: {status} {body}"));
    }
    Ok(body)
}

/// A path segment, percent-escaped.
fn segment(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// The sum of `fencegate_queue_depth` over the routes.
async fn depth_of(p: &Proc, routes: &[String]) -> Result<f64, String> {
    let mut total = 0.0;
    for r in routes {
        total += queue_depth(p, r).await?;
    }
    Ok(total)
}

async fn origin_count(origin: &Proc) -> Result<u64, String> {
    let text = loadgen::get_text(origin.addr, super::roles::COUNT_PATH).await?;
    text.trim()
        .parse()
        .map_err(|_| format!("origin count {text:?}"))
}

#[allow(clippy::too_many_arguments)]
async fn one(
    args: &Args,
    dir: &Path,
    n: u64,
    leases: usize,
    direct: &[DirectTarget],
    origin: &Proc,
    conc: &[usize],
    run_no: u64,
) -> Result<Run, String> {
    let port = dead_port()?;
    let up = SocketAddr::from(([127, 0, 0, 1], port));
    let store = dir.join(format!("leases-queued-{leases}"));
    let epochs = procs::store(&store)?;
    let mut lanes: Vec<(Uri, Creds)> = Vec::new();
    let mut routes = Vec::new();
    let mut names = Vec::new();
    for i in 0..leases {
        let lease = format!("bench-q{i}");
        let (e, t) = procs::acquire(&epochs, &lease).await?;
        let prefix = format!("/q{i}/");
        lanes.push((
            Uri::try_from(format!("{prefix}charge")).map_err(|e| e.to_string())?,
            Creds::new(e, &t),
        ));
        names.push(format!("q{i}"));
        routes.push(RouteSpec {
            name: format!("q{i}"),
            prefix,
            lease,
            derive_key: "content",
            extra: BACKLOG_ROUTE.into(),
            upstream: Some(up),
        });
    }
    let name = format!("queued-{leases}");
    let data_dir = dir.join(format!("state-{name}"));
    // `--fencegate-b PATH`: the queued fencegate is that build (A/B against
    // another run of this bench; the direct routes stay this build's).
    let exe = super::scaling::fencegate_exe();
    let spawn = || {
        procs::spawn_fencegate(
            &exe,
            &name,
            dir,
            &store,
            &data_dir,
            origin.addr,
            &routes,
            &format!("admin_token = {ADMIN_TOKEN:?}\n"),
            &[],
        )
    };
    let mut fg = spawn()?;
    let rss_before_kib = procs::rss_kib(fg.pid).0;
    let tag = 7_000_000 + run_no;

    // Each lease's first message, one at a time: its key is what the
    // operator's retry names.
    let mut heads = Vec::new();
    {
        let mut s = loadgen::connect(fg.addr).await?;
        for (i, (uri, creds)) in lanes.iter().enumerate() {
            let req = loadgen::request(uri.clone(), creds, loadgen::body(tag, 0, i as u64), None);
            s.ready().await.map_err(|e| e.to_string())?;
            let resp = s.send_request(req).await.map_err(|e| e.to_string())?;
            let status = resp.status();
            let key = resp
                .headers()
                .get("x-fencegate-dedup-key")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let _ = resp.into_body().collect().await;
            match (status, key) {
                (StatusCode::ACCEPTED, Some(k)) => heads.push((names[i].clone(), k)),
                (st, _) => {
                    return Err(format!(
                        "the first message of q{i}: {st}, not 202 with a key\n{}",
                        fg.log_tail()
                    ))
                }
            }
        }
    }

    // The rest, over 64 connections; RSS every 10,000 (a tenth of a smaller N).
    let step = (n / 10).clamp(1, 10_000);
    let lanes = Arc::new(lanes);
    let next = Arc::new(AtomicU64::new(leases as u64));
    let done = Arc::new(AtomicU64::new(leases as u64));
    let samples = Arc::new(Mutex::new(Vec::<RssSample>::new()));
    let first_error = Arc::new(Mutex::new(None::<String>));
    let t0 = Instant::now();
    let cpu0 = procs::cpu_secs(fg.pid);
    let mut tasks = Vec::new();
    for _ in 0..ACCEPT_CONNS {
        let (lanes, next, done, samples, first_error) = (
            lanes.clone(),
            next.clone(),
            done.clone(),
            samples.clone(),
            first_error.clone(),
        );
        let (addr, pid, data_dir) = (fg.addr, fg.pid, data_dir.clone());
        tasks.push(tokio::spawn(async move {
            let mut s = match loadgen::connect(addr).await {
                Ok(s) => s,
                Err(e) => {
                    first_error.lock().unwrap().get_or_insert(e);
                    return;
                }
            };
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return;
                }
                let (uri, creds) = &lanes[i as usize % lanes.len()];
                let req = loadgen::request(uri.clone(), creds, loadgen::body(tag, 0, i), None);
                match loadgen::exchange(&mut s, req).await {
                    Ok(a) if a.status == StatusCode::ACCEPTED => {
                        let d = done.fetch_add(1, Ordering::Relaxed) + 1;
                        if d % step == 0 || d == n {
                            let (rss_kib, threads) = procs::rss_kib(pid);
                            samples.lock().unwrap().push(RssSample {
                                accepted: d,
                                secs: t0.elapsed().as_secs_f64(),
                                rss_kib,
                                threads,
                                disk_bytes: disk_bytes(&data_dir),
                            });
                        }
                    }
                    Ok(a) => {
                        first_error.lock().unwrap().get_or_insert(format!(
                            "{} {}",
                            a.status,
                            a.code.unwrap_or_default()
                        ));
                        return;
                    }
                    Err(e) => {
                        first_error.lock().unwrap().get_or_insert(e);
                        return;
                    }
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let accept_secs = t0.elapsed().as_secs_f64();
    let accept_cpu_us = (procs::cpu_secs(fg.pid) - cpu0) * 1e6 / n as f64;
    if let Some(e) = first_error.lock().unwrap().take() {
        return Err(format!("accepting: {e}\n{}", fg.log_tail()));
    }
    let accepted = done.load(Ordering::Relaxed);
    let mut rss: Vec<RssSample> = samples.lock().unwrap().clone();
    rss.sort_by_key(|s| s.accepted);
    let ts = Instant::now();
    let depth = depth_of(&fg, &names).await?;
    let metrics_scrape_ms = ts.elapsed().as_secs_f64() * 1e3 / names.len() as f64;
    eprintln!(
        "  {leases} lease(s): {accepted} accepted in {accept_secs:.1} s ({:.0}/s, {accept_cpu_us:.1} µs CPU each); depth {depth}; RSS {} MiB; a /metrics scrape {metrics_scrape_ms:.1} ms",
        accepted as f64 / accept_secs,
        procs::rss_kib(fg.pid).0 / 1024
    );
    if depth as u64 != n {
        return Err(format!("{n} accepted but the queue depth is {depth}"));
    }
    // `--restart`: the memory a fresh process needs for the same backlog
    // (what the accepting one holds beyond it is cache).
    let mut restart = None;
    if args.backlog_restart {
        let rss_before = procs::rss_kib(fg.pid).0;
        drop(fg);
        let t = Instant::now();
        fg = spawn()?;
        let startup = t.elapsed().as_secs_f64();
        let rss = procs::rss_kib(fg.pid).0;
        eprintln!(
            "  restarted with {n} queued: RSS {} MiB before, {} MiB after a start of {startup:.2} s",
            rss_before / 1024,
            rss / 1024
        );
        restart = Some((rss_before, rss, startup));
    }
    let admin = fg.admin.ok_or("fencegate without an admin address")?;
    let mut dtag = 100 * run_no;
    let before = measure_direct(args, direct, origin, conc, &mut dtag).await;

    // The origin comes up on the dead port; each lease's first message is due now.
    let t0 = Instant::now();
    let cpu0 = procs::cpu_secs(fg.pid);
    let flush0 = flush_stats(&fg).await;
    let late = procs::spawn_role(
        "origin-late",
        &["origin", "--port", &port.to_string()],
        dir,
        false,
    )?;
    let perf = args.perf.then(|| perf_start(fg.pid, dir)).flatten();
    for (route, key) in &heads {
        admin_call(
            admin,
            "POST",
            &format!("/v1/deliveries/{}/{}/retry", segment(route), segment(key)),
        )
        .await?;
    }
    let ocpu0 = procs::cpu_secs(late.pid);
    let mut timeline = vec![(0.0, 0u64)];
    let mut last_mark = 0.0;
    let mut arrivals = 0;
    let deadline = Duration::from_secs(1800);
    while arrivals < n {
        if t0.elapsed() > deadline {
            return Err(format!(
                "{arrivals} of {n} messages arrived in {} s\n{}",
                deadline.as_secs(),
                fg.log_tail()
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        arrivals = origin_count(&late).await?;
        let now = t0.elapsed().as_secs_f64();
        if now - last_mark >= 1.0 || arrivals >= n {
            timeline.push((now, arrivals));
            last_mark = now;
        }
    }
    let last_arrival_secs = t0.elapsed().as_secs_f64();
    loop {
        if depth_of(&fg, &names).await? == 0.0 {
            break;
        }
        if t0.elapsed() > deadline {
            return Err(format!(
                "the queue is not empty after {} s",
                deadline.as_secs()
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let drain_secs = t0.elapsed().as_secs_f64();
    let cpu_us_per_msg = (procs::cpu_secs(fg.pid) - cpu0) * 1e6 / n as f64;
    let origin_cpu_us_per_msg = (procs::cpu_secs(late.pid) - ocpu0) * 1e6 / n as f64;
    let perf = perf.map(|p| perf_stop(p, n));
    // Durable writes over the drain: (records per flush, flushes per message).
    let flushes = match (flush0, flush_stats(&fg).await) {
        (Some(a), Some(b)) => Some(((b.0 - a.0) / (b.1 - a.1).max(1.0), (b.1 - a.1) / n as f64)),
        _ => None,
    };
    let arrivals = origin_count(&late).await?;
    let rss_after_drain_kib = procs::rss_kib(fg.pid).0;
    // Arrivals per second between 10% and 90% of the messages.
    let at = |share: f64| {
        timeline
            .iter()
            .find(|(_, a)| *a as f64 >= share * n as f64)
            .copied()
    };
    let steady_rate = match (at(0.1), at(0.9)) {
        (Some(a), Some(b)) if b.0 > a.0 => (b.1 - a.1) as f64 / (b.0 - a.0),
        _ => f64::NAN,
    };
    eprintln!(
        "  {leases} lease(s): drained {n} in {drain_secs:.1} s ({:.0} msg/s; 10–90%: {steady_rate:.0}/s), {cpu_us_per_msg:.1} µs CPU/msg; {arrivals} arrived",
        n as f64 / drain_secs
    );
    let after = measure_direct(args, direct, origin, conc, &mut dtag).await;
    drop(late);
    drop(fg);
    Ok(Run {
        restart,
        flushes,
        leases,
        messages: n,
        accept_secs,
        accept_cpu_us,
        rss,
        rss_before_kib,
        rss_after_drain_kib,
        metrics_scrape_ms,
        drain_secs,
        last_arrival_secs,
        steady_rate,
        timeline,
        cpu_us_per_msg,
        origin_cpu_us_per_msg,
        perf,
        direct: before
            .iter()
            .zip(&after)
            .map(|(b, a)| (b.0, b.1, b.2, a.2))
            .collect(),
        arrivals,
    })
}

/// `perf stat` attached to fencegate (software counters: this VM has no PMU);
/// with `BENCH_PERF_RECORD` set, also `perf record` on the CPU clock, whose
/// report goes to `target/bench-queue-backlog-perf-PID.txt`.
struct Perf {
    child: std::process::Child,
    out: PathBuf,
    record: Option<(std::process::Child, PathBuf, u32)>,
}

fn perf_start(pid: u32, dir: &Path) -> Option<Perf> {
    let out = dir.join(format!("perf-{pid}.csv"));
    let record = std::env::var_os("BENCH_PERF_RECORD").and_then(|_| {
        let data = dir.join(format!("perf-{pid}.data"));
        std::process::Command::new("perf")
            .args(["record", "-F", "1999", "-o"])
            .arg(&data)
            .args(["-p", &pid.to_string()])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .ok()
            .map(|c| (c, data, pid))
    });
    let child = std::process::Command::new("perf")
        .args([
            "stat",
            "-x",
            ",",
            "-e",
            "task-clock,context-switches,cpu-migrations,page-faults,raw_syscalls:sys_enter",
            "-o",
        ])
        .arg(&out)
        .args(["-p", &pid.to_string()])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| eprintln!("bench load: perf stat: {e}"))
        .ok()?;
    // perf attaches asynchronously.
    std::thread::sleep(Duration::from_millis(200));
    Some(Perf { child, out, record })
}

/// The counters per message.
fn perf_stop(mut p: Perf, n: u64) -> Vec<(String, f64)> {
    // SAFETY: kill(2) on our own child.
    unsafe {
        libc::kill(p.child.id() as libc::pid_t, libc::SIGINT);
    }
    let _ = p.child.wait();
    if let Some((mut c, data, pid)) = p.record.take() {
        // SAFETY: kill(2) on our own child.
        unsafe {
            libc::kill(c.id() as libc::pid_t, libc::SIGINT);
        }
        let _ = c.wait();
        let report = target_dir().join(format!("bench-queue-backlog-perf-{pid}.txt"));
        let out = std::process::Command::new("perf")
            .args([
                "report",
                "--stdio",
                "--no-children",
                "--sort",
                "dso,symbol",
                "-i",
            ])
            .arg(&data)
            .output();
        if let Ok(o) = out {
            let _ = std::fs::write(&report, o.stdout);
            eprintln!("  perf report: {}", report.display());
        }
    }
    let text = std::fs::read_to_string(&p.out).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            let v: f64 = f.first()?.parse().ok()?;
            Some((f.get(2)?.to_string(), v / n as f64))
        })
        .collect()
}

fn report(
    args: &Args,
    runs: &[Run],
    conc: &[usize],
    load_before: &str,
    load_after: &str,
) -> (String, Value) {
    let mib = |k: u64| k as f64 / 1024.0;
    let mut md = String::new();
    let mut checks = Vec::new();
    let mut runs_json = Vec::new();
    for r in runs {
        md.push_str(&format!(
            "\n### Queue backlog: {} messages, {} lease(s), destination unreachable while they were accepted\n\n\
             Accepted over {ACCEPT_CONNS} connections in {:.1} s ({:.0}/s, {:.1} µs of fencegate CPU each). \
             fencegate RSS before the first: {:.1} MiB; after the drain: {:.1} MiB. One /metrics scrape at this depth: {:.1} ms.{}\n\n\
             | accepted | fencegate RSS MiB | threads | data_dir MiB | accepted/s since the last reading |\n|---:|---:|---:|---:|---:|\n",
            r.messages,
            r.leases,
            r.accept_secs,
            r.messages as f64 / r.accept_secs,
            r.accept_cpu_us,
            mib(r.rss_before_kib),
            mib(r.rss_after_drain_kib),
            r.metrics_scrape_ms,
            r.restart.map_or(String::new(), |(b, a, secs)| format!(
                " Restarted with the backlog queued (`--restart`): RSS {:.1} MiB before the stop, {:.1} MiB after a start of {secs:.2} s.",
                mib(b),
                mib(a)
            )),
        ));
        let mut prev = (0u64, 0.0f64);
        for s in &r.rss {
            md.push_str(&format!(
                "| {} | {:.1} | {} | {:.1} | {:.0} |\n",
                s.accepted,
                mib(s.rss_kib),
                s.threads,
                s.disk_bytes as f64 / 1048576.0,
                (s.accepted - prev.0) as f64 / (s.secs - prev.1).max(1e-9),
            ));
            prev = (s.accepted, s.secs);
        }
        let direct_ref = |key: &str, c: usize| {
            r.direct
                .iter()
                .find(|d| d.0 == key && d.1 == c)
                .map(|d| (d.2.rps + d.3.rps) / 2.0)
        };
        md.push_str(&format!(
            "\nDrain: {} messages in {:.1} s once the destination was up: **{:.0} msg/s** (last arrival at {:.1} s; \
             10–90% of arrivals at {:.0} msg/s); fencegate CPU {:.1} µs/msg, the origin's {:.1}.\n",
            r.messages,
            r.drain_secs,
            r.drain_rate(),
            r.last_arrival_secs,
            r.steady_rate,
            r.cpu_us_per_msg,
            r.origin_cpu_us_per_msg,
        ));
        if let Some((rpf, fpm)) = r.flushes {
            md.push_str(&format!(
                "Durable writes over the drain (fencegate_flush_records_total ÷ fencegate_flush_batches_total): {rpf:.2} records per flush, {fpm:.2} flushes per message.\n"
            ));
        }
        if let Some(p) = &r.perf {
            md.push_str(&format!(
                "perf stat on fencegate over the drain, per message: {}.\n",
                p.iter()
                    .map(|(k, v)| format!("{k} {v:.2}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        md.push_str(
            "\n| direct route | conns | req/s before | req/s after | CPU µs/req | drain ÷ direct |\n|---|---:|---:|---:|---:|---:|\n",
        );
        for d in &r.direct {
            let mean = (d.2.rps + d.3.rps) / 2.0;
            md.push_str(&format!(
                "| {} | {} | {:.0} | {:.0} | {:.1} | {} |\n",
                d.0,
                d.1,
                d.2.rps,
                d.3.rps,
                (d.2.cpu_us + d.3.cpu_us) / 2.0,
                fmt_ratio(r.drain_rate() / mean)
            ));
        }
        if !args.smoke {
            for key in ["fencing", "dedup"] {
                for &c in conc {
                    if let Some(m) = direct_ref(key, c) {
                        let v = r.drain_rate() / m;
                        let name = format!(
                            "queue backlog, {} lease(s): drain ≥ 0.50× direct {key} c={c}",
                            r.leases
                        );
                        md.push_str(&format!(
                            "- {} {name}: {}\n",
                            if v >= 0.5 { "met" } else { "MISSED" },
                            fmt_ratio(v)
                        ));
                        checks.push(json!({"target": name, "value": v, "met": v >= 0.5}));
                    }
                }
            }
        }
        runs_json.push(json!({
            "leases": r.leases,
            "messages": r.messages,
            "accept_secs": r.accept_secs,
            "accept_cpu_us_per_message": r.accept_cpu_us,
            "rss_before_kib": r.rss_before_kib,
            "rss_after_drain_kib": r.rss_after_drain_kib,
            "rss": r.rss.iter().map(|s| json!({
                "accepted": s.accepted, "secs": s.secs, "rss_kib": s.rss_kib,
                "threads": s.threads, "disk_bytes": s.disk_bytes,
            })).collect::<Vec<_>>(),
            "metrics_scrape_ms": r.metrics_scrape_ms,
            "drain_secs": r.drain_secs,
            "drain_msgs_per_sec": r.drain_rate(),
            "last_arrival_secs": r.last_arrival_secs,
            "steady_msgs_per_sec": r.steady_rate,
            "timeline": r.timeline,
            "cpu_us_per_message": r.cpu_us_per_msg,
            "origin_cpu_us_per_message": r.origin_cpu_us_per_msg,
            "perf_per_message": r.perf.as_ref().map(|p| p.iter().cloned().collect::<std::collections::BTreeMap<_, _>>()),
            "direct": r.direct.iter().map(|d| json!({
                "target": d.0, "concurrency": d.1,
                "rps_before": d.2.rps, "rps_after": d.3.rps,
                "cpu_us_before": d.2.cpu_us, "cpu_us_after": d.3.cpu_us,
                "drain_over_direct": r.drain_rate() / ((d.2.rps + d.3.rps) / 2.0),
            })).collect::<Vec<_>>(),
            "arrivals": r.arrivals,
            "flushes": r.flushes.map(|(rpf, fpm)| json!({"records_per_flush": rpf, "flushes_per_message": fpm})),
            "restart": r.restart.map(|(b, a, s)| json!({"rss_before_kib": b, "rss_after_start_kib": a, "startup_secs": s})),
        }));
    }
    md.push_str(&format!(
        "\nMachine: nproc {}, {}; all processes on CPU {:?}; load average before {load_before}, after {load_after}.\n",
        nproc(),
        procs::cpu_model(),
        args.cpu,
    ));
    let js = json!({
        "bench": "queue-backlog",
        "args": format!("{args:?}"),
        "machine": super::machine(),
        "load_average": {"before": load_before, "after": load_after},
        "runs": runs_json,
        "targets": checks,
    });
    (md, js)
}
