//! Bad input over raw TCP (SPEC §7: bad input never crashes the process, never
//! leaves a lock held, never changes HWM or dedup state).
//!
//! Every request below carries a valid epoch and token, so the malformation is
//! the only possible reason for a refusal. Each must end in a 4xx or a closed
//! connection, nothing may reach the origin, the mark must not move, and the
//! process must still serve a valid request afterwards.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::*;

/// `[server]` keys (they follow the harness's own `[server]` lines).
const SERVER_KEYS: &str = "header_read_timeout_ms = 500\nmax_connections = 512\n";
/// The route's timeout: how long fencegate waits for a request body.
const ROUTE_TIMEOUT: Duration = Duration::from_millis(1000);
/// How long a case may take before its connection counts as left open.
const CASE_DEADLINE: Duration = Duration::from_secs(5);

/// How a case's bytes go on the wire.
enum Delivery {
    /// Everything at once; the connection stays open for the answer.
    Whole(Vec<u8>),
    /// Everything at once, then our write side is shut (EOF mid-message).
    WholeThenEof(Vec<u8>),
    /// `prefix` at once, then one byte of `drip` every `every` (then silence).
    Dribble {
        prefix: Vec<u8>,
        drip: Vec<u8>,
        every: Duration,
    },
    /// Connect and send nothing.
    Silent,
}

/// What the case must get.
#[derive(Debug, Clone, Copy)]
enum Expect {
    /// A 4xx or a closed connection, with nothing admitted.
    Refused,
    /// The connection closed (a 408 or 400 first is fine) within `within`.
    ClosedWithin(Duration),
}

struct Case {
    name: &'static str,
    delivery: Delivery,
    expect: Expect,
}

/// What came back.
#[derive(Debug)]
struct Answer {
    status: Option<u16>,
    code: Option<String>,
    responses: usize,
    /// EOF or reset before the deadline.
    closed: bool,
    reset: bool,
    elapsed: Duration,
}

impl Answer {
    fn describe(&self) -> String {
        let how = match (self.closed, self.reset) {
            (false, _) => "left open",
            (true, true) => "reset",
            (true, false) => "closed",
        };
        match self.status {
            Some(s) => format!(
                "{s}{} then {how} after {} ms",
                self.code
                    .as_deref()
                    .map(|c| format!(" {c}"))
                    .unwrap_or_default(),
                self.elapsed.as_millis()
            ),
            None => format!("no response, {how} after {} ms", self.elapsed.as_millis()),
        }
    }
}

fn parse_answer(out: &[u8]) -> (Option<u16>, Option<String>, usize) {
    let text = String::from_utf8_lossy(out);
    let responses = text.matches("HTTP/1.1 ").count();
    let status = text
        .strip_prefix("HTTP/1.1 ")
        .and_then(|r| r.get(..3))
        .and_then(|s| s.parse().ok());
    let code = text
        .split("\r\n\r\n")
        .next()
        .unwrap_or("")
        .lines()
        .find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.eq_ignore_ascii_case("x-fencegate-error")
                .then(|| v.trim().to_owned())
        });
    (status, code, responses)
}

/// Runs one delivery on a fresh connection and reads until EOF, reset or deadline.
async fn exchange(addr: SocketAddr, delivery: &Delivery) -> Answer {
    let started = Instant::now();
    let stream = TcpStream::connect(addr)
        .await
        .expect("connect to fencegate");
    let (mut rd, mut wr) = stream.into_split();
    let (first, eof, drip, every) = match delivery {
        Delivery::Whole(b) => (b.clone(), false, Vec::new(), Duration::ZERO),
        Delivery::WholeThenEof(b) => (b.clone(), true, Vec::new(), Duration::ZERO),
        Delivery::Dribble {
            prefix,
            drip,
            every,
        } => (prefix.clone(), false, drip.clone(), *every),
        Delivery::Silent => (Vec::new(), false, Vec::new(), Duration::ZERO),
    };
    // The writer may fail once the server has closed: that is an answer too.
    let writer = tokio::spawn(async move {
        if wr.write_all(&first).await.is_err() {
            return;
        }
        if eof {
            let _ = wr.shutdown().await;
        }
        let mut tick = tokio::time::interval(every.max(Duration::from_millis(1)));
        tick.tick().await;
        for b in drip {
            tick.tick().await;
            if wr.write_all(&[b]).await.is_err() {
                return;
            }
        }
        // Hold the write side open (no EOF) until the reader is done.
        std::future::pending::<()>().await;
    });
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    let deadline = tokio::time::Instant::now() + CASE_DEADLINE;
    let (closed, reset) = loop {
        match tokio::time::timeout_at(deadline, rd.read(&mut buf)).await {
            Err(_) => break (false, false),
            Ok(Ok(0)) => break (true, false),
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Ok(Err(_)) => break (true, true),
        }
    };
    let elapsed = started.elapsed();
    writer.abort();
    let (status, code, responses) = parse_answer(&out);
    Answer {
        status,
        code,
        responses,
        closed,
        reset,
        elapsed,
    }
}

