//! What both test binaries share: the recording origin, the HTTP client side
//! (requests, replies, SPEC §7 error checks), epoch objects written straight into
//! a store, and [`FaultStore`]. `tests/it` (fencegate as a process) and
//! `tests/inproc` (fencegate in the test process) include this file with `#[path]`.
//!
//! - [`Origin`]: a recording HTTP origin (arrival and completion times, headers,
//!   body). A request header `x-test-hold: NAME` makes it wait until the test calls
//!   [`Origin::release`]; `x-test-status` and `x-test-body` (or `x-test-size`: that
//!   many bytes) choose the answer. `x-test-stream-bytes: N` streams N bytes in
//!   1 MiB chunks (made as they are sent); `x-test-events: NAME` answers one
//!   server-sent event at once and a second only after [`Origin::release`] of NAME.
//!   `x-test-answer-early: 1` answers at once, before reading the request body,
//!   and reads the body afterwards (a destination that answers an upload early);
//!   the arrival's `completed` is when that body had been read to its end.
//!   `x-test-retry-after: V` answers with `Retry-After: V` (`x-test-claims-owner:
//!   V` with `X-Fencegate-Owner: V`); `x-test-delay-ms: N`
//!   answers N ms later (a destination that takes its time, so that concurrent
//!   requests overlap). [`Origin::max_concurrent`] is the most requests it was
//!   handling at once.
//! - [`postgres::PgServer`]: a real PostgreSQL on a free loopback port.
//! - [`Gateway`]: what a running fencegate is to a test, whichever harness runs it
//!   (its URLs, the admin API, metrics).

#![allow(dead_code)]

mod fault_store;
pub mod ports;
pub mod postgres;
pub mod queue;

pub use fault_store::{Fault, FaultStore, Op, Rule};
#[allow(unused_imports)]
pub use ports::free_port;
#[allow(unused_imports)]
pub use postgres::freeze::freeze;

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fencegate::epoch::LeaseName;
use fencegate::lease::acquire::{self, Holding};
use fencegate::lease::Epochs;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::sync::Notify;

/// The key prefix of epoch objects in every test store.
pub const PREFIX: &str = "fencegate/";

/// A running fencegate, as the tests talk to it.
pub trait Gateway {
    fn proxy_addr(&self) -> SocketAddr;
    fn admin_addr(&self) -> SocketAddr;

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.proxy_addr())
    }

    fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin_addr())
    }

    /// GET an admin endpoint and parse JSON.
    fn admin_json(&self, path: &str) -> impl Future<Output = serde_json::Value> + Send {
        let url = self.admin_url(path);
        async move {
            let r = send(Request::get(url).body(Full::default()).unwrap()).await;
            serde_json::from_slice(&r.body).unwrap_or(serde_json::Value::Null)
        }
    }

    /// The value of one exact series (`name{labels}`, labels as fencegate
    /// writes them), 0 if absent.
    fn series(&self, exact: &str) -> impl Future<Output = f64> + Send {
        let url = self.admin_url("/metrics");
        let exact = exact.to_owned();
        async move {
            let r = send(Request::get(url).body(Full::default()).unwrap()).await;
            String::from_utf8_lossy(&r.body)
                .lines()
                .find_map(|l| l.strip_prefix(&exact)?.strip_prefix(' ')?.parse().ok())
                .unwrap_or(0.0)
        }
    }

    /// The value of an unlabelled metric, or the sum of a labelled one.
    fn metric_sum(&self, name: &str) -> impl Future<Output = f64> + Send {
        let url = self.admin_url("/metrics");
        let name = name.to_owned();
        async move {
            let r = send(Request::get(url).body(Full::default()).unwrap()).await;
            let text = String::from_utf8_lossy(&r.body).into_owned();
            text.lines()
                .filter(|l| !l.starts_with('#'))
                .filter(|l| {
                    l.starts_with(&name)
                        && (l[name.len()..].starts_with('{') || l[name.len()..].starts_with(' '))
                })
                .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
                .sum()
        }
    }
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
    /// Requests being handled now, and the most there were at once.
    active: usize,
    max_active: usize,
}

/// Counts a request as being handled by the origin while it lives.
struct Active(Arc<Mutex<OriginState>>);

impl Active {
    fn new(st: &Arc<Mutex<OriginState>>) -> Active {
        let mut s = st.lock().unwrap();
        s.active += 1;
        s.max_active = s.max_active.max(s.active);
        Active(st.clone())
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        self.0.lock().unwrap().active -= 1;
    }
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

    /// The most requests the origin was handling at once, counted from a
    /// request's arrival until its handler answered.
    pub fn max_concurrent(&self) -> usize {
        self.state.lock().unwrap().max_active
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
        self.wait_until(&format!("{n} arrivals"), |log| log.len() >= n)
            .await;
    }

    /// Waits (bounded, woken by each arrival) until the log satisfies `done`.
    pub async fn wait_until(&self, what: &str, done: impl Fn(&[Arrival]) -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        let met = || done(&self.state.lock().unwrap().log);
        loop {
            let notified = self.arrived.notified();
            if met() {
                return;
            }
            assert!(
                tokio::time::timeout_at(deadline, notified).await.is_ok() || met(),
                "origin: waited 20 s for {what}, have {} arrivals",
                self.count()
            );
        }
    }
}

/// The origin's answer: whole, or streamed from a task through a channel of one
/// chunk (so it is made only as fast as it is read).
pub enum OriginBody {
    Full(Full<Bytes>),
    Channel(tokio::sync::mpsc::Receiver<Bytes>),
}

