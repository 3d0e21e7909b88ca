//! Bodies that pass through fencegate without being held whole (SPEC §6): a
//! request body streamed to the upstream under the route's `max_body_bytes`, and an
//! upstream response streamed to the worker while its lease's pass is held.
//!
//! The pass is held by the [`Exchange`] (SPEC §5): a request is in flight until
//! both ends of its exchange are over — its body handed whole to the upstream
//! connection *and* the answer read to its last byte — or the exchange was cut.
//! An upstream may answer before it has read the whole request (an upload
//! accepted at once): ending the pass with the answer would let a newer epoch
//! through while the older request's body is still arriving at the destination.
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
pub struct UploadState {
    end: AtomicU8,
    /// The upstream connection last asked for more and the worker had none yet.
    awaiting_worker: std::sync::atomic::AtomicBool,
}

impl UploadState {
    /// How the upload ended, read after the exchange to tell the worker's fault from
    /// the upstream's.
    pub fn get(&self) -> UploadEnd {
        match self.end.load(Ordering::SeqCst) {
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
        self.end.store(v, Ordering::SeqCst);
    }

    /// Still being sent, and waiting for the worker's next bytes (not for the
    /// upstream to read them): an exchange that fails so was stalled by the
    /// worker, which the breaker does not count against the upstream (SPEC §7).
    pub fn stalled_by_worker(&self) -> bool {
        self.get() == UploadEnd::Sending && self.awaiting_worker.load(Ordering::SeqCst)
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
        let polled = Pin::new(&mut this.body).poll_frame(cx);
        this.state
            .awaiting_worker
            .store(polled.is_pending(), Ordering::SeqCst);
        match polled {
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
/// its key and fingerprint) or streamed; for a fenced request, one end of its
/// [`Exchange`], closed once the upstream connection has taken the body whole (its
/// last frame polled) or has dropped it (sent, failed or cut).
pub struct UpBody {
    body: OrFull<Upload>,
    end: Option<ExchangeEnd>,
}

impl UpBody {
    /// A body streamed from the worker.
    pub fn stream(up: Upload) -> UpBody {
        UpBody {
            body: OrFull::Stream(up),
            end: None,
        }
    }

    /// The same body, closing `end` once it has been sent (or dropped).
    pub fn until_sent(mut self, end: ExchangeEnd) -> UpBody {
        self.end = Some(end);
        self
    }

    fn sent(&mut self) {
        if let Some(mut e) = self.end.take() {
            e.close();
        }
    }
}

impl From<Bytes> for UpBody {
    fn from(b: Bytes) -> UpBody {
        UpBody {
            body: OrFull::from(b),
            end: None,
        }
    }
}

impl Body for UpBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.body).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(_))) if this.body.is_end_stream() => this.sent(),
            Poll::Ready(None | Some(Err(_))) => this.sent(),
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

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

/// A forwarded request's time in flight (SPEC §5): from the answer's head on, it
/// holds the request's pass until both of its ends are closed — the request body sent ([`UpBody`]) and the
/// answer read to its last byte ([`Streamed`], or at once for an answer read
/// whole) — or until it is ended early: a failure, or a drain abort or shutdown
/// seen by its [watcher](Exchange::watch), which cuts the upstream connection.
pub struct Exchange(Arc<ExchangeState>);

impl Default for Exchange {
    fn default() -> Exchange {
        Exchange::new()
    }
}

struct ExchangeState {
    pass: std::sync::Mutex<Option<Pass>>,
    /// What the caller counts the request by until the exchange is over (its
    /// place under the route's `max_in_flight`, SPEC §9), dropped with the
    /// pass. Opaque here: streaming knows when an exchange ends, not what is
    /// counted.
    slot: std::sync::Mutex<Option<Box<dyn Send>>>,
    /// Ends still open (of two).
    open: AtomicU8,
    /// Why the watcher ended the exchange.
    stopped: std::sync::OnceLock<&'static str>,
    /// Cancelled when the pass has ended: the watcher's cue to go.
    over: tokio_util::sync::CancellationToken,
}

impl ExchangeState {
    fn end(&self) {
        let pass = self.pass.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(pass);
        let slot = self.slot.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(slot);
        self.over.cancel();
    }
}

impl Exchange {
    /// An exchange about to be sent: the forward holds the pass until the
    /// answer's head, then hands it over ([`Exchange::watch`]).
    pub fn new() -> Exchange {
        Exchange(Arc::new(ExchangeState {
            pass: std::sync::Mutex::new(None),
            slot: std::sync::Mutex::new(None),
            open: AtomicU8::new(2),
            stopped: std::sync::OnceLock::new(),
            over: tokio_util::sync::CancellationToken::new(),
        }))
    }

    /// One of the two ends (taken twice: the request body's and the answer's).
    pub fn end(&self) -> ExchangeEnd {
        ExchangeEnd {
            ex: self.0.clone(),
            open: true,
        }
    }

    /// Called with the answer's head, its end still open: the exchange holds
    /// `pass` from now on until both ends are closed.
    pub fn hold(&self, pass: Pass) {
        *self.0.pass.lock().unwrap_or_else(|p| p.into_inner()) = Some(pass);
    }

