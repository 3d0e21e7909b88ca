//! Load bench: fencegate measured against a bare hyper pass-through and
//! nginx, in the same run, on loopback.
//!
//! Separate processes: a fast origin (100-byte answers) and the bare pass-through
//! are this binary re-executed with `--role`; fencegate is the crate's own binary,
//! three times — fencing only (`derive_key = "none"`), durable dedup on sled (the
//! default `derive_key = "content"`, every body unique) and the same dedup route on
//! PostgreSQL (`dedup-pg`, below); nginx `proxy_pass` when `nginx` is on the PATH.
//! A closed-loop generator in this process drives each with N keep-alive
//! connections, interleaving the targets A B C D A B C D… for several rounds so the
//! VM's drift cancels out of the ratios. Every request carries a valid epoch and
//! token from a `dir` store (one per fencegate: each holds its store's instance
//! guard). All processes are pinned to one CPU (NOTES, "Measuring here"); CPU per
//! request is read from /proc/PID/stat.
//!
//! `fencing-traced`: the fencing-only route with `[telemetry] otlp_endpoint` at
//! the origin (which answers the exports 200), every request recorded (3 spans)
//! and exported; its A/B row is traced ÷ untraced within this build, and the
//! run prints how many spans were exported and dropped.
//!
//! `queued` ("fencegate, queued delivery (sled)"): the `dedup` route with
//! `delivery = "queued"` (SPEC §11): answered 202 once the message is durable;
//! its deliverer sends every message to the same origin, one at a time, during
//! the window (that CPU counts) and after it: the next target waits until the
//! queue is empty (`fencegate_queue_depth` 0), so none of its deliveries lands
//! in another target's window. Its table: ratios to `dedup` and the
//! pass-through, the backlog left at the window's end, how fast it drained and
//! fencegate's CPU per message accepted and delivered.
//!
//! `--queue-backlog [N]` (default 100,000; 1,000 under `--smoke`): a separate
//! mode, `load/backlog.rs` — N messages accepted while the destination is
//! unreachable, RSS every 10,000, then the drain rate against direct routes at
//! c=1 and c=64 (c=8 in the smoke) in the same run; `--leases 1,16`, `--perf` (`perf stat` over the
//! drain; `BENCH_PERF_RECORD=1`: a `perf record` report too), `--restart`
//! (restarts fencegate with the backlog queued before the drain).
//!
//! `queued-pg` ("fencegate, queued delivery, PostgreSQL"): `queued` on the
//! same PostgreSQL as `dedup-pg`, with its own table: ratios to `dedup-pg`
//! and its drain after each window.
//!
//! `dedup-pg` ("fencegate, durable dedup, PostgreSQL"): the same binary and route
//! as `dedup` with `[state] kind = "postgres"` (default pool size), on a private
//! PostgreSQL the bench starts with the tests' harness (`tests/common/postgres.rs`:
//! `initdb` in a temporary directory, `fsync = on`, `synchronous_commit` on, its
//! own database). Skipped, saying why, where PostgreSQL is not installed
//! (`FENCEGATE_TEST_REQUIRE_POSTGRES` makes the smoke fail instead, as the tests
//! do). Besides the usual row it reports PostgreSQL's CPU µs per request — the
//! postmaster and every process whose parent it is (backends, WAL writer,
//! checkpointer, autovacuum), utime + stime + cutime + cstime, so backends that
//! exit inside a window still count; also split by process kind, from the titles
//! PostgreSQL gives its processes — and from `pg_stat_wal` /
//! `pg_stat_database`, read over one extra connection at the window's edges:
//! commits per WAL fsync (PostgreSQL's group commit), WAL bytes per request, and
//! fencegate's write statements per request (its `fencegate_flush_batches_total`:
//! on PostgreSQL every statement is its own commit, and a batch of claims and
//! outcomes is one statement), and the database's commits per request.
//! PostgreSQL publishes a backend's statistics at most once a second, so the WAL
//! figures lag by up to a second at each edge; under steady load both edges lag
//! alike and the ratios hold, the absolute counts of a short window less so.
//!
//! PostgreSQL runs on the same CPU as everything else (it inherits the bench's
//! affinity). One core is the only setup that gave repeatable numbers here, and it
//! keeps the rows comparable: every row's req/s is what one core does with the
//! whole path on it (origin included), so `dedup-pg` pays for its database on the
//! same core rather than borrowing a second, idle one — other engineers' builds
//! run on the other cores, which would make an unpinned database's figures depend
//! on them. The per-process CPU columns separate the two costs: fencegate's CPU
//! µs/request is what a request costs the gateway's host, PostgreSQL's what it
//! costs the database's. An fsync wait costs no CPU on either side.
//!
//! ```text
//! cargo bench --bench load                 # full run (~5 min): table + target/bench-load.json
//! cargo bench --bench load -- --quick      # a few seconds: one round, c=64
//! cargo bench --bench load -- --scaling    # leases, 1M dedup records, 10k idle
//!                                          # connections, epoch changes under load
//! cargo bench --bench load -- --queue-backlog [N]   # queued delivery: backlog, RSS, drain
//! cargo bench --bench load -- --cluster    # two members on PostgreSQL: direct and relayed
//! cargo bench --bench load -- --smoke      # what `cargo test --benches` runs
//! ```
//! Options: `--rounds N`, `--secs S` (measured window per target), `--conc 8,64,256`,
//! `--only passthrough,fencing,dedup,queued,dedup-pg,nginx` (and, when named
//! or in the smoke, `default`, `default-fencing`, `default-fencing-quiet`: fencegate as
//! `config/fencegate.toml` starts it, [`procs::spawn_default`]), `--cpu N` (pin to CPU N, default 0),
//! `--no-pin`, `--no-nginx`, `--fencegate-b PATH` (another fencegate build measured
//! beside this one, interleaved: targets `fencing-b`, `dedup-b`; for before/after
//! figures, with a table of A ÷ B ratios paired round by round; `BENCH_B_LOG=warn`
//! sets build B's log filter; with `--scaling` it is the build measured instead of
//! this one). `BENCH_WRAP="valgrind --tool=callgrind"` runs the proxies under a
//! wrapper (profiling).
//!
//! Under `cargo test --all-targets` (no `--bench` in argv) it runs a smoke instead:
//! one short round at c=8, asserting only that every target answered, with zero
//! errors, then the backlog mode with 1,000 messages (1 and 4 leases), asserting
//! that every message arrived, then the cluster mode (`load/cluster.rs`) once,
//! asserting zero errors. No timing is asserted.

// Tests and benches may read the wall clock and sleep (clippy.toml bans both in
// the library, where time is injected).
#![allow(clippy::disallowed_methods)]

#[path = "load/backlog.rs"]
mod backlog;
#[path = "load/cluster.rs"]
mod cluster;
#[path = "load/loadgen.rs"]
mod loadgen;
#[path = "load/procs.rs"]
mod procs;
#[path = "load/roles.rs"]
mod roles;
#[path = "load/scaling.rs"]
mod scaling;
// The tests' PostgreSQL harness, shared rather than copied; the bench uses only
// part of it.
#[allow(dead_code)]
#[path = "../tests/common/postgres.rs"]
mod pg;
// The ports the harness starts PostgreSQL on (`super::ports` from `pg`).
#[path = "../tests/common/ports.rs"]
mod ports;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hdrhistogram::Histogram;
use http::Uri;
use serde_json::{json, Value};

use loadgen::{Creds, MakeReq, Plan, Probe};
use procs::{Proc, RouteSpec};

#[derive(Debug, Clone)]
pub struct Args {
    /// Run by `cargo test`: quick, unpinned, assert zero errors.
    pub smoke: bool,
    pub quick: bool,
    pub scaling: bool,
    /// `--cluster`: two members on PostgreSQL, direct and relayed.
    pub cluster: bool,
    pub rounds: usize,
    pub secs: f64,
    pub warmup: f64,
    pub conc: Vec<usize>,
    pub only: Option<Vec<String>>,
    pub cpu: Option<usize>,
    pub nginx: bool,
    /// Another fencegate binary, measured beside this build (A/B).
    pub fencegate_b: Option<String>,
    /// `--queue-backlog [N]`: the queue backlog mode, N messages.
    pub backlog: Option<usize>,
    /// `--leases 1,16`: the backlog mode's lease counts, one run each.
    pub backlog_leases: Vec<usize>,
    /// `--perf`: `perf stat` on fencegate while a backlog drains.
    pub perf: bool,
    /// `--restart`: the backlog's fencegate is restarted before the drain.
    pub backlog_restart: bool,
}

