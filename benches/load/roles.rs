//! The helper processes, run by re-executing this binary with `--role`:
//!
//! - `origin`: answers every request with the same 100-byte body; with
//!   `x-bench-bytes: N`, N bytes streamed in 256 KiB chunks (made as they are
//!   sent); with `x-bench-events: N`, N server-sent events 100 ms apart.
//! - `passthrough --upstream ADDR`: the reference a proxy is compared with — a bare
//!   hyper HTTP/1.1 server that forwards every request to ADDR through
//!   [`fencegate::forward::client`]'s hyper-util pool (nodelay, 60 s idle, the same
//!   connector; what fencegate uses for HTTPS upstreams, and used for plain-HTTP
//!   ones before it drove their connections in the request's task, issue 47) and
//!   streams the answer back. No route, no checks, no state.
//!
//! Each prints `{"event":"listening","proxy":ADDR}` on stdout when ready, like
//! fencegate, and runs on a multi-threaded tokio runtime, like fencegate (one
//! worker when pinned to one CPU).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Either, Full};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

/// The origin's answer: exactly 100 bytes.
pub const ORIGIN_BODY: &[u8; 100] =
    b"{\"ok\":true,\"id\":\"ch_0123456789abcdef\",\"amount\":4200,\"currency\":\"eur\",\"pad\":\"xxxxxxxxxxxxxxxxxxxxxx\"}";

pub fn run(args: &[String]) -> Result<(), String> {
    let role = args.first().map(String::as_str).unwrap_or("");
    let mut rt = if std::env::var("BENCH_RT").as_deref() == Ok("current") {
        tokio::runtime::Builder::new_current_thread()
    } else {
        tokio::runtime::Builder::new_multi_thread()
    };
    let rt = rt.enable_all().build().map_err(|e| e.to_string())?;
    match role {
        "origin" => {
            // `--port P`: a port chosen beforehand (the queue backlog's
            // destination, unreachable until this origin starts on it).
            let port = args
                .iter()
                .position(|a| a == "--port")
                .and_then(|i| args.get(i + 1))
                .and_then(|a| a.parse().ok())
                .unwrap_or(0);
            rt.block_on(origin(port))
        }
        "passthrough" => {
            let upstream: SocketAddr = args
                .iter()
                .position(|a| a == "--upstream")
                .and_then(|i| args.get(i + 1))
                .and_then(|a| a.parse().ok())
                .ok_or("passthrough needs --upstream ADDR")?;
            rt.block_on(passthrough(upstream))
        }
        other => Err(format!("unknown role {other:?}")),
    }
}

async fn listen() -> Result<TcpListener, String> {
    listen_on(0).await
}

