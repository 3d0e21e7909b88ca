//! One client connection: the idle limit (one timer per connection, counted from
//! the last request or the last byte written), the request future that is
//! finished even when its client goes away, graceful shutdown, and the accept
//! loop. Plain HTTP/1 connections are served by [`park`](super::park), which
//! gives an idle connection's buffers back.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use prometheus_client::metrics::gauge::Gauge;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio_util::either::Either;
use tokio_util::sync::CancellationToken;

use super::park;
use super::socket::{Activity, Tracked};
use crate::forward::ClientHop;
use crate::metrics::ConnGauges;

/// How connections are served: plain HTTP/1 by hyper's HTTP/1 server directly
/// (so that an idle one can be [parked](super::park)), anything else (TLS, HTTP/2,
/// a first read too short to tell) by the auto builder.
pub(super) struct Builders {
    pub auto: auto::Builder<TokioExecutor>,
    pub http1: http1::Builder,
}

pub(super) fn http_builder(idle_limit: Duration) -> Builders {
    let mut b = auto::Builder::new(TokioExecutor::new());
    // hyper's own header read timeout is off: it arms a timer for every request,
    // which cost ~5% of a forwarded request's CPU. `close_when_idle` enforces the
    // same limit with one timer per connection.
    b.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(None)
        .max_buf_size(128 * 1024);
    b.http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(256)
        // Pings are writes, and writes count as activity for `close_when_idle`:
        // kept above its limit, they cannot keep an idle connection open.
        .keep_alive_interval(Duration::from_secs(30).max(idle_limit * 2));
    let mut http1 = http1::Builder::new();
    http1
        .timer(TokioTimer::new())
        .header_read_timeout(None)
        .max_buf_size(128 * 1024);
    Builders { auto: b, http1 }
}

/// Graceful shutdown of every connection: an idle one closes at once, a busy one
/// after its answer; [`Shutdown::shutdown`] returns when all have ended. (What
/// hyper-util's `GracefulShutdown` does, with a signal a parked connection can
/// wait on without a hyper connection to call.)
pub(super) struct Shutdown {
    tx: watch::Sender<()>,
}

impl Shutdown {
    pub(super) fn new() -> Shutdown {
        Shutdown {
            tx: watch::channel(()).0,
        }
    }

    /// Held by a connection for its life; changes when shutdown begins.
    pub(super) fn watcher(&self) -> watch::Receiver<()> {
        self.tx.subscribe()
    }

    /// Signals every connection, then waits until each has ended.
    pub(super) async fn shutdown(&self) {
        let _ = self.tx.send(());
        self.tx.closed().await;
    }
}

/// An answer's body, noting in its connection's [`Activity`] while it waits for
/// its source ([`Activity::body_waiting`]) and until hyper drops it
/// ([`Activity::open_answers`]).
pub(super) struct Watched<B> {
    body: B,
    activity: Arc<Activity>,
    waiting: bool,
}

impl<B> Watched<B> {
    fn new(body: B, activity: Arc<Activity>) -> Watched<B> {
        activity.open_answers.fetch_add(1, Ordering::SeqCst);
        activity.answers.fetch_add(1, Ordering::SeqCst);
        Watched {
            body,
            activity,
            waiting: false,
        }
    }

    fn set_waiting(&mut self, waiting: bool) {
        if waiting != self.waiting {
            self.waiting = waiting;
            if waiting {
                self.activity.body_waiting.fetch_add(1, Ordering::SeqCst);
            } else {
                self.activity.body_waiting.fetch_sub(1, Ordering::SeqCst);
                self.activity
                    .idle_since_ms
                    .store(self.activity.now_ms(), Ordering::SeqCst);
            }
        }
    }
}

