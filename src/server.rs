//! Start-up and the listeners: open durable state, open and self-test the store,
//! build one fence per lease, then serve the proxy and admin listeners until a
//! shutdown signal, and drain.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::either::Either;
use tokio_util::sync::CancellationToken;

use crate::admin::Admin;
use crate::clock::Clock;
use crate::config::Config;
use crate::dedup::Dedup;
use crate::epoch::LeaseName;
use crate::fence::Fences;
use crate::forward::Peer;
use crate::lease::{self, Epochs, LeaseStore, StoreError};
use crate::metrics::Metrics;
use crate::proxy::{Proxy, Route};
use crate::shared::Shared;
use crate::state::sled::SledState;
use crate::state::{Owner, StateError, StateStore};

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    State(#[from] StateError),
    #[error("lease store: {0}")]
    Store(#[from] StoreError),
    #[error(transparent)]
    Probe(#[from] lease::probe::ProbeError),
    #[error("route {route}: {message}")]
    Route { route: String, message: String },
    #[error("TLS: {0}")]
    Tls(String),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// Everything a running fencegate owns.
pub struct App {
    pub shared: Arc<Shared>,
    pub proxy: Arc<Proxy>,
    pub admin: Arc<Admin>,
    /// The longest drain timeout of each lease's routes: how long stopping a fence
    /// waits for its requests before aborting them.
    drain_timeouts: HashMap<LeaseName, Duration>,
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    shutdown_timeout: Duration,
    max_connections: usize,
    header_read_timeout: Duration,
    tls: Option<tokio_rustls::TlsAcceptor>,
}

/// Loads the listener's certificate and key and advertises h2 and http/1.1.
fn tls_acceptor(cfg: &crate::config::TlsConfig) -> Result<tokio_rustls::TlsAcceptor, StartError> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&cfg.cert)
        .and_then(|it| it.collect::<Result<_, _>>())
        .map_err(|e| StartError::Tls(format!("reading certificate {}: {e}", cfg.cert.display())))?;
    let key = PrivateKeyDer::from_pem_file(&cfg.key)
        .map_err(|e| StartError::Tls(format!("reading private key {}: {e}", cfg.key.display())))?;
    let mut sc = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| StartError::Tls(e.to_string()))?
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .map_err(|e| StartError::Tls(format!("certificate and key do not form a valid pair: {e}")))?;
    sc.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(sc)))
}

/// Builds the app from a validated config: nothing listens yet.
pub async fn build(cfg: &Config, clock: Arc<dyn Clock>) -> Result<App, StartError> {
    build_on(cfg, clock, None).await
}

/// [`build`] on a lease store the caller opened (tests: a fault-injecting wrapper
/// over the `dir` store). `cfg.store` still gives the prefix and intervals; its
/// kind and location are not used.
pub async fn build_with_store(
    cfg: &Config,
    clock: Arc<dyn Clock>,
    store: Arc<dyn LeaseStore>,
) -> Result<App, StartError> {
    build_on(cfg, clock, Some(store)).await
}