async fn listen_on(port: u16) -> Result<TcpListener, String> {
    let l = TcpListener::bind(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let addr = l.local_addr().map_err(|e| e.to_string())?;
    println!(
        "{}",
        serde_json::json!({"event": "listening", "proxy": addr.to_string()})
    );
    Ok(l)
}

/// The next connection, with Nagle off (accept errors are retried after a pause).
async fn accept(l: &TcpListener) -> tokio::net::TcpStream {
    loop {
        match l.accept().await {
            Ok((s, _)) => {
                let _ = s.set_nodelay(true);
                return s;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

/// Requests the origin answered (`GET /__bench/count` reads it, uncounted).
static ANSWERED: AtomicU64 = AtomicU64::new(0);

/// The path that reads [`ANSWERED`].
pub const COUNT_PATH: &str = "/__bench/count";

async fn origin(port: u16) -> Result<(), String> {
    let l = listen_on(port).await?;
    loop {
        let s = accept(&l).await;
        tokio::spawn(async move {
            let svc = service_fn(|req: Request<Incoming>| async move {
                if req.uri().path() == COUNT_PATH {
                    let n = ANSWERED.load(Ordering::Relaxed).to_string();
                    return Ok::<_, Infallible>(Response::new(Made::Whole(Some(Bytes::from(n)))));
                }
                ANSWERED.fetch_add(1, Ordering::Relaxed);
                let n = |h: &str| {
                    req.headers()
                        .get(h)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse::<u64>().ok())
                };
                let body = match (n("x-bench-bytes"), n("x-bench-events")) {
                    (Some(left), _) => Made::Bytes(left),
                    (None, Some(events)) => Made::Events(events, None),
                    (None, None) => Made::Whole(Some(Bytes::from_static(ORIGIN_BODY))),
                };
                let _ = req.into_body().collect().await;
                Ok::<_, Infallible>(
                    Response::builder()
                        .header("content-type", "application/json")
                        .body(body)
                        .expect("static response"),
                )
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(s), svc)
                .await;
        });
    }
}

/// The origin's answers, made as they are read.
enum Made {
    Whole(Option<Bytes>),
    /// Bytes left to send.
    Bytes(u64),
    /// Events left, and the pause before the next.
    Events(u64, Option<Pin<Box<tokio::time::Sleep>>>),
}

const CHUNK: Bytes = Bytes::from_static(&[b'b'; 256 << 10]);

impl hyper::body::Body for Made {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match &mut *self {
            Made::Whole(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Made::Bytes(0) | Made::Events(0, _) => Poll::Ready(None),
            Made::Bytes(left) => {
                let n = (*left).min(CHUNK.len() as u64);
                *left -= n;
                Poll::Ready(Some(Ok(Frame::data(CHUNK.slice(..n as usize)))))
            }
            Made::Events(left, pause) => {
                if let Some(p) = pause {
                    if p.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                }
                *left -= 1;
                *pause = Some(Box::pin(tokio::time::sleep(Duration::from_millis(100))));
                Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"data: tick\n\n")))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(
            self,
            Made::Whole(None) | Made::Bytes(0) | Made::Events(0, _)
        )
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        match self {
            Made::Whole(b) => {
                hyper::body::SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64))
            }
            Made::Bytes(n) => hyper::body::SizeHint::with_exact(*n),
            Made::Events(..) => hyper::body::SizeHint::default(),
        }
    }
}

async fn passthrough(upstream: SocketAddr) -> Result<(), String> {
    let tls = fencegate::forward::tls_config(None, None)?;
    let client = fencegate::forward::client(tls, Duration::from_secs(5), usize::MAX);
    let authority: http::uri::Authority = upstream
        .to_string()
        .parse()
        .map_err(|e: http::uri::InvalidUri| e.to_string())?;
    let l = listen().await?;
    loop {
        let s = accept(&l).await;
        let (client, authority) = (client.clone(), authority.clone());
        tokio::spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| {
                let (client, authority) = (client.clone(), authority.clone());
                async move {
                    let (mut parts, body) = req.into_parts();
                    let body = body.collect().await.map(|c| c.to_bytes());
                    let pq = parts
                        .uri
                        .path_and_query()
                        .map_or("/", |p| p.as_str())
                        .to_owned();
                    let uri = Uri::builder()
                        .scheme("http")
                        .authority(authority)
                        .path_and_query(pq)
                        .build();
                    let (Ok(body), Ok(uri)) = (body, uri) else {
                        return Ok::<_, Infallible>(bad_gateway());
                    };
                    parts.uri = uri;
                    parts.headers.remove(http::header::HOST);
                    Ok(
                        match client
                            .request(Request::from_parts(parts, body.into()))
                            .await
                        {
                            Ok(resp) => resp.map(Either::Left),
                            Err(_) => bad_gateway(),
                        },
                    )
                }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(s), svc)
                .await;
        });
    }
}

fn bad_gateway() -> Response<Either<Incoming, Full<Bytes>>> {
    let mut r = Response::new(Either::Right(Full::new(Bytes::from_static(b"bad gateway"))));
    *r.status_mut() = StatusCode::BAD_GATEWAY;
    r
}