/// Builds the raw requests of one test run around a valid epoch and token.
struct Wire {
    auth: String,
}

impl Wire {
    /// `POST {path}` with a valid epoch and token, `extra` header lines (each
    /// ending in CRLF) and `Connection: close`, up to and including the blank line.
    fn head(&self, path: &str, extra: &str) -> Vec<u8> {
        format!(
            "POST {path} HTTP/1.1\r\nHost: fencegate.test\r\n{}{extra}Connection: close\r\n\r\n",
            self.auth
        )
        .into_bytes()
    }

    fn with_body(&self, extra: &str, body: &[u8]) -> Vec<u8> {
        let mut v = self.head("/billing/x", extra);
        v.extend_from_slice(body);
        v
    }

    /// A complete, valid request with a 5-byte body, in which `from` is replaced by `to`.
    fn mutate(&self, from: &str, to: &[u8]) -> Vec<u8> {
        let valid = self.with_body("Content-Length: 5\r\nX-Note: ok\r\n", b"hello");
        let at = valid
            .windows(from.len())
            .position(|w| w == from.as_bytes())
            .unwrap_or_else(|| panic!("{from:?} not in the template"));
        let mut v = valid[..at].to_vec();
        v.extend_from_slice(to);
        v.extend_from_slice(&valid[at + from.len()..]);
        v
    }
}

