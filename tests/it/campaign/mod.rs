//! Issue 5, "Prove it under failure": a Jepsen-style fault campaign.
//!
//! Real processes on loopback: the single-threaded moto S3 server, the real
//! fencegate binary (its data directory kept across restarts), a recording origin
//! (`scripts/campaign/origin.py`) and N worker processes
//! (`scripts/campaign/worker.py`) that contend for three leases with short TTLs
//! through SPEC §2 and send requests (with retries and concurrent duplicates of the
//! same Idempotency-Key) through fencegate. Meanwhile a nemesis driven by a seeded
//! RNG injects, at random:
//!
//! - SIGSTOP/SIGCONT of workers past their lease (preferring lease holders): the
//!   late worker of SPEC §1;
//! - kill -9 of fencegate and restart, sometimes with a failpoint armed (the
//!   process then aborts at a durable boundary of its own choosing, SPEC §6), and
//!   now and then a graceful restart (SIGTERM, SPEC §8);
//! - SIGSTOP of the S3 server (store unavailable) and of the origin (a slow
//!   destination: upstream timeouts and drain aborts).
//!
//! At the end every fault is healed, the workers finish, and [`checker::check`]
//! verifies the history (origin log, every worker's log, the epoch objects in the
//! store, the crash intervals). Any violation fails the test with the offending
//! entries printed and the run's directory kept.
//!
//! The CI smoke is 30 s of faults (~45 s in all). The long run:
//! `scripts/campaign.sh [secs] [seed]`, or the environment variables
//! `FENCEGATE_CAMPAIGN_SECS`, `FENCEGATE_CAMPAIGN_SEED`,
//! `FENCEGATE_CAMPAIGN_WORKERS` (default 6), `FENCEGATE_CAMPAIGN_KEEP=1` (keep
//! the logs even when the run passes) and `FENCEGATE_CAMPAIGN_ROUTE_EXTRA` (TOML
//! lines added to every route: `in_doubt = "resend"` weakens fencegate on purpose
//! and must make the checker report R4 violations).

mod checker;

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::support::{
    repo_root, skip_without_python, test_python, Fencegate, S3Server, BUCKET, PREFIX,
};
use checker::{Arrival, Attempt, History, Outcome, StoredEpoch};

const LEASES: [&str; 3] = ["l0", "l1", "l2"];
const FAILPOINTS: [&str; 6] = [
    "mark_written_before_flush",
    "mark_flushed",
    "dedup_in_flight_written",
    "dedup_in_flight_flushed",
    "dedup_response_before_done",
    "dedup_done_flushed",
];
/// The workers' contenders wait this long past an expiry (SPEC §2), as fencegate's
/// `[store] grace_ms` in [`S3Server::store_toml`].
const GRACE_MS: u64 = 500;

