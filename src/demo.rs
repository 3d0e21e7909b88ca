//! `fencegate demo`: the SPEC §1 story end to end, in one process, on the embedded
//! defaults — the `dir` lease store in a temporary directory, a local origin that
//! records what it receives, and fencegate itself on a free loopback port.
//!
//! Worker A acquires a short lease and publishes through fencegate; A pauses
//! for longer than its lease; worker B waits for A's expiry plus the grace period,
//! acquires the next epoch and publishes; A wakes and sends its stale result, and
//! fencegate refuses it with 409 `epoch_stale`. The destination's log shows that
//! nothing from A's epoch reached it after B's. [`run`] returns `Ok(true)` when
//! the story came out that way.
//!
//! The workers use the library's SPEC §2 algorithm ([`crate::lease::acquire`]) on
//! their own handle to the store, exactly as `fencegate lease` or any other
//! process would; they talk to fencegate over HTTP.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};

use crate::clock::{rfc3339, SystemClock};
use crate::config::Config;
use crate::epoch::{object_key, LeaseName};
use crate::lease::acquire::{self, AcquireError, Holding};
use crate::lease::{self, Epochs};

/// A's lease: short, so the story takes seconds.
const TTL: Duration = Duration::from_millis(1500);
/// How long a contender waits past the holder's expiry (SPEC §2 step 2).
const GRACE: Duration = Duration::from_millis(300);
/// The whole story must finish well within this.
const DEADLINE: Duration = Duration::from_secs(20);
const LEASE: &str = "report";
const PATH: &str = "/publish/report";

/// Runs the story; `Ok(true)` when the stale write was refused and the
/// destination's log is clean.
pub(crate) async fn run() -> anyhow::Result<bool> {
    let t0 = crate::clock::stopwatch();
    let tmp = TempDir::new()?;
    let origin = Origin::start().await?;
    let cfg = demo_config(tmp.path(), origin.addr)?;

    let app = crate::server::build(&cfg, Arc::new(SystemClock))
        .await
        .context("starting fencegate")?;
    let proxy_l = crate::server::bind(cfg.server.listen).await?;
    let admin_l = crate::server::bind(cfg.server.admin_listen).await?;
    let proxy = proxy_l.local_addr()?;

    println!("fencegate demo: a leader that wakes up too late (SPEC §1)\n");
    println!("  lease store  dir store at {}", cfg.store.path.display());
    println!(
        "  destination  http://{}/v1/ (records every request it receives)",
        origin.addr
    );
    println!("  fencegate    http://{proxy}/publish/ -> destination, protected by lease {LEASE:?}");
    println!(
        "  lease        ttl {} ms, contenders wait a further {} ms (grace)\n",
        TTL.as_millis(),
        GRACE.as_millis()
    );

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let story = async {
        let r = tokio::time::timeout(DEADLINE, story(&cfg, proxy, &origin, t0)).await;
        let _ = stop_tx.send(());
        match r {
            Ok(r) => r,
            Err(_) => anyhow::bail!("the story did not finish within {DEADLINE:?}"),
        }
    };
    let shutdown = async {
        let _ = stop_rx.await;
    };
    let (served, told) = tokio::join!(app.run(proxy_l, admin_l, shutdown), story);
    served.context("running fencegate")?;
    let ok = told?;
    println!("\n(finished in {:.1} s)", t0.elapsed().as_secs_f64());
    Ok(ok)
}