fn cases(w: &Wire) -> Vec<Case> {
    use Delivery::*;
    use Expect::*;
    let refused = |name, bytes| Case {
        name,
        delivery: Whole(bytes),
        expect: Refused,
    };
    let many_headers: String = (0..120).map(|i| format!("X-Filler-{i}: v\r\n")).collect();
    let huge_header = format!("X-Huge: {}\r\n", "a".repeat(200 * 1024));
    let huge_uri = format!("/billing/{}", "u".repeat(70_000));
    vec![
        // Transfer-Encoding / Content-Length disagreements hyper refuses outright.
        refused(
            "TE chunked, then TE identity (TE.TE obfuscation)",
            w.with_body(
                "Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\nContent-Length: 5\r\n",
                b"hello",
            ),
        ),
        refused(
            "TE 'chunked, identity' (chunked not last)",
            w.with_body("Transfer-Encoding: chunked, identity\r\n", b"5\r\nhello\r\n0\r\n\r\n"),
        ),
        refused(
            "TE xchunked next to Content-Length",
            w.with_body("Transfer-Encoding: xchunked\r\nContent-Length: 5\r\n", b"hello"),
        ),
        refused(
            "TE with a space before the colon",
            w.with_body("Transfer-Encoding : chunked\r\nContent-Length: 5\r\n", b"hello"),
        ),
        refused(
            "TE chunked in an HTTP/1.0 request",
            String::from_utf8(w.with_body(
                "Transfer-Encoding: chunked\r\n",
                b"5\r\nhello\r\n0\r\n\r\n",
            ))
            .unwrap()
            .replacen("HTTP/1.1", "HTTP/1.0", 1)
            .into_bytes(),
        ),
        refused(
            "duplicate differing Content-Length",
            w.with_body("Content-Length: 5\r\nContent-Length: 6\r\n", b"hello!"),
        ),
        refused(
            "Content-Length list with differing values",
            w.with_body("Content-Length: 5, 6\r\n", b"hello!"),
        ),
        refused("signed Content-Length", w.mutate("Content-Length: 5", b"Content-Length: +5")),
        refused(
            "Content-Length beyond u64",
            w.mutate("Content-Length: 5", b"Content-Length: 99999999999999999999999"),
        ),
        // Header syntax.
        refused(
            "obs-fold continuation of an ordinary header",
            w.mutate("X-Note: ok\r\n", b"X-Note: ok\r\n  folded\r\n"),
        ),
        refused(
            "obs-fold continuation of X-Lease-Epoch",
            {
                let epoch_line = w.auth.lines().next().unwrap().to_owned();
                let (name, value) = epoch_line.split_once(": ").unwrap();
                w.mutate(&epoch_line, format!("{name}:\r\n {value}").as_bytes())
            },
        ),
        refused("header line without a colon", w.mutate("X-Note: ok", b"X-Note ok")),
        refused("empty header name", w.mutate("X-Note: ok", b": ok")),
        refused("NUL in a header value", w.mutate("X-Note: ok", b"X-Note: o\0k")),
        refused("DEL in a header value", w.mutate("X-Note: ok", b"X-Note: o\x7fk")),
        refused("bare CR in a header value", w.mutate("X-Note: ok", b"X-Note: o\rk")),
        refused("NUL in a header name", w.mutate("X-Note: ok", b"X-N\0te: ok")),
        refused("DEL in a header name", w.mutate("X-Note: ok", b"X-N\x7fte: ok")),
        refused("non-ASCII in a header name", w.mutate("X-Note: ok", "X-Nöte: ok".as_bytes())),
        refused("space inside a header name", w.mutate("X-Note: ok", b"X Note: ok")),
        // Request line.
        refused("NUL in the request target", w.mutate("/billing/x", b"/billing/\0x")),
        refused("space inside the request target", w.mutate("/billing/x", b"/billing/ x")),
        refused("non-token method", w.mutate("POST", b"PO(ST")),
        refused("unknown HTTP version", w.mutate("HTTP/1.1", b"HTTP/1.7")),
        // Line endings (bare LF as the line terminator of the head: see
        // `ambiguous_framing_is_normalized_never_smuggled`).
        refused(
            "bare LF after a chunk size",
            w.with_body("Transfer-Encoding: chunked\r\n", b"5\nhello\r\n0\r\n\r\n"),
        ),
        // Chunked framing.
        refused(
            "chunk-size overflow ffffffffffffffffff",
            w.with_body(
                "Transfer-Encoding: chunked\r\n",
                b"ffffffffffffffffff\r\nhello\r\n0\r\n\r\n",
            ),
        ),
        refused(
            "chunk-size not hex",
            w.with_body("Transfer-Encoding: chunked\r\n", b"zz\r\nhello\r\n0\r\n\r\n"),
        ),
        refused(
            "chunk data longer than its size",
            w.with_body("Transfer-Encoding: chunked\r\n", b"3\r\nhello\r\n0\r\n\r\n"),
        ),
        Case {
            name: "chunked body cut off by EOF",
            delivery: WholeThenEof(w.with_body("Transfer-Encoding: chunked\r\n", b"5\r\nhel")),
            expect: Refused,
        },
        Case {
            name: "body shorter than Content-Length, then EOF",
            delivery: WholeThenEof(w.with_body("Content-Length: 50\r\n", b"hello")),
            expect: Refused,
        },
        // Limits.
        refused(
            "more than 100 headers",
            w.with_body(&format!("{many_headers}Content-Length: 5\r\n"), b"hello"),
        ),
        refused(
            "header block over 128 KiB",
            w.with_body(&format!("{huge_header}Content-Length: 5\r\n"), b"hello"),
        ),
        refused("URI over 65534 bytes", {
            let mut v = w.head(&huge_uri, "Content-Length: 5\r\n");
            v.extend_from_slice(b"hello");
            v
        }),
        refused("HTTP/2 preface followed by garbage", {
            let mut v = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
            v.extend_from_slice(&[0xff; 64]);
            v
        }),
        // Slow clients.
        Case {
            name: "silent connection (no bytes at all)",
            delivery: Silent,
            expect: ClosedWithin(Duration::from_secs(3)),
        },
        Case {
            name: "slowloris: request head dribbled one byte per 20 ms",
            delivery: Dribble {
                prefix: b"POST /billing/x HTTP/1.1\r\n".to_vec(),
                drip: format!("{}X-Pad: {}\r\n", w.auth, "p".repeat(400)).into_bytes(),
                every: Duration::from_millis(20),
            },
            expect: ClosedWithin(Duration::from_secs(3)),
        },
        Case {
            name: "slowloris: partial HTTP/2 preface, then silence",
            delivery: Dribble {
                prefix: b"PRI * HTTP/2.0\r\n".to_vec(),
                drip: Vec::new(),
                every: Duration::ZERO,
            },
            expect: ClosedWithin(Duration::from_secs(3)),
        },
        Case {
            name: "slowloris: body shorter than Content-Length, connection kept open",
            delivery: Whole(w.with_body("Content-Length: 100\r\n", b"only ten..")),
            expect: ClosedWithin(ROUTE_TIMEOUT + Duration::from_secs(2)),
        },
        Case {
            name: "slowloris: body dribbled one byte per 50 ms",
            delivery: Dribble {
                prefix: w.head("/billing/x", "Content-Length: 200\r\n"),
                drip: vec![b'b'; 200],
                every: Duration::from_millis(50),
            },
            expect: ClosedWithin(ROUTE_TIMEOUT + Duration::from_secs(2)),
        },
    ]
}

