//! The process-level harness: real parts on loopback, port 0 everywhere. The
//! recording origin, the client side and the fault-injecting store are shared with
//! `tests/inproc` (`tests/common`, re-exported here).
//!
//! - [`S3Server`]: the single-threaded moto server (`scripts/s3server.py`), one per
//!   test, pausable with SIGSTOP to make the store unreachable. It needs Python with
//!   moto: `FENCEGATE_TEST_PYTHON`, or the repository's `.venv`; without either, the
//!   tests that need it skip with a printed reason ([`skip_without_python!`]).
//! - [`Fencegate`]: the real `fencegate` binary, started from a written config, with
//!   kill -9, SIGTERM and restart on the same data directory; its state in sled or
//!   in PostgreSQL ([`Backend`], [`postgres::PgServer`]).
//! - [`relay::Relay`]: a TCP relay to PostgreSQL that holds bytes and cuts
//!   connections on the test's word.

#![allow(dead_code)]

#[path = "../../common/mod.rs"]
mod common;
pub mod egress;
pub mod gate;
pub mod members;
pub mod otlp;
pub mod relay;

pub use common::*;

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use fencegate::clock::SystemClock;
use fencegate::epoch::LeaseName;
use fencegate::lease::acquire::{self, Holding};
use fencegate::lease::s3::{S3Settings, S3Store};
use fencegate::lease::{Epochs, LeaseStore};

pub const BUCKET: &str = "leases";

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The Python that runs the test servers: `FENCEGATE_TEST_PYTHON` when set (then
/// always, so that a wrong value fails instead of skipping), else the repository's
/// `.venv` if it can import moto; `Err` says why there is none.
fn find_python() -> &'static Result<PathBuf, String> {
    static PYTHON: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    PYTHON.get_or_init(|| {
        if let Some(p) = std::env::var_os("FENCEGATE_TEST_PYTHON") {
            return Ok(PathBuf::from(p));
        }
        let venv = repo_root().join(".venv/bin/python");
        let usable = Command::new(&venv)
            .args(["-c", "import moto"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if usable {
            Ok(venv)
        } else {
            Err(format!(
                "no Python with moto for the S3 test server (FENCEGATE_TEST_PYTHON is unset; {} cannot import moto); scripts/test.sh sets it up",
                venv.display()
            ))
        }
    })
}

fn python() -> PathBuf {
    match find_python() {
        Ok(p) => p.clone(),
        Err(why) => {
            panic!("{why} (a test that needs Python must start with skip_without_python!())")
        }
    }
}

/// `PATH` with the test Python's folder first, as `python3` and `python`: for
/// scripts a test runs that call `python3` themselves.
pub fn path_with_test_python() -> std::ffi::OsString {
    let dir = tempfile::tempdir().unwrap().keep();
    for name in ["python3", "python"] {
        std::os::unix::fs::symlink(python(), dir.join(name)).unwrap();
    }
    let mut paths = vec![dir];
    paths.extend(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ));
    std::env::join_paths(paths).unwrap()
}

/// Whether the Python test servers can run; if not, says so on the terminal (past
/// the test harness's output capture) and returns `false`. See
/// [`skip_without_python!`].
pub fn python_or_skip() -> bool {
    match find_python() {
        Ok(_) => true,
        Err(why) => {
            let test = std::thread::current().name().unwrap_or("a test").to_owned();
            // Straight to the file descriptor: libtest captures only print!/eprint!.
            let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
            false
        }
    }
}

/// Ends the test early, with a printed reason, when there is no Python for the S3
/// test server (or the campaign's workers): the first line of every test that
/// needs one. With `FENCEGATE_TEST_PYTHON` set (scripts/test.sh sets it) it never
/// skips.
macro_rules! skip_without_python {
    () => {
        if !$crate::support::python_or_skip() {
            return;
        }
    };
}
pub(crate) use skip_without_python;

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "kill {sig} {pid} failed");
}

/// A moto S3 server on a free loopback port.
pub struct S3Server {
    child: Child,
    pub endpoint: String,
}

