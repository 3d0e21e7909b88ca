//! Bodies that pass through fencegate without being held whole (SPEC §6): a
//! request body streamed to the upstream under the route's `max_body_bytes`, and an
//! upstream response streamed to the worker while its lease's pass is held.
//!
//! Backpressure is hyper's: a frame is read from one side only when the other
//! side asks for the next one, so at most a frame or two per direction is in
//! fencegate's memory whatever the body's size.

use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper_util::client::legacy::connect::CaptureConnection;

use crate::gate::Pass;

/// Any error a body may end with, as hyper's body traits expect.
pub(crate) type BoxError = Box<dyn StdError + Send + Sync>;

/// What ends a streamed exchange early: a drain abort or shutdown, with its reason.
pub type Stop = Pin<Box<dyn Future<Output = &'static str> + Send>>;

/// How far a streamed request body got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UploadEnd {
    /// Still being sent.
    Sending,
    /// Sent whole.
    Complete,
    /// Went over `max_body_bytes`: cut off, the upstream got an incomplete body.
    TooLarge,
    /// The worker's body failed (it went away): the upstream got an incomplete body.
    ClientFailed,
}

/// Shared between an [`Upload`] (owned by the upstream connection) and the
/// request that sent it.
#[derive(Debug, Default)]
pub struct UploadState(AtomicU8);

impl UploadState {
    /// How the upload ended, read after the exchange to tell the worker's fault from
    /// the upstream's.
    pub fn get(&self) -> UploadEnd {
        match self.0.load(Ordering::SeqCst) {
            1 => UploadEnd::Complete,
            2 => UploadEnd::TooLarge,
            3 => UploadEnd::ClientFailed,
            _ => UploadEnd::Sending,
        }
    }

    fn set(&self, end: UploadEnd) {
        let v = match end {
            UploadEnd::Sending => 0,
            UploadEnd::Complete => 1,
            UploadEnd::TooLarge => 2,
            UploadEnd::ClientFailed => 3,
        };
        self.0.store(v, Ordering::SeqCst);
    }
}

/// The worker's request body on its way to the upstream, counted against the
/// route's `max_body_bytes` as it passes (SPEC §7 `body_too_large`).
pub struct Upload {
    body: Incoming,
    limit: u64,
    seen: u64,
    state: Arc<UploadState>,
}

impl Upload {
    /// Wraps a request body, limited to `limit` bytes; the state tells how it ended.
    pub fn new(body: Incoming, limit: usize) -> (Upload, Arc<UploadState>) {
        let state = Arc::new(UploadState::default());
        let up = Upload {
            body,
            limit: limit as u64,
            seen: 0,
            state: state.clone(),
        };
        (up, state)
    }
}

/// Said by an [`Upload`] that went over its limit.
#[derive(Debug, thiserror::Error)]
#[error("the request body exceeds the route's limit of {0} bytes")]
pub struct TooLarge(pub u64);

impl Body for Upload {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(d) = frame.data_ref() {
                    this.seen += d.len() as u64;
                    if this.seen > this.limit {
                        this.state.set(UploadEnd::TooLarge);
                        return Poll::Ready(Some(Err(Box::new(TooLarge(this.limit)))));
                    }
                }
                if this.body.is_end_stream() {
                    this.state.set(UploadEnd::Complete);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                this.state.set(UploadEnd::Complete);
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                this.state.set(UploadEnd::ClientFailed);
                Poll::Ready(Some(Err(Box::new(e))))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A body held whole, or streamed by `S`.
pub enum OrFull<S> {
    /// Held whole (a small or replayed body).
    Full(Full<Bytes>),
    /// Streamed as it arrives.
    Stream(S),
}

/// A request body for the upstream: buffered (a recorded route needs it whole for
/// its key and fingerprint) or streamed.
pub type UpBody = OrFull<Upload>;

/// What fencegate answers a worker with: a body it holds whole (its own answers,
/// replays, small responses) or one streamed from the upstream.
pub type ProxyBody = OrFull<Box<Streamed>>;

impl<S> From<Bytes> for OrFull<S> {
    fn from(b: Bytes) -> OrFull<S> {
        OrFull::Full(Full::new(b))
    }
}

impl<S> From<Full<Bytes>> for OrFull<S> {
    fn from(f: Full<Bytes>) -> OrFull<S> {
        OrFull::Full(f)
    }
}

impl<S> Body for OrFull<S>
where
    S: Body<Data = Bytes, Error = BoxError> + Unpin,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            OrFull::Full(f) => Pin::new(f).poll_frame(cx).map_err(|never| match never {}),
            OrFull::Stream(s) => Pin::new(s).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            OrFull::Full(f) => f.is_end_stream(),
            OrFull::Stream(s) => s.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            OrFull::Full(f) => f.size_hint(),
            OrFull::Stream(s) => s.size_hint(),
        }
    }
}