/// Codes that judge the epoch or token. Both are valid here, so one of these would
/// mean the malformation went unnoticed (or mangled them) instead of refusing it.
const ADMISSION_CODES: &[&str] = &[
    "epoch_missing",
    "epoch_malformed",
    "epoch_stale",
    "epoch_unknown",
    "epoch_invalid",
    "token_missing",
    "token_invalid",
    "lease_expired",
];

async fn lease_mark(fg: &Fencegate) -> (u64, u64) {
    let v = fg.admin_json("/v1/leases").await;
    let l = v["leases"]
        .as_array()
        .and_then(|a| a.iter().find(|l| l["lease"] == "billing"))
        .cloned()
        .unwrap_or_else(|| panic!("no billing lease in {v}"));
    (
        l["high_water_mark"].as_u64().unwrap(),
        l["in_flight"].as_u64().unwrap(),
    )
}

/// A fencegate with one route to `origin`, and a valid holding of its lease.
async fn setup() -> (Origin, Fencegate, fencegate::lease::acquire::Holding, Wire) {
    let origin = Origin::start().await;
    let fg = Fencegate::start_with(
        Setup {
            server: SERVER_KEYS,
            ..Setup::default()
        },
        &route_toml(
            "billing",
            "billing",
            &origin,
            &format!("timeout_ms = {}", ROUTE_TIMEOUT.as_millis()),
        ),
    )
    .await;
    let a = acquire(&fg.epochs, "billing", "corpus", Duration::from_secs(60)).await;
    let w = Wire {
        auth: format!(
            "X-Lease-Epoch: {}\r\nX-Lease-Token: {}\r\n",
            a.epoch.get(),
            a.token
        ),
    };
    (origin, fg, a, w)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_are_refused_and_reach_nothing() {
    let (origin, fg, a, w) = setup().await;

    let mut report = Vec::new();
    let mut failures = Vec::new();
    let mut seen = 0;
    for case in cases(&w) {
        let ans = exchange(fg.proxy, &case.delivery).await;
        report.push(format!("{:<68} {}", case.name, ans.describe()));
        let refused_status = ans.status.is_some_and(|s| (400..500).contains(&s));
        let ok = match case.expect {
            Expect::Refused => {
                (refused_status || (ans.status.is_none() && ans.closed)) && ans.responses <= 1
            }
            Expect::ClosedWithin(limit) => {
                ans.closed
                    && ans.elapsed <= limit
                    && (ans.status.is_none() || refused_status)
                    && ans.responses <= 1
            }
        };
        let admitted = ans
            .code
            .as_deref()
            .is_some_and(|c| ADMISSION_CODES.contains(&c));
        if !ok || admitted {
            failures.push(format!("{}: {} ({ans:?})", case.name, ans.describe()));
        }
        if origin.count() != seen {
            failures.push(format!(
                "{}: reached the origin: {:?}",
                case.name,
                &origin.log()[seen..]
            ));
            seen = origin.count();
        }
    }
    println!("corpus answers:\n  {}", report.join("\n  "));
    assert!(failures.is_empty(), "{}", failures.join("\n"));

    // Nothing was admitted: the mark never moved and nothing is in flight.
    assert_eq!(lease_mark(&fg).await, (0, 0));
    assert_eq!(origin.count(), 0);
    // And the process still serves the same epoch and token.
    let r = post(&fg, "/billing/after-corpus", &a, "valid").await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(origin.count(), 1);
    assert_eq!(origin.log()[0].path, "/v1/after-corpus");
    assert_eq!(lease_mark(&fg).await.0, a.epoch.get());
}

/// Framing that RFC 9112 lets a server accept: both Content-Length and
/// Transfer-Encoding (§6.3: Transfer-Encoding wins, then the connection must be
/// closed) and a bare LF as line terminator (§2.2). hyper 1.12 accepts both, and
/// fencegate never sees the raw framing, so these requests are admitted. What
/// must hold: one answer, then the connection closes; the origin sees at most
/// fencegate's own re-framing of the chunked reading (Content-Length, no
/// Transfer-Encoding) and never the smuggled second request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ambiguous_framing_is_normalized_never_smuggled() {
    let (origin, fg, _a, w) = setup().await;
    let smuggled = format!(
        "POST /billing/smuggled HTTP/1.1\r\nHost: fencegate.test\r\n{}Content-Length: 0\r\n\r\n",
        w.auth
    );
    // No `Connection: close` here: if the connection stayed open, the smuggled
    // request would be read next.
    let head = |path: &str, framing: &str| {
        format!(
            "POST {path} HTTP/1.1\r\nHost: fencegate.test\r\n{}{framing}\r\n",
            w.auth
        )
    };
    let cl_te = format!(
        "{}0\r\n\r\n{smuggled}",
        head(
            "/billing/cl-te",
            &format!(
                "Content-Length: {}\r\nTransfer-Encoding: chunked\r\n",
                5 + smuggled.len()
            )
        )
    );
    let te_cl = format!(
        "{}{:x}\r\n{smuggled}\r\n0\r\n\r\n",
        head(
            "/billing/te-cl",
            "Transfer-Encoding: chunked\r\nContent-Length: 4\r\n"
        ),
        smuggled.len()
    );
    // Chunked wins and says the body is empty; the smuggled request follows.
    let te_cl_empty = format!(
        "{}0\r\n\r\n{smuggled}",
        head(
            "/billing/te-cl-empty",
            &format!(
                "Transfer-Encoding: chunked\r\nContent-Length: {}\r\n",
                5 + smuggled.len()
            )
        )
    );
    let bare_lf = format!(
        "{}hello",
        head(
            "/billing/bare-lf",
            "Content-Length: 5\r\nConnection: close\r\n"
        )
    )
    .replace("\r\n", "\n");
    let cases: [(&str, String, &str, &[u8]); 4] = [
        (
            "Content-Length then Transfer-Encoding, smuggled request after the 0-chunk",
            cl_te,
            "/v1/cl-te",
            b"",
        ),
        (
            "Transfer-Encoding then Content-Length, smuggled request inside the chunk",
            te_cl,
            "/v1/te-cl",
            smuggled.as_bytes(),
        ),
        (
            "Transfer-Encoding then Content-Length, smuggled request after the 0-chunk",
            te_cl_empty,
            "/v1/te-cl-empty",
            b"",
        ),
        (
            "bare LF line endings throughout",
            bare_lf,
            "/v1/bare-lf",
            b"hello",
        ),
    ];
    let mut report = Vec::new();
    for (name, raw, path, body) in &cases {
        let before = origin.count();
        let ans = exchange(fg.proxy, &Delivery::Whole(raw.clone().into_bytes())).await;
        report.push(format!("{name:<76} {}", ans.describe()));
        assert!(
            ans.closed && ans.responses <= 1,
            "{name}: {}",
            ans.describe()
        );
        let log = origin.log();
        if ans.status != Some(200) {
            // A refusal would be as safe.
            assert!(
                ans.status.is_none_or(|s| (400..500).contains(&s)),
                "{name}: {}",
                ans.describe()
            );
            assert_eq!(log.len(), before, "{name}: origin saw {log:?}");
            continue;
        }
        assert_eq!(log.len(), before + 1, "{name}: origin saw {log:?}");
        let got = &log[before];
        assert_eq!(got.path, *path, "{name}");
        assert_eq!(&got.body[..], *body, "{name}");
        assert_eq!(got.header("transfer-encoding"), None, "{name}");
        assert_eq!(
            got.header("content-length"),
            (!body.is_empty()).then(|| body.len().to_string()),
            "{name}"
        );
    }
    println!("ambiguous framing:\n  {}", report.join("\n  "));
    assert!(origin.log().iter().all(|a| !a.path.contains("smuggled")));
}

