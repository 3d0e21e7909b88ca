//! SPEC §2 and §8 from the worker's side: the `fencegate lease` commands on both
//! store backends, concurrent acquires from many processes, the uncertain result
//! (a create whose response was lost), the store self-test, `fencegate demo`, and
//! the Python worker example `examples/fenced_worker.py`.
//!
//! Measured (2 shared cores, debug build, single-threaded moto; run with
//! `--nocapture` to see the figures): `fencegate lease acquire` against the test S3
//! server takes 0.13–0.21 s of process wall time (median of 5; start-up, SDK
//! set-up, the 3-call self-test, then list, put, get), the library's
//! `acquire::acquire` 45–57 ms (median of 20), the CLI on the `dir` store 20–33 ms;
//! `fencegate demo` about 2.0 s.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use fencegate::clock::SystemClock;
use fencegate::epoch::{object_key, Epoch, EpochObject, EpochRecord, LeaseName, TokenHash};
use fencegate::lease::acquire::{self as lease_acquire, AcquireError};
use fencegate::lease::dir::DirStore;
use fencegate::lease::probe::{self, ProbeError};
use fencegate::lease::{Epochs, LeaseStore};
use serde_json::Value;

use crate::support::*;

// ------------------------------------------------------------------ helpers

/// What one `fencegate lease ...` process did.
#[derive(Debug)]
struct Run {
    code: i32,
    json: Value,
    stdout: String,
    stderr: String,
    elapsed: Duration,
}

impl Run {
    fn ok(self) -> Value {
        assert_eq!(self.code, 0, "expected exit 0: {self:?}");
        self.json
    }

    fn held(self) -> Value {
        assert_eq!(self.code, 3, "expected exit 3 (held): {self:?}");
        self.json
    }
}

/// A config file with only a `[store]` section, and the commands that use it.
struct LeaseCli {
    dir: tempfile::TempDir,
    config: PathBuf,
    /// The `[store]` section, for a fencegate on the same store.
    store_toml: String,
    grace: Duration,
    /// The `dir` store's directory, removed with the helper.
    _leases: Option<tempfile::TempDir>,
}

impl LeaseCli {
    fn with_store(store_toml: String, grace: Duration) -> LeaseCli {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("lease.toml");
        std::fs::write(&config, &store_toml).unwrap();
        LeaseCli {
            dir,
            config,
            store_toml,
            grace,
            _leases: None,
        }
    }

    /// On the test S3 server (its `store_toml` sets grace_ms = 500).
    fn s3(s3: &S3Server) -> LeaseCli {
        LeaseCli::with_store(s3.store_toml(100), Duration::from_millis(500))
    }

    /// On a fresh `dir` store.
    fn dir() -> LeaseCli {
        let leases = tempfile::tempdir().unwrap();
        let cli = LeaseCli::with_store(
            format!(
                "[store]\nkind = \"dir\"\npath = \"{}\"\nrefresh_interval_ms = 100\ngrace_ms = 200\n",
                leases.path().display()
            ),
            Duration::from_millis(200),
        );
        LeaseCli {
            _leases: Some(leases),
            ..cli
        }
    }

    async fn run(&self, sub: &str, args: &[&str]) -> Run {
        let started = Instant::now();
        let out = tokio::process::Command::new(bin())
            .arg("lease")
            .arg(sub)
            .arg("--config")
            .arg(&self.config)
            .args(args)
            .current_dir(self.dir.path())
            .env("AWS_ACCESS_KEY_ID", "test")
            .env("AWS_SECRET_ACCESS_KEY", "test")
            .env("AWS_EC2_METADATA_DISABLED", "true")
            .env("FENCEGATE_LOG", "warn")
            .stdin(Stdio::null())
            .output()
            .await
            .expect("running fencegate lease");
        let elapsed = started.elapsed();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        Run {
            code: out.status.code().unwrap_or(-1),
            json: serde_json::from_str(stdout.trim()).unwrap_or(Value::Null),
            stdout,
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            elapsed,
        }
    }

    async fn acquire(&self, lease: &str, holder: &str, ttl_ms: u64) -> Run {
        self.run(
            "acquire",
            &[
                "--lease",
                lease,
                "--holder",
                holder,
                "--ttl-ms",
                &ttl_ms.to_string(),
            ],
        )
        .await
    }

    async fn tenure_cmd(&self, sub: &str, lease: &str, holder: &str, held: &Value) -> Run {
        let epoch = held["epoch"].as_u64().unwrap().to_string();
        self.run(
            sub,
            &[
                "--lease",
                lease,
                "--holder",
                holder,
                "--epoch",
                &epoch,
                "--token",
                held["token"].as_str().unwrap(),
            ],
        )
        .await
    }

    async fn show(&self, lease: &str) -> Value {
        self.run("show", &["--lease", lease]).await.ok()
    }
}

fn parse_time(v: &Value) -> SystemTime {
    humantime::parse_rfc3339(v.as_str().unwrap_or_else(|| panic!("not a time: {v}"))).unwrap()
}

