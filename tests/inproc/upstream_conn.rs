//! The upstream connection driven by its request (src/forward/inline.rs, issue
//! 47), cut at each point that code can see: an upstream that closes a
//! connection while it sits idle, after reading a request it does not answer,
//! and in the middle of an answer. The origin is a raw TCP server scripted per
//! connection, so that the test knows which connection a request came on and
//! when the upstream closed it. SPEC §6: what may have been sent is in doubt and
//! never sent again; what cannot have been sent is sent on another connection.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};

use crate::support::*;

const LEASE: &str = "billing";

/// What a connection of the scripted origin does with each request it reads.
#[derive(Clone, Copy, Debug)]
enum Step {
    /// Answers `200 ok`, keeping the connection open.
    Answer,
    /// Answers `200 ok`, then closes the connection (no `Connection: close`:
    /// the close comes while fencegate holds the connection idle).
    AnswerAndClose,
    /// Closes without answering.
    Close,
    /// Sends the head and 3 of the 10 bytes it announces, then closes.
    HalfAnswer,
}

/// What the scripted origin saw.
#[derive(Debug, PartialEq)]
enum Seen {
    /// Connection `n` (counted from 0) was accepted.
    Accepted(usize),
    /// Connection `n` read a request with this `Idempotency-Key`.
    Request(usize, String),
    /// Connection `n` was closed by the origin.
    Closed(usize),
}

/// A raw TCP origin: connection `n` runs `scripts[n]` (the last script for any
/// later one), one step per request.
async fn scripted(
    scripts: Vec<Vec<Step>>,
) -> (std::net::SocketAddr, mpsc::UnboundedReceiver<Seen>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        for n in 0.. {
            let Ok((s, _)) = l.accept().await else { return };
            let _ = tx.send(Seen::Accepted(n));
            let script = scripts[n.min(scripts.len() - 1)].clone();
            let tx = tx.clone();
            tokio::spawn(async move {
                serve(n, s, &script, &tx).await;
                let _ = tx.send(Seen::Closed(n));
            });
        }
    });
    (addr, rx)
}

async fn serve(n: usize, mut s: TcpStream, script: &[Step], tx: &mpsc::UnboundedSender<Seen>) {
    for step in script {
        let Some(key) = read_request(&mut s).await else {
            return;
        };
        let _ = tx.send(Seen::Request(n, key));
        let out: &[u8] = match step {
            Step::Answer | Step::AnswerAndClose => {
                b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
            }
            Step::Close => b"",
            Step::HalfAnswer => b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc",
        };
        s.write_all(out).await.unwrap();
        if !matches!(step, Step::Answer) {
            return; // Dropped: closed.
        }
    }
}

/// Reads one request (head and `content-length` body); its `Idempotency-Key`.
async fn read_request(s: &mut TcpStream) -> Option<String> {
    let mut buf = Vec::new();
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let mut chunk = [0u8; 4096];
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let field = |name: &str| {
        head.lines()
            .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_owned()))
    };
    let len: usize = field("content-length:").map_or(0, |v| v.parse().unwrap());
    while buf.len() < head_end + len {
        let mut chunk = [0u8; 4096];
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Some(field("idempotency-key:").unwrap_or_default())
}

async fn next(seen: &mut mpsc::UnboundedReceiver<Seen>) -> Seen {
    tokio::time::timeout(Duration::from_secs(30), seen.recv())
        .await
        .expect("the origin saw nothing within 30 s")
        .expect("the origin stopped")
}

async fn gate(origin: std::net::SocketAddr) -> Fencegate {
    Fencegate::start(
        60_000,
        &format!(
            "[[route]]\nname = \"billing\"\npath_prefix = \"/billing/\"\nupstream = \"http://{origin}/v1/\"\nlease = \"{LEASE}\"\ntimeout_ms = 10000\n"
        ),
    )
    .await
}

async fn charge(fg: &Fencegate, h: &fencegate::lease::acquire::Holding, key: &str) -> Reply {
    send(
        worker_req(&fg.url("/billing/charge"), h.epoch.get(), &h.token)
            .header("idempotency-key", key)
            .body(body(key))
            .unwrap(),
    )
    .await
}