/// 10k connections, at most `WINDOW` open at a time (file descriptors): a third
/// reset at once, a third half-closed at once, a third half-closed after part of
/// a request. A half-closed connection waits for fencegate to close its side, which
/// proves the server cleans up and paces us to its accept rate (its backlog is
/// small, and a SYN dropped on overflow is only retried after a second).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_connections_opened_and_dropped() {
    const TOTAL: usize = 10_000;
    const WINDOW: usize = 64;
    let (origin, fg, a, w) = setup().await;
    let partial = Arc::new(w.head("/billing/x", "Content-Length: 5\r\n"));
    let addr = fg.proxy;
    let window = Arc::new(tokio::sync::Semaphore::new(WINDOW));
    let started = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for i in 0..TOTAL {
        let slot = window.clone().acquire_owned().await.unwrap();
        let partial = partial.clone();
        set.spawn(async move {
            let mut s = TcpStream::connect(addr).await?;
            if i % 3 == 0 {
                s.set_zero_linger()?;
                return Ok(());
            }
            if i % 3 == 2 {
                s.write_all(&partial).await?;
                s.write_all(b"he").await?;
            }
            s.shutdown().await?;
            let mut rest = Vec::new();
            let read = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest));
            assert!(
                read.await.is_ok(),
                "fencegate kept a dropped connection open"
            );
            let (status, _, _) = parse_answer(&rest);
            assert!(status.is_none_or(|s| (400..500).contains(&s)), "{status:?}");
            drop(slot);
            Ok::<_, std::io::Error>(())
        });
        while let Some(r) = set.try_join_next() {
            r.unwrap().expect("connect to fencegate");
        }
    }
    while let Some(r) = set.join_next().await {
        r.unwrap().expect("connect to fencegate");
    }
    println!(
        "{TOTAL} connections opened and dropped in {} ms",
        started.elapsed().as_millis()
    );
    assert_eq!(origin.count(), 0);
    // The server notices the last closes asynchronously; every slot
    // (max_connections = 512) must come back, or this never succeeds.
    let url = fg.url("/billing/after-churn");
    eventually("a valid request is served after the churn", || async {
        try_send(
            worker_req(&url, a.epoch.get(), &a.token)
                .body(body("valid"))
                .unwrap(),
        )
        .await
        .is_ok_and(|r| r.status == 200)
    })
    .await;
    assert_eq!(origin.count(), 1);
    assert_eq!(lease_mark(&fg).await, (a.epoch.get(), 0));
}

