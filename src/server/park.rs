//! Parking: a plain HTTP/1 connection that has been at rest for a while gives
//! back what hyper holds for it (an 8 KiB read buffer, often grown to 16, an
//! 8 KiB write buffer, the connection's state) and waits for its client's next
//! bytes with nothing but its socket. When they come, a new hyper connection
//! serves them on the same socket. nginx does the same when a keep-alive
//! connection goes idle (`ngx_http_set_keepalive` frees the request's buffers).
//! An idle keep-alive connection cost ~20 KiB of RSS before; parked, ~2.
//!
//! A connection is parked only when nothing of an exchange is left in hyper
//! ([`Activity::at_rest`]: no request being served, every answer written out, no
//! bytes waiting for the socket) for `park_after`. hyper's own
//! `graceful_shutdown` then ends an idle connection at once without touching the
//! socket (`poll_without_shutdown`); bytes of a next request it had already read
//! come back in its `read_buf` and are served at once, ahead of the socket
//! ([`Tracked::ahead`]). If hyper turns out not to be idle after all (say, a request body
//! the handler never read), the connection is closed after its current exchange
//! instead, which HTTP/1.1 always allows: only a connection hyper ends at once,
//! idle, is parked, so the socket is never read again mid-message (what is left
//! of an unread body must not become a request: that is request smuggling).
//!
//! Before its first request a connection is parked too, and its first bytes are
//! peeked (not read) to tell HTTP/1 from HTTP/2's preface: HTTP/2, and a first
//! read too short to tell, go to the auto builder as before.

use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{Request, Response};
use hyper::body::{Body, Incoming};
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::watch;

use super::socket::{Activity, Tracked};

/// How long a connection rests before it is parked (at most; a quarter of the
/// idle limit when that is shorter). Re-serving a parked connection costs a new
/// hyper connection (two buffers and its state): too short a wait would pay that
/// on every request of a busy keep-alive client.
const PARK_AFTER: Duration = Duration::from_secs(1);

/// HTTP/2's connection preface (RFC 9113 §3.4).
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

#[derive(Clone, Copy)]
pub(super) struct Limits {
    /// How long a connection may go without a request (`header_read_timeout_ms`).
    pub idle: Duration,
    /// How long a connection rests before it is parked.
    pub park_after: Duration,
}

impl Limits {
    pub(super) fn new(idle: Duration) -> Limits {
        Limits {
            idle,
            park_after: PARK_AFTER.min(idle / 4),
        }
    }
}

/// How [`serve`] ended.
pub(super) enum Served<S> {
    /// The connection is over.
    Done,
    /// Not HTTP/1 (or too little to tell): for the auto builder, nothing read.
    NotHttp1(TcpStream, S, watch::Receiver<()>),
}

type Io = TokioIo<Tracked<TcpStream>>;

/// A service hyper's HTTP/1 connection can run, with `Unpin` futures (its
/// `poll_without_shutdown`, which parking needs, asks for them).
pub(super) trait Http1Service<B>:
    hyper::service::Service<
        Request<Incoming>,
        Response = Response<B>,
        Error: Into<Box<dyn StdError + Send + Sync>>,
        Future: Unpin,
    > + Unpin
{
}

impl<S, B> Http1Service<B> for S where
    S: hyper::service::Service<
            Request<Incoming>,
            Response = Response<B>,
            Error: Into<Box<dyn StdError + Send + Sync>>,
            Future: Unpin,
        > + Unpin
{
}

/// An answer's body hyper can send.
pub(super) trait AnswerBody:
    Body<Error: Into<Box<dyn StdError + Send + Sync>>> + 'static
{
}

impl<B> AnswerBody for B where B: Body<Error: Into<Box<dyn StdError + Send + Sync>>> + 'static {}
type Conn<S> = http1::Connection<Io, S>;

/// Serves a plain connection: waits (parked) for its first bytes, then serves
/// HTTP/1 on it, parking it whenever it rests, until it ends.
pub(super) async fn serve<S, B>(
    stream: TcpStream,
    builder: &http1::Builder,
    svc: S,
    activity: &Arc<Activity>,
    limits: Limits,
    mut shutdown: watch::Receiver<()>,
    parked: &Gauge,
) -> Served<S>
where
    S: Http1Service<B>,
    B: AnswerBody,
{
    // The first bytes, peeked (left for whoever serves them).
    let mut head = [0u8; H2_PREFACE.len()];
    match wait(
        &stream,
        &mut head,
        activity,
        limits.idle,
        &mut shutdown,
        parked,
    )
    .await
    {
        None => return Served::Done,
        Some(n) if head[..n] == H2_PREFACE[..n] => return Served::NotHttp1(stream, svc, shutdown),
        Some(_) => {}
    }
    let (mut stream, mut svc, mut ahead) = (stream, svc, Bytes::new());
    loop {
        let io = TokioIo::new(Tracked::new(stream, ahead, activity.clone()));
        // Boxed: a parked connection's task does not carry hyper's state.
        let conn = Box::new(builder.serve_connection(io, svc));
        let parts = match segment(conn, activity, limits, &mut shutdown).await {
            Some(parts) => parts,
            None => return Served::Done,
        };
        let Tracked {
            io: s,
            ahead: unread,
            ..
        } = parts.io.into_inner();
        (stream, svc) = (s, parts.service);
        ahead = join(parts.read_buf, unread);
        if !ahead.is_empty() {
            // Part of a next request already read: served now, ahead of the socket.
            tracing::debug!(
                bytes = ahead.len(),
                "a resting connection had read part of its next request: serving it"
            );
            continue;
        }
        tracing::debug!("connection parked");
        let mut byte = [0u8; 1];
        if wait(
            &stream,
            &mut byte,
            activity,
            limits.idle,
            &mut shutdown,
            parked,
        )
        .await
        .is_none()
        {
            return Served::Done;
        }
    }
}

