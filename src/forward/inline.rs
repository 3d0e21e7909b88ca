//! HTTP/1 connections to plain-`http://` upstreams, driven in the task of the
//! request that uses them (issue 47).
//!
//! hyper-util's pool gives each connection a task of its own: a request hands
//! its head to that task and waits to be woken with the answer, and each frame
//! of the body crosses back the same way — two task wake-ups a request, ~12 %
//! of a bare pass-through's CPU (benches/README.md). Here the request's own
//! future polls the connection: while it waits for the head, then, inside
//! [`OwnBody`], while whoever reads the body reads it. An idle connection is
//! polled by nobody; before it is reused one poll reads what arrived while it
//! sat (an upstream's close), as the connection task would have.
//!
//! What stays as with hyper-util, because SPEC §5–§6 rest on it:
//! - a request given back unsent by a reused connection that had closed is sent
//!   on another; any other failure after the connect is in doubt (only a failed
//!   connect is "nothing sent", 502);
//! - an exchange dropped before its head (a timeout, a drain abort, shutdown)
//!   cuts its connection ([`crate::cutoff`]): a reset, not one more byte;
//! - a body read to its end gives the connection back; if the request's own
//!   body is still being written (an upstream that answered early), a small
//!   task finishes writing it first, and an abort's cut still reaches it.
//!
//! HTTPS upstreams (TLS, h2 by ALPN) stay on hyper-util's pool.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use http::uri::{Authority, PathAndQuery};
use http::{header, HeaderValue, Request, Response, Uri};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1;
use tokio::time::Instant;
use tower_service::Service;

use super::UpstreamError;
use crate::cutoff::{CutHandle, CuttableConnector, CuttableStream};
use crate::streaming::UpBody;

/// How long a connection may sit idle before it is closed (hyper-util's
/// `pool_idle_timeout` as fencegate set it).
const IDLE_FOR: Duration = Duration::from_secs(60);

/// One connection: the sender of its requests, the future that drives it, and
/// the handle that cuts its current exchange.
struct Live {
    send: http1::SendRequest<UpBody>,
    conn: http1::Connection<CuttableStream, UpBody>,
    cut: CutHandle,
}

impl Live {
    /// Polls the connection once; true when it has ended (closed or failed).
    fn poll_conn(&mut self, cx: &mut Context<'_>) -> bool {
        Pin::new(&mut self.conn).poll(cx).is_ready()
    }
}

/// Each upstream's idle connections, newest last, with when each went idle.
type Idle = HashMap<Authority, Vec<(Box<Live>, Instant)>>;

/// The idle connections to each upstream, at most `max_idle` per host.
pub(super) struct Pool {
    idle: Mutex<Idle>,
    max_idle: usize,
    connector: Mutex<CuttableConnector>,
    sweeping: std::sync::atomic::AtomicBool,
}