impl<B: Body + Unpin> Body for Watched<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let r = Pin::new(&mut self.body).poll_frame(cx);
        self.set_waiting(r.is_pending());
        r
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl<B> Drop for Watched<B> {
    fn drop(&mut self) {
        self.set_waiting(false);
        self.activity.open_answers.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Held by a request while it is served; the connection is idle again when the
/// last one drops.
pub(super) struct Busy(Arc<Activity>);

impl Busy {
    fn start(a: &Arc<Activity>) -> Busy {
        a.in_flight.fetch_add(1, Ordering::SeqCst);
        Busy(a.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        // Stamp before leaving, so that "idle" always comes with a fresh time.
        self.0
            .idle_since_ms
            .store(self.0.now_ms(), Ordering::SeqCst);
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The service hyper calls for each request of a connection: the handler, with
/// the connection's client hop and activity. Its future is `Unpin` (hyper's
/// `poll_without_shutdown`, which parking needs, asks for it).
#[derive(Clone)]
pub(super) struct Svc<H> {
    handler: H,
    hop: Arc<ClientHop>,
    activity: Arc<Activity>,
}

impl<H, Fut, B> hyper::service::Service<Request<Incoming>> for Svc<H>
where
    H: Fn(Request<Incoming>, Arc<ClientHop>) -> Fut,
    Fut: Future<Output = Response<B>> + Unpin,
{
    type Response = Response<Watched<B>>;
    type Error = Infallible;
    type Future = Serving<Fut>;

    fn call(&self, req: Request<Incoming>) -> Serving<Fut> {
        Serving {
            busy: Some(Busy::start(&self.activity)),
            fut: (self.handler)(req, self.hop.clone()),
        }
    }
}

/// A request being served: busy until its answer is handed to hyper.
pub(super) struct Serving<F> {
    fut: F,
    busy: Option<Busy>,
}

impl<F, B> Future for Serving<F>
where
    F: Future<Output = Response<B>> + Unpin,
{
    type Output = Result<Response<Watched<B>>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let resp = std::task::ready!(Pin::new(&mut this.fut).poll(cx));
        let Some(busy) = this.busy.take() else {
            // Polled after completion: never ready again.
            return Poll::Pending;
        };
        // The answer counts as open before the request stops counting as busy:
        // the connection never looks at rest with an answer still to write.
        let answer = resp.map(|body| Watched::new(body, busy.0.clone()));
        drop(busy);
        Poll::Ready(Ok(answer))
    }
}

/// Serves `conn`, but closes it once it has gone `limit` without a request: after
/// accepting (a client that sends nothing, or part of an HTTP/2 preface, which
/// hyper's auto builder would wait for forever), and after each answer has gone
/// out (an idle keep-alive connection, a request head trickling in — slowloris —
/// or a client that stopped reading its answer). HTTP/1 and HTTP/2 alike.
///
/// One timer per connection, re-armed only when it fires (at most once per
/// `limit`), not per request: a connection is closed between `limit` and twice
/// `limit` after its last request.
async fn close_when_idle<F, E>(conn: F, activity: &Activity, limit: Duration) -> Result<(), E>
where
    F: Future<Output = Result<(), E>>,
{
    tokio::pin!(conn);
    let check = tokio::time::sleep(limit);
    tokio::pin!(check);
    std::future::poll_fn(|cx| {
        if let Poll::Ready(r) = conn.as_mut().poll(cx) {
            return Poll::Ready(r);
        }
        while check.as_mut().poll(cx).is_ready() {
            let next = match activity.idle_for() {
                Some(idle) if idle >= limit => {
                    tracing::debug!(
                        idle_ms = idle.as_millis() as u64,
                        "no request within the header read timeout; closing the connection"
                    );
                    return Poll::Ready(Ok(()));
                }
                Some(idle) => limit - idle,
                None => limit,
            };
            check.as_mut().reset(tokio::time::Instant::now() + next);
        }
        Poll::Pending
    })
    .await
}

/// A request's future that, if dropped before it finished (its client went
/// away), is finished on its own task instead of being cancelled: gate and
/// dedup transitions must never stop halfway. Cheaper than spawning every request
/// (no extra task, no extra wake-up); only abandoned requests pay for a spawn.
pub(super) struct FinishOnDrop<F>(Option<Pin<Box<F>>>)
where
    F: Future + Send + 'static,
    F::Output: Send + 'static;

impl<F> FinishOnDrop<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    pub(super) fn new(f: F) -> Self {
        FinishOnDrop(Some(Box::pin(f)))
    }
}

impl<F> Future for FinishOnDrop<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        let Some(f) = this.0.as_mut() else {
            // Polled after completion: never ready again.
            return Poll::Pending;
        };
        let out = f.as_mut().poll(cx);
        if out.is_ready() {
            this.0 = None;
        }
        out
    }
}

impl<F> Drop for FinishOnDrop<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn drop(&mut self) {
        // Dropped while unwinding from a panic inside the future: resuming it
        // would only panic again ("async fn resumed after panicking").
        if std::thread::panicking() {
            return;
        }
        if let (Some(f), Ok(rt)) = (self.0.take(), tokio::runtime::Handle::try_current()) {
            rt.spawn(f);
        }
    }
}

/// Polls `conn`, asking it to shut down gracefully (`stop`) once `shutdown`
/// changes; holds the receiver until `conn` ends, so that shutdown waits for it.
async fn until_shutdown<C, E>(
    conn: C,
    mut shutdown: watch::Receiver<()>,
    stop: fn(Pin<&mut C>),
) -> Result<(), E>
where
    C: Future<Output = Result<(), E>>,
{
    tokio::pin!(conn);
    let changed = shutdown.changed();
    tokio::pin!(changed);
    let mut asked = false;
    std::future::poll_fn(|cx| {
        if !asked && changed.as_mut().poll(cx).is_ready() {
            asked = true;
            stop(conn.as_mut());
        }
        conn.as_mut().poll(cx)
    })
    .await
}