impl S3Server {
    pub fn start() -> S3Server {
        let mut child = Command::new(python())
            .arg(repo_root().join("scripts/s3server.py"))
            // A client frozen mid-request (a SIGSTOPped worker or instance, in
            // the campaigns) holds this single-threaded server until it is
            // dropped: after 5 s, as a real store would time it out too.
            .args(["--port", "0", "--bucket", BUCKET, "--conn-timeout", "5"])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting scripts/s3server.py");
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("reading the LISTENING line");
        let addr = line
            .trim()
            .strip_prefix("LISTENING ")
            .unwrap_or_else(|| panic!("unexpected s3server output {line:?}"))
            .to_owned();
        S3Server {
            child,
            endpoint: format!("http://{addr}"),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGSTOP: the store stops answering (connections hang).
    pub fn pause(&self) {
        freeze(self.pid());
    }

    pub fn resume(&self) {
        signal(self.pid(), "-CONT");
    }

    pub fn settings(&self) -> S3Settings {
        S3Settings {
            bucket: BUCKET.into(),
            endpoint: Some(self.endpoint.clone()),
            region: "us-east-1".into(),
            force_path_style: true,
            timeout: Duration::from_secs(2),
            static_credentials: Some(("test".into(), "test".into())),
        }
    }

    pub async fn store(&self) -> Arc<dyn LeaseStore> {
        Arc::new(S3Store::connect(&self.settings(), Arc::new(SystemClock)).await)
    }

    pub async fn epochs(&self) -> Epochs {
        Epochs::new(self.store().await, PREFIX)
    }

    /// The `[store]` section for a fencegate using this server.
    pub fn store_toml(&self, refresh_ms: u64) -> String {
        format!(
            "[store]\nkind = \"s3\"\nbucket = \"{BUCKET}\"\nprefix = \"{PREFIX}\"\nendpoint = \"{}\"\nregion = \"us-east-1\"\nforce_path_style = true\nrefresh_interval_ms = {refresh_ms}\ntimeout_ms = 1500\ngrace_ms = 500\n",
            self.endpoint
        )
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Acquires `lease` for `holder`, waiting while someone else holds it.
pub async fn acquire(epochs: &Epochs, lease: &str, holder: &str, ttl: Duration) -> Holding {
    let lease = LeaseName::parse(lease).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match acquire::acquire(
            epochs,
            &lease,
            holder,
            ttl,
            Duration::from_millis(500),
            None,
        )
        .await
        {
            Ok(h) => return h,
            Err(e) if e.is_held() && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("acquire {lease} for {holder}: {e}"),
        }
    }
}

/// A running fencegate process.
pub struct Fencegate {
    child: Option<Child>,
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    pub proxy: SocketAddr,
    pub admin: SocketAddr,
    env: Vec<(String, String)>,
    /// More `serve` arguments.
    args: Vec<String>,
    pub stderr_path: PathBuf,
    /// How the last [`Fencegate::spawn`] that failed ended (e.g. exit 2: refused).
    pub last_exit: Option<std::process::ExitStatus>,
    /// `RLIMIT_NOFILE` (soft and hard) the process starts under, if set.
    pub nofile: Option<u64>,
}

/// The fencegate binary under test: this build's, or `FENCEGATE_TEST_BIN` (to
/// show a test, or the campaign's checker, failing on another build).
pub fn bin() -> &'static str {
    static BIN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        std::env::var("FENCEGATE_TEST_BIN")
            .unwrap_or_else(|_| env!("CARGO_BIN_EXE_fencegate").to_owned())
    })
}

impl Fencegate {
    /// Starts fencegate with `[store]` + routes TOML; server section is added here.
    pub fn start(store_and_routes: &str) -> Fencegate {
        Fencegate::start_with_env(store_and_routes, &[])
    }

    pub fn start_with_env(store_and_routes: &str, env: &[(&str, &str)]) -> Fencegate {
        Fencegate::start_with_server("", store_and_routes, env)
    }

    /// [`Fencegate::start_with_env`] with more `[server]` keys.
    pub fn start_with_server(
        server_extra: &str,
        store_and_routes: &str,
        env: &[(&str, &str)],
    ) -> Fencegate {
        Fencegate::start_listening("127.0.0.1:0", server_extra, store_and_routes, env)
    }

    /// [`Fencegate::start_with_server`] with the proxy listener on `listen` (a
    /// cluster member's `advertise` names it before it starts).
    pub fn start_listening(
        listen: &str,
        server_extra: &str,
        store_and_routes: &str,
        env: &[(&str, &str)],
    ) -> Fencegate {
        Fencegate::start_with_args(listen, server_extra, store_and_routes, env, &[])
    }

    /// [`Fencegate::start_listening`] with more `serve` arguments.
    pub fn start_with_args(
        listen: &str,
        server_extra: &str,
        store_and_routes: &str,
        env: &[(&str, &str)],
        args: &[&str],
    ) -> Fencegate {
        let mut fg =
            Fencegate::unstarted_with_args(listen, server_extra, store_and_routes, env, args);
        fg.spawn(None).expect("fencegate did not start");
        fg
    }

    /// [`Fencegate::start_listening`] without starting it: the test prepares its
    /// data directory ([`state_dir`]) first, then calls [`Fencegate::spawn`].
    pub fn unstarted(
        listen: &str,
        server_extra: &str,
        store_and_routes: &str,
        env: &[(&str, &str)],
    ) -> Fencegate {
        Fencegate::unstarted_with_args(listen, server_extra, store_and_routes, env, &[])
    }

