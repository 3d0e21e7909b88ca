//! A closed-loop load generator: N keep-alive HTTP/1.1 connections (hyper's
//! connection-level client, no pool), each sending its next request as soon as the
//! previous answer is complete, for a warm-up and then a measured window.
//! Latencies (µs) go into HDR histograms; the CPU time of the watched processes
//! (and of watched process trees: a PostgreSQL postmaster and its backends) is read
//! from /proc at the window's edges, and an optional probe (PostgreSQL's WAL
//! counters) is sampled there too.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hdrhistogram::Histogram;
use http::header::HeaderValue;
use http::{Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::time::Instant;

pub type Sender = SendRequest<Full<Bytes>>;
pub type MakeReq = Arc<dyn Fn(usize, u64) -> Request<Full<Bytes>> + Send + Sync>;
/// Counters read at both edges of the measured window; the outcome holds their
/// differences (a failed read gives an empty vector, and no differences).
pub type Probe = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Vec<f64>>>>>;

pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 120_000_000, 3).expect("valid histogram bounds")
}

/// Opens one keep-alive connection.
pub async fn connect(addr: SocketAddr) -> Result<Sender, String> {
    let s = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect {addr}: {e}"))?;
    let _ = s.set_nodelay(true);
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s))
        .await
        .map_err(|e| format!("handshake {addr}: {e}"))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

/// What came back.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: StatusCode,
    /// `X-Fencegate-Error`, if any.
    pub code: Option<String>,
    pub replayed: bool,
    pub body_len: usize,
    /// `X-Fencegate-Owner` (a cluster member's hint: the lease owner's URL).
    pub owner: Option<String>,
}

/// One request on an open connection, body read to the end.
pub async fn exchange(s: &mut Sender, req: Request<Full<Bytes>>) -> Result<Answer, String> {
    s.ready().await.map_err(|e| e.to_string())?;
    let resp = s.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status();
    let code = resp
        .headers()
        .get("x-fencegate-error")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let replayed = resp.headers().contains_key("x-fencegate-replayed");
    let owner = resp
        .headers()
        .get("x-fencegate-owner")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?;
    Ok(Answer {
        status,
        code,
        replayed,
        body_len: body.to_bytes().len(),
        owner,
    })
}

/// The headers every bench request carries.
#[derive(Clone)]
pub struct Creds {
    pub epoch: HeaderValue,
    pub token: HeaderValue,
}

impl Creds {
    pub fn new(epoch: u64, token: &str) -> Creds {
        Creds {
            epoch: HeaderValue::from(epoch),
            token: HeaderValue::from_str(token).expect("hex token"),
        }
    }
}

/// A 100-byte JSON body, unique per (tag, connection, sequence): content-derived
/// dedup keys never repeat, so nothing is answered from a record.
pub fn body(tag: u64, conn: usize, seq: u64) -> Bytes {
    let mut b = format!("{{\"tag\":{tag},\"conn\":{conn},\"seq\":{seq},\"pad\":\"").into_bytes();
    b.resize(98, b'x');
    b.extend_from_slice(b"\"}");
    Bytes::from(b)
}