/// How one listener serves its connections.
pub(super) struct Listener {
    pub listener: TcpListener,
    pub builders: Arc<Builders>,
    /// Stops accepting (connections already open go on).
    pub stop: CancellationToken,
    /// At most this many connections at once; more are closed at accept.
    pub limit: Arc<Semaphore>,
    /// Where the proxy listener finds its TLS acceptor, per connection (a reload
    /// may replace the certificate); `None` for the admin listener.
    pub tls: Option<Arc<crate::live::LiveConfig>>,
    /// The TLS handshake's bound, and how long a connection may go without a
    /// request.
    pub idle_limit: Duration,
    /// Open and parked connections, counted for the metrics.
    pub gauges: ConnGauges,
    /// At the cap, close the connection idle longest to make room instead of
    /// the new one (the admin listener: a liveness probe is always answered).
    pub evict_idle: bool,
}

/// Accepts connections until `l.stop`, serving each request with `handler`;
/// `shutdown` tracks the connections for a graceful stop.
pub(super) async fn accept_loop<F, Fut, B>(l: Listener, handler: F, shutdown: &Shutdown)
where
    F: Fn(Request<Incoming>, Arc<ClientHop>) -> Fut + Clone + Send + Sync + Unpin + 'static,
    Fut: Future<Output = Response<B>> + Unpin + Send + 'static,
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let Listener {
        listener,
        builders,
        stop,
        limit,
        tls,
        idle_limit,
        gauges,
        evict_idle,
    } = l;
    let open_conns = Arc::new(Registry::default());
    loop {
        let (stream, peer) = tokio::select! {
            _ = stop.cancelled() => return,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
        };
        let permit = match limit.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) if evict_idle && open_conns.close_idle() => {
                gauges.evicted.inc();
                match make_room(&limit, &open_conns, &gauges).await {
                    Some(p) => p,
                    None => {
                        gauges.refused.inc();
                        continue;
                    }
                }
            }
            Err(_) => {
                gauges.refused.inc();
                tracing::warn!(%peer, "connection limit reached; closing the new connection");
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let tls = tls.as_ref().and_then(|l| l.current().tls.clone());
        let proto = if tls.is_some() { "https" } else { "http" };
        let activity = Activity::new();
        let svc = Svc {
            handler: handler.clone(),
            hop: Arc::new(ClientHop::new(peer, proto)),
            activity: activity.clone(),
        };
        let builders = builders.clone();
        let watcher = shutdown.watcher();
        let open = Open::new(&gauges.open, permit);
        let parked = gauges.parked.clone();
        let evicted = evict_idle.then(|| open_conns.add(activity.clone()));
        let at_rest = activity.clone();
        tokio::spawn(Evictable::new(evicted, at_rest, async move {
            let _open = open;
            let (io, svc, watcher) = match tls {
                None => {
                    let limits = park::Limits::new(idle_limit);
                    match park::serve(
                        stream,
                        &builders.http1,
                        svc,
                        &activity,
                        limits,
                        watcher,
                        &parked,
                    )
                    .await
                    {
                        park::Served::Done => return,
                        // HTTP/2, or too little read to tell: the auto builder.
                        park::Served::NotHttp1(stream, svc, watcher) => {
                            (Either::Left(stream), svc, watcher)
                        }
                    }
                }
                // The TLS stream is boxed (and its handshake too): a plain
                // connection's task stays as small as if TLS did not exist.
                Some(acceptor) => {
                    match tokio::time::timeout(idle_limit, Box::pin(acceptor.accept(stream))).await
                    {
                        Ok(Ok(s)) => (Either::Right(Box::new(s)), svc, watcher),
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "TLS handshake failed");
                            return;
                        }
                        Err(_) => return,
                    }
                }
            };
            let io = TokioIo::new(Tracked::new(io, Bytes::new(), activity.clone()));
            // Boxed: the task of a parked plain connection does not carry its size.
            let conn = Box::pin(builders.auto.serve_connection(io, svc).into_owned());
            let conn = until_shutdown(conn, watcher, |c| c.get_mut().as_mut().graceful_shutdown());
            if let Err(e) = close_when_idle(conn, &activity, idle_limit).await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        }));
    }
}

