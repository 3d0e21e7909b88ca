//! Start-up and the listeners: open the state, open and self-test the store,
//! start one fence per lease, then serve the proxy and admin listeners until a
//! shutdown signal, and drain. One connection's plumbing is in `conn`.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::Request;
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

mod build;
mod conn;
mod park;
mod socket;

pub use crate::metrics::ConnGauges;
pub mod reload;

use conn::{accept_loop, http_builder, FinishOnDrop, Listener, Shutdown};

use crate::admin::Admin;
use crate::clock::Clock;
use crate::config::Config;
use crate::epoch::LeaseName;
use crate::epoch::TokenHash;
use crate::fence::Fences;
use crate::forward::ClientHop;
use crate::lease::{self, LeaseStore, StoreError};
use crate::live::Live;
use crate::metrics::Metrics;
use crate::proxy::{Proxy, Route, RouteTable};
use crate::shared::{Mode, Shared};
use crate::state::StateError;

/// Why `serve` could not start; every case is found before the proxy admits anything.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The state backend could not be opened.
    #[error(transparent)]
    State(#[from] StateError),
    /// The lease store failed.
    #[error("lease store: {0}")]
    Store(#[from] StoreError),
    /// The store's self-test failed: it does not honour conditional creates (SPEC §2).
    #[error(transparent)]
    Probe(#[from] lease::probe::ProbeError),
    /// The instance guard could not be taken (SPEC §10.1).
    #[error(transparent)]
    Guard(#[from] crate::cluster::guard::GuardError),
    /// The cluster could not be joined (SPEC §10.2).
    #[error(transparent)]
    Cluster(#[from] crate::cluster::ClusterError),
    /// A route could not be built (upstream URL, headers, CA file).
    #[error("route {route}: {message}")]
    Route {
        /// The route's name.
        route: String,
        /// What is wrong with it.
        message: String,
    },
    /// The TLS certificate or key could not be loaded.
    #[error("TLS: {0}")]
    Tls(String),
    /// Trace export could not be set up (`[telemetry]`).
    #[error("telemetry: {0}")]
    Telemetry(String),
    /// The descriptor limit leaves too little for connections (SPEC §9 "Limits").
    #[error(transparent)]
    Budget(#[from] crate::budget::TooFew),
    /// A listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The bind failure.
        #[source]
        source: std::io::Error,
    },
}

/// Everything a running fencegate owns.
pub struct App {
    shared: Arc<Shared>,
    proxy: Arc<Proxy>,
    admin: Arc<Admin>,
    metrics: Arc<Metrics>,
    /// The longest drain timeout of each lease's routes: how long stopping a fence
    /// waits for its requests before aborting them.
    drain_timeouts: HashMap<LeaseName, Duration>,
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// The trace exporter: sends what is queued once `stop` is cancelled.
    exporter: Option<tokio::task::JoinHandle<()>>,
    shutdown_timeout: Duration,
    /// How long to go on serving, not ready, after the shutdown signal.
    shutdown_delay: Duration,
    /// The proxy listener's connections at once, within the descriptor budget.
    max_connections: usize,
    /// The admin listener's.
    admin_max_connections: usize,
    /// How the descriptor limit is split (logged when serving begins).
    budget: crate::budget::Budget,
    header_read_timeout: Duration,
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
    build::build_on(cfg, clock, None).await
}

/// [`build`] on a lease store the caller opened (tests: a fault-injecting wrapper
/// over the `dir` store). `cfg.store` still gives the prefix and intervals; its
/// kind and location are not used.
pub async fn build_with_store(
    cfg: &Config,
    clock: Arc<dyn Clock>,
    store: Arc<dyn LeaseStore>,
) -> Result<App, StartError> {
    build::build_on(cfg, clock, Some(store)).await
}

/// The longest drain timeout among each lease's routes: how long stopping its
/// fence waits for its requests (and see `Gate::restarted`).
fn drain_timeouts(cfg: &Config) -> HashMap<LeaseName, Duration> {
    let mut settle: HashMap<LeaseName, Duration> = HashMap::new();
    for r in &cfg.routes {
        let s = settle.entry(r.lease.clone()).or_default();
        *s = (*s).max(r.drain_timeout());
    }
    settle
}

/// What a reload may change, built from `cfg`: each route with its lease's fence
/// (a single instance's, started or the running one; a cluster's fences follow
/// its shards), an upstream client per CA bundle and client certificate, the admin token
/// (`FENCEGATE_ADMIN_TOKEN` wins over the file), the listener's TLS.
async fn build_live(
    cfg: &Config,
    fences: &Fences,
    mode: &Mode,
    metrics: &Metrics,
    upstreams: &Arc<crate::budget::Upstreams>,
) -> Result<Live, StartError> {
    let settle = drain_timeouts(cfg);
    type TlsFiles = (
        Option<std::path::PathBuf>,
        Option<std::path::PathBuf>,
        Option<std::path::PathBuf>,
    );
    let mut clients: HashMap<TlsFiles, crate::forward::HttpsClient> = HashMap::new();
    let mut routes = Vec::new();
    let shards = mode.cluster().map_or(1, |c| c.shards());
    for rc in &cfg.routes {
        let fence = match mode {
            Mode::Single(_) => Some(
                fences
                    .start(
                        &rc.lease,
                        settle.get(&rc.lease).copied().unwrap_or_default(),
                    )
                    .await?,
            ),
            Mode::Cluster(_) => None,
        };
        let route_err = |message: String| StartError::Route {
            route: rc.name.clone(),
            message,
        };
        // The files are read again on every build: a reload picks up a renewed
        // CA bundle or client certificate.
        let tls_files = (
            rc.ca_file.clone(),
            rc.client_cert.clone(),
            rc.client_key.clone(),
        );
        let client = match clients.get(&tls_files) {
            Some(c) => c.clone(),
            None => {
                let identity = rc.client_identity().map_err(route_err)?;
                let tls = crate::forward::tls_config(rc.ca_file.as_deref(), identity.as_ref())
                    .map_err(route_err)?;
                let c = crate::forward::client(
                    tls,
                    (rc.timeout() / 2).min(Duration::from_secs(5)),
                    upstreams.idle_per_host,
                );
                clients.insert(tls_files, c.clone());
                c
            }
        };
        let shard = crate::cluster::shard_of(&rc.lease, shards);
        routes.push(
            Route::new(
                rc,
                fence,
                shard,
                client,
                upstreams.clone(),
                &cfg.state,
                metrics,
            )
            .map_err(route_err)?,
        );
    }
    let admin_token = std::env::var("FENCEGATE_ADMIN_TOKEN")
        .ok()
        .filter(|t| !t.is_empty())
        .or_else(|| cfg.server.admin_token.clone());
    Ok(Live {
        routes: RouteTable::new(routes),
        admin_token: admin_token.map(|t| TokenHash::of(t.as_bytes())),
        tls: cfg.server.tls.as_ref().map(tls_acceptor).transpose()?,
        access_log: cfg.server.access_log,
    })
}

/// Binds a listener, naming the address on failure.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::Bind { addr, source })
}

impl App {
    /// What SIGHUP calls: reloads `path`, the file this app was built from.
    pub fn reloader(
        &self,
        path: std::path::PathBuf,
        set_log: Option<reload::SetLogFilter>,
    ) -> Arc<reload::Reloader> {
        Arc::new(reload::Reloader::new(
            path,
            self.shared.clone(),
            self.metrics.clone(),
            set_log,
        ))
    }

    /// Cancelling this abandons every request still forwarding, as shutdown does
    /// after its deadline (their keys become in doubt).
    pub fn abandon_handle(&self) -> CancellationToken {
        self.proxy.abandon_token()
    }

    /// Serves on the given listeners until `shutdown` resolves; then fails
    /// `/readyz` and goes on serving for the shutdown delay, stops accepting
    /// proxy connections, lets in-flight requests finish up to the deadline,
    /// hands shards over (a cluster) or releases the guard, and flushes. The
    /// admin listener answers until then, so liveness never fails during it.
    /// Long on purpose: the shutdown is one sequence, read top to bottom in
    /// the order SPEC §8 gives it.
    pub async fn run(
        mut self,
        proxy_l: TcpListener,
        admin_l: TcpListener,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), StartError> {
        let exporter = self.exporter.take();
        let b = &self.budget;
        tracing::info!(
            limit = b.limit,
            reserved = b.reserved,
            client_connections = b.client_connections,
            upstream_requests = b.upstream_requests,
            admin_connections = b.admin_connections,
            "descriptor budget: {}",
            b.summary()
        );
        let builders = Arc::new(http_builder(self.header_read_timeout));
        let graceful = Shutdown::new();
        let admin_graceful = Shutdown::new();
        let accept_stop = CancellationToken::new();
        let admin_stop = CancellationToken::new();
        let limit = Arc::new(Semaphore::new(self.max_connections));
        let proxy = self.proxy.clone();
        let proxy_handler = move |req: Request<Incoming>, hop: Arc<ClientHop>| {
            // A client going away must not cancel a request halfway through its
            // gate or dedup transitions.
            FinishOnDrop::new(proxy.clone().handle(req, hop))
        };
        let admin = self.admin.clone();
        let admin_handler = move |req: Request<Incoming>, hop: Arc<ClientHop>| {
            let a = admin.clone();
            Box::pin(async move { a.handle(req, hop.addr.ip()).await })
        };
        let listener = |listener, limit, tls, gauges, stop: &CancellationToken| Listener {
            listener,
            builders: builders.clone(),
            stop: stop.clone(),
            limit,
            tls,
            idle_limit: self.header_read_timeout,
            gauges,
            evict_idle: false,
        };
        let serve = async {
            tokio::join!(
                accept_loop(
                    listener(
                        proxy_l,
                        limit.clone(),
                        Some(self.shared.live.clone()),
                        self.metrics.connections.clone(),
                        &accept_stop,
                    ),
                    proxy_handler,
                    &graceful,
                ),
                accept_loop(
                    Listener {
                        evict_idle: true,
                        ..listener(
                            admin_l,
                            Arc::new(Semaphore::new(self.admin_max_connections)),
                            None,
                            self.metrics.admin_connections.clone(),
                            &admin_stop,
                        )
                    },
                    admin_handler,
                    &admin_graceful,
                ),
            )
        };
        // The listeners run beside the shutdown sequence: the admin listener
        // answers (`/livez` 200, `/readyz` 503) until the state is closed.
        let stopping = async {
            shutdown.await;
            self.shared.begin_stopping();
            if !self.shutdown_delay.is_zero() {
                // Endpoint removal reaches load balancers late: keep serving
                // (not ready) until it has.
                tracing::info!(
                    delay_ms = self.shutdown_delay.as_millis() as u64,
                    "shutting down: not ready, still serving for the shutdown delay"
                );
                tokio::time::sleep(self.shutdown_delay).await;
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
            self.stop.cancel();
            if let Some(q) = &self.shared.queue {
                // No attempt starts from now on; one still out is given the
                // shutdown timeout, then cut (its outcome unknown: sent again
                // at the next start with the same webhook-id).
                q.stop(self.shutdown_timeout).await;
            }
            if let Mode::Cluster(c) = &self.shared.mode {
                // Nothing is in flight: each shard is released, successors start at once.
                c.leave().await;
            }
            // Nothing is in flight any more: each fence stops at once.
            for f in self.shared.fences.all() {
                let timeout = self.drain_timeouts.get(f.lease()).copied();
                self.shared
                    .fences
                    .stop(f.lease(), timeout.unwrap_or_default())
                    .await;
            }
            for t in &self.tasks {
                t.abort();
            }
            // Nothing is in flight: a successor may start at once.
            if let Mode::Single(guard) = &self.shared.mode {
                guard.release().await;
            }
            if let Some(t) = exporter {
                // The last spans, one try (after the guard is released: a successor
                // never waits for a collector): a collector that does not answer delays
                // the exit by at most this.
                if tokio::time::timeout(Duration::from_secs(2), t)
                    .await
                    .is_err()
                {
                    tracing::warn!("the last trace export did not finish; its spans are lost");
                }
            }
            let closed = self.shared.state.close().await;
            // Only now: liveness holds until the process is about to exit.
            admin_stop.cancel();
            closed
        };
        let (_, closed) = tokio::join!(serve, stopping);
        let _ = tokio::time::timeout(Duration::from_secs(1), admin_graceful.shutdown()).await;
        closed?;
        tracing::info!("stopped; durable state flushed");
        Ok(())
    }
}