/// `POST path` with the lease headers, a unique 100-byte body and optional extras.
pub fn request(
    path: Uri,
    creds: &Creds,
    body: Bytes,
    extra: Option<(&'static str, HeaderValue)>,
) -> Request<Full<Bytes>> {
    let mut r = Request::new(Full::new(body));
    *r.method_mut() = http::Method::POST;
    *r.uri_mut() = path;
    let h = r.headers_mut();
    h.insert(http::header::HOST, HeaderValue::from_static("bench.local"));
    h.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert("x-lease-epoch", creds.epoch.clone());
    h.insert("x-lease-token", creds.token.clone());
    if let Some((n, v)) = extra {
        h.insert(n, v);
    }
    r
}

pub struct Plan {
    pub addr: SocketAddr,
    pub conns: usize,
    pub warmup: Duration,
    pub measure: Duration,
    pub make: MakeReq,
    /// Processes whose CPU time is read at the window's edges.
    pub pids: Vec<u32>,
    /// Processes whose CPU time *and that of their children* is read at the
    /// window's edges ([`super::procs::tree_cpu_secs`]).
    pub trees: Vec<u32>,
    /// Sampled just before the window's first CPU reading and just after its last
    /// (a PostgreSQL query: ~3 ms under load, which the CPU window loses against
    /// the count window — ~0.1 % of a 4 s window).
    pub probe: Option<Probe>,
}

#[derive(Debug, Default, Clone)]
pub struct Counts {
    /// 2xx answers completed inside the window.
    pub ok: u64,
    /// 2xx answers at any time (warm-up included).
    pub ok_total: u64,
    /// Non-2xx answers and transport failures, at any time.
    pub errors: u64,
    /// Answers replayed from a dedup record (should be none: bodies are unique).
    pub replayed: u64,
    pub by_code: BTreeMap<String, u64>,
    pub first_error: Option<String>,
}

impl Counts {
    fn error(&mut self, what: String) {
        self.errors += 1;
        *self.by_code.entry(what.clone()).or_default() += 1;
        if self.first_error.is_none() {
            self.first_error = Some(what);
        }
    }

    fn merge(&mut self, o: Counts) {
        self.ok += o.ok;
        self.ok_total += o.ok_total;
        self.errors += o.errors;
        self.replayed += o.replayed;
        for (k, v) in o.by_code {
            *self.by_code.entry(k).or_default() += v;
        }
        if self.first_error.is_none() {
            self.first_error = o.first_error;
        }
    }
}

pub struct Outcome {
    pub counts: Counts,
    /// Latency of the window's 2xx answers, µs.
    pub hist: Histogram<u64>,
    /// The window's length as measured, seconds.
    pub secs: f64,
    /// CPU seconds each watched process used during the window.
    pub cpu: Vec<f64>,
    /// CPU seconds each watched process tree used during the window, by kind of
    /// process ([`super::procs::tree_cpu_secs`]).
    pub tree_cpu: Vec<BTreeMap<String, f64>>,
    /// The probe's counters at the window's end minus at its start.
    pub probe: Vec<f64>,
}

impl Outcome {
    pub fn rps(&self) -> f64 {
        self.counts.ok as f64 / self.secs.max(1e-9)
    }

    /// CPU µs per answered request of watched process `i`.
    pub fn cpu_us(&self, i: usize) -> f64 {
        self.cpu.get(i).copied().unwrap_or(0.0) * 1e6 / (self.counts.ok.max(1) as f64)
    }
}

async fn conn_task(
    addr: SocketAddr,
    idx: usize,
    make: MakeReq,
    window: (Instant, Instant),
) -> (Counts, Histogram<u64>) {
    let (ws, we) = window;
    let mut counts = Counts::default();
    let mut hist = histogram();
    let mut sender: Option<Sender> = None;
    let mut seq = 0u64;
    while Instant::now() < we {
        let s = match sender.as_mut() {
            Some(s) => s,
            None => match connect(addr).await {
                Ok(s) => sender.insert(s),
                Err(e) => {
                    counts.error(format!("transport: {e}"));
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
        };
        let req = make(idx, seq);
        seq += 1;
        let t0 = Instant::now();
        let res = exchange(s, req).await;
        let t1 = Instant::now();
        match res {
            // The origin's answer, or a queued route's `202 Accepted` (its body
            // is the message's status, not the origin's).
            Ok(a)
                if a.status.is_success()
                    && (a.body_len == super::roles::ORIGIN_BODY.len()
                        || a.status == StatusCode::ACCEPTED) =>
            {
                counts.ok_total += 1;
                if a.replayed {
                    counts.replayed += 1;
                }
                if t1 >= ws && t1 < we {
                    counts.ok += 1;
                    hist.saturating_record((t1 - t0).as_micros() as u64);
                }
            }
            Ok(a) => counts.error(format!(
                "{} {} ({} body bytes)",
                a.status.as_u16(),
                a.code.unwrap_or_default(),
                a.body_len
            )),
            Err(e) => {
                counts.error(format!("transport: {e}"));
                sender = None;
            }
        }
    }
    (counts, hist)
}

/// Runs a plan: connects, warms up, measures, stops, closes the connections.
pub async fn run(plan: &Plan) -> Outcome {
    let start = Instant::now();
    let ws = start + plan.warmup;
    let we = ws + plan.measure;
    let tasks: Vec<_> = (0..plan.conns)
        .map(|i| tokio::spawn(conn_task(plan.addr, i, plan.make.clone(), (ws, we))))
        .collect();
    tokio::time::sleep_until(ws).await;
    let probe0 = match &plan.probe {
        Some(p) => p().await,
        None => vec![],
    };
    let cpu0: Vec<f64> = plan
        .pids
        .iter()
        .map(|p| super::procs::cpu_secs(*p))
        .collect();
    let tree0: Vec<BTreeMap<String, f64>> = plan
        .trees
        .iter()
        .map(|p| super::procs::tree_cpu_secs(*p))
        .collect();
    let t0 = std::time::Instant::now();
    tokio::time::sleep_until(we).await;
    let cpu1: Vec<f64> = plan
        .pids
        .iter()
        .map(|p| super::procs::cpu_secs(*p))
        .collect();
    let tree1: Vec<BTreeMap<String, f64>> = plan
        .trees
        .iter()
        .map(|p| super::procs::tree_cpu_secs(*p))
        .collect();
    let secs = t0.elapsed().as_secs_f64();
    let probe1 = match &plan.probe {
        Some(p) => p().await,
        None => vec![],
    };
    let mut counts = Counts::default();
    let mut hist = histogram();
    for t in tasks {
        if let Ok((c, h)) = t.await {
            counts.merge(c);
            let _ = hist.add(h);
        }
    }
    Outcome {
        counts,
        hist,
        secs,
        cpu: cpu1.iter().zip(&cpu0).map(|(b, a)| b - a).collect(),
        tree_cpu: tree1
            .iter()
            .zip(&tree0)
            .map(|(b, a)| {
                // Over both readings' kinds: a process gone by the end moved its
                // time into its parent's (the kind's difference goes negative,
                // the parent's covers it; the sum is right).
                let get = |m: &BTreeMap<String, f64>, k: &str| m.get(k).copied().unwrap_or(0.0);
                a.keys()
                    .chain(b.keys())
                    .map(|k| (k.clone(), get(b, k) - get(a, k)))
                    .collect()
            })
            .collect(),
        probe: if probe0.len() == probe1.len() {
            probe1.iter().zip(&probe0).map(|(b, a)| b - a).collect()
        } else {
            vec![]
        },
    }
}

/// `GET path` on a fresh connection; the body as text.
pub async fn get_text(addr: SocketAddr, path: &str) -> Result<String, String> {
    let mut s = connect(addr).await?;
    let req = Request::builder()
        .uri(path)
        .header("host", "bench.local")
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    s.ready().await.map_err(|e| e.to_string())?;
    let resp = s.send_request(req).await.map_err(|e| e.to_string())?;
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// The value of an unlabelled sample `name` in Prometheus text.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let rest = l.strip_prefix(name)?;
        // prometheus-client writes `name{} v` for an empty label set.
        let rest = rest.strip_prefix("{}").unwrap_or(rest);
        rest.strip_prefix(' ')?.trim().parse().ok()
    })
}

/// The cumulative buckets `(le, count)` of histogram `name`.
pub fn buckets(text: &str, name: &str) -> Vec<(f64, f64)> {
    // Summed over the other labels (a histogram per route).
    let prefix = format!("{name}_bucket{{");
    let mut out: Vec<(f64, f64)> = Vec::new();
    for l in text.lines() {
        let Some(rest) = l.strip_prefix(&prefix) else {
            continue;
        };
        let Some((labels, count)) = rest.split_once('}') else {
            continue;
        };
        let Some(le) = labels
            .split(',')
            .find_map(|kv| kv.strip_prefix("le=\""))
            .and_then(|v| v.strip_suffix('"'))
        else {
            continue;
        };
        let le = if le == "+Inf" {
            f64::INFINITY
        } else {
            let Ok(le) = le.parse() else { continue };
            le
        };
        let Ok(count) = count.trim().parse::<f64>() else {
            continue;
        };
        match out.iter_mut().find(|(l, _)| *l == le) {
            Some((_, c)) => *c += count,
            None => out.push((le, count)),
        }
    }
    out
}

/// The upper bound of the bucket holding quantile `q` of the difference
/// `after - before` of two scrapes of one histogram.
pub fn bucket_quantile(before: &[(f64, f64)], after: &[(f64, f64)], q: f64) -> Option<f64> {
    let delta: Vec<(f64, f64)> = after
        .iter()
        .map(|(le, c)| {
            let b = before
                .iter()
                .find(|(l, _)| l == le)
                .map_or(0.0, |(_, c)| *c);
            (*le, c - b)
        })
        .collect();
    let total = delta.last()?.1;
    if total <= 0.0 {
        return None;
    }
    delta
        .iter()
        .find(|(_, c)| *c >= q * total)
        .map(|(le, _)| *le)
}