impl Pool {
    pub(super) fn new(connector: CuttableConnector, max_idle: usize) -> Arc<Pool> {
        Arc::new(Pool {
            idle: Mutex::default(),
            max_idle,
            connector: Mutex::new(connector),
            sweeping: Default::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Idle> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An idle connection still open, newest first; the older ones are left to
    /// the sweep.
    fn reuse(&self, host: &Authority) -> Option<Box<Live>> {
        loop {
            let (mut live, since) = self.lock().get_mut(host)?.pop()?;
            if since.elapsed() < IDLE_FOR && idle_and_open(&mut live) {
                return Some(live);
            }
        }
    }

    async fn connect(&self, host: &Authority) -> Result<Box<Live>, UpstreamError> {
        let uri = Uri::builder()
            .scheme("http")
            .authority(host.clone())
            .path_and_query("/")
            .build()
            .map_err(|e| UpstreamError::Unreachable(e.to_string()))?;
        let connecting = self
            .connector
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .call(uri);
        let stream = connecting
            .await
            .map_err(|e| UpstreamError::Unreachable(super::error_chain(e.as_ref())))?;
        let cut = stream.handle();
        let (send, conn) = http1::handshake(stream)
            .await
            .map_err(|e| UpstreamError::Unreachable(super::error_chain(&e)))?;
        Ok(Box::new(Live { send, conn, cut }))
    }

    /// Gives back a connection whose exchange is over and that is idle now.
    fn put(self: &Arc<Pool>, host: Authority, mut live: Box<Live>) {
        if !live.cut.next_exchange() {
            return; // Cut: closed with a reset when dropped.
        }
        {
            let mut idle = self.lock();
            let list = idle.entry(host).or_default();
            if list.len() >= self.max_idle {
                return;
            }
            list.push((live, Instant::now()));
        }
        self.sweep_later();
    }

    /// Closes, every so often, the connections idle too long or closed by their
    /// upstream (what hyper-util's pool timer did); one task per pool, ending
    /// with it.
    fn sweep_later(self: &Arc<Pool>) {
        use std::sync::atomic::Ordering;
        if self.sweeping.swap(true, Ordering::Relaxed) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            self.sweeping.store(false, Ordering::Relaxed);
            return;
        };
        let pool: Weak<Pool> = Arc::downgrade(self);
        rt.spawn(async move {
            let mut every = tokio::time::interval(IDLE_FOR / 4);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                let Some(pool) = pool.upgrade() else { return };
                let closed: Vec<(Box<Live>, Instant)> = {
                    let mut idle = pool.lock();
                    let mut closed = Vec::new();
                    for list in idle.values_mut() {
                        closed.extend(list.extract_if(.., |(live, since)| {
                            since.elapsed() >= IDLE_FOR || !idle_and_open(live)
                        }));
                    }
                    idle.retain(|_, l| !l.is_empty());
                    closed
                };
                drop(closed); // Outside the lock.
            }
        });
    }
}

/// One poll, without a task to wake: reads what arrived while the connection
/// sat idle (an upstream's close) and tells whether it can take a request.
fn idle_and_open(live: &mut Live) -> bool {
    let mut cx = Context::from_waker(Waker::noop());
    !live.poll_conn(&mut cx) && matches!(live.send.poll_ready(&mut cx), Poll::Ready(Ok(())))
}

/// Armed while an exchange waits for its head: dropped then (a timeout, a
/// drain abort, shutdown), it cuts the connection, which closes with a reset.
struct CutOnDrop(Option<CutHandle>);

impl Drop for CutOnDrop {
    fn drop(&mut self) {
        if let Some(h) = &self.0 {
            h.cut();
        }
    }
}

/// Sends `req` on a connection to its upstream and drives it until the
/// response head arrives; the body, read later, drives it on.
pub(super) async fn send(
    pool: &Arc<Pool>,
    mut req: Request<UpBody>,
) -> Result<(Response<OwnBody>, OwnCut), UpstreamError> {
    let host = req
        .uri()
        .authority()
        .cloned()
        .ok_or_else(|| UpstreamError::Unreachable("the upstream URI has no host".into()))?;
    // What hyper-util did for a request to an origin: the target in origin
    // form, and a `Host` when the request has none.
    let path = req
        .uri()
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    *req.uri_mut() = Uri::from(path);
    if !req.headers().contains_key(header::HOST) {
        let h = HeaderValue::from_str(host.as_str())
            .map_err(|e| UpstreamError::Unreachable(e.to_string()))?;
        req.headers_mut().insert(header::HOST, h);
    }
    loop {
        let (mut live, reused) = match pool.reuse(&host) {
            Some(live) => (live, true),
            None => (pool.connect(&host).await?, false),
        };
        // Declared after `live`, dropped before it: the stream sees the cut.
        let mut armed = CutOnDrop(Some(live.cut.clone()));
        let mut answer = std::pin::pin!(live.send.try_send_request(req));
        let failed = match drive(&mut live, answer.as_mut()).await {
            Ok((Ok(resp), ended)) => {
                armed.0 = None;
                let handle = live.cut.clone();
                let slot: Slot = Arc::new(Mutex::new((!ended).then_some(live)));
                let cut = OwnCut {
                    slot: slot.clone(),
                    handle,
                };
                let pool = pool.clone();
                return Ok((
                    resp.map(|body| OwnBody {
                        body,
                        live: slot,
                        pool,
                        host,
                        released: false,
                    }),
                    cut,
                ));
            }
            Ok((Err(e), _)) => e,
            Err(Ended) => {
                // Ended cleanly without taking the request (an idle close seen
                // only now): hyper hands a request it never took back when the
                // connection is dropped.
                armed.0 = None;
                drop(live);
                match answer.await {
                    Err(e) => e,
                    Ok(_) => {
                        return Err(UpstreamError::Uncertain(
                            "the upstream connection closed before an answer".into(),
                        ))
                    }
                }
            }
        };
        let mut failed = failed;
        match failed.take_message() {
            // Not sent: the connection had closed while it sat idle.
            Some(back) if reused => {
                armed.0 = None;
                req = back;
            }
            // Given back by a new connection (an upstream that closes what it
            // accepts), or taken and written: in doubt, as with hyper-util
            // (only a failed connect is "nothing sent").
            _ => return Err(UpstreamError::Uncertain(super::error_chain(failed.error()))),
        }
    }
}

/// The connection ended before the future it was driven with.
struct Ended;

/// Runs `f`, polling `live`'s connection beside it (its reads and writes
/// happen here, in this task). The connection first: what it reads resolves `f`
/// in the same poll, without a wake-up. With `f`'s output, whether the
/// connection has ended too (it is not polled again).
async fn drive<F: Future>(live: &mut Live, f: F) -> Result<(F::Output, bool), Ended> {
    let mut f = std::pin::pin!(f);
    let mut ended = false;
    std::future::poll_fn(|cx| {
        // Its end answers what it held: `f` is looked at once more.
        ended = ended || live.poll_conn(cx);
        match f.as_mut().poll(cx) {
            Poll::Ready(out) => Poll::Ready(Ok((out, ended))),
            Poll::Pending if ended => Poll::Ready(Err(Ended)),
            Poll::Pending => Poll::Pending,
        }
    })
    .await
}

/// Where an exchange's connection is while its body is read, shared with the
/// exchange's [`OwnCut`]; `None` once it has ended or gone back to the pool.
type Slot = Arc<Mutex<Option<Box<Live>>>>;

fn lock(slot: &Slot) -> std::sync::MutexGuard<'_, Option<Box<Live>>> {
    slot.lock().unwrap_or_else(|p| p.into_inner())
}