impl hyper::body::Body for OriginBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        match self.get_mut() {
            OriginBody::Full(f) => std::pin::Pin::new(f).poll_frame(cx),
            OriginBody::Channel(rx) => rx
                .poll_recv(cx)
                .map(|c| c.map(|b| Ok(hyper::body::Frame::data(b)))),
        }
    }
}

/// A streamed answer made by `make` (it sends chunks), its completion logged.
fn streamed<F, Fut>(st: Arc<Mutex<OriginState>>, idx: usize, make: F) -> Response<OriginBody>
where
    F: FnOnce(tokio::sync::mpsc::Sender<Bytes>) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        make(tx).await;
        st.lock().unwrap().log[idx].completed = Some(Instant::now());
    });
    Response::builder()
        .header("x-origin-seq", idx.to_string())
        .header("content-type", "text/event-stream")
        .body(OriginBody::Channel(rx))
        .unwrap()
}

async fn origin_handle(
    req: Request<Incoming>,
    st: Arc<Mutex<OriginState>>,
    arrived: Arc<Notify>,
) -> Response<OriginBody> {
    let _active = Active::new(&st);
    let (parts, body) = req.into_parts();
    // `x-test-hold-body: NAME`: the request is logged when its head arrives, and its
    // body is read only once NAME is released (a destination that reads slowly).
    if let Some(name) = parts
        .headers
        .get("x-test-hold-body")
        .and_then(|v| v.to_str().ok())
    {
        return origin_hold_body(name.to_owned(), parts, body, st, arrived)
            .await
            .map(OriginBody::Full);
    }
    if parts.headers.contains_key("x-test-answer-early") {
        return origin_answer_early(parts, body, st, arrived);
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
    let header = |n: &str| {
        parts
            .headers
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    if let Some(n) = header("x-test-stream-bytes").and_then(|v| v.parse::<usize>().ok()) {
        return streamed(st, idx, move |tx| async move {
            let chunk = Bytes::from(vec![b's'; 1 << 20]);
            let mut left = n;
            while left > 0 {
                let c = chunk.slice(..left.min(chunk.len()));
                left -= c.len();
                if tx.send(c).await.is_err() {
                    return;
                }
            }
        });
    }
    if let Some(name) = header("x-test-events") {
        let hold = st.lock().unwrap().holds.entry(name).or_default().clone();
        return streamed(st, idx, move |tx| async move {
            if tx.send(Bytes::from_static(b"data: one\n\n")).await.is_ok() {
                hold.notified().await;
                let _ = tx.send(Bytes::from_static(b"data: two\n\n")).await;
            }
        });
    }
    let status = parts
        .headers
        .get("x-test-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    if let Some(ms) = header("x-test-delay-ms").and_then(|v| v.parse::<u64>().ok()) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
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
    let mut answer = Response::builder()
        .status(status)
        .header("x-origin-seq", idx.to_string())
        .header("content-type", "text/plain");
    if let Some(v) = header("x-test-retry-after") {
        answer = answer.header("retry-after", v);
    }
    if let Some(v) = header("x-test-claims-owner") {
        // A destination that sets fencegate's owner hint itself.
        answer = answer.header("x-fencegate-owner", v);
    }
    answer.body(OriginBody::Full(Full::new(body))).unwrap()
}

/// Logs the request's head, answers at once, and reads its body in the
/// background: `completed` is set when the body has been read to its end.
fn origin_answer_early(
    parts: http::request::Parts,
    mut body: Incoming,
    st: Arc<Mutex<OriginState>>,
    arrived: Arc<Notify>,
) -> Response<OriginBody> {
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
    tokio::spawn(async move {
        let mut whole = true;
        let mut got = Vec::new();
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(f) => {
                    if let Some(d) = f.data_ref() {
                        got.extend_from_slice(d);
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
        s.log[idx].body = Bytes::from(got);
        s.log[idx].body_whole = whole;
        s.log[idx].completed = Some(Instant::now());
        drop(s);
        arrived.notify_waiters();
    });
    Response::builder()
        .header("x-origin-seq", idx.to_string())
        .body(OriginBody::Full(Full::new(Bytes::from_static(b"accepted"))))
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

    /// Its `Retry-After` in whole seconds (there must be one).
    pub fn retry_after_secs(&self) -> u64 {
        self.headers["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap()
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
pub async fn post(fg: &impl Gateway, path: &str, h: &Holding, payload: &str) -> Reply {
    send(
        worker_req(&fg.url(path), h.epoch.get(), &h.token)
            .body(body(payload))
            .unwrap(),
    )
    .await
}

/// A worker POST with an idempotency key.
pub fn keyed(
    fg: &impl Gateway,
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

/// Sends a worker's POST of `payload` to `/billing/x` at `h`'s epoch with extra
/// headers, in the background (a request a test holds at the origin).
pub fn spawn_post(
    fg: &impl Gateway,
    h: &Holding,
    headers: &[(&str, &str)],
    payload: Vec<u8>,
) -> tokio::task::JoinHandle<Result<Reply, String>> {
    let mut req = worker_req(&fg.url("/billing/x"), h.epoch.get(), &h.token);
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    let req = req.body(Full::new(Bytes::from(payload))).unwrap();
    tokio::spawn(try_send(req))
}

/// Whether a drain has started on `fg` (its metric).
pub async fn drains_started(fg: &impl Gateway) -> bool {
    fg.metric_sum("fencegate_drains_started_total").await >= 1.0
}