/// Reads one HTTP/1.1 response (head and a Content-Length body); its status.
async fn read_response(s: &mut TcpStream) -> u16 {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(&mut chunk).await.unwrap();
        assert!(n > 0, "closed before a response");
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map_or(0, |v| v.trim().parse().unwrap());
    while buf.len() < head_end + len {
        let n = s.read(&mut chunk).await.unwrap();
        assert!(n > 0, "closed mid-body");
        buf.extend_from_slice(&chunk[..n]);
    }
    head[9..12].parse().unwrap()
}

/// Waits for the peer to close; how long that took (panics after 5 s).
async fn closed_after(s: &mut TcpStream, from: Instant) -> Duration {
    let mut chunk = [0u8; 1024];
    loop {
        match tokio::time::timeout(CASE_DEADLINE, s.read(&mut chunk)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return from.elapsed(),
            Ok(Ok(_)) => {}
            Err(_) => panic!("the connection was left open"),
        }
    }
}

/// The header read timeout (500 ms here) also runs between requests: a keep-alive
/// connection that goes quiet after an answer, or that trickles its next request
/// head, is closed; so is an HTTP/2 connection with no stream open. fencegate
/// enforces this with one timer per connection, so the close comes between one
/// and two timeouts after the last answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_trickling_keep_alive_connections_are_closed() {
    let (origin, fg, a, w) = setup().await;
    let keep_alive = |path: &str| {
        format!(
            "POST {path} HTTP/1.1\r\nHost: fencegate.test\r\n{}Content-Length: 2\r\n\r\nok",
            w.auth
        )
    };
    // Quiet after one answer.
    let mut s = TcpStream::connect(fg.proxy).await.unwrap();
    s.write_all(keep_alive("/billing/first").as_bytes())
        .await
        .unwrap();
    assert_eq!(read_response(&mut s).await, 200);
    let idle = closed_after(&mut s, Instant::now()).await;
    assert!(idle < Duration::from_secs(3), "closed after {idle:?}");

    // The next head trickles in after an answer.
    let mut s = TcpStream::connect(fg.proxy).await.unwrap();
    s.write_all(keep_alive("/billing/second").as_bytes())
        .await
        .unwrap();
    assert_eq!(read_response(&mut s).await, 200);
    let started = Instant::now();
    let next = keep_alive("/billing/trickled");
    let writer = async {
        for b in next.as_bytes() {
            if s.write_all(&[*b]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(4), writer).await;
    let trickled = closed_after(&mut s, started).await;
    assert!(
        trickled < Duration::from_secs(4),
        "closed after {trickled:?}"
    );
    assert_eq!(origin.count(), 2, "the trickled request never got through");

    // HTTP/2 (prior knowledge) with no stream open.
    let tcp = TcpStream::connect(fg.proxy).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    let conn = tokio::spawn(conn);
    let req = worker_req(&fg.url("/billing/h2"), a.epoch.get(), &a.token)
        .body(body("h2"))
        .unwrap();
    assert_eq!(send.send_request(req).await.unwrap().status(), 200);
    let started = Instant::now();
    let _ = tokio::time::timeout(CASE_DEADLINE, conn)
        .await
        .expect("the idle HTTP/2 connection was left open");
    assert!(started.elapsed() < Duration::from_secs(3));
    assert_eq!(origin.count(), 3);
}

/// The idle limit starts once an answer has gone out, not when it was handed to
/// the connection: a client reading a large answer slowly (for longer than two
/// header read timeouts) gets all of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reader_gets_its_whole_answer() {
    let (_origin, fg, _a, w) = setup().await;
    const SIZE: usize = 24 << 20;
    let mut s = TcpStream::connect(fg.proxy).await.unwrap();
    let req = format!(
        "POST /billing/big HTTP/1.1\r\nHost: fencegate.test\r\n{}X-Test-Size: {SIZE}\r\nContent-Length: 2\r\n\r\nok",
        w.auth
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let started = Instant::now();
    let mut got = 0usize;
    let mut chunk = vec![0u8; 256 << 10];
    // ~1 MiB every 100 ms: about 2.4 s, well past 2 × 500 ms.
    loop {
        let n = s.read(&mut chunk).await.unwrap();
        if n == 0 {
            break;
        }
        got += n;
        if got >= SIZE {
            break;
        }
        if got % (1 << 20) < n {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    assert!(got >= SIZE, "got {got} of {SIZE} bytes");
    assert!(
        started.elapsed() > Duration::from_millis(1000),
        "the read was meant to be slow"
    );
}