/// A connection is kept and used again: five requests, one connection.
#[tokio::test]
async fn one_connection_carries_requests_one_after_another() {
    let (addr, mut seen) = scripted(vec![vec![Step::Answer; 5]]).await;
    let fg = gate(addr).await;
    let a = acquire(&fg.epochs, LEASE, "worker-a", Duration::from_secs(60)).await;
    for i in 0..5 {
        let key = format!("k{i}");
        let r = charge(&fg, &a, &key).await;
        assert_eq!(r.status, 200, "{key}: {}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.body.as_ref(), b"ok");
        if i == 0 {
            assert_eq!(next(&mut seen).await, Seen::Accepted(0));
        }
        assert_eq!(next(&mut seen).await, Seen::Request(0, key));
    }
}

/// An upstream that closes each connection after its answer, while fencegate
/// holds it idle: the next request goes on a new connection, is sent once and
/// answered — not in doubt. Fails when an idle connection is reused without
/// first reading what arrived on it (the close).
#[tokio::test]
async fn a_connection_the_upstream_closed_while_idle_is_not_used_again() {
    let (addr, mut seen) = scripted(vec![vec![Step::AnswerAndClose]]).await;
    let fg = gate(addr).await;
    let a = acquire(&fg.epochs, LEASE, "worker-a", Duration::from_secs(60)).await;
    for i in 0..10 {
        let key = format!("k{i}");
        let r = charge(&fg, &a, &key).await;
        assert_eq!(r.status, 200, "{key}: {}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.body.as_ref(), b"ok");
        assert_eq!(next(&mut seen).await, Seen::Accepted(i));
        assert_eq!(next(&mut seen).await, Seen::Request(i, key));
        // The close has happened before the next request is sent.
        assert_eq!(next(&mut seen).await, Seen::Closed(i));
    }
}

/// A reused connection that the upstream closes after reading the request: in
/// doubt (504 `upstream_timeout`), not sent again on another connection, and a
/// retry of the key is refused. Fails when a request that may have been written
/// is retried like one given back unsent.
#[tokio::test]
async fn a_request_read_then_closed_on_a_reused_connection_is_in_doubt() {
    let (addr, mut seen) =
        scripted(vec![vec![Step::Answer, Step::Close], vec![Step::Answer]]).await;
    let fg = gate(addr).await;
    let a = acquire(&fg.epochs, LEASE, "worker-a", Duration::from_secs(60)).await;
    assert_eq!(charge(&fg, &a, "first").await.status, 200);
    assert_eq!(next(&mut seen).await, Seen::Accepted(0));
    assert_eq!(next(&mut seen).await, Seen::Request(0, "first".into()));
    let r = charge(&fg, &a, "second").await;
    r.assert_error(504, "upstream_timeout");
    assert_eq!(next(&mut seen).await, Seen::Request(0, "second".into()));
    assert_eq!(next(&mut seen).await, Seen::Closed(0));
    charge(&fg, &a, "second")
        .await
        .assert_error(409, "dedup_in_doubt");
    // Nothing else reached the origin: a new key opens the next connection.
    assert_eq!(charge(&fg, &a, "third").await.status, 200);
    assert_eq!(next(&mut seen).await, Seen::Accepted(1));
    assert_eq!(next(&mut seen).await, Seen::Request(1, "third".into()));
}

/// An answer cut in the middle of its body: in doubt, and the broken connection
/// is not given back to the pool (the next request opens a new one).
#[tokio::test]
async fn an_answer_cut_mid_body_is_in_doubt_and_its_connection_dropped() {
    let (addr, mut seen) = scripted(vec![vec![Step::HalfAnswer], vec![Step::Answer]]).await;
    let fg = gate(addr).await;
    let a = acquire(&fg.epochs, LEASE, "worker-a", Duration::from_secs(60)).await;
    charge(&fg, &a, "cut")
        .await
        .assert_error(504, "upstream_timeout");
    assert_eq!(next(&mut seen).await, Seen::Accepted(0));
    assert_eq!(next(&mut seen).await, Seen::Request(0, "cut".into()));
    assert_eq!(next(&mut seen).await, Seen::Closed(0));
    charge(&fg, &a, "cut")
        .await
        .assert_error(409, "dedup_in_doubt");
    assert_eq!(charge(&fg, &a, "after").await.status, 200);
    assert_eq!(next(&mut seen).await, Seen::Accepted(1));
    assert_eq!(next(&mut seen).await, Seen::Request(1, "after".into()));
}

/// Reads a request head (for the streaming origin below); returns (head text, bytes read past it).
async fn read_head(s: &mut (impl AsyncReadExt + Unpin)) -> Option<(String, Vec<u8>)> {
    let mut buf = Vec::new();
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..i + 4]).to_ascii_lowercase();
            return Some((head, buf[i + 4..].to_vec()));
        }
        let mut chunk = [0u8; 4096];
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn field(head: &str, name: &str) -> Option<String> {
    head.lines()
        .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_owned()))
}

/// Serves any later connection: answers every request `200 ok` (keep-alive).
async fn answer_all(mut s: TcpStream, seen: mpsc::UnboundedSender<String>) {
    loop {
        let Some((head, mut rest)) = read_head(&mut s).await else {
            return;
        };
        let len: usize = field(&head, "content-length:").map_or(0, |v| v.parse().unwrap());
        while rest.len() < len {
            let mut c = [0u8; 65536];
            match s.read(&mut c).await {
                Ok(0) | Err(_) => return,
                Ok(n) => rest.extend_from_slice(&c[..n]),
            }
        }
        let _ = seen.send(field(&head, "x-lease-epoch:").unwrap_or_default());
        if s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            .await
            .is_err()
        {
            return;
        }
    }
}