    /// [`Fencegate::unstarted`] with more `serve` arguments.
    pub fn unstarted_with_args(
        listen: &str,
        server_extra: &str,
        store_and_routes: &str,
        env: &[(&str, &str)],
        args: &[&str],
    ) -> Fencegate {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("fencegate.toml");
        let text = format!(
            "[server]\nlisten = \"{listen}\"\nadmin_listen = \"127.0.0.1:0\"\ndata_dir = \"{}\"\nshutdown_timeout_ms = 5000\n{server_extra}\n\n{store_and_routes}",
            dir.path().join("state").display()
        );
        std::fs::write(&config, text).unwrap();
        Fencegate {
            child: None,
            stderr_path: dir.path().join("stderr.log"),
            dir,
            config,
            proxy: "0.0.0.0:0".parse().unwrap(),
            admin: "0.0.0.0:0".parse().unwrap(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            args: args.iter().map(|a| a.to_string()).collect(),
            last_exit: None,
            nofile: None,
        }
    }

    /// Starts the process; `Err(stderr)` if it exits before listening.
    pub fn spawn(&mut self, failpoint: Option<&str>) -> Result<(), String> {
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.stderr_path)
            .unwrap();
        let mut cmd = Command::new(bin());
        cmd.args(["serve", "--config"])
            .arg(&self.config)
            .args(&self.args)
            .current_dir(self.dir.path())
            .env("AWS_ACCESS_KEY_ID", "test")
            .env("AWS_SECRET_ACCESS_KEY", "test")
            .env("AWS_EC2_METADATA_DISABLED", "true")
            .env("FENCEGATE_LOG", "info")
            .env_remove("FENCEGATE_FAILPOINT")
            .stdout(Stdio::piped())
            .stderr(stderr);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        if let Some(fp) = failpoint {
            cmd.env("FENCEGATE_FAILPOINT", fp);
        }
        if let Some(n) = self.nofile {
            use std::os::unix::process::CommandExt;
            // SAFETY: setrlimit is async-signal-safe; nothing else runs here.
            unsafe {
                cmd.pre_exec(move || rlimit::setrlimit(rlimit::Resource::NOFILE, n, n));
            }
        }
        let mut child = cmd.spawn().expect("spawning fencegate");
        let stdout = child.stdout.take().unwrap();
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        if line.trim().is_empty() {
            self.last_exit = child.wait().ok();
            return Err(self.stderr());
        }
        let v: serde_json::Value = serde_json::from_str(line.trim())
            .unwrap_or_else(|e| panic!("ready line {line:?}: {e}"));
        self.proxy = v["proxy"].as_str().unwrap().parse().unwrap();
        self.admin = v["admin"].as_str().unwrap().parse().unwrap();
        self.child = Some(child);
        Ok(())
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// Descriptors the process holds open now.
    pub fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// kill -9: no flush, no destructors.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits for the process to exit by itself (after a failpoint abort).
    pub fn wait_exit(&mut self) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("running");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(s) = c.try_wait().unwrap() {
                return s;
            }
            assert!(Instant::now() < deadline, "fencegate did not exit");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGTERM, then waits for the exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        signal(self.pid(), "-TERM");
        self.wait_exit()
    }

    /// SIGHUP: reload the config file.
    pub fn hup(&self) {
        signal(self.pid(), "-HUP");
    }

    /// Rewrites the config file through `edit` (the process does not notice until
    /// [`Fencegate::hup`]).
    pub fn edit_config(&self, edit: impl FnOnce(String) -> String) {
        let text = std::fs::read_to_string(&self.config).unwrap();
        std::fs::write(&self.config, edit(text)).unwrap();
    }

    /// The `serve` arguments of the next [`Fencegate::spawn`].
    pub fn set_args(&mut self, args: &[&str]) {
        self.args = args.iter().map(|a| a.to_string()).collect();
    }

    pub fn restart(&mut self) {
        self.kill9();
        self.spawn(None).expect("fencegate did not restart");
    }
}

impl Gateway for Fencegate {
    fn proxy_addr(&self) -> SocketAddr {
        self.proxy
    }

    fn admin_addr(&self) -> SocketAddr {
        self.admin
    }
}

impl Drop for Fencegate {
    fn drop(&mut self) {
        self.kill9();
        if std::thread::panicking() {
            eprintln!("---- fencegate stderr ----\n{}", self.stderr());
        }
    }
}

/// Runs `fencegate serve` on `toml` in a fresh directory, expecting it to exit by
/// itself within 20 s: its exit code and stderr.
pub fn serve_expecting_exit(toml: &str) -> (Option<i32>, String) {
    serve_expecting_exit_with(toml, &[])
}