impl Args {
    fn parse(argv: &[String]) -> Args {
        let has = |f: &str| argv.iter().any(|a| a == f);
        let val = |f: &str| {
            argv.iter()
                .position(|a| a == f)
                .and_then(|i| argv.get(i + 1))
                .cloned()
        };
        let smoke = !has("--bench") || has("--smoke");
        let quick = smoke || has("--quick");
        let mut a = Args {
            smoke,
            quick,
            scaling: has("--scaling"),
            cluster: has("--cluster"),
            rounds: if quick { 1 } else { 5 },
            secs: if smoke {
                0.4
            } else if quick {
                1.5
            } else {
                4.0
            },
            warmup: if smoke { 0.2 } else { 0.5 },
            conc: if smoke {
                vec![8]
            } else if quick {
                vec![64]
            } else {
                vec![8, 64, 256]
            },
            only: None,
            cpu: if smoke || has("--no-pin") {
                None
            } else {
                Some(0)
            },
            nginx: !has("--no-nginx"),
            fencegate_b: val("--fencegate-b"),
            backlog: has("--queue-backlog").then(|| {
                val("--queue-backlog")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(if smoke { 1000 } else { 100_000 })
            }),
            backlog_leases: if smoke { vec![1, 4] } else { vec![1, 16] },
            perf: has("--perf"),
            backlog_restart: has("--restart"),
        };
        if let Some(v) = val("--leases") {
            a.backlog_leases = v.split(',').filter_map(|c| c.trim().parse().ok()).collect();
        }
        if let Some(v) = val("--rounds").and_then(|v| v.parse().ok()) {
            a.rounds = v;
        }
        if let Some(v) = val("--secs").and_then(|v| v.parse().ok()) {
            a.secs = v;
        }
        if let Some(v) = val("--conc") {
            a.conc = v.split(',').filter_map(|c| c.trim().parse().ok()).collect();
        }
        if let Some(v) = val("--only") {
            a.only = Some(v.split(',').map(|s| s.trim().to_owned()).collect());
        }
        if let Some(v) = val("--cpu").and_then(|v| v.parse().ok()) {
            if !has("--no-pin") {
                a.cpu = Some(v);
            }
        }
        a
    }

    fn wants(&self, key: &str) -> bool {
        self.only
            .as_ref()
            .is_none_or(|o| o.iter().any(|k| k == key))
    }

    pub fn measure(&self) -> Duration {
        Duration::from_secs_f64(self.secs)
    }

    pub fn warm(&self) -> Duration {
        Duration::from_secs_f64(self.warmup)
    }
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if let Some(i) = argv.iter().position(|a| a == "--role") {
        if let Err(e) = roles::run(&argv[i + 1..]) {
            eprintln!("bench role: {e}");
            std::process::exit(1);
        }
        return;
    }
    let args = Args::parse(&argv);
    if let Some(cpu) = args.cpu {
        if let Err(e) = procs::pin_to_cpu(cpu) {
            eprintln!("bench load: cannot pin to CPU {cpu} ({e}); running unpinned");
        }
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let started = std::time::Instant::now();
    // Every child is owned by the future below and killed when it is dropped, on
    // success, error or panic alike.
    let res = rt.block_on(async {
        if args.scaling {
            scaling::run(&args).await
        } else if args.cluster {
            cluster::run(&args).await
        } else if args.backlog.is_some() {
            backlog::run(&args).await
        } else if args.smoke {
            // The smoke runs the backlog and cluster modes too, at their
            // smoke sizes.
            main_run(&args).await?;
            let small = Args {
                backlog: Some(1000),
                ..args.clone()
            };
            backlog::run(&small).await?;
            cluster::run(&args).await
        } else {
            main_run(&args).await
        }
    });
    drop(rt);
    match res {
        Ok(()) if args.smoke => {
            println!(
                "bench load smoke: every target answered with zero errors ({:.1} s)",
                started.elapsed().as_secs_f64()
            );
        }
        Ok(()) => {}
        Err(e) => {
            if args.smoke {
                panic!("bench load smoke failed: {e}");
            }
            eprintln!("bench load: {e}");
            std::process::exit(1);
        }
    }
}

/// `target/` (next to `target/tmp`).
pub fn target_dir() -> PathBuf {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    tmp.parent().unwrap_or(tmp).to_owned()
}

/// A scratch directory under `target/tmp` (same disk as the project, so fsync
/// costs what it costs; /tmp may be a tmpfs elsewhere).
pub fn scratch(name: &str) -> Result<tempfile::TempDir, String> {
    std::fs::create_dir_all(env!("CARGO_TARGET_TMPDIR")).map_err(|e| e.to_string())?;
    tempfile::Builder::new()
        .prefix(name)
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .map_err(|e| e.to_string())
}

/// The machine, for the report.
pub fn machine() -> Value {
    json!({
        "nproc": nproc(),
        "online_cpus": std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap_or_default().trim(),
        "model": procs::cpu_model(),
        "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
    })
}

/// CPUs online (not the affinity mask: this process may be pinned).
pub fn nproc() -> i64 {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }
}

struct Target {
    key: String,
    label: String,
    proc_: Proc,
    creds: Creds,
    /// The database this target's fencegate keeps its state in (`dedup-pg`).
    db: Option<Db>,
}

/// What the bench watches of a PostgreSQL server.
#[derive(Clone)]
struct Db {
    /// The postmaster: its tree's CPU is the database's.
    postmaster: u32,
    /// [`PG_PROBE`]'s counters, over a connection of the bench's own.
    probe: Probe,
}

/// The PostgreSQL counters read at a window's edges, in this order: WAL fsyncs,
/// WAL writes, WAL records, WAL bytes (the insert position), commits in the bench
/// database. All cast to float8 (an LSN difference is numeric).
const PG_PROBE: &str = "SELECT w.wal_sync::float8, w.wal_write::float8, w.wal_records::float8, \
     (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::float8, d.xact_commit::float8 \
     FROM pg_stat_wal w, pg_stat_database d WHERE d.datname = current_database()";

/// A private PostgreSQL for `dedup-pg`, or why there is none (`Ok(None)` after
/// printing the reason; an error only if it is installed and fails to start, or is
/// required and missing).
async fn start_postgres(args: &Args) -> Result<Option<(pg::PgServer, String, Db)>, String> {
    if let Some(why) = pg::unavailable() {
        if args.smoke && std::env::var_os("FENCEGATE_TEST_REQUIRE_POSTGRES").is_some() {
            return Err(format!("PostgreSQL is required here: {why}"));
        }
        eprintln!("bench load: skipping dedup-pg: {why}");
        return Ok(None);
    }
    // The harness asserts on failure; a panic here becomes the bench's error. It
    // blocks (initdb, readiness polling) while nothing else runs.
    let (server, url) = std::panic::catch_unwind(|| {
        let s = pg::PgServer::start();
        let (_, url) = s.new_database();
        (s, url)
    })
    .map_err(|e| {
        let msg = e
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        format!("PostgreSQL did not start: {msg}")
    })?;
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .map_err(|e| format!("bench connection to PostgreSQL: {e}"))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let client = Arc::new(client);
    let probe: Probe = Arc::new(move || {
        let c = client.clone();
        Box::pin(async move {
            match c.query_one(PG_PROBE, &[]).await {
                Ok(row) => (0..5).map(|i| row.get::<_, f64>(i)).collect(),
                Err(e) => {
                    eprintln!("bench load: PostgreSQL counters: {e}");
                    vec![]
                }
            }
        })
    });
    let db = Db {
        postmaster: server.pid(),
        probe,
    };
    Ok(Some((server, url, db)))
}