/// fencegate's drain counters (started, aborted) from `/metrics`, if it answers.
fn drain_counters(admin: std::net::SocketAddr) -> Option<(u64, u64)> {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect_timeout(&admin, Duration::from_millis(300)).ok()?;
    conn.set_read_timeout(Some(Duration::from_millis(500)))
        .ok()?;
    conn.write_all(b"GET /metrics HTTP/1.0\r\nHost: fencegate\r\n\r\n")
        .ok()?;
    let mut text = String::new();
    conn.read_to_string(&mut text).ok()?;
    let sum = |name: &str| -> u64 {
        text.lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    };
    Some((
        sum("fencegate_drains_started"),
        sum("fencegate_drains_aborted"),
    ))
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// CLOCK_MONOTONIC in ns: the clock of the Python processes' `time.monotonic_ns()`.
/// `Instant` is CLOCK_MONOTONIC on Linux but opaque; its `Debug` shows the timespec
/// (checked against Python at the start of the campaign).
fn mono_ns() -> u64 {
    let s = format!("{:?}", Instant::now());
    let field = |name: &str| -> u64 {
        let at = s
            .find(name)
            .unwrap_or_else(|| panic!("cannot read CLOCK_MONOTONIC from {s:?}"))
            + name.len();
        s[at..]
            .chars()
            .skip_while(|c| !c.is_ascii_digit())
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse()
            .unwrap_or_else(|_| panic!("cannot read CLOCK_MONOTONIC from {s:?}"))
    };
    field("tv_sec:") * 1_000_000_000 + field("tv_nsec:")
}

/// A child process that may be SIGSTOPped: resumed, killed and reaped on drop.
struct Proc {
    name: String,
    child: Child,
    stopped: bool,
}

impl Proc {
    fn signal(&self, sig: &str) {
        let _ = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .stderr(Stdio::null())
            .status();
    }

    fn stop(&mut self) {
        self.signal("-STOP");
        self.stopped = true;
    }

    fn cont(&mut self) {
        if self.stopped {
            self.signal("-CONT");
            self.stopped = false;
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return; // reaped: its pid may belong to someone else by now
        }
        self.signal("-CONT");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The recording origin, started and its `LISTENING host:port` line read.
fn start_origin(dir: &Path, seed: u64) -> (Proc, String) {
    let mut child = Command::new(test_python())
        .arg(repo_root().join("scripts/campaign/origin.py"))
        .arg("--log")
        .arg(dir.join("origin.jsonl"))
        .args(["--seed", &seed.to_string()])
        .stdout(Stdio::piped())
        .stderr(fs::File::create(dir.join("origin.stderr")).unwrap())
        .spawn()
        .expect("starting scripts/campaign/origin.py");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let proc = Proc {
        name: "origin".into(),
        child,
        stopped: false,
    };
    let addr = line
        .trim()
        .strip_prefix("LISTENING ")
        .unwrap_or_else(|| panic!("origin.py said {line:?}"))
        .to_owned();
    (proc, addr)
}

fn start_worker(dir: &Path, i: usize, s3: &S3Server, secs: u64, seed: u64) -> Proc {
    let child = Command::new(test_python())
        .arg(repo_root().join("scripts/campaign/worker.py"))
        .args(["--id", &i.to_string(), "--endpoint", &s3.endpoint])
        .args(["--bucket", BUCKET, "--prefix", PREFIX])
        .args(["--leases", &LEASES.join(",")])
        .arg("--addr-file")
        .arg(dir.join("proxy.addr"))
        .arg("--log")
        .arg(dir.join(format!("w{i}.jsonl")))
        .arg("--state-file")
        .arg(dir.join(format!("w{i}.state")))
        .args(["--seed", &seed.to_string(), "--secs", &secs.to_string()])
        .args(["--grace-ms", &GRACE_MS.to_string()])
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .stdout(Stdio::null())
        .stderr(fs::File::create(dir.join(format!("w{i}.stderr"))).unwrap())
        .spawn()
        .expect("starting scripts/campaign/worker.py");
    Proc {
        name: format!("worker {i}"),
        child,
        stopped: false,
    }
}

/// The fault injector. Single-threaded; every fault it starts it also ends.
struct Nemesis<'a> {
    rng: StdRng,
    dir: PathBuf,
    s3: &'a S3Server,
    fg: Fencegate,
    origin: Proc,
    workers: Vec<Proc>,
    worker_resume: Vec<Option<Instant>>,
    store_resume: Option<Instant>,
    origin_resume: Option<Instant>,
    /// Since when (mono ns) the running fencegate has been up, and its failpoint.
    started: u64,
    armed: Option<&'static str>,
    /// Fencegate is down; restart at this instant (once the store answers).
    down: Option<(Instant, Option<&'static str>)>,
    crashes: Vec<(u64, u64)>,
    events: BTreeMap<String, usize>,
    timeline: Vec<String>,
    unexpected_exits: Vec<String>,
    t0: Instant,
}

impl Nemesis<'_> {
    fn note(&mut self, kind: &str, detail: String) {
        *self.events.entry(kind.to_owned()).or_default() += 1;
        self.timeline.push(format!(
            "{:>8.3}s {kind}{}",
            self.t0.elapsed().as_secs_f64(),
            if detail.is_empty() {
                detail
            } else {
                format!(": {detail}")
            }
        ));
    }

    fn write_addr(&self) {
        let tmp = self.dir.join("proxy.addr.tmp");
        fs::write(&tmp, self.fg.proxy.to_string()).unwrap();
        fs::rename(tmp, self.dir.join("proxy.addr")).unwrap();
    }

    /// Restarts fencegate on its port (another if that was taken meanwhile).
    fn restart(&mut self, failpoint: Option<&'static str>) {
        // Start-up needs the store (the self-test); a busy single-threaded moto, or a
        // worker SIGSTOPped in the middle of a store call, can make it time out.
        let mut tries = 0;
        loop {
            self.started = mono_ns();
            let Err(stderr) = self.fg.spawn(failpoint) else {
                break;
            };
            tries += 1;
            assert!(tries < 30, "fencegate did not restart:\n{stderr}");
            let last = stderr.lines().last().unwrap_or_default().to_owned();
            if last.contains("in use") {
                // The pinned port was taken meanwhile: take any.
                let text = fs::read_to_string(&self.fg.config).unwrap();
                let port = format!("\nlisten = \"{}\"", self.fg.proxy);
                fs::write(
                    &self.fg.config,
                    text.replace(&port, "\nlisten = \"127.0.0.1:0\""),
                )
                .unwrap();
            }
            self.note("restart failed", last);
            std::thread::sleep(Duration::from_millis(500));
        }
        self.write_addr();
        self.armed = failpoint;
        self.down = None;
        match failpoint {
            Some(fp) => self.note(&format!("restart with failpoint {fp}"), String::new()),
            None => self.note("restart", String::new()),
        }
    }

    fn holder(&self, i: usize) -> bool {
        fs::read_to_string(self.dir.join(format!("w{i}.state"))).is_ok_and(|s| !s.trim().is_empty())
    }

    /// Ends the faults whose time has come; notices (and restarts) a dead fencegate.
    fn tick(&mut self) {
        let now = Instant::now();
        for i in 0..self.workers.len() {
            if self.worker_resume[i].is_some_and(|t| now >= t) {
                self.worker_resume[i] = None;
                self.workers[i].cont();
            }
        }
        if self.store_resume.is_some_and(|t| now >= t) {
            self.store_resume = None;
            self.s3.resume();
        }
        if self.origin_resume.is_some_and(|t| now >= t) {
            self.origin_resume = None;
            self.origin.cont();
        }
        if self.down.is_none() && self.fg.exited() {
            self.crashes.push((self.started, mono_ns()));
            match self.armed {
                Some(fp) => self.note(&format!("failpoint abort {fp}"), String::new()),
                None => {
                    let tail: String = self
                        .fg
                        .stderr()
                        .lines()
                        .rev()
                        .take(30)
                        .collect::<Vec<_>>()
                        .join("\n");
                    self.unexpected_exits.push(tail);
                    self.note("unexpected fencegate exit", String::new());
                }
            }
            self.down = Some((now, None));
        }
        if let Some((at, fp)) = self.down {
            if now >= at && self.store_resume.is_none() {
                self.restart(fp);
            }
        }
    }

    /// Adds the running fencegate's drain counters to the totals (before it dies).
    fn scrape(&mut self) {
        if let Some((started, aborted)) = drain_counters(self.fg.admin) {
            *self
                .events
                .entry("(fencegate drains started)".into())
                .or_default() += started as usize;
            *self
                .events
                .entry("(fencegate drains aborted)".into())
                .or_default() += aborted as usize;
        }
    }

    fn kill_fencegate(&mut self, restart_with: Option<&'static str>) {
        self.scrape();
        // An armed process may already have aborted unnoticed: its whole life counts.
        let lo = if self.armed.is_some() {
            self.started
        } else {
            mono_ns()
        };
        if self.armed.is_some() && self.fg.exited() {
            self.note(
                &format!("failpoint abort {}", self.armed.unwrap_or_default()),
                String::new(),
            );
        } else {
            self.fg.kill9();
            self.note("kill -9 fencegate", String::new());
        }
        self.crashes.push((lo, mono_ns()));
        let delay = Duration::from_millis(self.rng.gen_range(0..400));
        self.down = Some((Instant::now() + delay, restart_with));
    }

    /// Starts one random fault (or none).
    fn inject(&mut self) {
        let now = Instant::now();
        let x = self.rng.gen_range(0..100);
        if x < 30 {
            let idle: Vec<usize> = (0..self.workers.len())
                .filter(|&i| self.worker_resume[i].is_none())
                .collect();
            let holders: Vec<usize> = idle.iter().copied().filter(|&i| self.holder(i)).collect();
            let pool = if !holders.is_empty() && self.rng.gen_bool(0.8) {
                &holders
            } else {
                &idle
            };
            if pool.is_empty() {
                return;
            }
            let i = pool[self.rng.gen_range(0..pool.len())];
            let held = self.holder(i);
            // Past the longest TTL (4 s) in most cases: the late worker.
            let ms = self.rng.gen_range(1500..6500);
            self.workers[i].stop();
            self.worker_resume[i] = Some(now + Duration::from_millis(ms));
            let kind = if held {
                "pause worker holding a lease"
            } else {
                "pause worker not holding a lease"
            };
            self.note(kind, format!("w{i} for {ms} ms"));
        } else if x < 40 {
            if self.down.is_some() {
                return;
            }
            let fp = self
                .rng
                .gen_bool(0.5)
                .then(|| FAILPOINTS[self.rng.gen_range(0..FAILPOINTS.len())]);
            self.kill_fencegate(fp);
        } else if x < 48 {
            if self.store_resume.is_some() {
                return;
            }
            let ms = self.rng.gen_range(300..2500);
            self.s3.pause();
            self.store_resume = Some(now + Duration::from_millis(ms));
            self.note("pause store", format!("{ms} ms"));
        } else if x < 58 {
            if self.origin_resume.is_some() {
                return;
            }
            let ms = self.rng.gen_range(200..2000);
            self.origin.stop();
            self.origin_resume = Some(now + Duration::from_millis(ms));
            self.note("pause origin", format!("{ms} ms"));
        } else if x < 61 && self.down.is_none() {
            self.terminate_fencegate();
        }
    }

    /// SIGTERM: the graceful shutdown (in-flight requests finish or are abandoned
    /// as in doubt), then a restart. For the checker it is a restart like any other.
    fn terminate_fencegate(&mut self) {
        self.scrape();
        let lo = if self.armed.is_some() {
            self.started
        } else {
            mono_ns()
        };
        if self.fg.exited() {
            let fp = self.armed.unwrap_or("none");
            self.note(&format!("failpoint abort {fp}"), String::new());
        } else {
            let status = self.fg.terminate();
            self.note("SIGTERM fencegate (graceful restart)", format!("{status}"));
        }
        self.crashes.push((lo, mono_ns()));
        self.down = Some((Instant::now(), None));
    }

    fn run(&mut self, secs: u64) {
        let end = Instant::now() + Duration::from_secs(secs);
        let mut next = Instant::now() + Duration::from_millis(500);
        while Instant::now() < end {
            self.tick();
            if Instant::now() >= next {
                self.inject();
                next = Instant::now() + Duration::from_millis(self.rng.gen_range(250..900));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Ends every fault, then lets the workers finish (bounded).
    fn heal(&mut self) -> Vec<String> {
        for (w, r) in self.workers.iter_mut().zip(self.worker_resume.iter_mut()) {
            w.cont();
            *r = None;
        }
        if self.store_resume.take().is_some() {
            self.s3.resume();
        }
        self.origin_resume = None;
        self.origin.cont();
        if self.down.is_none() && self.armed.is_some() && !self.fg.exited() {
            self.kill_fencegate(None);
        }
        self.tick();
        if self.down.is_some() {
            self.restart(None);
        }
        let deadline = Instant::now() + Duration::from_secs(40);
        let mut failures = Vec::new();
        for w in &mut self.workers {
            let status = loop {
                if let Some(s) = w.child.try_wait().unwrap() {
                    break Some(s);
                }
                if Instant::now() > deadline {
                    break None;
                }
                std::thread::sleep(Duration::from_millis(50));
            };
            match status {
                Some(s) if s.success() => {}
                other => failures.push(format!("{} ended with {other:?}", w.name)),
            }
        }
        if self.fg.exited() {
            self.unexpected_exits
                .push("fencegate exited while the workers finished".into());
        } else {
            self.scrape();
        }
        // The origin answers within 1.5 s; let the last answers be written.
        std::thread::sleep(Duration::from_millis(2000));
        failures
    }
}

fn json_lines(path: &Path) -> Vec<serde_json::Value> {
    let text = fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{}: {e}: {l}", path.display())))
        .collect()
}

fn s(v: &serde_json::Value) -> Option<String> {
    v.as_str().map(str::to_owned)
}

fn read_attempts(path: &Path) -> Vec<Attempt> {
    json_lines(path)
        .into_iter()
        .filter(|v| v["ev"] == "attempt")
        .map(|v| Attempt {
            worker: v["w"].as_u64().unwrap() as u32,
            req: s(&v["req"]).unwrap(),
            kind: s(&v["kind"]).unwrap(),
            route: s(&v["route"]).unwrap(),
            epoch: v["epoch"].as_u64().unwrap(),
            token: s(&v["token"]).unwrap(),
            key: s(&v["key"]).unwrap(),
            invoke: v["invoke"].as_u64().unwrap(),
            complete: v["complete"].as_u64().unwrap(),
            outcome: match v["outcome"].as_str().unwrap() {
                "response" => Outcome::Response {
                    status: v["status"].as_u64().unwrap() as u16,
                    error: s(&v["error"]),
                    replayed: v["replayed"].as_bool().unwrap(),
                    body: s(&v["resp_body"]).unwrap_or_default(),
                },
                "timeout" => Outcome::Timeout,
                _ => Outcome::ConnError(s(&v["detail"]).unwrap_or_default()),
            },
        })
        .collect()
}

fn read_arrivals(path: &Path) -> Vec<Arrival> {
    let mut by_seq: BTreeMap<u64, Arrival> = BTreeMap::new();
    let lines = json_lines(path);
    for v in &lines {
        if v["ev"] == "arrive" {
            let path = s(&v["path"]).unwrap_or_default();
            by_seq.insert(
                v["seq"].as_u64().unwrap(),
                Arrival {
                    seq: v["seq"].as_u64().unwrap(),
                    route: path.split('/').nth(1).unwrap_or_default().to_owned(),
                    req: s(&v["req"]),
                    epoch: v["epoch"].as_str().and_then(|e| e.parse().ok()),
                    key: s(&v["key"]),
                    arrive: v["arrive"].as_u64().unwrap(),
                    complete: None,
                    status: None,
                    body: None,
                },
            );
        }
    }
    for v in &lines {
        if v["ev"] == "done" {
            let a = by_seq.get_mut(&v["seq"].as_u64().unwrap()).unwrap();
            a.complete = v["complete"].as_u64();
            a.status = v["status"].as_u64().map(|s| s as u16);
            a.body = s(&v["body"]);
        }
    }
    by_seq.into_values().collect()
}

/// Every epoch object of the campaign's leases (nothing is garbage-collected).
async fn read_epochs(s3: &S3Server) -> BTreeMap<(String, u64), StoredEpoch> {
    let store = s3.store().await;
    let mut out = BTreeMap::new();
    for lease in LEASES {
        let prefix = format!("{PREFIX}{lease}/");
        for key in store.list(&prefix, None).await.expect("listing epochs") {
            let Some(epoch) = key
                .strip_prefix(&prefix)
                .and_then(|k| k.strip_suffix(".json"))
                .and_then(|k| k.parse::<u64>().ok())
            else {
                continue;
            };
            let obj = store.get(&key).await.expect("reading an epoch").unwrap();
            let v: serde_json::Value = serde_json::from_slice(&obj.body).unwrap_or_default();
            let parsed = match (v["kind"].as_str(), v["token_sha256"].as_str()) {
                _ if v["lease"] != lease || v["epoch"] != epoch => {
                    StoredEpoch::Invalid(String::from_utf8_lossy(&obj.body).into_owned())
                }
                (Some("acquire"), Some(t)) => StoredEpoch::Acquire {
                    token_sha256: t.to_owned(),
                },
                (Some("release"), _) => StoredEpoch::Release,
                _ => StoredEpoch::Invalid(String::from_utf8_lossy(&obj.body).into_owned()),
            };
            out.insert((lease.to_owned(), epoch), parsed);
        }
    }
    out
}

fn print_counts(title: &str, m: &BTreeMap<String, usize>) {
    println!("{title}:");
    for (k, n) in m {
        println!("  {n:>6}  {k}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_campaign() {
    skip_without_python!();
    let secs = env_u64("FENCEGATE_CAMPAIGN_SECS", 30);
    let seed = env_u64("FENCEGATE_CAMPAIGN_SEED", 5);
    let n_workers = env_u64("FENCEGATE_CAMPAIGN_WORKERS", 6).max(5) as usize;
    let begun = Instant::now();
    let tmp = tempfile::Builder::new()
        .prefix("fencegate-campaign-")
        .tempdir()
        .unwrap();
    let dir = tmp.path().to_owned();

    // The Python processes' clock is ours.
    let (lo, py, hi) = {
        let lo = mono_ns();
        let out = Command::new(test_python())
            .args(["-c", "import time; print(time.monotonic_ns())"])
            .output()
            .unwrap();
        let py: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
        (lo, py, mono_ns())
    };
    assert!(
        lo <= py && py <= hi,
        "monotonic clocks differ: {lo} {py} {hi}"
    );

    let s3 = S3Server::start();
    let (origin, origin_addr) = start_origin(&dir, seed * 100 + 99);
    // Extra route lines, for checking the checker against a weakened fencegate
    // (e.g. `in_doubt = "resend"` must produce R4 violations).
    let extra = std::env::var("FENCEGATE_CAMPAIGN_ROUTE_EXTRA").unwrap_or_default();
    let mut config = s3.store_toml(200);
    for (i, lease) in LEASES.iter().enumerate() {
        config.push_str(&format!(
            "\n[[route]]\nname = \"r{i}\"\npath_prefix = \"/r{i}/\"\nupstream = \"http://{origin_addr}/r{i}/\"\nlease = \"{lease}\"\ntimeout_ms = 1000\ndrain_timeout_ms = 600\n{extra}\n"
        ));
    }
    let started = mono_ns();
    let fg = Fencegate::start(&config);
    // Pin the proxy port so restarts keep it (workers also re-read proxy.addr).
    let text = fs::read_to_string(&fg.config).unwrap();
    fs::write(
        &fg.config,
        text.replacen(
            "\nlisten = \"127.0.0.1:0\"",
            &format!("\nlisten = \"{}\"", fg.proxy),
            1,
        ),
    )
    .unwrap();
    let routes: BTreeMap<String, String> = LEASES
        .iter()
        .enumerate()
        .map(|(i, l)| (format!("r{i}"), l.to_string()))
        .collect();

    let mut nemesis = Nemesis {
        rng: StdRng::seed_from_u64(seed),
        dir: dir.clone(),
        s3: &s3,
        fg,
        origin,
        workers: Vec::new(),
        worker_resume: vec![None; n_workers],
        store_resume: None,
        origin_resume: None,
        started,
        armed: None,
        down: None,
        crashes: Vec::new(),
        events: BTreeMap::new(),
        timeline: Vec::new(),
        unexpected_exits: Vec::new(),
        t0: Instant::now(),
    };
    nemesis.write_addr();
    nemesis.workers = (0..n_workers)
        .map(|i| start_worker(&dir, i, &s3, secs, seed * 100 + i as u64))
        .collect();
    let worker_failures = tokio::task::block_in_place(|| {
        nemesis.run(secs);
        nemesis.heal()
    });
    let fg_stderr = nemesis.fg.stderr();
    let Nemesis {
        crashes,
        events,
        timeline,
        unexpected_exits,
        origin,
        workers,
        fg,
        ..
    } = nemesis;
    drop(workers);
    drop(origin);
    drop(fg);
    fs::write(dir.join("nemesis.log"), timeline.join("\n")).unwrap();
    fs::write(dir.join("fencegate.stderr"), &fg_stderr).unwrap();

    let mut history = History {
        routes,
        attempts: Vec::new(),
        arrivals: read_arrivals(&dir.join("origin.jsonl")),
        epochs: read_epochs(&s3).await,
        crashes,
    };
    for i in 0..n_workers {
        history
            .attempts
            .extend(read_attempts(&dir.join(format!("w{i}.jsonl"))));
    }
    let report = checker::check(&history);

    println!(
        "\n=== fault campaign: seed {seed}, {secs} s of faults, {n_workers} workers, {} leases ===",
        LEASES.len()
    );
    println!(
        "histories checked: {} leases; {} epochs in the store; {} worker attempts; {} arrivals at the destination; {} dedup keys at the destination; {} epoch-ordered pairs; {} replays",
        report.leases.len(),
        history.epochs.len(),
        history.attempts.len(),
        history.arrivals.len(),
        report.keys_at_destination,
        report.ordered_pairs,
        report.replays_checked,
    );
    for (lease, f) in &report.leases {
        println!(
            "  lease {lease}: {} epochs in the store, {} seen at the destination, {} attempts, {} arrivals",
            f.epochs_in_store, f.epochs_at_destination, f.attempts, f.arrivals
        );
    }
    print_counts("operations by outcome", &report.outcomes);
    print_counts("attempts by kind", &report.kinds);
    print_counts("nemesis events", &events);
    println!("R1/R2 exemptions used:");
    for (k, n) in &report.exempt {
        println!("  {n:>6}  {k}");
    }
    println!("violations: {}", report.violations.len());
    for v in &report.violations {
        println!("{v}");
    }
    println!("run time: {:.1} s", begun.elapsed().as_secs_f64());

    let mut problems = Vec::new();
    if !report.violations.is_empty() {
        problems.push(format!("{} violations (above)", report.violations.len()));
    }
    problems.extend(worker_failures);
    // A Python exception (e.g. in a worker's request thread) only shows here.
    for i in 0..n_workers {
        let name = format!("w{i}.stderr");
        let text = fs::read_to_string(dir.join(&name)).unwrap_or_default();
        if !text.trim().is_empty() {
            problems.push(format!("{name}:\n{text}"));
        }
    }
    problems.extend(
        unexpected_exits
            .iter()
            .map(|t| format!("fencegate exited without a failpoint:\n{t}")),
    );
    let ops = history
        .attempts
        .iter()
        .filter(|a| matches!(a.outcome, Outcome::Response { error: None, .. }))
        .count();
    if ops < 20 {
        problems.push(format!("only {ops} attempts were answered by the origin: the campaign did not exercise fencegate"));
    }
    if problems.is_empty() && std::env::var_os("FENCEGATE_CAMPAIGN_KEEP").is_none() {
        return;
    }
    let kept = tmp.keep();
    println!("campaign logs kept in {}", kept.display());
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