/// Waits for the place of a connection asked to close. An evicted connection
/// gives its place back once its task has seen the signal, which on a busy
/// machine may take a while, and one that took a request meanwhile finishes it
/// first: every quarter second without a place another idle one is asked, for
/// up to ten seconds (the accept loop waits meanwhile, so at most one extra
/// descriptor is held, as the budget counts). `None` when every connection
/// stayed busy all along.
async fn make_room(
    limit: &Arc<Semaphore>,
    open_conns: &Registry,
    gauges: &ConnGauges,
) -> Option<tokio::sync::OwnedSemaphorePermit> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let step = (tokio::time::Instant::now() + Duration::from_millis(250)).min(deadline);
        match tokio::time::timeout_at(step, limit.clone().acquire_owned()).await {
            Ok(p) => return p.ok(),
            Err(_) if step >= deadline => return None,
            Err(_) => {
                if open_conns.close_idle() {
                    gauges.evicted.inc();
                }
            }
        }
    }
}

/// A listener's open connections, for eviction: each one's activity and the
/// signal that asks it to close.
#[derive(Default)]
struct Registry {
    /// The last id given, and each open connection by id.
    inner: std::sync::Mutex<(u64, HashMap<u64, Entry>)>,
}

/// A registered connection: what it is doing, and how to ask it to close.
type Entry = (Arc<Activity>, CancellationToken);

/// A connection's place in its [`Registry`]: removed when dropped.
struct Registered {
    registry: Arc<Registry>,
    id: u64,
    evict: CancellationToken,
}

impl Registry {
    fn add(self: &Arc<Self>, activity: Arc<Activity>) -> Registered {
        let evict = CancellationToken::new();
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.0 += 1;
        let id = g.0;
        g.1.insert(id, (activity, evict.clone()));
        Registered {
            registry: self.clone(),
            id,
            evict,
        }
    }

    /// Asks the connection idle longest (nothing of an exchange in it) to
    /// close; false when every one is busy.
    fn close_idle(&self) -> bool {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let idlest =
            g.1.values()
                .filter(|(a, t)| a.at_rest() && !t.is_cancelled())
                .max_by_key(|(a, _)| a.idle_for().unwrap_or_default());
        match idlest {
            Some((_, t)) => {
                t.cancel();
                true
            }
            None => false,
        }
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        let mut g = self
            .registry
            .inner
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        g.1.remove(&self.id);
    }
}

pin_project_lite::pin_project! {
    /// A connection's task that ends when asked to (eviction) once the
    /// connection is at rest between its polls: hyper has handed every complete
    /// request head to the service by then, so no request is cut.
    struct Evictable<F> {
        #[pin]
        fut: F,
        // Only an evicting listener's connections have one.
        asked: Option<Pin<Box<tokio_util::sync::WaitForCancellationFutureOwned>>>,
        registered: Option<Registered>,
        activity: Arc<Activity>,
    }
}

impl<F: Future<Output = ()>> Evictable<F> {
    fn new(registered: Option<Registered>, activity: Arc<Activity>, fut: F) -> Self {
        Evictable {
            fut,
            asked: registered
                .as_ref()
                .map(|r| Box::pin(r.evict.clone().cancelled_owned())),
            registered,
            activity,
        }
    }
}

impl<F: Future<Output = ()>> Future for Evictable<F> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.project();
        if this.fut.poll(cx).is_ready() {
            return Poll::Ready(());
        }
        let asked = this
            .asked
            .as_mut()
            .is_some_and(|a| a.as_mut().poll(cx).is_ready());
        if asked && this.activity.at_rest() {
            tracing::debug!("admin connection limit reached: closing an idle connection");
            return Poll::Ready(());
        }
        Poll::Pending
    }
}

/// An open connection: counted in `fencegate_connections_open`, holding its place
/// under `max_connections`, until it drops.
struct Open {
    gauge: Gauge,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Open {
    fn new(gauge: &Gauge, permit: tokio::sync::OwnedSemaphorePermit) -> Open {
        gauge.inc();
        Open {
            gauge: gauge.clone(),
            _permit: permit,
        }
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request whose connection drops it halfway still runs to its end.
    #[tokio::test]
    async fn a_dropped_request_is_finished_in_the_background() {
        let (started_tx, started_rx) = tokio::sync::oneshot::channel();
        let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        let fut = FinishOnDrop::new(async move {
            let _ = started_tx.send(());
            let _ = go_rx.await;
            let _ = done_tx.send("finished");
        });
        let client = tokio::spawn(fut);
        started_rx.await.unwrap();
        client.abort(); // the client went away
        assert!(client.await.unwrap_err().is_cancelled());
        go_tx.send(()).unwrap();
        assert_eq!(done_rx.await.unwrap(), "finished");
    }

    #[tokio::test]
    async fn a_finished_request_is_not_run_again() {
        let runs = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let r = runs.clone();
        let out = FinishOnDrop::new(async move { r.fetch_add(1, Ordering::SeqCst) + 1 }).await;
        tokio::task::yield_now().await;
        assert_eq!((out, runs.load(Ordering::SeqCst)), (1, 1));
    }
}