fn lease(name: &str) -> LeaseName {
    LeaseName::parse(name).unwrap()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

// ------------------------------------------------------------------ round trip

/// acquire / held / show / renew / stale renew / release / immediate re-acquire,
/// then the printed token is admitted by a fencegate on the same store.
async fn round_trip(cli: &LeaseCli, epochs: &Epochs) {
    const L: &str = "jobs";
    let none = cli.show(L).await;
    assert_eq!(none["epoch"], 0, "{none}");
    assert_eq!(none["kind"], "none");
    assert_eq!(none["free"], true);

    let a = cli.acquire(L, "worker-a", 30_000).await.ok();
    assert_eq!(a["lease"], L);
    assert_eq!(a["epoch"], 1);
    assert_eq!(a["holder"], "worker-a");
    let token_a = a["token"].as_str().unwrap().to_owned();
    assert!(
        token_a.len() >= 32 && token_a.bytes().all(|c| c.is_ascii_hexdigit()),
        "{token_a}"
    );
    let expires_a = parse_time(&a["expires_at"]);
    let in_30s = SystemTime::now() + Duration::from_secs(30);
    assert!(
        expires_a <= in_30s + Duration::from_secs(2)
            && expires_a + Duration::from_secs(10) >= in_30s,
        "expires_at {} is not about 30 s away",
        a["expires_at"]
    );
    // The object is SPEC §2's format at SPEC §2's key.
    let obj = epochs
        .store()
        .get(&format!("{PREFIX}{L}/00000000000000000001.json"))
        .await
        .unwrap()
        .expect("epoch object 1");
    let rec: Value = serde_json::from_slice(&obj.body).unwrap();
    assert_eq!(rec["v"], 1);
    assert_eq!(rec["lease"], L);
    assert_eq!(rec["epoch"], 1);
    assert_eq!(rec["kind"], "acquire");
    assert_eq!(rec["holder"], "worker-a");
    assert_eq!(rec["ttl_ms"], 30_000);
    assert_eq!(
        rec["token_sha256"],
        TokenHash::of(token_a.as_bytes()).to_hex()
    );

    // Another holder: exit 3, told who holds it, no token.
    let b = cli.acquire(L, "worker-b", 30_000).await.held();
    assert_eq!(b["epoch"], 1, "{b}");
    assert_eq!(b["holder"], "worker-a");
    assert!(b.get("token").is_none(), "{b}");
    // Acquiring again under the same holder name is not a renewal: still held.
    cli.acquire(L, "worker-a", 30_000).await.held();

    let shown = cli.show(L).await;
    assert_eq!(shown["epoch"], 1);
    assert_eq!(shown["kind"], "acquire");
    assert_eq!(shown["holder"], "worker-a");
    assert_eq!(shown["free"], false);
    assert_eq!(parse_time(&shown["expires_at"]), expires_a);

    // Renew: epoch 2, a fresh token.
    let a2 = cli.tenure_cmd("renew", L, "worker-a", &a).await.ok();
    assert_eq!(a2["epoch"], 2, "{a2}");
    assert_ne!(a2["token"], a["token"]);
    // The old tenure can neither renew nor release any more.
    cli.tenure_cmd("renew", L, "worker-a", &a).await.held();
    cli.tenure_cmd("release", L, "worker-a", &a).await.held();
    // A wrong token cannot release the current one.
    let forged = serde_json::json!({"epoch": 2, "token": "00".repeat(32)});
    cli.tenure_cmd("release", L, "worker-a", &forged)
        .await
        .held();

    let rel = cli.tenure_cmd("release", L, "worker-a", &a2).await.ok();
    assert_eq!(rel["epoch"], 3, "{rel}");
    assert_eq!(rel["kind"], "release");
    let shown = cli.show(L).await;
    assert_eq!(
        (shown["epoch"].as_u64(), shown["kind"].as_str()),
        (Some(3), Some("release"))
    );
    assert_eq!(shown["free"], true);

    // After a release the lease is free at once: no expiry, no grace.
    let b = cli.acquire(L, "worker-b", 30_000).await;
    assert!(
        b.elapsed < Duration::from_secs(5),
        "acquire after release took {:?}",
        b.elapsed
    );
    let b = b.ok();
    assert_eq!(b["epoch"], 4);

    // The printed token is what a running fencegate admits.
    let origin = Origin::start().await;
    let fg = Fencegate::start(&format!(
        "{}{}",
        cli.store_toml,
        route_toml("jobs", L, &origin, "")
    ));
    let epoch_b = b["epoch"].as_u64().unwrap();
    let token_b = b["token"].as_str().unwrap();
    let r = send(
        worker_req(&fg.url("/jobs/run"), epoch_b, token_b)
            .body(body("from the shell"))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let log = origin.log();
    assert_eq!(log.len(), 1);
    assert_eq!(log[0].epoch(), Some(epoch_b));
    assert_eq!(log[0].path, "/v1/run");
    // And the superseded tenure is fenced off.
    let stale = send(
        worker_req(&fg.url("/jobs/run"), 2, a2["token"].as_str().unwrap())
            .body(body("old"))
            .unwrap(),
    )
    .await;
    stale.assert_error(409, "epoch_stale");
    assert_eq!(origin.count(), 1);
}

/// `acquire --wait` returns only once the holder's expiry plus grace has passed
/// on the store's clock, reporting progress on stderr. `ttl_ms` must leave the
/// waiter ample time to start and see the lease held (a CLI process takes ~0.2 s,
/// more on a loaded machine; S3 truncates LastModified, costing up to 1 s more).
async fn acquire_waits(cli: &LeaseCli, ttl_ms: u64) {
    const L: &str = "waited";
    let a = cli.acquire(L, "short", ttl_ms).await.ok();
    let free_at = parse_time(&a["expires_at"]) + cli.grace;
    let b = cli
        .run("acquire", &["--lease", L, "--holder", "patient", "--wait"])
        .await;
    let done = SystemTime::now();
    assert_eq!(b.code, 0, "{b:?}");
    assert_eq!(b.json["epoch"], 2);
    assert_eq!(b.json["holder"], "patient");
    assert!(
        done >= free_at,
        "acquired at {} before the holder's expiry + grace {}",
        humantime::format_rfc3339_millis(done),
        humantime::format_rfc3339_millis(free_at)
    );
    assert!(
        b.stderr.contains("held by \"short\"") && b.stderr.contains("waiting"),
        "no progress on stderr: {}",
        b.stderr
    );
    assert!(b.elapsed < Duration::from_secs(8), "{:?}", b.elapsed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_round_trip_on_s3() {
    skip_without_python!();
    let s3 = S3Server::start();
    let cli = LeaseCli::s3(&s3);
    round_trip(&cli, &s3.epochs().await).await;
    // The waiter judges the holder's expiry on the earliest reading of the store's
    // clock (`Date` has 1 s resolution), so even on S3 it never acquires early.
    acquire_waits(&cli, 3000).await;
}

/// A TTL of 0 is refused by acquire and by renew (the tenure would be over when
/// written; it used to succeed with an expired lease), and on S3 a TTL under 3 s
/// is taken with a warning (`Last-Modified` has 1 s resolution). Nothing is
/// written by a refused command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_checks_refuse_zero_and_warn_below_three_seconds_on_s3() {
    skip_without_python!();
    let s3 = S3Server::start();
    let cli = LeaseCli::s3(&s3);
    let zero = cli.acquire("jobs", "w", 0).await;
    assert_eq!(zero.code, 2, "{zero:?}");
    assert!(zero.stderr.contains("--ttl-ms 0"), "{zero:?}");
    assert_eq!(cli.show("jobs").await["epoch"], 0, "nothing written");

    let short = cli.acquire("jobs", "w", 2000).await;
    assert!(
        short
            .stderr
            .contains("warning: --ttl-ms 2000 is below 3000"),
        "{short:?}"
    );
    let held = short.ok();
    let plain = cli.acquire("other", "w", 3000).await;
    assert!(!plain.stderr.contains("warning"), "{plain:?}");

    let epoch = held["epoch"].as_u64().unwrap().to_string();
    let renew = cli
        .run(
            "renew",
            &[
                "--lease",
                "jobs",
                "--holder",
                "w",
                "--epoch",
                &epoch,
                "--token",
                held["token"].as_str().unwrap(),
                "--ttl-ms",
                "0",
            ],
        )
        .await;
    assert_eq!(renew.code, 2, "{renew:?}");
    assert!(renew.stderr.contains("--ttl-ms 0"), "{renew:?}");
    assert_eq!(cli.show("jobs").await["epoch"], 1, "no renewal written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_round_trip_on_dir_store() {
    let cli = LeaseCli::dir();
    let (epochs, path) = dir_epochs(&cli);
    round_trip(&cli, &epochs).await;
    // The dir store's clock is the local clock, exactly.
    acquire_waits(&cli, 1500).await;
    // Nothing but epoch objects is left in the lease's directory.
    let mut files: Vec<String> = std::fs::read_dir(path.join("fencegate/jobs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        (1..=4).map(|e| format!("{e:020}.json")).collect::<Vec<_>>()
    );
}

/// `--format env` when the lease is held by someone else (issue 32: a second run
/// of the quick start): exit 3, and what `eval` runs sets nothing usable — no
/// other holder's epoch — unsets an earlier run's values, says why on stderr and
/// fails, so a script with `eval "$(…)" || exit` stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn format_env_of_a_held_lease_sets_nothing_and_fails_in_the_shell() {
    let cli = LeaseCli::dir();
    let first = cli
        .run(
            "acquire",
            &["--lease", "jobs", "--holder", "one", "--format", "env"],
        )
        .await;
    assert_eq!(first.code, 0, "{first:?}");
    assert!(first.stdout.contains("FENCEGATE_TOKEN='"), "{first:?}");
    let second = cli
        .run(
            "acquire",
            &["--lease", "jobs", "--holder", "two", "--format", "env"],
        )
        .await;
    assert_eq!(second.code, 3, "{second:?}");
    assert!(!second.stdout.contains("FENCEGATE_EPOCH="), "{second:?}");
    let script = format!(
        "FENCEGATE_EPOCH=7; FENCEGATE_TOKEN=t; eval \"$(cat <<'EOF'\n{}EOF\n)\" && echo evaluated; echo \"epoch=${{FENCEGATE_EPOCH:-unset}}\"",
        second.stdout
    );
    let sh = std::process::Command::new("sh")
        .args(["-c", &script])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&sh.stdout);
    let err = String::from_utf8_lossy(&sh.stderr);
    assert!(!out.contains("evaluated"), "eval succeeded: {out}");
    assert!(out.contains("epoch=unset"), "{out}");
    assert!(err.contains("nothing was acquired"), "{err}");
    // Said once, by what `eval` runs; fencegate's own stderr adds nothing.
    assert_eq!(err.matches("held by").count(), 1, "{err}");
    assert!(second.stderr.trim().is_empty(), "{second:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_usage_and_config_errors_exit_2() {
    let cli = LeaseCli::dir();
    let bad_name = cli.run("show", &["--lease", "Not-A-Lease"]).await;
    assert_eq!(bad_name.code, 2, "{bad_name:?}");
    assert!(
        bad_name.stderr.contains("invalid lease name"),
        "{bad_name:?}"
    );
    let missing = LeaseCli {
        config: cli.dir.path().join("nope.toml"),
        ..LeaseCli::dir()
    };
    let r = missing.run("show", &["--lease", "jobs"]).await;
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("nope.toml"), "{r:?}");
    let s3_without_bucket = LeaseCli::with_store("[store]\nkind = \"s3\"\n".into(), Duration::ZERO);
    let r = s3_without_bucket.run("show", &["--lease", "jobs"]).await;
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("bucket"), "{r:?}");
}

// ------------------------------------------------------------------ contention

/// `processes` CLI acquires at once, `rounds` times: each round exactly one exits
/// 0 and the rest exit 3 naming the winner; the winner then releases.
async fn contend(
    cli: Arc<LeaseCli>,
    epochs: &Epochs,
    processes: usize,
    rounds: u64,
    start_line: Option<&StartLine>,
) {
    const L: &str = "contended";
    for round in 0..rounds {
        if let Some(line) = start_line {
            line.arm(processes);
        }
        let tasks: Vec<_> = (0..processes)
            .map(|i| {
                let cli = cli.clone();
                tokio::spawn(async move {
                    let holder = format!("w{i}");
                    let r = cli.acquire(L, &holder, 30_000).await;
                    (holder, r)
                })
            })
            .collect();
        let mut runs = Vec::new();
        for t in tasks {
            runs.push(t.await.unwrap());
        }
        let (winners, losers): (Vec<_>, Vec<_>) = runs.into_iter().partition(|(_, r)| r.code == 0);
        assert_eq!(
            winners.len(),
            1,
            "round {round}: winners {:?}",
            winners
                .iter()
                .map(|(h, r)| (h, &r.json))
                .collect::<Vec<_>>()
        );
        let (winner, won) = &winners[0];
        let epoch = round * 2 + 1; // acquire, release, acquire, ...
        assert_eq!(won.json["epoch"], epoch, "round {round}: {won:?}");
        assert_eq!(&won.json["holder"], winner.as_str());
        for (holder, r) in &losers {
            assert_eq!(r.code, 3, "round {round}, {holder}: {r:?}");
            assert_eq!(r.json["epoch"], epoch, "{holder}: {r:?}");
            assert_eq!(&r.json["holder"], winner.as_str(), "{holder}: {r:?}");
        }
        cli.tenure_cmd("release", L, winner, &won.json).await.ok();
    }
    // Every epoch exists once: no gaps, no extras.
    let lp = format!("{PREFIX}{L}/");
    let keys = epochs.store().list(&lp, None).await.unwrap();
    assert_eq!(
        keys,
        (1..=rounds * 2)
            .map(|e| format!("{lp}{e:020}.json"))
            .collect::<Vec<_>>()
    );
}

fn dir_epochs(cli: &LeaseCli) -> (Epochs, PathBuf) {
    let path = PathBuf::from(
        cli.store_toml
            .lines()
            .find_map(|l| l.strip_prefix("path = "))
            .unwrap()
            .trim_matches('"'),
    );
    let store = DirStore::open(&path, Arc::new(SystemClock)).unwrap();
    (Epochs::new(Arc::new(store), PREFIX), path)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_cli_acquires_one_winner_per_epoch_on_s3() {
    skip_without_python!();
    let s3 = S3Server::start();
    let line = StartLine::start(&s3.endpoint, "PUT /leases/fencegate/contended/").await;
    let cli = Arc::new(LeaseCli::with_store(
        s3.store_toml(100).replace(&s3.endpoint, &line.endpoint),
        Duration::from_millis(500),
    ));
    let started = Instant::now();
    contend(cli, &s3.epochs().await, 8, 3, Some(&line)).await;
    let lost = line.refused_creates.load(Ordering::SeqCst);
    eprintln!(
        "8 processes x 3 rounds on s3: {:?}; {lost} conditional creates of an epoch refused with 412",
        started.elapsed()
    );
    // The start line made them race for the same epoch (not just find it held).
    assert!(lost > 0, "no process ever lost a create race");
}

/// A TCP relay in front of the S3 server. Armed with `n`, it holds new
/// connections until `n` have arrived, so that `n` processes make their store
/// calls together (the single-threaded server then serves them round-robin:
/// everyone lists before anyone creates). It also counts 412 answers to requests
/// whose first line starts with `watch`.
struct StartLine {
    endpoint: String,
    armed: Armed,
    refused_creates: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

/// While armed: how many connections to gather, and those waiting.
type Armed = Arc<std::sync::Mutex<Option<(usize, Vec<tokio::sync::oneshot::Sender<()>>)>>>;

impl StartLine {
    async fn start(upstream: &str, watch: &'static str) -> StartLine {
        let upstream = upstream.trim_start_matches("http://").to_owned();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let armed: Armed = Arc::default();
        let refused_creates = Arc::new(AtomicUsize::new(0));
        let (a, r) = (armed.clone(), refused_creates.clone());
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let gate = {
                    let mut armed = a.lock().unwrap();
                    match armed.as_mut() {
                        Some((n, waiting)) => {
                            let (tx, rx) = tokio::sync::oneshot::channel();
                            waiting.push(tx);
                            if waiting.len() >= *n {
                                for tx in armed.take().unwrap().1 {
                                    let _ = tx.send(());
                                }
                            }
                            Some(rx)
                        }
                        None => None,
                    }
                };
                let (upstream, r) = (upstream.clone(), r.clone());
                tokio::spawn(async move {
                    if let Some(rx) = gate {
                        let _ = rx.await;
                    }
                    relay(client, &upstream, watch, &r).await;
                });
            }
        });
        StartLine {
            endpoint,
            armed,
            refused_creates,
            task,
        }
    }

    /// Holds the next `n` connections until all `n` have arrived.
    fn arm(&self, n: usize) {
        *self.armed.lock().unwrap() = Some((n, Vec::new()));
    }
}

impl Drop for StartLine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn relay(client: tokio::net::TcpStream, upstream: &str, watch: &str, refused: &AtomicUsize) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(up) = tokio::net::TcpStream::connect(upstream).await else {
        return;
    };
    let (mut cr, mut cw) = client.into_split();
    let (mut ur, mut uw) = up.into_split();
    let watched = AtomicBool::new(false);
    let to_server = async {
        let mut buf = vec![0u8; 16 * 1024];
        let n = cr.read(&mut buf).await.unwrap_or(0);
        watched.store(buf[..n].starts_with(watch.as_bytes()), Ordering::SeqCst);
        if uw.write_all(&buf[..n]).await.is_ok() && n > 0 {
            let _ = tokio::io::copy(&mut cr, &mut uw).await;
        }
        let _ = uw.shutdown().await;
    };
    let to_client = async {
        let mut buf = vec![0u8; 16 * 1024];
        let n = ur.read(&mut buf).await.unwrap_or(0);
        // "HTTP/1.0 412 ..." (werkzeug answers in HTTP/1.0).
        let status = buf[..n].get(9..12);
        if status == Some(b"412") && watched.load(Ordering::SeqCst) {
            refused.fetch_add(1, Ordering::SeqCst);
        }
        if cw.write_all(&buf[..n]).await.is_ok() && n > 0 {
            let _ = tokio::io::copy(&mut ur, &mut cw).await;
        }
        let _ = cw.shutdown().await;
    };
    tokio::join!(to_server, to_client);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_cli_acquires_one_winner_per_epoch_on_dir_store() {
    let cli = Arc::new(LeaseCli::dir());
    let (epochs, _) = dir_epochs(&cli);
    let started = Instant::now();
    contend(cli, &epochs, 10, 3, None).await;
    eprintln!("10 processes x 3 rounds on dir: {:?}", started.elapsed());
}

/// `waiters` processes run `acquire --wait` on a held lease and take turns as
/// each winner's short tenure expires: every waiter ends with its own epoch, and
/// each epoch object is the one its winner wrote. (Their backoff schedules differ,
/// so they rarely collide on a create; the start-line test above forces that.)
async fn take_turns(cli: Arc<LeaseCli>, epochs: &Epochs, waiters: usize, ttl_ms: u64) {
    const L: &str = "turns";
    cli.acquire(L, "seed", ttl_ms).await.ok();
    let tasks: Vec<_> = (0..waiters)
        .map(|i| {
            let cli = cli.clone();
            tokio::spawn(async move {
                let holder = format!("w{i}");
                let ttl = ttl_ms.to_string();
                let args = [
                    "--lease", L, "--holder", &holder, "--ttl-ms", &ttl, "--wait",
                ];
                let r = cli.run("acquire", &args).await;
                (holder, r)
            })
        })
        .collect();
    let mut won = BTreeMap::new();
    for t in tasks {
        let (holder, r) = t.await.unwrap();
        assert_eq!(r.code, 0, "{holder}: {r:?}");
        let epoch = r.json["epoch"].as_u64().unwrap();
        let token = r.json["token"].as_str().unwrap().to_owned();
        assert!(
            won.insert(epoch, (holder.clone(), token)).is_none(),
            "epoch {epoch} was won twice (second: {holder})"
        );
    }
    assert_eq!(
        won.keys().copied().collect::<Vec<_>>(),
        (2..=waiters as u64 + 1).collect::<Vec<_>>()
    );
    // Each winner's epoch object is its own: no one believes it holds another's.
    let l = lease(L);
    for (epoch, (holder, token)) in &won {
        match epochs.read(&l, Epoch::new(*epoch)).await.unwrap() {
            Some(EpochObject::Acquire {
                holder: h,
                token: t,
                ..
            }) => {
                assert_eq!(&h, holder);
                assert!(t.matches(&TokenHash::of(token.as_bytes())), "epoch {epoch}");
            }
            other => panic!("epoch {epoch}: {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_acquirers_take_turns_on_s3() {
    skip_without_python!();
    let s3 = S3Server::start();
    let started = Instant::now();
    // LastModified has 1 s resolution: a TTL under 1 s could be over at creation.
    take_turns(Arc::new(LeaseCli::s3(&s3)), &s3.epochs().await, 3, 1000).await;
    eprintln!("3 waiters taking turns on s3: {:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_acquirers_take_turns_on_dir_store() {
    let cli = Arc::new(LeaseCli::dir());
    let (epochs, _) = dir_epochs(&cli);
    let started = Instant::now();
    take_turns(cli, &epochs, 6, 300).await;
    eprintln!("6 waiters taking turns on dir: {:?}", started.elapsed());
}

// ------------------------------------------------------------------ the uncertain result

/// The uncertain results of a create, as [`FaultStore`] injects them on the first
/// create of the target key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Case {
    /// Our create is applied, then the response is lost (timeout, reset, 5xx).
    AppliedThenLost,
    /// Our create is applied, the response is lost, and the SDK's automatic retry
    /// answers 412: our own first attempt looks like someone else's object.
    AppliedThenRetry412,
    /// A rival's create lands first, then ours times out.
    RivalThenLost,
    /// A rival's create lands first, then ours is answered 412 by a retry.
    RivalThenRetry412,
    /// Nothing is applied and the response is lost.
    NotAppliedLost,
}

impl Case {
    /// The fault that makes this case on the create of `epoch` of `l` (a rival's
    /// object, where there is one, names holder `rival`).
    fn fault(self, l: &LeaseName, epoch: Epoch) -> Fault {
        let rival = || {
            let token = lease_acquire::fresh_token();
            let record =
                EpochRecord::acquire(l, epoch, "rival", token.as_bytes(), Duration::from_secs(30));
            Bytes::from(record.to_json())
        };
        match self {
            Case::AppliedThenLost => Fault::LoseResponse,
            Case::AppliedThenRetry412 => Fault::AppliedThenExists,
            Case::RivalThenLost => Fault::RivalFirst {
                body: rival(),
                lost: true,
            },
            Case::RivalThenRetry412 => Fault::RivalFirst {
                body: rival(),
                lost: false,
            },
            Case::NotAppliedLost => Fault::Unavailable,
        }
    }
}

/// Each case on its own lease of `inner`: the caller learns the truth from the
/// read-back, never from the create's answer.
async fn uncertain_cases(inner: Arc<dyn LeaseStore>) {
    let cases = [
        (Case::AppliedThenLost, "applied-lost"),
        (Case::AppliedThenRetry412, "applied-412"),
        (Case::RivalThenLost, "rival-lost"),
        (Case::RivalThenRetry412, "rival-412"),
        (Case::NotAppliedLost, "not-applied"),
    ];
    for (case, name) in cases {
        let l = lease(name);
        let fault = case.fault(&l, Epoch::new(1));
        let target = object_key(PREFIX, &l, Epoch::new(1));
        let store = FaultStore::new(inner.clone());
        store.add(Rule::new(Op::Create, fault).key(&target).once());
        let epochs = Epochs::new(store.clone(), PREFIX);
        let got = lease_acquire::acquire(
            &epochs,
            &l,
            "me",
            Duration::from_secs(30),
            Duration::from_millis(500),
            None,
        )
        .await;
        assert_eq!(store.fired(), 1, "{case:?}: fault not injected");
        let latest = epochs.latest_after(&l, Epoch::NONE).await.unwrap();
        assert_eq!(
            latest,
            Epoch::new(1),
            "{case:?}: exactly one epoch was created"
        );
        let stored = epochs.read(&l, Epoch::new(1)).await.unwrap().unwrap();
        match case {
            Case::AppliedThenLost | Case::AppliedThenRetry412 | Case::NotAppliedLost => {
                let h = got.unwrap_or_else(|e| panic!("{case:?}: the caller won but was told {e}"));
                assert_eq!(h.epoch, Epoch::new(1), "{case:?}");
                match stored {
                    EpochObject::Acquire { token, holder, .. } => {
                        assert!(
                            token.matches(&TokenHash::of(h.token.as_bytes())),
                            "{case:?}"
                        );
                        assert_eq!(holder, "me");
                    }
                    other => panic!("{case:?}: {other:?}"),
                }
            }
            Case::RivalThenLost | Case::RivalThenRetry412 => match got {
                Err(AcquireError::Held { holder, epoch, .. }) => {
                    assert_eq!(holder, "rival", "{case:?}");
                    assert_eq!(epoch, Epoch::new(1), "{case:?}");
                }
                Ok(h) => panic!("{case:?}: the caller lost but believes it holds {h:?}"),
                Err(e) => panic!("{case:?}: {e}"),
            },
        }
        let creates = store.calls(Op::Create, Some(&target));
        let expected = if case == Case::NotAppliedLost { 2 } else { 1 };
        assert_eq!(creates, expected, "{case:?}: creates of epoch 1");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncertain_create_results_are_decided_by_reading_back_on_s3() {
    skip_without_python!();
    let s3 = S3Server::start();
    uncertain_cases(s3.store().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncertain_create_results_are_decided_by_reading_back_on_dir_store() {
    let tmp = tempfile::tempdir().unwrap();
    uncertain_cases(Arc::new(
        DirStore::open(tmp.path(), Arc::new(SystemClock)).unwrap(),
    ))
    .await;
}

/// The same uncertain results on a direct renewal (`renew_direct`: the create of
/// L+1 with no listing first — how a cluster instance renews its gate leases
/// every `gate_ttl / 3`): the read-back decides, on S3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncertain_direct_renewals_are_decided_by_reading_back_on_s3() {
    skip_without_python!();
    let s3 = S3Server::start();
    let inner = s3.store().await;
    let cases = [
        (Case::AppliedThenLost, "r-applied-lost"),
        (Case::AppliedThenRetry412, "r-applied-412"),
        (Case::RivalThenLost, "r-rival-lost"),
        (Case::RivalThenRetry412, "r-rival-412"),
        (Case::NotAppliedLost, "r-not-applied"),
    ];
    for (case, name) in cases {
        let l = lease(name);
        let plain = Epochs::new(inner.clone(), PREFIX);
        let held = lease_acquire::acquire(
            &plain,
            &l,
            "me",
            Duration::from_secs(30),
            Duration::from_millis(500),
            None,
        )
        .await
        .unwrap();
        let fault = case.fault(&l, Epoch::new(2));
        let target = object_key(PREFIX, &l, Epoch::new(2));
        let store = FaultStore::new(inner.clone());
        store.add(Rule::new(Op::Create, fault).key(&target).once());
        let epochs = Epochs::new(store.clone(), PREFIX);
        let got =
            lease_acquire::renew_direct(&epochs, &held, Duration::from_secs(30), &|_| {}).await;
        assert_eq!(store.fired(), 1, "{case:?}: fault not injected");
        assert_eq!(
            epochs.latest_after(&l, Epoch::NONE).await.unwrap(),
            Epoch::new(2),
            "{case:?}: exactly one epoch was created"
        );
        let stored = epochs.read(&l, Epoch::new(2)).await.unwrap().unwrap();
        let EpochObject::Acquire { token, holder, .. } = stored else {
            panic!("{case:?}: {stored:?}");
        };
        match (case, got) {
            (
                Case::RivalThenLost | Case::RivalThenRetry412,
                Err(AcquireError::NotHolder { .. }),
            ) => {
                assert_eq!(holder, "rival", "{case:?}");
            }
            (Case::RivalThenLost | Case::RivalThenRetry412, other) => {
                panic!("{case:?}: the renewal lost but was told {other:?}")
            }
            (_, Ok(h)) => {
                assert_eq!(h.epoch, Epoch::new(2), "{case:?}");
                assert_eq!(holder, "me", "{case:?}");
                assert!(
                    token.matches(&TokenHash::of(h.token.as_bytes())),
                    "{case:?}"
                );
            }
            (_, Err(e)) => panic!("{case:?}: the renewal won but was told {e}"),
        }
    }
}

// ------------------------------------------------------------------ the self-test

/// A store that ignores `If-None-Match` (every create "succeeds" and overwrites)
/// is refused by the self-test; a real one passes.
#[tokio::test]
async fn self_test_refuses_a_store_that_ignores_if_none_match() {
    let tmp = tempfile::tempdir().unwrap();
    let dir: Arc<dyn LeaseStore> =
        Arc::new(DirStore::open(tmp.path(), Arc::new(SystemClock)).unwrap());
    let store = FaultStore::new(dir.clone());
    store.add(Rule::new(Op::Create, Fault::IgnoreIfNoneMatch));
    let err = probe::self_test(store.as_ref(), PREFIX).await.unwrap_err();
    assert!(matches!(err, ProbeError::NotFencing { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("fencing is impossible"), "{msg}");
    assert!(msg.contains("If-None-Match"), "{msg}");
    // It created its probe object twice, and cleaned up after itself.
    assert_eq!(store.calls(Op::Create, None), 2);
    let probes = format!("{PREFIX}.probe/");
    assert_eq!(dir.list(&probes, None).await.unwrap(), Vec::<String>::new());
    // A real store passes.
    probe::self_test(dir.as_ref(), PREFIX).await.unwrap();
}

/// An "S3 endpoint" that answers 200 to everything, like a server that ignores
/// `If-None-Match`: `fencegate lease` must refuse to use it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_cli_refuses_an_s3_endpoint_that_ignores_if_none_match() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let puts = Arc::new(AtomicUsize::new(0));
    let counted = puts.clone();
    let server = tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let counted = counted.clone();
            tokio::spawn(async move {
                let svc =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let counted = counted.clone();
                        async move {
                            if req.method() == http::Method::PUT {
                                counted.fetch_add(1, Ordering::SeqCst);
                            }
                            let _ = http_body_util::BodyExt::collect(req.into_body()).await;
                            Ok::<_, std::convert::Infallible>(
                                http::Response::builder()
                                    .status(200)
                                    .header("etag", "\"0\"")
                                    .body(http_body_util::Full::new(Bytes::new()))
                                    .unwrap(),
                            )
                        }
                    });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    let cli = LeaseCli::with_store(
        format!(
            "[store]\nkind = \"s3\"\nbucket = \"leases\"\nendpoint = \"http://{addr}\"\nforce_path_style = true\n"
        ),
        Duration::ZERO,
    );
    for (sub, extra) in [("show", vec![]), ("acquire", vec!["--holder", "w"])] {
        let mut args = vec!["--lease", "jobs"];
        args.extend(extra);
        let r = cli.run(sub, &args).await;
        assert_ne!(r.code, 0, "{sub}: {r:?}");
        assert_ne!(r.code, 3, "{sub}: {r:?}");
        assert!(
            r.stderr.contains("fencing is impossible"),
            "{sub}: {}",
            r.stderr
        );
        assert!(r.stdout.trim().is_empty(), "{sub}: {}", r.stdout);
    }
    assert!(puts.load(Ordering::SeqCst) >= 4, "the probe never wrote");
    server.abort();
}

// ------------------------------------------------------------------ the demo

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_tells_the_late_worker_story() {
    let started = Instant::now();
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(bin())
            .arg("demo")
            .env_remove("FENCEGATE_LOG")
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .expect("the demo took over 30 s")
    .unwrap();
    let elapsed = started.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("fencegate demo wall time: {elapsed:?}");
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("409 epoch_stale"), "{stdout}");
    assert!(stdout.contains("What the destination received"), "{stdout}");
    // Exactly two deliveries: A at epoch 1, then B at epoch 2.
    let deliveries: Vec<&str> = stdout
        .lines()
        .filter(|l| l.trim_start().starts_with('#'))
        .collect();
    assert_eq!(deliveries.len(), 2, "{stdout}");
    assert!(deliveries[0].contains("epoch 1"), "{stdout}");
    assert!(deliveries[1].contains("epoch 2"), "{stdout}");
    // Quiet by default: fencegate's own logs stay out of the newcomer's way.
    assert!(!stderr.contains(" INFO "), "{stderr}");
    assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");
}

// ------------------------------------------------------------------ the Python worker

async fn run_python_worker(s3: &S3Server, fg: &Fencegate, extra: &[&str]) -> (i32, Value, String) {
    let out = tokio::process::Command::new(test_python())
        .arg(repo_root().join("examples/fenced_worker.py"))
        .args([
            "--endpoint",
            &s3.endpoint,
            "--bucket",
            BUCKET,
            "--prefix",
            PREFIX,
        ])
        .args(["--lease", "pyjobs", "--grace-ms", "500"])
        .args(["--fencegate", &fg.url("")])
        .args(extra)
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env("AWS_CONFIG_FILE", "/dev/null")
        .env("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
        .stdin(Stdio::null())
        .output()
        .await
        .expect("running examples/fenced_worker.py");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let json = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("worker output {stdout:?} ({e}); stderr: {stderr}"));
    (out.status.code().unwrap_or(-1), json, stderr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_worker_example_calls_through_fencegate() {
    skip_without_python!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let fg = Fencegate::start(&format!(
        "{}{}",
        s3.store_toml(100),
        route_toml("pyjobs", "pyjobs", &origin, "")
    ));
    let (code, out, stderr) = run_python_worker(
        &s3,
        &fg,
        &[
            "--holder",
            "py-worker",
            "--path",
            "/pyjobs/charge?order=7",
            "--body",
            r#"{"amount":42}"#,
            "--idempotency-key",
            "charge-42",
        ],
    )
    .await;
    assert_eq!(code, 0, "{out}\n{stderr}");
    assert_eq!(out["acquired"]["epoch"], 1, "{out}");
    assert_eq!(out["call"]["status"], 200, "{out}");
    assert_eq!(out["call"]["error"], Value::Null, "{out}");
    assert_eq!(out["renewed"]["epoch"], 2, "{out}");
    assert_eq!(out["released"]["epoch"], 3, "{out}");

    // The destination got the call, with the epoch and the key, without the token.
    let log = origin.log();
    assert_eq!(log.len(), 1, "{log:?}");
    assert_eq!(log[0].method, "POST");
    assert_eq!(log[0].path, "/v1/charge?order=7");
    assert_eq!(log[0].epoch(), Some(1));
    assert_eq!(
        log[0].header("idempotency-key").as_deref(),
        Some("charge-42")
    );
    assert_eq!(log[0].header("x-lease-token"), None);
    assert_eq!(&log[0].body[..], br#"{"amount":42}"#);

    // What Python wrote is what the Rust side reads: SPEC §2's format.
    let epochs = s3.epochs().await;
    let l = lease("pyjobs");
    let token = out["acquired"]["token"].as_str().unwrap();
    match epochs.read(&l, Epoch::new(1)).await.unwrap().unwrap() {
        EpochObject::Acquire {
            token: h, holder, ..
        } => {
            assert!(h.matches(&TokenHash::of(token.as_bytes())));
            assert_eq!(holder, "py-worker");
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        epochs.read(&l, Epoch::new(3)).await.unwrap(),
        Some(EpochObject::Release { .. })
    ));

    // While a Rust worker holds the lease, the Python worker is told so (exit 3).
    let rust = acquire(&epochs, "pyjobs", "rust-worker", Duration::from_secs(30)).await;
    assert_eq!(rust.epoch, Epoch::new(4));
    let (code, out, stderr) = run_python_worker(&s3, &fg, &["--path", "/pyjobs/charge"]).await;
    assert_eq!(code, 3, "{out}\n{stderr}");
    assert_eq!(out["held"]["holder"], "rust-worker", "{out}");
    assert_eq!(out["held"]["epoch"], 4, "{out}");
    assert_eq!(origin.count(), 1);
}

// ------------------------------------------------------------------ measurements

/// How long an acquire takes against the test S3 server: a whole CLI process
/// (start, SDK set-up, self-test, list, get, put, get) and the library call alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_latency_is_reported() {
    skip_without_python!();
    let s3 = S3Server::start();
    let cli = LeaseCli::s3(&s3);
    let mut cli_times = Vec::new();
    for _ in 0..5 {
        let r = cli.acquire("timed", "cli", 30_000).await;
        cli_times.push(r.elapsed);
        let held = r.ok();
        cli.tenure_cmd("release", "timed", "cli", &held).await.ok();
    }
    let epochs = s3.epochs().await;
    let l = lease("timed-lib");
    let mut lib_times = Vec::new();
    for _ in 0..20 {
        let started = Instant::now();
        let h = lease_acquire::acquire(
            &epochs,
            &l,
            "lib",
            Duration::from_secs(30),
            Duration::from_millis(500),
            None,
        )
        .await
        .unwrap();
        lib_times.push(started.elapsed());
        lease_acquire::release(&epochs, &l, "lib", h.epoch, &h.token)
            .await
            .unwrap();
    }
    let dir = LeaseCli::dir();
    let mut dir_times = Vec::new();
    for _ in 0..5 {
        let r = dir.acquire("timed", "cli", 30_000).await;
        dir_times.push(r.elapsed);
        let held = r.ok();
        dir.tenure_cmd("release", "timed", "cli", &held).await.ok();
    }
    let (cli_m, lib_m, dir_m) = (
        median(cli_times.clone()),
        median(lib_times.clone()),
        median(dir_times),
    );
    eprintln!(
        "acquire on the test S3 server: CLI process median {cli_m:?} (all {cli_times:?}); \
         library call median {lib_m:?} (max {:?}); CLI on the dir store median {dir_m:?}",
        lib_times.iter().max().unwrap()
    );
    assert!(cli_m < Duration::from_secs(3), "{cli_m:?}");
    assert!(lib_m < Duration::from_secs(1), "{lib_m:?}");
}
