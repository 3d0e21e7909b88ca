//! The integration harness: real parts on loopback, port 0 everywhere.
//!
//! - [`S3Server`]: the single-threaded moto server (`scripts/s3server.py`), one per
//!   test, pausable with SIGSTOP to make the store unreachable.
//! - [`Origin`]: a recording HTTP origin (arrival and completion times, headers,
//!   body). A request header `x-test-hold: NAME` makes it wait until the test calls
//!   [`Origin::release`]; `x-test-status` and `x-test-body` (or `x-test-size`: that
//!   many bytes) choose the answer.
//! - [`Fencegate`]: the real `fencegate` binary, started from a written config, with
//!   kill -9, SIGTERM and restart on the same data directory.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fencegate::clock::SystemClock;
use fencegate::epoch::LeaseName;
use fencegate::lease::acquire::{self, Holding};
use fencegate::lease::s3::{S3Settings, S3Store};
use fencegate::lease::{Epochs, LeaseStore};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::sync::Notify;

pub const BUCKET: &str = "leases";
pub const PREFIX: &str = "fencegate/";

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn python() -> PathBuf {
    if let Ok(p) = std::env::var("FENCEGATE_TEST_PYTHON") {
        return PathBuf::from(p);
    }
    let venv = repo_root().join(".venv/bin/python");
    assert!(
        venv.exists(),
        "no S3 test server: run the tests through scripts/test.sh (it installs moto into .venv), or set FENCEGATE_TEST_PYTHON"
    );
    venv
}

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
            .args(["--port", "0", "--bucket", BUCKET])
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
        signal(self.pid(), "-STOP");
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

/// What the origin received.
#[derive(Debug, Clone)]
pub struct Arrival {
    pub method: String,
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// Bytes of the body the origin read, and whether it read the whole body
    /// (differs from `body` only under `x-test-hold-body`).
    pub body_read: usize,
    pub body_whole: bool,
    pub arrived: Instant,
    pub completed: Option<Instant>,
}

impl Arrival {
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .map(|v| v.to_str().unwrap_or("<binary>").to_owned())
    }

    pub fn epoch(&self) -> Option<u64> {
        self.header("x-lease-epoch").and_then(|e| e.parse().ok())
    }
}

#[derive(Default)]
struct OriginState {
    log: Vec<Arrival>,
    holds: HashMap<String, Arc<Notify>>,
}

/// A recording origin on a free loopback port.
#[derive(Clone)]
pub struct Origin {
    pub addr: SocketAddr,
    state: Arc<Mutex<OriginState>>,
    arrived: Arc<Notify>,
    task: Arc<tokio::task::JoinHandle<()>>,
}