/// `postgres --version`, for the report.
fn postgres_version() -> String {
    pg::bindir()
        .and_then(|b| {
            std::process::Command::new(b.join("postgres"))
                .arg("--version")
                .output()
                .ok()
        })
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

/// The route lines that make a route queued (the origin answers 200, so the
/// retry schedule only matters if it does not).
pub const QUEUED_ROUTE: &str = "delivery = \"queued\"\nretry = { schedule = [\"1s\"] }";

fn factory(creds: Creds, tag: u64) -> MakeReq {
    let uri = Uri::from_static("/bench/charge");
    Arc::new(move |conn, seq| {
        loadgen::request(uri.clone(), &creds, loadgen::body(tag, conn, seq), None)
    })
}

/// One measured window of one target.
struct Sample {
    round: usize,
    rps: f64,
    ok: u64,
    secs: f64,
    cpu: f64,
    origin_cpu: f64,
    /// CPU seconds of the target's database (postmaster and children), if any.
    db_cpu: Option<f64>,
    /// The same by kind of process (backends, walwriter, checkpointer…).
    db_parts: BTreeMap<String, f64>,
    /// [`PG_PROBE`]'s differences over the window, if any.
    db_probe: Option<Vec<f64>>,
    /// 2xx answers including the warm-up: what `flush` (read around the whole
    /// run) is divided by.
    ok_total: u64,
    errors: u64,
    by_code: BTreeMap<String, u64>,
    first_error: Option<String>,
    replayed: u64,
    hist: Histogram<u64>,
    flush: Option<(f64, f64)>,
    /// The queued target: its queue after the window, drained before the next.
    queue: Option<QueueRun>,
}

/// A queued target's window, and the drain of its queue that follows it (no
/// other target runs until the queue is empty, so its deliverer's work never
/// lands in another target's window).
#[derive(Debug, Clone, Copy, Default)]
struct QueueRun {
    /// Messages not settled when the window ended (the warm-up's included).
    left: f64,
    /// Seconds from the window's end until none was left.
    drain_secs: f64,
    /// fencegate's CPU seconds from the plan's start (warm-up included) until
    /// the queue was empty: accepting and delivering every message.
    cpu_all: f64,
    /// The origin's CPU seconds over the same span.
    origin_cpu_all: f64,
    /// Messages accepted over the plan (warm-up included).
    accepted: u64,
}

impl QueueRun {
    /// A queued target's runs at one concurrency, summed, and how many.
    fn total(ss: &[Sample]) -> (QueueRun, usize) {
        ss.iter()
            .filter_map(|s| s.queue)
            .fold((QueueRun::default(), 0), |(t, n), q| {
                (
                    QueueRun {
                        left: t.left + q.left,
                        drain_secs: t.drain_secs + q.drain_secs,
                        cpu_all: t.cpu_all + q.cpu_all,
                        origin_cpu_all: t.origin_cpu_all + q.origin_cpu_all,
                        accepted: t.accepted + q.accepted,
                    },
                    n + 1,
                )
            })
    }

    /// CPU seconds `cpu` as µs per message accepted.
    fn per_msg(&self, cpu: f64) -> f64 {
        cpu * 1e6 / self.accepted.max(1) as f64
    }

    /// Messages left at the windows' ends per second of their drains.
    fn drain_rate(&self) -> f64 {
        self.left / self.drain_secs.max(1e-9)
    }
}

/// `fencegate_queue_depth{route}` from the admin listener's /metrics.
pub async fn queue_depth(p: &Proc, route: &str) -> Result<f64, String> {
    let admin = p.admin.ok_or("fencegate without an admin address")?;
    let text = loadgen::get_text(admin, "/metrics").await?;
    loadgen::metric(
        &text,
        &format!("fencegate_queue_depth{{route=\"{route}\"}}"),
    )
    .ok_or_else(|| format!("no fencegate_queue_depth for route {route:?} in /metrics"))
}

/// Waits until `route`'s queue is empty (every message settled), polling its
/// depth every 100 ms; `cpu0`: fencegate's and the origin's CPU seconds when the plan began.
async fn drain_queue(
    p: &Proc,
    origin: &Proc,
    route: &str,
    cpu0: (f64, f64),
    accepted: u64,
) -> Result<QueueRun, String> {
    let t0 = std::time::Instant::now();
    let left = queue_depth(p, route).await?;
    let mut depth = left;
    while depth > 0.0 {
        if t0.elapsed() > Duration::from_secs(600) {
            return Err(format!(
                "{}: {depth} queued messages still not delivered after 600 s\n{}",
                p.name,
                p.log_tail()
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        depth = queue_depth(p, route).await?;
    }
    Ok(QueueRun {
        left,
        drain_secs: t0.elapsed().as_secs_f64(),
        cpu_all: procs::cpu_secs(p.pid) - cpu0.0,
        origin_cpu_all: procs::cpu_secs(origin.pid) - cpu0.1,
        accepted,
    })
}

impl Sample {
    fn cpu_us(&self) -> f64 {
        self.cpu * 1e6 / self.ok.max(1) as f64
    }
    fn p99(&self) -> f64 {
        self.hist.value_at_quantile(0.99) as f64
    }
    fn db_cpu_us(&self) -> f64 {
        self.db_cpu
            .map_or(f64::NAN, |c| c * 1e6 / self.ok.max(1) as f64)
    }
}

async fn flush_stats(p: &Proc) -> Option<(f64, f64)> {
    let text = loadgen::get_text(p.admin?, "/metrics").await.ok()?;
    Some((
        loadgen::metric(&text, "fencegate_flush_records_total")?,
        loadgen::metric(&text, "fencegate_flush_batches_total")?,
    ))
}

async fn main_run(args: &Args) -> Result<(), String> {
    let load_before = procs::loadavg();
    let dir = scratch("bench-load-")?;
    let store_root = dir.path().join("leases");
    let epochs = procs::store(&store_root)?;

    let origin = procs::spawn_role("origin", &["origin"], dir.path(), false)?;
    // Declared before the targets, so dropped after them: fencegate goes first.
    let postgres = if args.wants("dedup-pg") || args.wants("queued-pg") {
        start_postgres(args).await?
    } else {
        None
    };
    let mut targets: Vec<Target> = Vec::new();
    let (fe, ft) = procs::acquire(&epochs, "bench-fencing").await?;
    let fencing_creds = Creds::new(fe, &ft);
    if args.wants("passthrough") {
        let up = origin.addr.to_string();
        targets.push(Target {
            key: "passthrough".into(),
            label: "bare pass-through".into(),
            proc_: procs::spawn_role(
                "passthrough",
                &["passthrough", "--upstream", &up],
                dir.path(),
                true,
            )?,
            creds: fencing_creds.clone(),
            db: None,
        });
    }
    // fencegate: this build, and optionally another build for an interleaved A/B
    // (`--fencegate-b PATH`: targets `fencing-b`, `dedup-b`; by name
    // `queued-b`, `dedup-pg-b`, `queued-pg-b`).
    let mut builds: Vec<(&str, PathBuf)> =
        vec![("", PathBuf::from(env!("CARGO_BIN_EXE_fencegate")))];
    if let Some(b) = &args.fencegate_b {
        builds.push(("-b", PathBuf::from(b)));
    }
    for (suffix, exe) in &builds {
        for (kind, label, derive_key) in [
            ("fencing", "fencegate, fencing only", "none"),
            (
                "fencing-traced",
                "fencegate, fencing only, traced (OTLP to the origin)",
                "none",
            ),
            ("dedup", "fencegate, durable dedup", "content"),
            ("queued", "fencegate, queued delivery (sled)", "content"),
            (
                "dedup-pg",
                "fencegate, durable dedup, PostgreSQL",
                "content",
            ),
            (
                "queued-pg",
                "fencegate, queued delivery, PostgreSQL",
                "content",
            ),
        ] {
            let key = format!("{kind}{suffix}");
            // Build B's twins of the PostgreSQL and queued targets are asked
            // for by name (`--only queued-pg,queued-pg-b`): an older build B
            // may not know `[state]` or queued delivery.
            let db = match (kind, suffix.is_empty(), &postgres) {
                ("dedup-pg" | "queued-pg", _, Some((_, url, db))) => Some((url, db)),
                ("dedup-pg" | "queued-pg", _, _) => continue,
                // This build only (build B may not know `[telemetry]`).
                ("fencing-traced", false, _) => continue,
                _ => None,
            };
            let b_by_name = matches!(kind, "dedup-pg" | "queued-pg" | "queued");
            let named = args.only.as_ref().is_some_and(|o| o.contains(&key));
            if !suffix.is_empty() && b_by_name && !named {
                continue;
            }
            if !args.wants(kind) && !args.wants(&key) {
                continue;
            }
            let mut extra = db.map_or(String::new(), |(url, _)| {
                // A set-up per database schema (SPEC §10): each target, and
                // each build's twin, is a set-up of its own.
                let schema = match (kind, suffix.is_empty()) {
                    ("queued-pg", true) => "schema = \"bench_queued\"\n",
                    ("queued-pg", false) => "schema = \"bench_queued_b\"\n",
                    (_, false) => "schema = \"bench_b\"\n",
                    _ => "",
                };
                format!("[state]\nkind = \"postgres\"\nurl = {url:?}\n{schema}")
            });
            if kind == "fencing-traced" {
                // The origin answers any POST 200: a sink for the spans, whose
                // CPU is the origin's, not fencegate's.
                extra.push_str(&format!(
                    "[telemetry]\notlp_endpoint = \"http://{}\"\n",
                    origin.addr
                ));
            }
            // One lease store per fencegate: a single instance holds its store's
            // instance guard (SPEC §10.1), so two never share one. `fencing` has the
            // first store (the epoch-change measurement renews its lease there).
            let (lease, creds, store) = if key == "fencing" {
                (
                    "bench-fencing".to_owned(),
                    fencing_creds.clone(),
                    store_root.clone(),
                )
            } else {
                let lease = format!("bench-{key}");
                let store = dir.path().join(format!("leases-{key}"));
                let (e, t) = procs::acquire(&procs::store(&store)?, &lease).await?;
                (lease, Creds::new(e, &t), store)
            };
            // `BENCH_B_LOG=warn` runs build B with that log filter (e.g. to see what
            // the per-request span costs at the default `info`).
            let b_log = std::env::var("BENCH_B_LOG").unwrap_or_default();
            let envs: Vec<(&str, &str)> = if !suffix.is_empty() && !b_log.is_empty() {
                vec![("FENCEGATE_LOG", b_log.as_str())]
            } else {
                vec![]
            };
            targets.push(Target {
                label: if suffix.is_empty() {
                    label.to_owned()
                } else {
                    format!("{label} [B: {}]", exe.display())
                },
                proc_: procs::spawn_fencegate(
                    exe,
                    &key,
                    dir.path(),
                    &store,
                    &dir.path().join(format!("state-{key}")),
                    origin.addr,
                    &[RouteSpec {
                        name: "bench".into(),
                        prefix: "/bench/".into(),
                        lease,
                        derive_key,
                        // Queued (SPEC §11): answered 202 once durable; the
                        // deliverer sends each message to the same origin.
                        extra: if kind.starts_with("queued") {
                            QUEUED_ROUTE.into()
                        } else {
                            String::new()
                        },
                        upstream: None,
                    }],
                    &extra,
                    &envs,
                )?,
                key,
                creds,
                db: db.map(|(_, d)| d.clone()),
            });
        }
    }
    // fencegate as the shipped config starts it (issue 47): its route as
    // shipped (durable dedup), the access log on as shipped; fencing only;
    // and fencing only with `access_log = false`. Run by the smoke (so the
    // shipped file keeps the lines they rewrite) and when named (`--only
    // default,default-fencing,default-fencing-quiet,…`).
    for (key, label, departure) in [
        (
            "default",
            "fencegate, config/fencegate.toml as shipped (dedup, access log on)",
            procs::Departure {
                fencing_only: false,
                quiet: false,
            },
        ),
        (
            "default-fencing",
            "fencegate, shipped config, fencing only (access log on)",
            procs::Departure {
                fencing_only: true,
                quiet: false,
            },
        ),
        (
            "default-fencing-quiet",
            "fencegate, shipped config, fencing only, access_log = false",
            procs::Departure {
                fencing_only: true,
                quiet: true,
            },
        ),
    ] {
        // Build B's twin (`default-fencing-b`…) when named.
        for (suffix, exe) in &builds {
            let key = format!("{key}{suffix}");
            let named = args.only.as_ref().is_some_and(|o| o.contains(&key));
            let smoke = args.smoke && suffix.is_empty();
            if !(named || smoke) {
                continue;
            }
            let store = dir.path().join(format!("leases-{key}"));
            let (e, t) = procs::acquire(&procs::store(&store)?, "billing").await?;
            targets.push(Target {
                label: if suffix.is_empty() {
                    label.to_owned()
                } else {
                    format!("{label} [B: {}]", exe.display())
                },
                proc_: procs::spawn_default(exe, &key, dir.path(), &store, origin.addr, departure)?,
                key,
                creds: Creds::new(e, &t),
                db: None,
            });
        }
    }
    let nginx_path = procs::find_nginx().filter(|_| args.nginx && args.wants("nginx"));
    if let Some(n) = &nginx_path {
        // A reference, not the subject: if it will not start here, say so and go on.
        match procs::spawn_nginx(n, dir.path(), origin.addr) {
            Ok(p) => targets.push(Target {
                key: "nginx".into(),
                label: "nginx proxy_pass".into(),
                proc_: p,
                creds: fencing_creds.clone(),
                db: None,
            }),
            Err(e) => eprintln!("bench load: skipping nginx, it did not start: {e}"),
        }
    } else if !args.smoke {
        eprintln!("bench load: nginx is not on the PATH (or --no-nginx): skipping it");
    }
    if targets.is_empty() {
        return Err("no target selected".into());
    }
    eprintln!(
        "bench load: origin {}, {}; pinned to CPU {:?}; load average {load_before}",
        origin.addr,
        targets
            .iter()
            .map(|t| format!("{} {} (pid {})", t.key, t.proc_.addr, t.proc_.pid))
            .collect::<Vec<_>>()
            .join(", "),
        args.cpu
    );

    let mut tag = 0u64;
    let mut plan_for = |t: &Target, c: usize, warm: Duration, measure: Duration| {
        tag += 1;
        Plan {
            addr: t.proc_.addr,
            conns: c,
            warmup: warm,
            measure,
            make: factory(t.creds.clone(), tag),
            pids: vec![t.proc_.pid, origin.pid],
            trees: t.db.iter().map(|d| d.postmaster).collect(),
            probe: t.db.as_ref().map(|d| d.probe.clone()),
        }
    };

    // Warm every target once (pools, allocators, the first epoch's mark).
    if !args.smoke {
        for t in &targets {
            let c = args.conc.iter().copied().max().unwrap_or(64);
            loadgen::run(&plan_for(t, c, Duration::ZERO, Duration::from_millis(700))).await;
            if t.key.starts_with("queued") {
                drain_queue(&t.proc_, &origin, "bench", (0.0, 0.0), 0).await?;
            }
        }
    }

    let mut samples: BTreeMap<(usize, usize), Vec<Sample>> = BTreeMap::new();
    for round in 0..args.rounds {
        for &c in &args.conc {
            for (ti, t) in targets.iter().enumerate() {
                let before = if t.key.starts_with("dedup") || t.key.starts_with("queued") {
                    flush_stats(&t.proc_).await
                } else {
                    None
                };
                let cpu0 = (procs::cpu_secs(t.proc_.pid), procs::cpu_secs(origin.pid));
                let out = loadgen::run(&plan_for(t, c, args.warm(), args.measure())).await;
                let flush = match (before, flush_stats(&t.proc_).await) {
                    (Some(b), Some(a)) => Some((a.0 - b.0, a.1 - b.1)),
                    _ => None,
                };
                let queue = if t.key.starts_with("queued") {
                    Some(drain_queue(&t.proc_, &origin, "bench", cpu0, out.counts.ok_total).await?)
                } else {
                    None
                };
                let s = Sample {
                    round,
                    rps: out.rps(),
                    ok: out.counts.ok,
                    secs: out.secs,
                    cpu: out.cpu[0],
                    origin_cpu: out.cpu[1],
                    db_cpu: out.tree_cpu.first().map(|m| m.values().sum()),
                    db_parts: out.tree_cpu.first().cloned().unwrap_or_default(),
                    db_probe: t.db.as_ref().map(|_| out.probe.clone()),
                    ok_total: out.counts.ok_total,
                    errors: out.counts.errors,
                    by_code: out.counts.by_code.clone(),
                    first_error: out.counts.first_error.clone(),
                    replayed: out.counts.replayed,
                    hist: out.hist,
                    flush,
                    queue,
                };
                eprintln!(
                    "  round {round} c={c:<3} {:<12} {:>8.0} req/s  p99 {:>7.2} ms  cpu {:>5.1} µs/req  errors {}{}",
                    t.key,
                    s.rps,
                    s.p99() / 1000.0,
                    s.cpu_us(),
                    s.errors,
                    if s.db_cpu.is_some() {
                        format!("  PostgreSQL cpu {:.1} µs/req", s.db_cpu_us())
                    } else if let Some(q) = s.queue {
                        format!(
                            "  left {:.0} of {}, drained in {:.1} s ({:.0} msg/s), {:.1} µs/msg in all",
                            q.left,
                            q.accepted,
                            q.drain_secs,
                            q.drain_rate(),
                            q.per_msg(q.cpu_all)
                        )
                    } else {
                        String::new()
                    }
                );
                samples.entry((ti, c)).or_default().push(s);
            }
        }
    }

    // The time from a newer epoch's first request to its forward, nothing older in
    // flight (mark flush + an empty drain), on the fencing-only target.
    let epoch_idle = match targets.iter().find(|t| t.key == "fencing") {
        Some(t) => Some(
            epoch_idle(
                &t.proc_,
                &epochs,
                "bench-fencing",
                (fe, ft.clone()),
                if args.smoke { 1 } else { 20 },
            )
            .await?,
        ),
        None => None,
    };

    // The traced target's spans: exported, not dropped (else its CPU is the
    // dropping path's).
    if let Some(t) = targets.iter().find(|t| t.key == "fencing-traced") {
        if let Some(admin) = t.proc_.admin {
            let text = loadgen::get_text(admin, "/metrics")
                .await
                .unwrap_or_default();
            let m = |name: &str| loadgen::metric(&text, name).unwrap_or(f64::NAN);
            println!(
                "fencing-traced: spans exported {}, dropped: queue_full {}, export_failed {}",
                m("fencegate_trace_spans_exported_total"),
                m("fencegate_trace_spans_dropped_total{reason=\"queue_full\"}"),
                m("fencegate_trace_spans_dropped_total{reason=\"export_failed\"}"),
            );
        }
    }
    // Every proxy must still be alive.
    for t in &mut targets {
        if !t.proc_.is_running() {
            return Err(format!(
                "{} exited during the run:\n{}",
                t.key,
                t.proc_.log_tail()
            ));
        }
    }
    let load_after = procs::loadavg();
    let report = report(
        args,
        &targets,
        &samples,
        epoch_idle,
        &load_before,
        &load_after,
    );
    let json_path = target_dir().join(if args.smoke {
        "bench-load-smoke.json"
    } else {
        "bench-load.json"
    });
    std::fs::write(
        &json_path,
        serde_json::to_vec_pretty(&report.json).unwrap_or_default(),
    )
    .map_err(|e| format!("{}: {e}", json_path.display()))?;
    println!("{}", report.markdown);
    println!("JSON: {}", json_path.display());

    if args.smoke {
        for (ti, t) in targets.iter().enumerate() {
            for c in &args.conc {
                let ss = &samples[&(ti, *c)];
                let ok: u64 = ss.iter().map(|s| s.ok).sum();
                let errors: u64 = ss.iter().map(|s| s.errors).sum();
                let replayed: u64 = ss.iter().map(|s| s.replayed).sum();
                if ok == 0 || errors > 0 || replayed > 0 {
                    return Err(format!(
                        "{} at c={c}: {ok} answered, {errors} errors ({:?}), {replayed} replayed; log:\n{}",
                        t.key,
                        ss.iter().find_map(|s| s.first_error.clone()),
                        t.proc_.log_tail()
                    ));
                }
            }
        }
    }
    Ok(())
}

/// What the epoch-change measurement with nothing in flight found.
struct EpochIdle {
    /// First request of a new epoch that fencegate had not yet seen: on-demand
    /// store read + mark flush + drain + forward.
    unseen_us: Vec<f64>,
    /// First request of a new epoch the refresher already knew: mark flush + drain
    /// + forward.
    known_us: Vec<f64>,
    /// Later requests at the same epoch: forward only.
    steady_us: Vec<f64>,
}

async fn epoch_idle(
    p: &Proc,
    epochs: &fencegate::lease::Epochs,
    lease: &str,
    mut held: (u64, String),
    samples: usize,
) -> Result<EpochIdle, String> {
    let admin = p.admin.ok_or("fencegate without an admin address")?;
    let mut s = loadgen::connect(p.addr).await?;
    let uri = Uri::from_static("/bench/charge");
    let mut out = EpochIdle {
        unseen_us: vec![],
        known_us: vec![],
        steady_us: vec![],
    };
    for i in 0..samples * 2 {
        held = procs::renew(epochs, lease, held.0, &held.1).await?;
        let creds = Creds::new(held.0, &held.1);
        let known = i % 2 == 1;
        if known {
            // Wait for the refresher (every 1 s) to have listed and read the epoch.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            loop {
                let text = loadgen::get_text(admin, "/v1/leases").await?;
                let v: Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
                let latest = v["leases"][0]["latest_epoch"].as_u64().unwrap_or(0);
                if latest >= held.0 || tokio::time::Instant::now() > deadline {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        for n in 0..6 {
            let req = loadgen::request(
                uri.clone(),
                &creds,
                loadgen::body(9_000 + i as u64, 0, n),
                None,
            );
            let t0 = std::time::Instant::now();
            let a = loadgen::exchange(&mut s, req).await?;
            let us = t0.elapsed().as_secs_f64() * 1e6;
            if !a.status.is_success() {
                return Err(format!(
                    "epoch {} request {n}: {} {:?}",
                    held.0, a.status, a.code
                ));
            }
            match (n, known) {
                (0, false) => out.unseen_us.push(us),
                (0, true) => out.known_us.push(us),
                _ => out.steady_us.push(us),
            }
        }
    }
    Ok(out)
}

fn median(v: &[f64]) -> f64 {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

pub fn quantile(v: &[f64], q: f64) -> f64 {
    let mut v: Vec<f64> = v.to_vec();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((v.len() as f64 - 1.0) * q).round() as usize;
    v[i.min(v.len() - 1)]
}

struct Report {
    markdown: String,
    json: Value,
}

/// One row of the table: a target at one concurrency, over every round.
struct Row {
    rps: f64,
    cpu_us: f64,
    origin_cpu_us: f64,
    p50: f64,
    p99: f64,
    p999: f64,
    errors: u64,
    ok: u64,
}

fn row(ss: &[Sample]) -> Row {
    let mut h = loadgen::histogram();
    for s in ss {
        let _ = h.add(&s.hist);
    }
    let ok: u64 = ss.iter().map(|s| s.ok).sum();
    let secs: f64 = ss.iter().map(|s| s.secs).sum();
    Row {
        rps: ok as f64 / secs.max(1e-9),
        cpu_us: ss.iter().map(|s| s.cpu).sum::<f64>() * 1e6 / ok.max(1) as f64,
        origin_cpu_us: ss.iter().map(|s| s.origin_cpu).sum::<f64>() * 1e6 / ok.max(1) as f64,
        p50: h.value_at_quantile(0.5) as f64,
        p99: h.value_at_quantile(0.99) as f64,
        p999: h.value_at_quantile(0.999) as f64,
        errors: ss.iter().map(|s| s.errors).sum(),
        ok,
    }
}

/// The database side of a `dedup-pg` row, over every round.
struct DbRow {
    cpu_us: f64,
    /// CPU µs per request by kind of PostgreSQL process.
    parts: BTreeMap<String, f64>,
    statements_per_request: f64,
    commits_per_request: f64,
    records_per_statement: f64,
    commits_per_wal_sync: f64,
    wal_bytes_per_request: f64,
    wal_records_per_request: f64,
    /// [`PG_PROBE`]'s sums over the windows.
    probe: Vec<f64>,
    /// Paired ratios to sled dedup: req/s, fencegate CPU, fencegate + database CPU.
    vs_sled: (f64, f64, f64),
}

impl DbRow {
    fn json(&self) -> Value {
        let nan_null = |v: f64| if v.is_finite() { json!(v) } else { Value::Null };
        json!({
            "cpu_us_per_request": nan_null(self.cpu_us),
            "cpu_us_per_request_by_process": self.parts,
            "statements_per_request": nan_null(self.statements_per_request),
            "commits_per_request": nan_null(self.commits_per_request),
            "records_per_statement": nan_null(self.records_per_statement),
            "commits_per_wal_sync": nan_null(self.commits_per_wal_sync),
            "wal_bytes_per_request": nan_null(self.wal_bytes_per_request),
            "wal_records_per_request": nan_null(self.wal_records_per_request),
            "window_totals": {
                "wal_sync": self.probe.first(), "wal_write": self.probe.get(1),
                "wal_records": self.probe.get(2), "wal_bytes": self.probe.get(3),
                "commits": self.probe.get(4),
            },
            "vs_sled_dedup": {
                "rps": nan_null(self.vs_sled.0),
                "fencegate_cpu": nan_null(self.vs_sled.1),
                "fencegate_plus_db_cpu": nan_null(self.vs_sled.2),
            },
        })
    }
}

fn db_row(ss: &[Sample], sled: Option<&Vec<Sample>>) -> DbRow {
    let ok: u64 = ss.iter().map(|s| s.ok).sum();
    let ok_total: u64 = ss.iter().map(|s| s.ok_total).sum();
    let (records, batches) = ss
        .iter()
        .filter_map(|s| s.flush)
        .fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
    // Only windows whose counters were read at both edges.
    let probed: Vec<&Sample> = ss
        .iter()
        .filter(|s| s.db_probe.as_ref().is_some_and(|p| p.len() == 5))
        .collect();
    let mut probe = vec![0.0; 5];
    for s in &probed {
        for (t, v) in probe.iter_mut().zip(s.db_probe.iter().flatten()) {
            *t += v;
        }
    }
    let probed_ok = probed.iter().map(|s| s.ok).sum::<u64>().max(1) as f64;
    let div = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    let vs = |f: &dyn Fn(&Sample) -> f64, g: &dyn Fn(&Sample) -> f64| {
        let ratios: Vec<f64> = sled
            .into_iter()
            .flatten()
            .filter_map(|y| {
                let x = ss.iter().find(|x| x.round == y.round)?;
                Some(f(x) / g(y))
            })
            .collect();
        median(&ratios)
    };
    let mut parts = BTreeMap::new();
    for s in ss {
        for (k, v) in &s.db_parts {
            *parts.entry(k.clone()).or_insert(0.0) += v * 1e6 / ok.max(1) as f64;
        }
    }
    DbRow {
        cpu_us: ss.iter().filter_map(|s| s.db_cpu).sum::<f64>() * 1e6 / ok.max(1) as f64,
        parts,
        statements_per_request: div(batches, ok_total as f64),
        commits_per_request: div(probe[4], probed_ok),
        records_per_statement: div(records, batches),
        commits_per_wal_sync: div(probe[4], probe[0]),
        wal_bytes_per_request: if probed.is_empty() {
            f64::NAN
        } else {
            probe[3] / probed_ok
        },
        wal_records_per_request: if probed.is_empty() {
            f64::NAN
        } else {
            probe[2] / probed_ok
        },
        probe,
        vs_sled: (
            vs(&|s| s.rps, &|s| s.rps),
            vs(&|s| s.cpu_us(), &|s| s.cpu_us()),
            vs(&|s| s.cpu_us() + s.db_cpu_us(), &|s| s.cpu_us()),
        ),
    }
}

/// Median over rounds of the paired ratio a/b of one figure (same round, same
/// concurrency: drift cancels).
fn paired(a: &[Sample], b: &[Sample], f: impl Fn(&Sample) -> f64) -> f64 {
    let ratios: Vec<f64> = a
        .iter()
        .filter_map(|x| {
            let y = b.iter().find(|y| y.round == x.round)?;
            Some(f(x) / f(y))
        })
        .collect();
    median(&ratios)
}

/// `v` with `decimals`, or "–" when there is no figure.
fn fmt_num(v: f64, decimals: usize) -> String {
    if v.is_finite() {
        format!("{v:.decimals$}")
    } else {
        "–".into()
    }
}

fn fmt_ratio(r: f64) -> String {
    if r.is_finite() {
        format!("{r:.2}")
    } else {
        "–".into()
    }
}

fn report(
    args: &Args,
    targets: &[Target],
    samples: &BTreeMap<(usize, usize), Vec<Sample>>,
    epoch_idle: Option<EpochIdle>,
    load_before: &str,
    load_after: &str,
) -> Report {
    let idx = |key: &str| targets.iter().position(|t| t.key == key);
    let (pass, nginx) = (idx("passthrough"), idx("nginx"));
    let mut md = String::new();
    md.push_str(&format!(
        "### fencegate load bench ({} round(s) × {} s per target and concurrency, interleaved; 100-byte answers; all processes on CPU {:?})\n\n",
        args.rounds, args.secs, args.cpu
    ));
    md.push_str("| target | conns | req/s | p50 ms | p99 ms | p99.9 ms | errors | CPU µs/req | req/s ÷ pass | CPU ÷ pass | p99 ÷ pass | req/s ÷ nginx | CPU ÷ nginx |\n");
    md.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    let mut rows_json = Vec::new();
    let mut ratio_of = BTreeMap::new();
    for &c in &args.conc {
        for (ti, t) in targets.iter().enumerate() {
            let Some(ss) = samples.get(&(ti, c)) else {
                continue;
            };
            let r = row(ss);
            let vs = |other: Option<usize>, f: &dyn Fn(&Sample) -> f64| {
                other
                    .and_then(|o| samples.get(&(o, c)))
                    .map_or(f64::NAN, |os| paired(ss, os, f))
            };
            let (pr, pc, pp) = (
                vs(pass, &|s| s.rps),
                vs(pass, &|s| s.cpu_us()),
                vs(pass, &|s| s.p99()),
            );
            let (nr, nc) = (vs(nginx, &|s| s.rps), vs(nginx, &|s| s.cpu_us()));
            let np = vs(nginx, &|s| s.p99());
            ratio_of.insert((t.key.as_str(), c), (pr, pc, pp, nr, np));
            md.push_str(&format!(
                "| {} | {c} | {:.0} | {:.2} | {:.2} | {:.2} | {} | {:.1} | {} | {} | {} | {} | {} |\n",
                t.label,
                r.rps,
                r.p50 / 1e3,
                r.p99 / 1e3,
                r.p999 / 1e3,
                r.errors,
                r.cpu_us,
                fmt_ratio(pr),
                fmt_ratio(pc),
                fmt_ratio(pp),
                fmt_ratio(nr),
                fmt_ratio(nc),
            ));
            let flush: Option<(f64, f64)> = ss
                .iter()
                .filter_map(|s| s.flush)
                .reduce(|a, b| (a.0 + b.0, a.1 + b.1));
            let mut codes = BTreeMap::new();
            for s in ss {
                for (k, v) in &s.by_code {
                    *codes.entry(k.clone()).or_insert(0u64) += v;
                }
            }
            rows_json.push(json!({
                "target": t.key,
                "label": t.label,
                "concurrency": c,
                "requests": r.ok,
                "rps": r.rps,
                "p50_us": r.p50,
                "p99_us": r.p99,
                "p999_us": r.p999,
                "errors": r.errors,
                "errors_by_code": codes,
                "cpu_us_per_request": r.cpu_us,
                "origin_cpu_us_per_request": r.origin_cpu_us,
                "vs_passthrough": {"rps": pr, "cpu": pc, "p99": pp},
                "vs_nginx": {"rps": nr, "cpu": nc},
                "flush": flush.map(|(rec, b)| json!({"records": rec, "batches": b, "records_per_flush": rec / b.max(1.0)})),
                "db": t.db.as_ref().map(|_| db_row(ss, idx("dedup").and_then(|d| samples.get(&(d, c)))).json()),
                "rounds": ss.iter().map(|s| json!({
                    "round": s.round, "rps": s.rps, "cpu_us_per_request": s.cpu_us(),
                    "p99_us": s.p99(), "errors": s.errors,
                    "db_cpu_us_per_request": s.db_cpu.map(|_| s.db_cpu_us()),
                })).collect::<Vec<_>>(),
            }));
        }
    }
    md.push_str(
        "\nreq/s and CPU µs/req: totals over all rounds; percentiles: all rounds' latencies merged; \
         ratios: median over rounds of the ratio within one round (drift cancels). \
         CPU is the proxy process's utime+stime (/proc/PID/stat) ÷ answered requests.\n",
    );

    // Queued delivery against durable dedup (the same route, answered 202 once
    // durable) and the pass-through.
    let mut queued_json = Value::Null;
    let mut queued_vs_dedup = BTreeMap::new();
    if let Some(q) = idx("queued") {
        let dedup = idx("dedup");
        md.push_str(
            "\nQueued delivery on sled (the `dedup` route plus `delivery = \"queued\"`: answered 202 once durable; \
             its deliverer sends every message to the same origin, one at a time, during the window and after it):\n\n\
             | conns | accepted req/s | p50 ms | p99 ms | CPU µs/req | req/s ÷ dedup | CPU ÷ dedup | p99 ÷ dedup | req/s ÷ pass | \
             delivered within the run | left at the window's end | drained after it, msg/s | fencegate CPU µs/msg, accepted + delivered | origin CPU µs/msg |\n\
             |---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        let mut per_c = serde_json::Map::new();
        for &c in &args.conc {
            let Some(ss) = samples.get(&(q, c)) else {
                continue;
            };
            let r = row(ss);
            let vs = |other: Option<usize>, f: &dyn Fn(&Sample) -> f64| {
                other
                    .and_then(|o| samples.get(&(o, c)))
                    .map_or(f64::NAN, |os| paired(ss, os, f))
            };
            let (dr, dc, dp) = (
                vs(dedup, &|s| s.rps),
                vs(dedup, &|s| s.cpu_us()),
                vs(dedup, &|s| s.p99()),
            );
            let pr = vs(pass, &|s| s.rps);
            queued_vs_dedup.insert(c, dr);
            let (t, runs) = QueueRun::total(ss);
            let (accepted, left, drain_secs) = (t.accepted, t.left, t.drain_secs);
            let delivered_share = 1.0 - left / accepted.max(1) as f64;
            let drain_rate = t.drain_rate();
            md.push_str(&format!(
                "| {c} | {:.0} | {:.2} | {:.2} | {:.1} | {} | {} | {} | {} | {:.0}% | {:.0} | {:.0} | {:.1} | {:.1} |\n",
                r.rps,
                r.p50 / 1e3,
                r.p99 / 1e3,
                r.cpu_us,
                fmt_ratio(dr),
                fmt_ratio(dc),
                fmt_ratio(dp),
                fmt_ratio(pr),
                delivered_share * 100.0,
                left / runs.max(1) as f64,
                drain_rate,
                t.per_msg(t.cpu_all),
                t.per_msg(t.origin_cpu_all),
            ));
            per_c.insert(
                c.to_string(),
                json!({
                    "rps": r.rps, "p50_us": r.p50, "p99_us": r.p99, "cpu_us_per_request": r.cpu_us,
                    "vs_dedup": {"rps": dr, "cpu": dc, "p99": dp},
                    "vs_passthrough": {"rps": pr},
                    "accepted": accepted,
                    "delivered_within_run_share": delivered_share,
                    "left_at_window_end_total": left,
                    "drain_secs_total": drain_secs,
                    "drain_after_window_msgs_per_sec": drain_rate,
                    "cpu_us_per_message_accepted_and_delivered": t.per_msg(t.cpu_all),
                    "origin_cpu_us_per_message": t.per_msg(t.origin_cpu_all),
                }),
            );
        }
        md.push_str(
            "\nCPU µs/req: fencegate's CPU over the window ÷ messages accepted in it (its deliverer's work \
             in the window included); µs/msg, accepted + delivered: fencegate's CPU from the plan's start (warm-up \
             included) until its queue was empty ÷ every message accepted. \
             Left at the window's end: mean over rounds; the next target waits until they are delivered.\n",
        );
        queued_json = Value::Object(per_c);
    }
    // Queued delivery on PostgreSQL against durable dedup on PostgreSQL.
    let mut queued_pg_json = Value::Null;
    if let Some(q) = idx("queued-pg") {
        let dedup = idx("dedup-pg");
        md.push_str(
            "\nQueued delivery on PostgreSQL (the `dedup-pg` route plus `delivery = \"queued\"`; a \
             lease's acceptances arriving together share a transaction; one per attempt's start and per settlement):\n\n\
             | conns | accepted req/s | p50 ms | p99 ms | fencegate CPU µs/req | req/s ÷ dedup-pg | CPU ÷ dedup-pg | \
             drained after the window, msg/s | fencegate CPU µs/msg, accepted + delivered |\n\
             |---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        let mut per_c = serde_json::Map::new();
        for &c in &args.conc {
            let Some(ss) = samples.get(&(q, c)) else {
                continue;
            };
            let r = row(ss);
            let vs = |f: &dyn Fn(&Sample) -> f64| {
                dedup
                    .and_then(|o| samples.get(&(o, c)))
                    .map_or(f64::NAN, |os| paired(ss, os, f))
            };
            let (dr, dc) = (vs(&|s| s.rps), vs(&|s| s.cpu_us()));
            let (t, _) = QueueRun::total(ss);
            let (per_msg, drain_rate) = (t.per_msg(t.cpu_all), t.drain_rate());
            md.push_str(&format!(
                "| {c} | {:.0} | {:.2} | {:.2} | {:.1} | {} | {} | {:.0} | {:.1} |\n",
                r.rps,
                r.p50 / 1e3,
                r.p99 / 1e3,
                r.cpu_us,
                fmt_ratio(dr),
                fmt_ratio(dc),
                drain_rate,
                per_msg,
            ));
            per_c.insert(
                c.to_string(),
                json!({
                    "rps": r.rps, "p50_us": r.p50, "p99_us": r.p99, "cpu_us_per_request": r.cpu_us,
                    "vs_dedup_pg": {"rps": dr, "cpu": dc},
                    "drain_after_window_msgs_per_sec": drain_rate,
                    "cpu_us_per_message_accepted_and_delivered": per_msg,
                }),
            );
        }
        queued_pg_json = Value::Object(per_c);
    }

    // Records per flush for the dedup target(s), summed over each one's windows.
    let per_flush = |d: usize| -> Vec<(usize, f64)> {
        args.conc
            .iter()
            .filter_map(|&c| {
                samples
                    .get(&(d, c))
                    .into_iter()
                    .flatten()
                    .filter_map(|s| s.flush)
                    .reduce(|a, b| (a.0 + b.0, a.1 + b.1))
                    .map(|(rec, b)| (c, rec / b.max(1.0)))
            })
            .collect()
    };
    let mut flush_json = Value::Null;
    let mut pg_json = Value::Null;
    if let Some(d) = idx("dedup-pg") {
        md.push_str(&format!(
            "\nDurable dedup on PostgreSQL ({}; `[state]` pool_size the default, 16; on the same CPU as everything else):\n\n\
             | conns | req/s | p50 ms | p99 ms | fencegate CPU µs/req | PostgreSQL CPU µs/req | both µs/req | statements/req | records/statement | commits/req | commits per WAL fsync | WAL bytes/req | req/s ÷ sled dedup | fencegate CPU ÷ sled dedup | both ÷ sled dedup |\n\
             |---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
            postgres_version()
        ));
        let mut per_c = serde_json::Map::new();
        let mut by_process = String::new();
        for &c in &args.conc {
            let Some(ss) = samples.get(&(d, c)) else {
                continue;
            };
            let sled = idx("dedup").and_then(|i| samples.get(&(i, c)));
            let r = row(ss);
            let db = db_row(ss, sled);
            md.push_str(&format!(
                "| {c} | {:.0} | {:.2} | {:.2} | {:.1} | {:.1} | {:.1} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                r.rps,
                r.p50 / 1e3,
                r.p99 / 1e3,
                r.cpu_us,
                db.cpu_us,
                r.cpu_us + db.cpu_us,
                fmt_num(db.statements_per_request, 2),
                fmt_num(db.records_per_statement, 2),
                fmt_num(db.commits_per_request, 2),
                fmt_num(db.commits_per_wal_sync, 1),
                fmt_num(db.wal_bytes_per_request, 0),
                fmt_ratio(db.vs_sled.0),
                fmt_ratio(db.vs_sled.1),
                fmt_ratio(db.vs_sled.2),
            ));
            // Kinds that used (next to) nothing are left out of the line.
            let mut parts: Vec<(&String, &f64)> =
                db.parts.iter().filter(|(_, v)| v.abs() >= 0.05).collect();
            parts.sort_by(|a, b| b.1.total_cmp(a.1));
            by_process.push_str(&format!(
                "- c={c}: {}; WAL records/req {}\n",
                parts
                    .iter()
                    .map(|(k, v)| format!("{k} {v:.1}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                fmt_num(db.wal_records_per_request, 1),
            ));
            per_c.insert(c.to_string(), db.json());
        }
        md.push_str("\nPostgreSQL CPU µs/req by process (backends: fencegate's connections; postmaster: with its exited children):\n");
        md.push_str(&by_process);
        md.push_str(
            "\nPostgreSQL CPU: the postmaster and every process whose parent it is, utime+stime+cutime+cstime ÷ answered requests. \
             statements/req: fencegate's write statements (fencegate_flush_batches_total: a batch of claims and outcomes is one statement, one commit) over the run (warm-up included) ÷ the run's answers; \
             records/statement: its flush_records ÷ flush_batches. \
             commits/req, commits per WAL fsync and WAL bytes: pg_stat_database.xact_commit (every transaction, reads included), pg_stat_wal.wal_sync and the WAL insert position over the window \
             (PostgreSQL publishes a backend's counters at most once a second). Ratios to sled dedup: median over rounds within one round.\n",
        );
        pg_json = json!({
            "version": postgres_version(),
            "pool_size": 16,
            "pinned": "same CPU as every other process (inherited affinity)",
            "by_concurrency": Value::Object(per_c),
        });
    }
    // This build (A) against `--fencegate-b` (B), each target with its B twin,
    // paired round by round.
    let mut ab_json = Vec::new();
    let mut ab_md = String::new();
    for (kind, twin, what) in [
        ("fencing", "fencing-b", "fencing only"),
        ("dedup", "dedup-b", "durable dedup"),
        ("queued", "queued-b", "queued delivery, accepted"),
        ("dedup-pg", "dedup-pg-b", "durable dedup, PostgreSQL"),
        (
            "queued-pg",
            "queued-pg-b",
            "queued delivery on PostgreSQL, accepted",
        ),
        (
            "fencing-traced",
            "fencing",
            "fencing only: traced (A) ÷ untraced (B), both this build",
        ),
    ] {
        let (Some(a), Some(b)) = (idx(kind), idx(twin)) else {
            continue;
        };
        for &c in &args.conc {
            let (Some(sa), Some(sb)) = (samples.get(&(a, c)), samples.get(&(b, c))) else {
                continue;
            };
            let (ra, rb) = (row(sa), row(sb));
            let cpu = paired(sa, sb, |s| s.cpu_us());
            let rps = paired(sa, sb, |s| s.rps);
            let p99 = paired(sa, sb, |s| s.p99());
            let rounds: Vec<f64> = sa
                .iter()
                .filter_map(|x| {
                    let y = sb.iter().find(|y| y.round == x.round)?;
                    Some(x.cpu_us() / y.cpu_us())
                })
                .collect();
            ab_md.push_str(&format!(
                "| {what} | {c} | {:.1} | {:.1} | {} | {} | {:.0} | {:.0} | {} | {} |\n",
                ra.cpu_us,
                rb.cpu_us,
                fmt_ratio(cpu),
                rounds
                    .iter()
                    .map(|r| fmt_ratio(*r))
                    .collect::<Vec<_>>()
                    .join(" "),
                ra.rps,
                rb.rps,
                fmt_ratio(rps),
                fmt_ratio(p99),
            ));
            ab_json.push(json!({
                "target": kind, "concurrency": c,
                "a_cpu_us_per_request": ra.cpu_us, "b_cpu_us_per_request": rb.cpu_us,
                "cpu_a_over_b": cpu, "cpu_a_over_b_by_round": rounds,
                "a_rps": ra.rps, "b_rps": rb.rps, "rps_a_over_b": rps, "p99_a_over_b": p99,
            }));
        }
    }
    if !ab_md.is_empty() {
        md.push_str(&format!(
            "\nA/B: this build (A) against {} (B), interleaved:\n\n\
             | target | conns | A CPU µs/req | B CPU µs/req | CPU A ÷ B | CPU A ÷ B by round | A req/s | B req/s | req/s A ÷ B | p99 A ÷ B |\n\
             |---|---:|---:|---:|---:|---|---:|---:|---:|---:|\n{ab_md}\
             \nA ÷ B: median over rounds of the ratio within one round.\n",
            args.fencegate_b.as_deref().unwrap_or("build B"),
        ));
    }
    if let Some(d) = idx("dedup-b") {
        md.push_str("\nBuild B, durable dedup, records per flush:");
        for (c, r) in per_flush(d) {
            md.push_str(&format!(" c={c}: {r:.1};"));
        }
        md.push('\n');
    }
    if let Some(d) = idx("dedup") {
        md.push_str("\nDurable dedup, records per flush (fencegate_flush_records_total / fencegate_flush_batches_total over the windows):");
        let mut per_c = serde_json::Map::new();
        for (c, r) in per_flush(d) {
            md.push_str(&format!(" c={c}: {r:.1};"));
            per_c.insert(c.to_string(), json!(r));
        }
        md.push('\n');
        flush_json = Value::Object(per_c);
    }

    // The issue's targets.
    let mut checks = Vec::new();
    let mut check = |name: String, value: f64, ok: bool| {
        checks.push(json!({"target": name, "value": value, "met": ok}));
        format!(
            "- {} {name}: {}\n",
            if ok { "met" } else { "MISSED" },
            fmt_ratio(value)
        )
    };
    let mut tmd = String::from("\nTargets (bench figures, not test assertions):\n");
    // Fencing only: at least nginx's throughput at no more than the bare
    // pass-through's CPU, p99 within 1.1× nginx's; durable dedup on sled: 0.6×
    // the pass-through's throughput at c=64.
    for &c in &args.conc {
        if let Some(&(_, pc, _, nr, np)) = ratio_of.get(&("fencing", c)) {
            if pass.is_some() {
                tmd.push_str(&check(
                    format!("fencing only c={c}: CPU/req ≤ 1.00× pass-through"),
                    pc,
                    pc <= 1.0,
                ));
            }
            if nginx.is_some() {
                tmd.push_str(&check(
                    format!("fencing only c={c}: req/s ≥ 1.00× nginx"),
                    nr,
                    nr >= 1.0,
                ));
                tmd.push_str(&check(
                    format!("fencing only c={c}: p99 ≤ 1.10× nginx"),
                    np,
                    np <= 1.10,
                ));
            }
        }
        if let Some(&(pr, _, _, _, _)) = ratio_of.get(&("dedup", c)) {
            if pass.is_some() && c == 64 {
                tmd.push_str(&check(
                    format!("durable dedup c={c}: req/s ≥ 0.60× pass-through"),
                    pr,
                    pr >= 0.60,
                ));
            }
        }
    }
    for (c, r) in &queued_vs_dedup {
        tmd.push_str(&check(
            format!("queued c={c}: accepted req/s ≥ 0.80× durable dedup"),
            *r,
            *r >= 0.80,
        ));
    }
    if let Some(rpf) = flush_json.get("64").and_then(Value::as_f64) {
        tmd.push_str(&check(
            "durable dedup c=64: ≥ 8 records per flush".into(),
            rpf,
            rpf >= 8.0,
        ));
    }
    // A smoke's figures mean nothing: no verdicts on them.
    if !args.smoke {
        md.push_str(&tmd);
    }

    let mut idle_json = Value::Null;
    if let Some(e) = epoch_idle {
        let base = median(&e.steady_us);
        md.push_str(&format!(
            "\nNewer epoch, nothing older in flight (fencing only, {} samples each; one connection): \
             first request after the refresher saw the epoch (mark flush + drain + forward) p50 {:.0} µs, max {:.0} µs; \
             first request of an epoch fencegate had not seen (+ on-demand store read) p50 {:.0} µs, max {:.0} µs; \
             a request at an admitted epoch p50 {:.0} µs. Added by the epoch change: {:.0} µs (known), {:.0} µs (unseen).\n",
            e.known_us.len(),
            median(&e.known_us),
            quantile(&e.known_us, 1.0),
            median(&e.unseen_us),
            quantile(&e.unseen_us, 1.0),
            base,
            median(&e.known_us) - base,
            median(&e.unseen_us) - base,
        ));
        idle_json = json!({
            "known_first_us": e.known_us, "unseen_first_us": e.unseen_us,
            "steady_p50_us": base,
            "known_added_p50_us": median(&e.known_us) - base,
            "unseen_added_p50_us": median(&e.unseen_us) - base,
        });
    }
    md.push_str(&format!(
        "\nMachine: nproc {}, {}; load average before {load_before}, after {load_after}.\n",
        nproc(),
        procs::cpu_model(),
    ));
    let json = json!({
        "bench": "load",
        "args": format!("{args:?}"),
        "machine": machine(),
        "load_average": {"before": load_before, "after": load_after},
        "results": rows_json,
        "records_per_flush": flush_json,
        "queued": queued_json,
        "queued_pg": queued_pg_json,
        "postgres": pg_json,
        "a_b": ab_json,
        "epoch_change_idle": idle_json,
        "targets": checks,
    });
    Report { markdown: md, json }
}