/// Waits, parked, for the client's next bytes and peeks (does not read) up to
/// `buf.len()` of them: how many, or `None` when the connection is to close
/// instead (the idle limit, shutdown, the client's close, a socket error).
/// Readiness alone is not trusted: a readiness event with nothing to read would
/// build a hyper connection for nothing.
async fn wait(
    stream: &TcpStream,
    buf: &mut [u8],
    activity: &Activity,
    idle: Duration,
    shutdown: &mut watch::Receiver<()>,
    parked: &Gauge,
) -> Option<usize> {
    let left = idle.saturating_sub(activity.idle_for().unwrap_or_default());
    parked.inc();
    let peeked = tokio::select! {
        biased;
        _ = shutdown.changed() => None,
        r = stream.peek(buf) => r.ok().filter(|&n| n > 0),
        _ = tokio::time::sleep(left) => None,
    };
    parked.dec();
    peeked
}

/// Runs one hyper connection until it ends (`None`) or is parked (its parts).
async fn segment<S, B>(
    mut conn: Box<Conn<S>>,
    activity: &Activity,
    limits: Limits,
    shutdown: &mut watch::Receiver<()>,
) -> Option<http1::Parts<Io, S>>
where
    S: Http1Service<B>,
    B: AnswerBody,
{
    // One timer per connection, as `close_when_idle`: it fires at most once per
    // `park_after` and enforces the idle limit too.
    let check = tokio::time::sleep(limits.park_after);
    tokio::pin!(check);
    let changed = shutdown.changed();
    tokio::pin!(changed);
    // `parking`: graceful_shutdown was called to park; `asked_now`: in this very
    // poll, right before polling hyper again.
    let (mut parking, mut closing) = (false, false);
    let ended = std::future::poll_fn(|cx| {
        if !closing && changed.as_mut().poll(cx).is_ready() {
            closing = true;
            Pin::new(&mut *conn).graceful_shutdown();
        }
        let mut asked_now = false;
        loop {
            if let Poll::Ready(r) = conn.poll_without_shutdown(cx) {
                return Poll::Ready(Some((r, asked_now)));
            }
            let mut park = false;
            while check.as_mut().poll(cx).is_ready() {
                let next = match activity.idle_for() {
                    Some(idle) if idle >= limits.idle => {
                        tracing::debug!(
                            idle_ms = idle.as_millis() as u64,
                            "no request within the header read timeout; closing the connection"
                        );
                        return Poll::Ready(None);
                    }
                    Some(idle) => {
                        park |= idle >= limits.park_after && activity.at_rest();
                        limits.park_after.min(limits.idle - idle)
                    }
                    None => limits.park_after,
                };
                check
                    .as_mut()
                    .reset(tokio::time::Instant::now() + next.max(Duration::from_millis(1)));
            }
            if !park || parking || closing {
                return Poll::Pending;
            }
            // Idle in hyper's view too, it ends at once: poll it again.
            parking = true;
            asked_now = true;
            Pin::new(&mut *conn).graceful_shutdown();
        }
    })
    .await;
    match ended {
        // The idle limit: dropped (closed) as it is.
        None => None,
        Some((Err(e), _)) => {
            tracing::debug!(error = %e, "connection ended with an error");
            None
        }
        Some((Ok(()), parked)) => {
            let mut parts = conn.into_parts();
            // Parked only if hyper ended at once when asked, i.e. it was idle: a
            // connection it ends later, or on its own, may stop mid-message (a
            // request body it chose not to read is still in the socket), and the
            // rest of the socket must never be read as a new request.
            if parked && !closing {
                return Some(parts);
            }
            // Ended by hyper (the client's `Connection: close`, an unread body…)
            // or by shutdown: close the write side as hyper's own shutdown would.
            let _ = parts.io.inner_mut().io.shutdown().await;
            None
        }
    }
}

/// Bytes read before they were wanted, then the socket's. Never hyper's empty
/// read buffer itself: an empty `Bytes` frozen from it still holds its
/// allocation (8–16 KiB), which parking is there to give back.
fn join(read: Bytes, unread: Bytes) -> Bytes {
    match (read.is_empty(), unread.is_empty()) {
        (true, true) => Bytes::new(),
        (false, true) => read,
        (true, false) => unread,
        (false, false) => {
            let mut b = BytesMut::with_capacity(read.len() + unread.len());
            b.extend_from_slice(&read);
            b.extend_from_slice(&unread);
            b.freeze()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn rewound_bytes_come_before_the_socket() {
        let (a, mut b) = tokio::io::duplex(64);
        b.write_all(b" world").await.unwrap();
        drop(b);
        let mut r = Tracked::new(a, Bytes::from_static(b"hello"), Activity::new());
        let mut out = String::new();
        r.read_to_string(&mut out).await.unwrap();
        assert_eq!(out, "hello world");
    }

    #[test]
    fn joined_bytes_keep_their_order() {
        let j =
            |a: &'static [u8], b: &'static [u8]| join(Bytes::from_static(a), Bytes::from_static(b));
        assert_eq!(
            j(b"GET /", b" HTTP/1.1"),
            Bytes::from_static(b"GET / HTTP/1.1")
        );
        assert_eq!(j(b"", b"x"), Bytes::from_static(b"x"));
        assert_eq!(j(b"x", b""), Bytes::from_static(b"x"));
    }

    #[test]
    fn the_park_wait_is_a_quarter_of_a_short_idle_limit() {
        assert_eq!(Limits::new(Duration::from_secs(10)).park_after, PARK_AFTER);
        assert_eq!(
            Limits::new(Duration::from_millis(500)).park_after,
            Duration::from_millis(125)
        );
    }
}