    /// Like [`Exchange::hold`], for what else ends with the exchange (the
    /// request's in-flight slot, SPEC §9 `max_in_flight`): dropped when the
    /// exchange is over at both ends.
    pub fn keep(&self, slot: impl Send + 'static) {
        *self.0.slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(Box::new(slot));
    }

    /// While the exchange lasts, a small task waits for `stop` (a drain abort,
    /// shutdown): it then cuts the upstream connection and ends the pass at once,
    /// even when nobody polls the bodies any more (a worker that stopped reading,
    /// an upload stalled after its answer). Nothing is spawned for an exchange
    /// already over (the usual whole answer to a body sent whole).
    pub fn watch<F, C>(&self, stop: F, conn: C)
    where
        F: Future<Output = &'static str> + Send + 'static,
        C: CutConn,
    {
        if self.0.over.is_cancelled() {
            return;
        }
        let ex = self.0.clone();
        tokio::spawn(async move {
            tokio::select! {
                why = stop => {
                    let _ = ex.stopped.set(why);
                    conn.cut();
                    ex.end();
                }
                _ = ex.over.cancelled() => {}
            }
        });
    }
}

/// One end of an [`Exchange`]; closed by [`ExchangeEnd::close`] or when dropped.
pub struct ExchangeEnd {
    ex: Arc<ExchangeState>,
    open: bool,
}

impl ExchangeEnd {
    /// This end is over; the last one ends the pass.
    pub fn close(&mut self) {
        if std::mem::take(&mut self.open) && self.ex.open.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.ex.end();
        }
    }

    /// The exchange ended early: cut off, the pass ended now.
    fn end_all(&mut self) {
        self.open = false;
        self.ex.end();
    }

    /// Why the watcher stopped the exchange, if it did.
    fn stopped(&self) -> Option<&'static str> {
        self.ex.stopped.get().copied()
    }
}

impl Drop for ExchangeEnd {
    fn drop(&mut self) {
        self.close();
    }
}

/// How an exchange cuts its upstream connection (SPEC §5: not one more byte),
/// whichever pool the connection came from (`forward::ConnCut`).
pub trait CutConn: Send + Sync + 'static {
    /// Cuts the connection, if it is still this exchange's.
    fn cut(&self);
}

/// An upstream response body on its way to the worker. It keeps the answer's end
/// of the request's [`Exchange`] open until the body has ended (the drain orders
/// whole exchanges), and ends early — cutting the upstream connection and
/// truncating the worker's answer — on a drain abort, shutdown (the exchange's
/// watcher), or when the upstream sends nothing for `idle_limit` (the route's
/// timeout, counted between frames: a long stream is not a slow one).
pub struct Streamed {
    /// Bytes already read from `body` (while deciding whether to buffer), sent first.
    prefix: Option<Bytes>,
    body: Pin<Box<dyn Body<Data = Bytes, Error = hyper::Error> + Send>>,
    /// The answer's end of the exchange (none for an answer relayed from a
    /// cluster peer: the owner holds the pass).
    end: Option<ExchangeEnd>,
    /// The body has ended (or failed): nothing more to send.
    finished: bool,
    idle: Pin<Box<tokio::time::Sleep>>,
    idle_limit: Duration,
    last_frame: Instant,
    conn: Box<dyn CutConn>,
    /// For the failure log line.
    route: Arc<str>,
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
    /// `end`: the answer's end of the request's exchange (none for an answer
    /// relayed from a cluster peer: the owner holds the pass).
    pub fn new(
        prefix: Bytes,
        body: impl Body<Data = Bytes, Error = hyper::Error> + Send + 'static,
        end: Option<ExchangeEnd>,
        idle_limit: Duration,
        conn: impl CutConn,
        route: Arc<str>,
    ) -> Streamed {
        Streamed {
            prefix: (!prefix.is_empty()).then_some(prefix),
            body: Box::pin(body),
            end,
            finished: false,
            idle: Box::pin(tokio::time::sleep(idle_limit)),
            idle_limit,
            last_frame: Instant::now(),
            conn: Box::new(conn),
            route,
        }
    }

    /// The answer is over.
    fn close(&mut self) {
        self.finished = true;
        if let Some(e) = &mut self.end {
            e.close();
        }
    }

    /// Ends the exchange early: the upstream connection is cut (SPEC §5: not one
    /// more byte), the pass ends, the worker's answer is truncated.
    fn fail(&mut self, e: StreamError) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.conn.cut();
        self.finished = true;
        if let Some(end) = &mut self.end {
            end.end_all();
        }
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
        if this.finished {
            return Poll::Ready(None);
        }
        if let Some(why) = this.end.as_ref().and_then(ExchangeEnd::stopped) {
            return this.fail(StreamError::Stopped(why));
        }
        if let Some(p) = this.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(p))));
        }
        match this.body.as_mut().poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                this.last_frame = Instant::now();
                if this.body.is_end_stream() {
                    this.close();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                this.close();
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