/// The cut of an exchange on this pool's connection. It reaches the connection
/// even when nobody polls it (a worker that stopped reading its answer: the
/// task that would read the body is stuck writing to the worker): the
/// connection is taken from its body and dropped, with a reset.
#[derive(Clone)]
pub(crate) struct OwnCut {
    slot: Slot,
    handle: CutHandle,
}

impl OwnCut {
    pub(crate) fn cut(&self) {
        if self.handle.cut() {
            drop(lock(&self.slot).take());
        }
    }
}

impl std::fmt::Debug for OwnCut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnCut")
            .field("handle", &self.handle)
            .finish()
    }
}

/// An upstream's response body that drives its connection while it is read,
/// and gives the connection back to the pool at its end.
pub(crate) struct OwnBody {
    body: Incoming,
    live: Slot,
    pool: Arc<Pool>,
    host: Authority,
    /// The end was seen: the connection is the pool's (or a finishing
    /// task's), not this body's, to poll.
    released: bool,
}

impl OwnBody {
    /// The body has ended: the connection goes back to the pool once idle.
    fn release(&mut self, live: &mut Option<Box<Live>>, cx: &mut Context<'_>) {
        if std::mem::replace(&mut self.released, true) {
            return;
        }
        let Some(l) = live else { return };
        // The connection turns idle on the poll after the body's end, or a
        // few later (hyper resets its state after writing): looked at again
        // before a task is spawned to finish it.
        let mut ready = Poll::Pending;
        for _ in 0..3 {
            if l.poll_conn(cx) {
                *live = None;
                return;
            }
            ready = l.send.poll_ready(cx);
            if ready.is_ready() {
                break;
            }
        }
        match ready {
            Poll::Ready(Ok(())) => {
                if let Some(l) = live.take() {
                    self.pool.put(self.host.clone(), l);
                }
            }
            Poll::Ready(Err(_)) => *live = None,
            Poll::Pending => {
                // The request's body is still being written (an upstream that
                // answered first): finished by a task of its own, as hyper-util's
                // connection task would, the connection left in its slot where
                // a cut still reaches it.
                let (slot, pool, host) = (self.live.clone(), self.pool.clone(), self.host.clone());
                if let Ok(rt) = tokio::runtime::Handle::try_current() {
                    rt.spawn(finish(slot, pool, host));
                } else {
                    *live = None;
                }
            }
        }
    }
}

/// Drives the connection in `slot` until it can take another request, then
/// gives it back; ends when it ends or is cut.
async fn finish(slot: Slot, pool: Arc<Pool>, host: Authority) {
    let idle = std::future::poll_fn(|cx| {
        let mut live = lock(&slot);
        let Some(l) = live.as_mut() else {
            return Poll::Ready(false);
        };
        if l.poll_conn(cx) {
            *live = None;
            return Poll::Ready(false);
        }
        match l.send.poll_ready(cx) {
            Poll::Ready(Ok(())) => Poll::Ready(true),
            Poll::Ready(Err(_)) => {
                *live = None;
                Poll::Ready(false)
            }
            Poll::Pending => Poll::Pending,
        }
    })
    .await;
    let live = lock(&slot).take();
    if let (true, Some(live)) = (idle, live) {
        pool.put(host, live);
    }
}

impl Body for OwnBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        if this.released {
            return Pin::new(&mut this.body).poll_frame(cx);
        }
        let slot = this.live.clone();
        let mut live = lock(&slot);
        if let Some(l) = live.as_mut() {
            if l.poll_conn(cx) {
                *live = None;
            }
        }
        let frame = Pin::new(&mut this.body).poll_frame(cx);
        match &frame {
            Poll::Ready(None) => this.release(&mut live, cx),
            Poll::Ready(Some(Ok(_))) if this.body.is_end_stream() => this.release(&mut live, cx),
            Poll::Ready(Some(Err(_))) => *live = None,
            _ => {}
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for OwnBody {
    /// Read to its end without the last poll that says so: still given back.
    /// Dropped before its end: the connection closes (a cut one with a reset).
    fn drop(&mut self) {
        if self.released {
            return;
        }
        let slot = self.live.clone();
        let mut live = lock(&slot);
        if live.is_some() && self.body.is_end_stream() {
            self.release(&mut live, &mut Context::from_waker(Waker::noop()));
        } else {
            *live = None;
        }
    }
}
