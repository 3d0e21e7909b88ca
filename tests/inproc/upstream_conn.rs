//! The upstream connection driven by its request (src/forward/inline.rs, issue
//! 47), cut at each point that code can see: an upstream that closes a
//! connection while it sits idle, after reading a request it does not answer,
//! and in the middle of an answer. The origin is a raw TCP server scripted per
//! connection, so that the test knows which connection a request came on and
//! when the upstream closed it. SPEC §6: what may have been sent is in doubt and
//! never sent again; what cannot have been sent is sent on another connection.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

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