/// An upstream response body on its way to the worker. It holds the request's
/// pass until the body has ended (the drain orders whole exchanges), and ends
/// early — cutting the upstream connection and truncating the worker's answer — on
/// a drain abort, shutdown, or when the upstream sends nothing for `idle_limit`
/// (the route's timeout, counted between frames: a long stream is not a slow one).
///
/// A drain abort must end the pass at once even when the worker has stopped
/// reading (hyper then polls the body no more): a small task per streamed answer
/// watches for it, cuts the upstream connection and drops the pass.
pub struct Streamed {
    /// Bytes already read from `body` (while deciding whether to buffer), sent first.
    prefix: Option<Bytes>,
    body: Incoming,
    held: Arc<Held>,
    idle: Pin<Box<tokio::time::Sleep>>,
    idle_limit: Duration,
    last_frame: Instant,
    conn: CaptureConnection,
    /// For the failure log line.
    route: Arc<str>,
    /// Dropped with the body: ends the watcher.
    _watch: tokio::sync::oneshot::Sender<()>,
}

/// What a streamed answer and its watcher share.
struct Held {
    pass: std::sync::Mutex<Option<Pass>>,
    done: std::sync::atomic::AtomicBool,
    /// Why the watcher ended the exchange.
    stopped: std::sync::OnceLock<&'static str>,
}

impl Held {
    fn end(&self) {
        self.done.store(true, Ordering::SeqCst);
        let pass = self.pass.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(pass);
    }

    fn ended(&self) -> bool {
        self.done.load(Ordering::SeqCst)
    }
}

/// Why a streamed response ended before the upstream finished it.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// A drain abort or shutdown stopped it (the reason).
    #[error("{0}")]
    Stopped(&'static str),
    /// The upstream paused longer than the route's timeout (ms).
    #[error("the upstream sent nothing for {0} ms")]
    Idle(u128),
    /// The upstream connection failed mid-body.
    #[error("reading the upstream's response body: {0}")]
    Upstream(hyper::Error),
}

impl Streamed {
    /// `held`: the request's pass and what ends it early (none for an answer
    /// relayed from a cluster peer: the owner holds the pass).
    pub fn new(
        prefix: Bytes,
        body: Incoming,
        held: Option<(Pass, Stop)>,
        idle_limit: Duration,
        conn: CaptureConnection,
        route: Arc<str>,
    ) -> Streamed {
        let (pass, stop) = held.unzip();
        let held = Arc::new(Held {
            pass: std::sync::Mutex::new(pass),
            done: std::sync::atomic::AtomicBool::new(false),
            stopped: std::sync::OnceLock::new(),
        });
        let (watch, done) = tokio::sync::oneshot::channel::<()>();
        if let Some(stop) = stop {
            let (h, c) = (held.clone(), conn.clone());
            tokio::spawn(async move {
                tokio::select! {
                    why = stop => {
                        let _ = h.stopped.set(why);
                        crate::cutoff::cut(&c);
                        h.end();
                    }
                    _ = done => {}
                }
            });
        }
        Streamed {
            prefix: (!prefix.is_empty()).then_some(prefix),
            body,
            held,
            idle: Box::pin(tokio::time::sleep(idle_limit)),
            idle_limit,
            last_frame: Instant::now(),
            conn,
            route,
            _watch: watch,
        }
    }

    /// Ends the exchange early: the upstream connection is cut (SPEC §5: not one
    /// more byte), the pass ends, the worker's answer is truncated.
    fn fail(&mut self, e: StreamError) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        crate::cutoff::cut(&self.conn);
        self.held.end();
        tracing::warn!(route = %self.route, error = %e, "streamed response ended early");
        Poll::Ready(Some(Err(Box::new(e))))
    }

    /// Whether the idle limit has passed since the last frame (re-arming the timer
    /// when it has not: one timer reset per idle limit, not per frame).
    fn poll_idle(&mut self, cx: &mut Context<'_>) -> bool {
        loop {
            if self.idle.as_mut().poll(cx).is_pending() {
                return false;
            }
            let until = self.last_frame + self.idle_limit;
            if until <= Instant::now() {
                return true;
            }
            self.idle.as_mut().reset(until);
        }
    }
}

impl Body for Streamed {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if let Some(why) = this.held.stopped.get() {
            return this.fail(StreamError::Stopped(why));
        }
        if let Some(p) = this.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(p))));
        }
        if this.held.ended() {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                this.last_frame = Instant::now();
                if this.body.is_end_stream() {
                    this.held.end();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                this.held.end();
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => this.fail(StreamError::Upstream(e)),
            Poll::Pending => {
                if this.poll_idle(cx) {
                    return this.fail(StreamError::Idle(this.idle_limit.as_millis()));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none() && self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let rest = self.body.size_hint();
        let pre = self.prefix.as_ref().map_or(0, |p| p.len() as u64);
        let mut h = SizeHint::new();
        h.set_lower(rest.lower() + pre);
        if let Some(u) = rest.upper() {
            h.set_upper(u + pre);
        }
        h
    }
}