/// The §1 story, step by step, printing a timeline. A script, read top to
/// bottom as the README tells the story: splitting it would hide the order.
async fn story(
    cfg: &Config,
    proxy: SocketAddr,
    origin: &Origin,
    t0: Instant,
) -> anyhow::Result<bool> {
    let lease = LeaseName::parse(LEASE).map_err(anyhow::Error::msg)?;
    // The workers reach the store on their own handle (shared by A and B here),
    // not through fencegate: exactly what separate worker processes do.
    let store = lease::open(&cfg.store, Arc::new(SystemClock)).await?;
    let epochs = Epochs::new(store, cfg.store.prefix.clone());
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let url = format!("http://{proxy}{PATH}");
    let say = |who: &str, what: String| {
        println!("{:>6.2}s  {who:<2} {what}", t0.elapsed().as_secs_f64());
    };

    // 1. A wins the lease and publishes.
    let a = acquire::acquire(&epochs, &lease, "worker-a", TTL, GRACE, None)
        .await
        .context("worker A acquiring")?;
    say(
        "A",
        format!(
            "acquires lease {LEASE:?}: epoch {} (object {}), valid until {}",
            a.epoch,
            object_key(&cfg.store.prefix, &lease, a.epoch),
            clock_of(a.expires_at)
        ),
    );
    let a_start = "status=running (from A)";
    let first = publish(&client, &url, &a, "a-status-1", a_start).await?;
    say(
        "A",
        format!("POST {PATH} {a_start:?} -> {}", first.describe()),
    );

    // 2. A pauses (GC, VM freeze, network) for longer than its lease.
    say(
        "A",
        "pauses (GC, a frozen VM, a partition) for longer than its lease, its result in memory"
            .into(),
    );

    // 3. B sees the lease held, waits for expiry plus grace, and takes over.
    let b = loop {
        match acquire::acquire(&epochs, &lease, "worker-b", TTL * 4, GRACE, None).await {
            Ok(h) => break h,
            Err(AcquireError::Held {
                holder,
                epoch,
                expires_at,
                ..
            }) => {
                let free_at = acquire::free_at(expires_at, GRACE);
                let wait = free_at
                    .duration_since(epochs.store().clock().earliest())
                    .unwrap_or(Duration::ZERO)
                    .max(Duration::from_millis(20));
                say(
                    "B",
                    format!(
                        "tries to acquire: held by {holder} at epoch {epoch} until {}; waits until {} (expiry + grace)",
                        clock_of(expires_at),
                        clock_of(free_at)
                    ),
                );
                // Waiting for the lease to expire is the condition itself.
                tokio::time::sleep(wait).await;
            }
            Err(e) => return Err(e).context("worker B acquiring"),
        }
    };
    say(
        "B",
        format!(
            "acquires lease {LEASE:?}: epoch {}, valid until {}",
            b.epoch,
            clock_of(b.expires_at)
        ),
    );
    let b_result = "total=120 (from B)";
    let second = publish(&client, &url, &b, "b-report-1", b_result).await?;
    say(
        "B",
        format!("POST {PATH} {b_result:?} -> {}", second.describe()),
    );

    // 4. A wakes up, unaware, and sends its stale result.
    say(
        "A",
        format!(
            "wakes up, still believing it holds epoch {}, and sends the result it computed before",
            a.epoch
        ),
    );
    let a_result = "total=100 (from A)";
    let late = publish(&client, &url, &a, "a-report-1", a_result).await?;
    say(
        "A",
        format!("POST {PATH} {a_result:?} -> {}", late.describe()),
    );
    if let Some(m) = late.message() {
        println!("{:>8}   fencegate says: {m}", "");
    }

    // 5. What reached the destination.
    let log = origin.log();
    println!("\nWhat the destination received:");
    for (i, r) in log.iter().enumerate() {
        println!(
            "  #{} at {:>5.2}s  epoch {}  Idempotency-Key {}  body {:?}",
            i + 1,
            r.at.duration_since(t0).as_secs_f64(),
            r.epoch.as_deref().unwrap_or("-"),
            r.idempotency_key.as_deref().unwrap_or("-"),
            r.body
        );
    }
    let epochs_seen: Vec<Option<u64>> = log
        .iter()
        .map(|r| r.epoch.as_deref().and_then(|e| e.parse().ok()))
        .collect();
    let a_ep = Some(a.epoch.get());
    let b_ep = Some(b.epoch.get());
    let refused =
        late.status == StatusCode::CONFLICT && late.code.as_deref() == Some("epoch_stale");
    let ok = first.status == StatusCode::OK
        && second.status == StatusCode::OK
        && refused
        && epochs_seen == [a_ep, b_ep]
        && log.iter().all(|r| !r.had_token);
    println!();
    if ok {
        println!(
            "OK: A's stale write (epoch {}) was refused with 409 epoch_stale; the destination \
             saw epoch {} then epoch {} and nothing older after that.\n    Without fencegate, \
             A's stale {a_result:?} would have overwritten B's {b_result:?}.",
            a.epoch, a.epoch, b.epoch
        );
    } else {
        println!(
            "UNEXPECTED: the story did not come out as SPEC §1 requires (statuses {} / {} / {}, \
             destination epochs {epochs_seen:?}).",
            first.status, second.status, late.status
        );
    }
    Ok(ok)
}

/// A worker's call through fencegate.
struct Outcome {
    status: StatusCode,
    code: Option<String>,
    body: Bytes,
}

impl Outcome {
    fn describe(&self) -> String {
        match &self.code {
            Some(code) => format!(
                "fencegate {} {code} (refused, not forwarded)",
                self.status.as_u16()
            ),
            None => format!(
                "{} from the destination ({:?})",
                self.status,
                String::from_utf8_lossy(&self.body)
            ),
        }
    }

    fn message(&self) -> Option<String> {
        self.code.as_ref()?;
        let v: serde_json::Value = serde_json::from_slice(&self.body).ok()?;
        v["message"].as_str().map(str::to_owned)
    }
}

async fn publish(
    client: &Client<HttpConnector, Full<Bytes>>,
    url: &str,
    h: &Holding,
    key: &str,
    payload: &str,
) -> anyhow::Result<Outcome> {
    let req = Request::post(url)
        .header("x-lease-epoch", h.epoch.to_string())
        .header("x-lease-token", &h.token)
        .header("idempotency-key", key)
        .header("content-type", "text/plain")
        .body(Full::new(Bytes::from(payload.to_owned())))?;
    let resp = tokio::time::timeout(Duration::from_secs(5), client.request(req))
        .await
        .context("fencegate did not answer within 5 s")?
        .context("calling fencegate")?;
    let status = resp.status();
    let code = resp
        .headers()
        .get("x-fencegate-error")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body = resp.into_body().collect().await?.to_bytes();
    Ok(Outcome { status, code, body })
}