async fn build_on(
    cfg: &Config,
    clock: Arc<dyn Clock>,
    store: Option<Arc<dyn LeaseStore>>,
) -> Result<App, StartError> {
    for w in cfg.warnings() {
        tracing::warn!("{w}");
    }
    let durable: Arc<dyn StateStore> = SledState::open(&cfg.server.data_dir)?;
    let store = match store {
        Some(s) => s,
        None => lease::open(&cfg.store, clock.clone()).await?,
    };
    lease::probe::self_test(store.as_ref(), &cfg.store.prefix).await?;
    let epochs = Epochs::new(store.clone(), cfg.store.prefix.clone());
    let dedup = Arc::new(Dedup::new(durable.clone(), clock.clone(), cfg.dedup.ttl));
    let recovered = dedup.recover(Owner::SINGLE).await?;
    if recovered > 0 {
        tracing::warn!(
            records = recovered,
            "dedup records left in flight by a previous run are now in doubt"
        );
    }
    let refresh = Duration::from_millis(cfg.store.refresh_interval_ms);
    // The longest drain timeout among a lease's routes (see Gate::restarted).
    let mut settle: HashMap<LeaseName, Duration> = HashMap::new();
    for r in &cfg.routes {
        let s = settle.entry(r.lease.clone()).or_default();
        *s = (*s).max(r.drain_timeout());
    }
    let fences = Fences::new(epochs.clone(), durable.clone());
    let mut clients: HashMap<Option<std::path::PathBuf>, crate::forward::HttpsClient> =
        HashMap::new();
    let mut routes = Vec::new();
    for rc in &cfg.routes {
        let fence = fences
            .start(
                &rc.lease,
                settle.get(&rc.lease).copied().unwrap_or_default(),
            )
            .await?;
        let route_err = |message: String| StartError::Route {
            route: rc.name.clone(),
            message,
        };
        let client = match clients.get(&rc.ca_file) {
            Some(c) => c.clone(),
            None => {
                let tls = crate::forward::tls_config(rc.ca_file.as_deref()).map_err(route_err)?;
                let c = crate::forward::client(tls, (rc.timeout() / 2).min(Duration::from_secs(5)));
                clients.insert(rc.ca_file.clone(), c.clone());
                c
            }
        };
        routes.push(Route::new(rc, fence, client).map_err(route_err)?);
    }
    let tls = cfg.server.tls.as_ref().map(tls_acceptor).transpose()?;
    let shared = Arc::new(Shared {
        state: durable,
        store,
        fences: fences.clone(),
        dedup: dedup.clone(),
        routes: cfg
            .routes
            .iter()
            .map(|r| (r.name.clone(), r.lease.clone()))
            .collect(),
    });
    let metrics = Metrics::new(shared.clone());
    let proxy = Arc::new(Proxy::new(routes, &shared, metrics.clone()));
    let stop = CancellationToken::new();
    let tasks = vec![
        tokio::spawn(crate::fence::refresh_all(fences, refresh, stop.clone())),
        tokio::spawn(
            dedup
                .clone()
                .run_sweeper(cfg.dedup.sweep_interval, stop.clone()),
        ),
    ];
    let admin_token = std::env::var("FENCEGATE_ADMIN_TOKEN")
        .ok()
        .filter(|t| !t.is_empty())
        .or_else(|| cfg.server.admin_token.clone());
    let admin = Arc::new(Admin::new(
        shared.clone(),
        metrics,
        admin_token,
        Duration::from_millis(cfg.store.timeout_ms),
    ));
    Ok(App {
        shared,
        proxy,
        admin,
        drain_timeouts: settle,
        stop,
        tasks,
        shutdown_timeout: Duration::from_millis(cfg.server.shutdown_timeout_ms),
        max_connections: cfg.server.max_connections,
        header_read_timeout: Duration::from_millis(cfg.server.header_read_timeout_ms),
        tls,
    })
}

/// Binds a listener, naming the address on failure.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::Bind { addr, source })
}

fn http_builder(idle_limit: Duration) -> auto::Builder<TokioExecutor> {
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
    b
}

/// What a connection is doing, for [`close_when_idle`]: requests being served,
/// and when the last one ended.
struct Activity {
    started: Instant,
    in_flight: AtomicUsize,
    /// Milliseconds after `started` when the connection last became idle.
    idle_since_ms: AtomicU64,
    /// Milliseconds after `started` of the last write that moved bytes: a large
    /// answer still going out to a slow reader is not idleness.
    wrote_ms: AtomicU64,
}

impl Activity {
    fn new() -> Arc<Activity> {
        Arc::new(Activity {
            started: Instant::now(),
            in_flight: AtomicUsize::new(0),
            idle_since_ms: AtomicU64::new(0),
            wrote_ms: AtomicU64::new(0),
        })
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// How long the connection has been without a request (`None`: serving one).
    fn idle_for(&self) -> Option<Duration> {
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            return None;
        }
        let since = self
            .idle_since_ms
            .load(Ordering::SeqCst)
            .max(self.wrote_ms.load(Ordering::Relaxed));
        Some(Duration::from_millis(self.now_ms().saturating_sub(since)))
    }
}

/// The connection's socket, noting in its [`Activity`] when a write moves bytes.
struct Tracked<S> {
    io: S,
    activity: Arc<Activity>,
}