impl Origin {
    pub async fn start() -> Origin {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(OriginState::default()));
        let arrived = Arc::new(Notify::new());
        let (st, ar) = (state.clone(), arrived.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (st, ar) = (st.clone(), ar.clone());
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let (st, ar) = (st.clone(), ar.clone());
                        async move {
                            Ok::<_, std::convert::Infallible>(origin_handle(req, st, ar).await)
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Origin {
            addr,
            state,
            arrived,
            task: Arc::new(task),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn log(&self) -> Vec<Arrival> {
        self.state.lock().unwrap().log.clone()
    }

    pub fn count(&self) -> usize {
        self.state.lock().unwrap().log.len()
    }

    fn hold(&self, name: &str) -> Arc<Notify> {
        self.state
            .lock()
            .unwrap()
            .holds
            .entry(name.to_owned())
            .or_default()
            .clone()
    }

    /// Lets requests held under `name` answer.
    pub fn release(&self, name: &str) {
        self.hold(name).notify_waiters();
        // A permit for a holder that has not started waiting yet.
        self.hold(name).notify_one();
    }

    /// Waits (bounded) until at least `n` requests have arrived.
    pub async fn wait_for(&self, n: usize) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let notified = self.arrived.notified();
            if self.count() >= n {
                return;
            }
            assert!(
                tokio::time::timeout_at(deadline, notified).await.is_ok() || self.count() >= n,
                "origin: waited 20 s for {n} arrivals, have {}",
                self.count()
            );
        }
    }
}

async fn origin_handle(
    req: Request<Incoming>,
    st: Arc<Mutex<OriginState>>,
    arrived: Arc<Notify>,
) -> Response<Full<Bytes>> {
    let (parts, body) = req.into_parts();
    // `x-test-hold-body: NAME`: the request is logged when its head arrives, and its
    // body is read only once NAME is released (a destination that reads slowly).
    if let Some(name) = parts
        .headers
        .get("x-test-hold-body")
        .and_then(|v| v.to_str().ok())
    {
        return origin_hold_body(name.to_owned(), parts, body, st, arrived).await;
    }
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let idx = {
        let mut s = st.lock().unwrap();
        s.log.push(Arrival {
            method: parts.method.to_string(),
            path: parts
                .uri
                .path_and_query()
                .map(|p| p.to_string())
                .unwrap_or_default(),
            headers: parts.headers.clone(),
            body_read: body.len(),
            body_whole: true,
            body,
            arrived: Instant::now(),
            completed: None,
        });
        s.log.len() - 1
    };
    arrived.notify_waiters();
    if let Some(name) = parts
        .headers
        .get("x-test-hold")
        .and_then(|v| v.to_str().ok())
    {
        let n = st
            .lock()
            .unwrap()
            .holds
            .entry(name.to_owned())
            .or_default()
            .clone();
        n.notified().await;
    }
    let status = parts
        .headers
        .get("x-test-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let size: Option<usize> = parts
        .headers
        .get("x-test-size")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let body = match (size, parts.headers.get("x-test-body")) {
        (Some(n), _) => Bytes::from(vec![b'z'; n]),
        (None, Some(v)) => Bytes::copy_from_slice(v.as_bytes()),
        (None, None) => Bytes::from(format!("origin saw request #{idx}")),
    };
    st.lock().unwrap().log[idx].completed = Some(Instant::now());
    Response::builder()
        .status(status)
        .header("x-origin-seq", idx.to_string())
        .header("content-type", "text/plain")
        .body(Full::new(body))
        .unwrap()
}

async fn origin_hold_body(
    name: String,
    parts: http::request::Parts,
    mut body: Incoming,
    st: Arc<Mutex<OriginState>>,
    arrived: Arc<Notify>,
) -> Response<Full<Bytes>> {
    let idx = {
        let mut s = st.lock().unwrap();
        s.log.push(Arrival {
            method: parts.method.to_string(),
            path: parts.uri.path().to_owned(),
            headers: parts.headers.clone(),
            body: Bytes::new(),
            body_read: 0,
            body_whole: false,
            arrived: Instant::now(),
            completed: None,
        });
        s.log.len() - 1
    };
    arrived.notify_waiters();
    let hold = st.lock().unwrap().holds.entry(name).or_default().clone();
    hold.notified().await;
    let mut whole = true;
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(f) => {
                if let Some(d) = f.data_ref() {
                    st.lock().unwrap().log[idx].body_read += d.len();
                }
            }
            Err(_) => {
                whole = false;
                break;
            }
        }
    }
    let mut s = st.lock().unwrap();
    s.log[idx].body_whole = whole;
    s.log[idx].completed = Some(Instant::now());
    Response::new(Full::new(Bytes::from_static(b"read")))
}

/// A running fencegate process.
pub struct Fencegate {
    child: Option<Child>,
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    pub proxy: SocketAddr,
    pub admin: SocketAddr,
    env: Vec<(String, String)>,
    pub stderr_path: PathBuf,
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

/// A route section pointing at `origin` with extra TOML lines.
pub fn route_toml(name: &str, lease: &str, origin: &Origin, extra: &str) -> String {
    let timeout = if extra.lines().any(|l| l.starts_with("timeout_ms")) {
        ""
    } else {
        "timeout_ms = 3000\n"
    };
    format!(
        "[[route]]\nname = \"{name}\"\npath_prefix = \"/{name}/\"\nupstream = \"{}\"\nlease = \"{lease}\"\n{timeout}{extra}\n",
        origin.url("/v1/")
    )
}

impl Fencegate {
    /// Starts fencegate with `[store]` + routes TOML; server section is added here.
    pub fn start(store_and_routes: &str) -> Fencegate {
        Fencegate::start_with_env(store_and_routes, &[])
    }

    pub fn start_with_env(store_and_routes: &str, env: &[(&str, &str)]) -> Fencegate {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("fencegate.toml");
        let text = format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\ndata_dir = \"{}\"\nshutdown_timeout_ms = 5000\n\n{store_and_routes}",
            dir.path().join("state").display()
        );
        std::fs::write(&config, text).unwrap();
        let mut fg = Fencegate {
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
        };
        fg.spawn(None).expect("fencegate did not start");
        fg
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
        let mut child = cmd.spawn().expect("spawning fencegate");
        let stdout = child.stdout.take().unwrap();
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        if line.trim().is_empty() {
            let _ = child.wait();
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

    pub fn restart(&mut self) {
        self.kill9();
        self.spawn(None).expect("fencegate did not restart");
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.proxy)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin)
    }

    /// GET an admin endpoint and parse JSON.
    pub async fn admin_json(&self, path: &str) -> serde_json::Value {
        let r = send(
            Request::get(self.admin_url(path))
                .body(Full::default())
                .unwrap(),
        )
        .await;
        serde_json::from_slice(&r.body).unwrap_or(serde_json::Value::Null)
    }