/// The wall-clock time of day, for the timeline (UTC, milliseconds).
fn clock_of(t: SystemTime) -> String {
    let s = rfc3339(t);
    // "2024-05-01T12:00:01.500Z" -> "12:00:01.500Z"
    s.split_once('T')
        .map(|(_, time)| time.to_owned())
        .unwrap_or(s)
}

fn demo_config(dir: &Path, origin: SocketAddr) -> anyhow::Result<Config> {
    let text = format!(
        r#"
[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
data_dir = {state}
shutdown_timeout_ms = 2000

[store]
kind = "dir"
path = {leases}
prefix = "fencegate/"
refresh_interval_ms = 100
grace_ms = {grace}

[[route]]
name = "publish"
path_prefix = "/publish/"
upstream = "http://{origin}/v1/"
lease = "{LEASE}"
timeout_ms = 5000
"#,
        state = toml_str(&dir.join("state")),
        leases = toml_str(&dir.join("leases")),
        grace = GRACE.as_millis(),
    );
    let cfg = Config::parse(&text).map_err(|e| anyhow::anyhow!("demo config: {e}"))?;
    cfg.validate()
        .map_err(|e| anyhow::anyhow!("demo config: {e}"))?;
    Ok(cfg)
}

/// A path as a TOML basic string.
fn toml_str(p: &Path) -> String {
    let s = p.to_string_lossy();
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A temporary directory removed on drop (the demo leaves nothing behind).
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> anyhow::Result<TempDir> {
        let name = format!(
            "fencegate-demo-{}-{:016x}",
            std::process::id(),
            crate::entropy::u64()
        );
        let path = std::env::temp_dir().join(name);
        std::fs::create_dir(&path)
            .with_context(|| format!("creating a temporary directory {}", path.display()))?;
        Ok(TempDir(path))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One request as the destination received it.
#[derive(Debug, Clone)]
struct Received {
    at: Instant,
    method: String,
    path: String,
    epoch: Option<String>,
    idempotency_key: Option<String>,
    had_token: bool,
    body: String,
}

/// The destination: a tiny HTTP server on 127.0.0.1:0 that records every request.
#[derive(Clone)]
struct Origin {
    addr: SocketAddr,
    log: Arc<Mutex<Vec<Received>>>,
}

/// `fencegate origin`: the demo's destination on `addr`, printing each request it
/// receives on stdout, until interrupted (the quick start's upstream).
pub(crate) async fn serve_origin(addr: SocketAddr) -> anyhow::Result<()> {
    let origin = Origin::start_on(addr, true).await?;
    println!(
        "origin listening on http://{}/ — every request it receives is printed here",
        origin.addr
    );
    tokio::signal::ctrl_c()
        .await
        .context("waiting for Ctrl-C")?;
    Ok(())
}

impl Origin {
    async fn start() -> anyhow::Result<Origin> {
        Origin::start_on(SocketAddr::from(([127, 0, 0, 1], 0)), false).await
    }

    async fn start_on(addr: SocketAddr, print: bool) -> anyhow::Result<Origin> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding the origin on {addr}"))?;
        let origin = Origin {
            addr: listener.local_addr()?,
            log: Arc::default(),
        };
        let log = origin.log.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let log = log.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let log = log.clone();
                        async move { Ok::<_, std::convert::Infallible>(record(req, &log, print).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Ok(origin)
    }

    fn log(&self) -> Vec<Received> {
        self.log.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

async fn record(
    req: Request<Incoming>,
    log: &Mutex<Vec<Received>>,
    print: bool,
) -> Response<Full<Bytes>> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let header = |name: &str| {
        parts
            .headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let n = {
        let mut log = log.lock().unwrap_or_else(|p| p.into_inner());
        let r = Received {
            at: crate::clock::stopwatch(),
            method: parts.method.to_string(),
            path: parts.uri.path().to_owned(),
            epoch: header("x-lease-epoch"),
            idempotency_key: header("idempotency-key"),
            had_token: parts.headers.contains_key("x-lease-token"),
            body: String::from_utf8_lossy(&body).into_owned(),
        };
        if print {
            println!(
                "#{} {} {} epoch={} key={} token_forwarded={} body={:?}",
                log.len() + 1,
                r.method,
                r.path,
                r.epoch.as_deref().unwrap_or("-"),
                r.idempotency_key.as_deref().unwrap_or("-"),
                r.had_token,
                r.body
            );
        }
        log.push(r);
        log.len()
    };
    let mut resp = Response::new(Full::new(Bytes::from(format!("stored as #{n}"))));
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain"),
    );
    resp
}
