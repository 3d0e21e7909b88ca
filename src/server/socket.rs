//! A client connection's socket as the server sees it: [`Tracked`] wraps it and
//! notes in the connection's [`Activity`] what the idle limit and parking
//! ([`super::park`]) decide on — requests in flight, answers being written,
//! whether the last write would have blocked.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// What a connection is doing, for the idle limit ([`super::conn`]) and parking: requests
/// being served, answers being written, and when the last one ended.
pub(super) struct Activity {
    pub(super) started: Instant,
    pub(super) in_flight: AtomicUsize,
    /// Answers whose body is waiting for its source (a streamed upstream answer
    /// between events): not idleness, however long. An answer waiting for the
    /// *client* to read is, unless its writes move bytes.
    pub(super) body_waiting: AtomicUsize,
    /// Answers handed to hyper and not yet dropped by it (their body not yet all
    /// written): a connection with one is never parked.
    pub(super) open_answers: AtomicUsize,
    /// The socket's last write would have blocked: hyper holds bytes not yet sent.
    pub(super) write_blocked: AtomicBool,
    /// Milliseconds after `started` when the connection last became idle.
    pub(super) idle_since_ms: AtomicU64,
    /// Milliseconds after `started` of the last write that moved bytes: a large
    /// answer still going out to a slow reader is not idleness.
    pub(super) wrote_ms: AtomicU64,
    /// Answers handed to hyper: after the first, nothing hyper writes is
    /// replaced ([`Tracked::own_answer`]).
    pub(super) answers: AtomicU64,
}

impl Activity {
    pub(super) fn new() -> Arc<Activity> {
        Arc::new(Activity {
            started: Instant::now(),
            in_flight: AtomicUsize::new(0),
            body_waiting: AtomicUsize::new(0),
            open_answers: AtomicUsize::new(0),
            write_blocked: AtomicBool::new(false),
            idle_since_ms: AtomicU64::new(0),
            wrote_ms: AtomicU64::new(0),
            answers: AtomicU64::new(0),
        })
    }

    pub(super) fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// How long the connection has been without a request (`None`: serving one).
    pub(super) fn idle_for(&self) -> Option<Duration> {
        if self.in_flight.load(Ordering::SeqCst) > 0 || self.body_waiting.load(Ordering::SeqCst) > 0
        {
            return None;
        }
        let since = self
            .idle_since_ms
            .load(Ordering::SeqCst)
            .max(self.wrote_ms.load(Ordering::Relaxed));
        Some(Duration::from_millis(self.now_ms().saturating_sub(since)))
    }

    /// Nothing of an exchange is left in hyper: no request being served, every
    /// answer written out and dropped, no bytes waiting for the socket. Checked
    /// between polls of the connection, so hyper has handed every complete
    /// request head it read to the service already.
    pub(super) fn at_rest(&self) -> bool {
        self.in_flight.load(Ordering::SeqCst) == 0
            && self.open_answers.load(Ordering::SeqCst) == 0
            && !self.write_blocked.load(Ordering::SeqCst)
    }
}

/// The connection's socket, noting in its [`Activity`] when a write moves bytes
/// and whether the last one would have blocked; bytes already read from it
/// (`ahead`: what hyper had read of a next request when its connection was
/// [parked](super::park)) are read again first.
pub(super) struct Tracked<S> {
    pub io: S,
    pub ahead: Bytes,
    pub activity: Arc<Activity>,
    /// fencegate's answer being written in place of one hyper wrote itself
    /// ([`Tracked::own_answer`]).
    pub own: Bytes,
}

impl<S> Tracked<S> {
    pub(super) fn new(io: S, ahead: Bytes, activity: Arc<Activity>) -> Tracked<S> {
        Tracked {
            io,
            ahead,
            activity,
            own: Bytes::new(),
        }
    }

    /// hyper answers a head it cannot parse (400, 414, 431, 505) by itself,
    /// with an empty body, then closes. Such a write is replaced whole by
    /// fencegate's answer in its own format (SPEC §7) only on a connection
    /// that has had no answer yet: once one was handed to hyper, a later
    /// write may be the tail of its body (hyper drops a body before its last
    /// bytes are written), which must never be touched — a malformed head
    /// after a first exchange gets hyper's plain answer. HTTP/2 frames never
    /// start with a status line.
    fn own_answer(&self, first: &[u8]) -> Option<Bytes> {
        let line = first.strip_prefix(b"HTTP/1.")?.get(2..)?;
        let status = line.get(..3)?;
        let a = &self.activity;
        let untouched = a.answers.load(Ordering::SeqCst) == 0
            && a.in_flight.load(Ordering::SeqCst) == 0
            && a.open_answers.load(Ordering::SeqCst) == 0;
        let hypers = line
            .iter()
            .position(|b| *b == b'\n')
            .and_then(|n| line.get(n + 1..))
            .is_some_and(|rest| rest.starts_with(b"connection: close\r\n"));
        if !matches!(status.first(), Some(b'4' | b'5')) || !untouched || !hypers {
            return None;
        }
        let code = std::str::from_utf8(status).ok()?.parse().ok()?;
        Some(Bytes::from(crate::error::unparsable_head(code)))
    }
}

impl<S: AsyncWrite + Unpin> Tracked<S> {
    /// Writes what is left of [`Tracked::own`].
    fn write_own(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        while !self.own.is_empty() {
            let r = Pin::new(&mut self.io).poll_write(cx, &self.own);
            self.wrote(&r);
            match std::task::ready!(r)? {
                0 => return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into())),
                n => bytes::Buf::advance(&mut self.own, n),
            }
        }
        Poll::Ready(Ok(()))
    }

    /// Takes hyper's `len` bytes as written, and starts writing `own` instead.
    fn replace(
        &mut self,
        cx: &mut Context<'_>,
        own: Bytes,
        len: usize,
    ) -> Poll<std::io::Result<usize>> {
        self.own = own;
        match self.write_own(cx) {
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            // The rest goes out with the flush hyper makes next.
            _ => Poll::Ready(Ok(len)),
        }
    }
    fn wrote(&self, r: &Poll<std::io::Result<usize>>) {
        let blocked = r.is_pending();
        if self.activity.write_blocked.load(Ordering::Relaxed) != blocked {
            self.activity.write_blocked.store(blocked, Ordering::SeqCst);
        }
        if let Poll::Ready(Ok(n)) = r {
            if *n > 0 {
                self.activity
                    .wrote_ms
                    .store(self.activity.now_ms(), Ordering::Relaxed);
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Tracked<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if this.ahead.is_empty() {
            return Pin::new(&mut this.io).poll_read(cx, buf);
        }
        let n = this.ahead.len().min(buf.remaining());
        buf.put_slice(&this.ahead[..n]);
        bytes::Buf::advance(&mut this.ahead, n);
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Tracked<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        std::task::ready!(this.write_own(cx))?;
        if let Some(own) = this.own_answer(buf) {
            return this.replace(cx, own, buf.len());
        }
        let r = Pin::new(&mut this.io).poll_write(cx, buf);
        this.wrote(&r);
        r
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        std::task::ready!(this.write_own(cx))?;
        let first = bufs
            .iter()
            .find(|b| !b.is_empty())
            .map_or(&[][..], |b| &b[..]);
        if let Some(own) = this.own_answer(first) {
            let len = bufs.iter().map(|b| b.len()).sum();
            return this.replace(cx, own, len);
        }
        let r = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.wrote(&r);
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        std::task::ready!(this.write_own(cx))?;
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        std::task::ready!(this.write_own(cx))?;
        Pin::new(&mut this.io).poll_shutdown(cx)
    }
}