    /// The value of an unlabelled metric, or the sum of a labelled one.
    pub async fn metric_sum(&self, name: &str) -> f64 {
        let r = send(
            Request::get(self.admin_url("/metrics"))
                .body(Full::default())
                .unwrap(),
        )
        .await;
        let text = String::from_utf8_lossy(&r.body).into_owned();
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| {
                l.starts_with(name)
                    && (l[name.len()..].starts_with('{') || l[name.len()..].starts_with(' '))
            })
            .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
            .sum()
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

/// A response, fully read.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }

    pub fn error_code(&self) -> Option<String> {
        self.headers
            .get("x-fencegate-error")
            .map(|v| v.to_str().unwrap().to_owned())
    }

    /// Asserts a fencegate-made error: status, code in header and body.
    pub fn assert_error(&self, status: u16, code: &str) {
        assert_eq!(
            self.status.as_u16(),
            status,
            "body: {}",
            String::from_utf8_lossy(&self.body)
        );
        assert_eq!(self.error_code().as_deref(), Some(code));
        let j = self.json();
        assert_eq!(j["error"], code, "{j}");
        assert!(j["message"].as_str().is_some_and(|m| !m.is_empty()), "{j}");
        assert_eq!(self.headers["content-type"], "application/json");
    }
}

fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

pub async fn send(req: Request<Full<Bytes>>) -> Reply {
    let resp = tokio::time::timeout(Duration::from_secs(30), client().request(req))
        .await
        .expect("request timed out")
        .expect("request failed");
    let (parts, body) = resp.into_parts();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body: body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default(),
    }
}

/// A request builder for a worker at `epoch` with `token`.
pub fn worker_req(url: &str, epoch: u64, token: &str) -> http::request::Builder {
    Request::post(url)
        .header("x-lease-epoch", epoch.to_string())
        .header("x-lease-token", token)
}

pub fn body(s: &str) -> Full<Bytes> {
    Full::new(Bytes::from(s.to_owned()))
}

/// Sends a worker's POST through fencegate.
pub async fn post(fg: &Fencegate, path: &str, h: &Holding, payload: &str) -> Reply {
    send(
        worker_req(&fg.url(path), h.epoch.get(), &h.token)
            .body(body(payload))
            .unwrap(),
    )
    .await
}

/// Writes a raw epoch object (forged or garbage) straight into the store.
pub async fn put_raw(epochs: &Epochs, lease: &str, epoch: u64, body: &[u8]) {
    let key = fencegate::epoch::object_key(
        PREFIX,
        &LeaseName::parse(lease).unwrap(),
        fencegate::epoch::Epoch::new(epoch),
    );
    epochs
        .store()
        .create_if_absent(&key, Bytes::copy_from_slice(body))
        .await
        .unwrap();
}

pub fn data_dir(fg: &Fencegate) -> &Path {
    fg.dir.path()
}

/// Creates the next epoch regardless of who holds the lease (a takeover by a new
/// leader, without waiting for expiry): for tests of the gate, not of acquiring.
pub async fn force_next_epoch(
    epochs: &Epochs,
    lease: &str,
    holder: &str,
    ttl: Duration,
) -> Holding {
    use fencegate::epoch::{Epoch, EpochRecord};
    let name = LeaseName::parse(lease).unwrap();
    let latest = epochs.latest_after(&name, Epoch::NONE).await.unwrap();
    let next = latest.next().unwrap();
    let token = acquire::fresh_token();
    let rec = EpochRecord::acquire(&name, next, holder, token.as_bytes(), ttl);
    let out = epochs
        .create(&name, next, Bytes::from(rec.to_json()))
        .await
        .unwrap();
    assert_eq!(out, fencegate::lease::CreateOutcome::Created);
    let obj = epochs.read(&name, next).await.unwrap().unwrap();
    let expires_at = match obj {
        fencegate::epoch::EpochObject::Acquire { expires_at, .. } => expires_at,
        other => panic!("{other:?}"),
    };
    Holding {
        lease: name,
        epoch: next,
        token,
        holder: holder.into(),
        expires_at,
    }
}

/// Polls `cond` every 10 ms for up to 20 s (for conditions only observable from
/// outside, e.g. a metric); panics with `what` on timeout.
pub async fn eventually<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond().await {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Like [`send`], but a connection failure is an `Err` (fencegate crashed).
pub async fn try_send(req: Request<Full<Bytes>>) -> Result<Reply, String> {
    let resp = tokio::time::timeout(Duration::from_secs(30), client().request(req))
        .await
        .map_err(|_| "timed out".to_string())?
        .map_err(|e| e.to_string())?;
    let (parts, body) = resp.into_parts();
    Ok(Reply {
        status: parts.status,
        headers: parts.headers,
        body: body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .map_err(|e| e.to_string())?,
    })
}

/// A worker POST with an idempotency key.
pub fn keyed(
    fg: &Fencegate,
    path: &str,
    h: &Holding,
    key: &str,
    payload: &str,
) -> Request<Full<Bytes>> {
    worker_req(&fg.url(path), h.epoch.get(), &h.token)
        .header("idempotency-key", key)
        .body(body(payload))
        .unwrap()
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