impl<S> Tracked<S> {
    fn wrote(&self, r: &Poll<std::io::Result<usize>>) {
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
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Tracked<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
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
        let r = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.wrote(&r);
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// Held by a request while it is served; the connection is idle again when the
/// last one drops.
struct Busy(Arc<Activity>);

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
struct FinishOnDrop<F>(Option<Pin<Box<F>>>)
where
    F: Future + Send + 'static,
    F::Output: Send + 'static;

impl<F> FinishOnDrop<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn new(f: F) -> Self {
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
        if let (Some(f), Ok(rt)) = (self.0.take(), tokio::runtime::Handle::try_current()) {
            rt.spawn(f);
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn accept_loop<F, Fut>(
    listener: TcpListener,
    builder: Arc<auto::Builder<TokioExecutor>>,
    handler: F,
    graceful: &GracefulShutdown,
    stop: CancellationToken,
    limit: Arc<Semaphore>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    handshake_timeout: Duration,
) where
    F: Fn(Request<Incoming>, Arc<Peer>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<Full<Bytes>>> + Send + 'static,
{
    let proto = if tls.is_some() { "https" } else { "http" };
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
        let Ok(permit) = limit.clone().try_acquire_owned() else {
            tracing::warn!(%peer, "connection limit reached; closing the new connection");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let h = handler.clone();
        let activity = Activity::new();
        let active = activity.clone();
        let conn_peer = Arc::new(Peer::new(peer, proto));
        let svc = service_fn(move |req| {
            let busy = Busy::start(&active);
            let fut = h(req, conn_peer.clone());
            async move {
                let resp = fut.await;
                drop(busy);
                Ok::<_, Infallible>(resp)
            }
        });
        let builder = builder.clone();
        let watcher = graceful.watcher();
        let tls = tls.clone();
        tokio::spawn(async move {
            // The TLS stream is boxed (and its handshake too): a plain connection's
            // task stays as small as if TLS did not exist.
            let io = match tls {
                None => Either::Left(stream),
                Some(acceptor) => {
                    match tokio::time::timeout(handshake_timeout, Box::pin(acceptor.accept(stream)))
                        .await
                    {
                        Ok(Ok(s)) => Either::Right(Box::new(s)),
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "TLS handshake failed");
                            return;
                        }
                        Err(_) => return,
                    }
                }
            };
            let io = TokioIo::new(Tracked {
                io,
                activity: activity.clone(),
            });
            let conn = builder.serve_connection(io, svc).into_owned();
            let result = close_when_idle(watcher.watch(conn), &activity, handshake_timeout).await;
            if let Err(e) = result {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
            drop(permit);
        });
    }
}

impl App {
    /// Serves on the given listeners until `shutdown` resolves, then stops
    /// accepting, lets in-flight requests finish up to the deadline, and flushes.
    pub async fn run(
        self,
        proxy_l: TcpListener,
        admin_l: TcpListener,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), StartError> {
        let builder = Arc::new(http_builder(self.header_read_timeout));
        let graceful = GracefulShutdown::new();
        let admin_graceful = GracefulShutdown::new();
        let accept_stop = CancellationToken::new();
        let limit = Arc::new(Semaphore::new(self.max_connections));
        let proxy = self.proxy.clone();
        let proxy_handler = move |req: Request<Incoming>, peer: Arc<Peer>| {
            // A client going away must not cancel a request halfway through its
            // gate or dedup transitions.
            FinishOnDrop::new(proxy.clone().handle(req, peer))
        };
        let admin = self.admin.clone();
        let admin_handler = move |req: Request<Incoming>, _peer: Arc<Peer>| {
            let a = admin.clone();
            async move { a.handle(req).await }
        };
        let serve = async {
            tokio::join!(
                accept_loop(
                    proxy_l,
                    builder.clone(),
                    proxy_handler,
                    &graceful,
                    accept_stop.clone(),
                    limit.clone(),
                    self.tls.clone(),
                    self.header_read_timeout,
                ),
                accept_loop(
                    admin_l,
                    builder.clone(),
                    admin_handler,
                    &admin_graceful,
                    accept_stop.clone(),
                    Arc::new(Semaphore::new(256)),
                    None,
                    self.header_read_timeout,
                ),
            )
        };
        tokio::select! {
            _ = serve => {}
            _ = shutdown => {}
        }
        accept_stop.cancel();
        tracing::info!(
            timeout_ms = self.shutdown_timeout.as_millis() as u64,
            "shutting down: finishing in-flight requests"
        );
        let finishing = graceful.shutdown();
        tokio::pin!(finishing);
        if tokio::time::timeout(self.shutdown_timeout, &mut finishing)
            .await
            .is_err()
        {
            // Abandon what is left: each such request's dedup record becomes in
            // doubt and its worker is told the outcome is unknown.
            tracing::warn!(
                "in-flight requests did not finish before the shutdown deadline; abandoning them"
            );
            self.proxy.abandon_all();
            let _ = tokio::time::timeout(Duration::from_secs(2), &mut finishing).await;
        }
        let _ = tokio::time::timeout(Duration::from_secs(1), admin_graceful.shutdown()).await;
        self.stop.cancel();
        // Nothing is in flight any more: each fence stops at once.
        for f in self.shared.fences.all() {
            let timeout = self.drain_timeouts.get(f.lease()).copied();
            self.shared
                .fences
                .stop(f.lease(), timeout.unwrap_or_default())
                .await;
        }
        for t in self.tasks {
            t.abort();
        }
        self.shared.state.close().await?;
        tracing::info!("stopped; durable state flushed");
        Ok(())
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