/// [`serve_expecting_exit`] with more `serve` arguments.
pub fn serve_expecting_exit_with(toml: &str, args: &[&str]) -> (Option<i32>, String) {
    serve_expecting_exit_prepared(toml, args, |_| {})
}

/// [`serve_expecting_exit_with`] after `prepare` has had the (not yet created)
/// data directory.
pub fn serve_expecting_exit_prepared(
    toml: &str,
    args: &[&str],
    prepare: impl FnOnce(&Path),
) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().unwrap();
    prepare(&dir.path().join("state"));
    let cfg = dir.path().join("fencegate.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\ndata_dir = \"{}\"\n\n{toml}",
            dir.path().join("state").display()
        ),
    )
    .unwrap();
    let mut child = Command::new(bin())
        .args(["serve", "--config"])
        .arg(&cfg)
        .args(args)
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "fencegate kept running: a second instance was let in, or it hung: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

pub fn data_dir(fg: &Fencegate) -> &Path {
    fg.dir.path()
}

/// The `data_dir` of `fg`'s config (it may not exist before the first start).
pub fn state_dir(fg: &Fencegate) -> PathBuf {
    fg.dir.path().join("state")
}

/// The Python that runs the test servers (for the campaign's worker and origin processes).
pub fn test_python() -> PathBuf {
    python()
}

impl Fencegate {
    /// Whether the process has exited by itself (e.g. a failpoint abort); reaps it,
    /// so that [`Fencegate::spawn`] may start it again.
    pub fn exited(&mut self) -> bool {
        match self.child.as_mut().map(|c| c.try_wait()) {
            Some(Ok(None)) => false,
            Some(_) => {
                self.child = None;
                true
            }
            None => true,
        }
    }
}

/// Where a fencegate process keeps marks and dedup records (`[state]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sled,
    Postgres,
}

impl Backend {
    /// The `[state]` section: none for sled (the default); for PostgreSQL, a fresh
    /// database on the test process's shared server.
    pub fn state_toml(self) -> String {
        match self {
            Backend::Sled => String::new(),
            Backend::Postgres => state_toml(&postgres::PgServer::shared().database(), ""),
        }
    }
}

/// A `[state]` section on PostgreSQL at `url`, with extra lines.
pub fn state_toml(url: &str, extra: &str) -> String {
    format!("[state]\nkind = \"postgres\"\nurl = \"{url}\"\n{extra}\n")
}

/// A `[store]` section on the `dir` lease store at `path` (no Python needed).
pub fn dir_store_toml(path: &Path) -> String {
    format!(
        "[store]\nkind = \"dir\"\npath = \"{}\"\nprefix = \"{PREFIX}\"\nrefresh_interval_ms = 100\ngrace_ms = 200\n",
        path.display()
    )
}

/// The workers' handle on a `dir` lease store.
pub fn dir_epochs(path: &Path) -> Epochs {
    let store = fencegate::lease::dir::DirStore::open(path, Arc::new(SystemClock)).unwrap();
    Epochs::new(Arc::new(store), PREFIX)
}

/// A test S3 server, a recording origin and a fencegate process with one route,
/// `/billing/` on lease `billing` (`route_extra`: more keys of that route).
pub async fn billing_route(
    refresh_ms: u64,
    route_extra: &str,
) -> (S3Server, Origin, Fencegate, fencegate::lease::Epochs) {
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let fg = Fencegate::start(&format!(
        "{}{}",
        s3.store_toml(refresh_ms),
        route_toml("billing", "billing", &origin, route_extra)
    ));
    let epochs = s3.epochs().await;
    (s3, origin, fg, epochs)
}

/// Prints the origin's log (each arrival's times counted from `t0`, its epoch
/// and body) and returns it.
pub fn dump_arrivals(origin: &Origin, t0: Instant) -> Vec<Arrival> {
    let log = origin.log();
    for x in &log {
        eprintln!(
            "  arrived {:?} epoch {:?} body {:?} completed {:?}",
            x.arrived.saturating_duration_since(t0),
            x.epoch(),
            String::from_utf8_lossy(&x.body),
            x.completed.map(|c| c.saturating_duration_since(t0))
        );
    }
    log
}

/// Epoch e's request, held: a POST of `payload` (which starts `a:`) through
/// `fg`, held at the origin under `a`; returns once it has arrived there.
pub async fn held_a(
    fg: &Fencegate,
    origin: &Origin,
    h: &Holding,
    payload: &str,
) -> tokio::task::JoinHandle<Result<Reply, String>> {
    let a = spawn_post(fg, h, &[("x-test-hold", "a")], payload.as_bytes().to_vec());
    origin
        .wait_until("a", |l| l.iter().any(|x| x.body.starts_with(b"a:")))
        .await;
    a
}