/// SPEC §5: a drain abort cuts the upstream connection (a reset, the kernel's
/// queued bytes dropped) even when nobody polls it: A's upstream answered early
/// with an endless stream, A's worker stopped reading it (so the task that
/// would read the answer is stuck writing to the worker) and A's upload is
/// still in progress. After the abort (B answered) the origin reads A's
/// connection: it must end (reset or EOF), not stay open. Found by the
/// review of the connection driven by its request: the cut only woke a task
/// that never came back to poll it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_abort_cuts_a_connection_whose_answer_nobody_reads() {
    const SIZE: usize = 64 << 20;
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (release_tx, release_rx) = oneshot::channel::<()>();
    let (res_tx, res_rx) = oneshot::channel::<(usize, usize, String, Duration)>();
    let (head_tx, head_rx) = oneshot::channel::<()>();
    let (seen_tx, mut seen_rx) = mpsc::unbounded_channel();
    let streamed = Arc::new(AtomicUsize::new(0));
    let counted = streamed.clone();
    tokio::spawn(async move {
        let streamed = counted;
        let (mut s, _) = l.accept().await.unwrap();
        tokio::spawn(async move {
            let (_head, rest) = read_head(&mut s).await.unwrap();
            s.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                .await
                .unwrap();
            let _ = head_tx.send(());
            let (mut r, mut w) = s.into_split();
            tokio::spawn(async move {
                let chunk = format!("{:x}\r\n{}\r\n", 65536, "e".repeat(65536));
                while w.write_all(chunk.as_bytes()).await.is_ok() {
                    streamed.fetch_add(chunk.len(), Ordering::Relaxed);
                }
            });
            let _ = release_rx.await;
            let released = Instant::now();
            let mut n = rest.len();
            let before = n;
            let end = loop {
                let mut c = vec![0u8; 1 << 16];
                match tokio::time::timeout(Duration::from_secs(5), r.read(&mut c)).await {
                    Err(_) => break "still open, nothing for 5 s".to_string(),
                    Ok(Ok(0)) => break "eof".to_string(),
                    Ok(Ok(k)) => n += k,
                    Ok(Err(e)) => break format!("error {e}"),
                }
            };
            let _ = res_tx.send((before, n, end, released.elapsed()));
        });
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            tokio::spawn(answer_all(s, seen_tx.clone()));
        }
    });
    let fg = Fencegate::start(
        60_000,
        &format!(
            "[[route]]\nname = \"billing\"\npath_prefix = \"/billing/\"\nupstream = \"http://{addr}/v1/\"\nlease = \"{LEASE}\"\ntimeout_ms = 60000\ndrain_timeout_ms = 300\nderive_key = \"none\"\nmax_body_bytes = 134217728\n"
        ),
    )
    .await;
    let a = acquire(&fg.epochs, LEASE, "worker-a", Duration::from_secs(60)).await;
    // Worker A: raw TCP, writes its head and body, never reads.
    let mut ws = TcpStream::connect(fg.proxy).await.unwrap();
    let head = format!(
        "POST /billing/up HTTP/1.1\r\nhost: fg\r\nx-lease-epoch: {}\r\nx-lease-token: {}\r\ncontent-length: {SIZE}\r\n\r\n",
        a.epoch.get(),
        a.token
    );
    ws.write_all(head.as_bytes()).await.unwrap();
    let (_wr, mut ww) = ws.into_split();
    let writer = tokio::spawn(async move {
        let buf = vec![b'a'; 1 << 16];
        let mut sent = 0;
        while sent < SIZE {
            if ww.write_all(&buf).await.is_err() {
                break;
            }
            sent += buf.len();
        }
        (sent, ww)
    });
    tokio::time::timeout(Duration::from_secs(20), head_rx)
        .await
        .unwrap()
        .unwrap();
    // The buffers toward worker A are full: the origin's stream has stalled.
    let mut last = (streamed.load(Ordering::Relaxed), Instant::now());
    while last.1.elapsed() < Duration::from_millis(500) {
        assert!(
            last.0 < 1 << 30,
            "the stream toward a worker that does not read never stalled"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = streamed.load(Ordering::Relaxed);
        if now != last.0 {
            last = (now, Instant::now());
        }
    }
    let b = force_next_epoch(&fg.epochs, LEASE, "worker-b", Duration::from_secs(60)).await;
    let r = post(&fg, "/billing/x", &b, "B").await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(seen_rx.recv().await.unwrap(), b.epoch.get().to_string());
    assert_eq!(fg.metric_sum("fencegate_drains_aborted_total").await, 1.0);
    // B has been answered: A was aborted. Now the origin reads A's body.
    release_tx.send(()).unwrap();
    let (before, n, end, took) = tokio::time::timeout(Duration::from_secs(30), res_rx)
        .await
        .unwrap()
        .unwrap();
    eprintln!(
        "origin: A's body read before the abort {before}, in all {n} of {SIZE}; the connection ended: {end} after {took:?}"
    );
    writer.abort();
    assert!(
        !end.starts_with("still open"),
        "the aborted exchange's upstream connection was not cut: the origin read {n} bytes of A after the abort and the connection is still open ({end})"
    );
}
