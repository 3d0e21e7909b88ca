//! The in-process harness: fencegate's own `server::build_with_store` and
//! `App::run` (what `serve` and `demo` run), on listeners bound to port 0, in this
//! test process, on the `dir` lease store in a temporary directory.
//!
//! - Time: one [`ManualClock`], started at the real time, is fencegate's clock and
//!   the workers'. It moves only when a test says so ([`Fencegate::advance_to`]), so
//!   expiry is a clock step, never a sleep, and a 30 s lease never expires by itself
//!   on a slow machine. (The `dir` store's `LastModified` is a file's mtime, real
//!   time: starting the clock at the real time keeps expiry arithmetic in line.)
//!   Route, drain and header timeouts still run on tokio's real timer.
//! - The store: fencegate's lease store is the `dir` store behind a [`FaultStore`]
//!   ([`Fencegate::store`]); the workers have their own handle on the same directory
//!   ([`Fencegate::epochs`]), as separate processes would.
//! - Logs and panics: fencegate runs on its own runtime whose threads log into a
//!   buffer of its own ([`Fencegate::logs`]), shown when a test fails. A panic on
//!   one of them (which a process would survive too, as a dropped connection) fails
//!   the test when the harness is dropped: bad input must never crash anything.
//! - Stopping: [`Fencegate::stop`] is the graceful shutdown; dropping it abandons
//!   whatever is still in flight, then shuts down the same way.
//! - State: sled in the temporary directory, or — inside a test declared with
//!   [`on_both_backends!`], once per backend — a fresh database on the test run's
//!   PostgreSQL ([`PgServer::shared`]).

use std::cell::RefCell;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, SystemTime};

use fencegate::clock::{Clock, ManualClock};
use fencegate::config::Config;
use fencegate::epoch::LeaseName;
use fencegate::lease::acquire::{self, Holding};
use fencegate::lease::dir::DirStore;
use fencegate::lease::{Epochs, LeaseStore};
use fencegate::server;

pub use crate::common::postgres::PgServer;
pub use crate::common::*;

/// The `grace_ms` of the harness's `[store]`: contenders wait this long past an
/// expiry.
pub const GRACE: Duration = Duration::from_millis(500);

/// Where marks and dedup records live (`[state]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sled,
    Postgres,
}

tokio::task_local! {
    /// The backend of the test running on this task ([`on_both_backends!`]).
    pub static BACKEND: Backend;
}

/// Declares each test twice, `NAME::sled` and `NAME::postgres`: the same body
/// with the in-process fencegate's state on each backend (the PostgreSQL one
/// skips, saying why, where no PostgreSQL is installed).
macro_rules! on_both_backends {
    ($( $(#[doc = $doc:expr])* async fn $name:ident() { $($body:tt)* } )*) => {$(
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            $(#[doc = $doc])*
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sled() {
                $crate::support::BACKEND
                    .scope($crate::support::Backend::Sled, async { $($body)* })
                    .await
            }
            $(#[doc = $doc])*
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                if !$crate::common::postgres::available_or_skip() {
                    return;
                }
                $crate::support::BACKEND
                    .scope($crate::support::Backend::Postgres, async { $($body)* })
                    .await
            }
        }
    )*};
}
pub(crate) use on_both_backends;

/// The `[state]` section for the running test's backend.
fn state_section() -> String {
    match BACKEND.try_with(|b| *b).unwrap_or(Backend::Sled) {
        Backend::Sled => String::new(),
        Backend::Postgres => format!(
            "[state]\nkind = \"postgres\"\nurl = \"{}\"\n",
            PgServer::shared().database()
        ),
    }
}

/// How one in-process fencegate is set up; the routes and any other sections are
/// the `rest` argument of [`Fencegate::start_with`].
pub struct Setup<'a> {
    /// `refresh_interval_ms` of the store.
    pub refresh_ms: u64,
    /// Extra `[server]` keys, one per line.
    pub server: &'a str,
    /// The log filter (`FENCEGATE_LOG` syntax).
    pub log: &'a str,
}

impl Default for Setup<'_> {
    fn default() -> Self {
        Setup {
            refresh_ms: 200,
            server: "",
            log: "info",
        }
    }
}

/// A fencegate running in this process. See the module docs.
pub struct Fencegate {
    pub proxy: SocketAddr,
    pub admin: SocketAddr,
    /// Fencegate's clock and the workers'.
    pub clock: Arc<ManualClock>,
    /// Fencegate's lease store: set faults here.
    pub store: Arc<FaultStore>,
    /// The workers' handle on the lease store (never faulted).
    pub epochs: Epochs,
    _dir: tempfile::TempDir,
    /// What fencegate logged.
    pub logs: Logs,
    /// Panics on fencegate's threads.
    panics: Arc<AtomicUsize>,
    abandon: tokio_util::sync::CancellationToken,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    finished: Option<std::sync::mpsc::Receiver<Result<(), String>>>,
}

impl Fencegate {
    /// Starts fencegate with the harness's `[server]` and `[store]` sections and
    /// `rest` (routes, `[dedup]`...).
    pub async fn start(refresh_ms: u64, rest: &str) -> Fencegate {
        Fencegate::start_with(
            Setup {
                refresh_ms,
                ..Setup::default()
            },
            rest,
        )
        .await
    }

    pub async fn start_with(setup: Setup<'_>, rest: &str) -> Fencegate {
        let dir = tempfile::tempdir().unwrap();
        let leases = dir.path().join("leases");
        let text = format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\ndata_dir = \"{}\"\nshutdown_timeout_ms = 5000\n{}\n\n[store]\nkind = \"dir\"\npath = \"{}\"\nprefix = \"{PREFIX}\"\nrefresh_interval_ms = {}\ngrace_ms = {}\n\n{}{rest}",
            dir.path().join("state").display(),
            setup.server,
            leases.display(),
            setup.refresh_ms,
            GRACE.as_millis(),
            state_section(),
        );
        let cfg = Config::parse(&text).unwrap_or_else(|e| panic!("config: {e}\n{text}"));
        cfg.validate()
            .unwrap_or_else(|e| panic!("config: {e}\n{text}"));
        let clock = ManualClock::new(SystemTime::now());
        let local: Arc<dyn Clock> = clock.clone();
        let dir_store = |root| -> Arc<dyn LeaseStore> {
            Arc::new(DirStore::open(root, local.clone()).expect("opening the dir store"))
        };
        let store = FaultStore::new(dir_store(&leases));
        let epochs = Epochs::new(dir_store(&leases), PREFIX);

        let logs = Logs::default();
        let dispatch = tracing::Dispatch::new(
            tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new(setup.log))
                .with_writer(logs.clone())
                .with_ansi(false)
                .finish(),
        );
        let panics = Arc::new(AtomicUsize::new(0));
        count_panics();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (finished_tx, finished_rx) = std::sync::mpsc::channel();
        let fenced: Arc<dyn LeaseStore> = store.clone();
        let panicked = panics.clone();
        std::thread::Builder::new()
            .name("fencegate-inproc".into())
            .spawn(move || {
                let _logs = tracing::dispatcher::set_default(&dispatch);
                PANICS.set(Some(panicked.clone()));
                let on_start = dispatch.clone();
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .thread_name("fencegate-inproc-rt")
                    .enable_all()
                    // Each runtime thread logs to this fencegate's buffer, and counts
                    // its panics here, for its life.
                    .on_thread_start(move || {
                        std::mem::forget(tracing::dispatcher::set_default(&on_start));
                        PANICS.set(Some(panicked.clone()));
                    })
                    .build()
                    .expect("building fencegate's runtime");
                let result = rt.block_on(async move {
                    let started = async {
                        let app = server::build_with_store(&cfg, local, fenced).await?;
                        let proxy_l = server::bind(cfg.server.listen).await?;
                        let admin_l = server::bind(cfg.server.admin_listen).await?;
                        Ok::<_, server::StartError>((app, proxy_l, admin_l))
                    };
                    let (app, proxy_l, admin_l) = match started.await {
                        Ok(s) => s,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e.to_string()));
                            return Err(e.to_string());
                        }
                    };
                    let addrs = (proxy_l.local_addr(), admin_l.local_addr());
                    let _ = ready_tx.send(Ok((addrs, app.abandon_handle())));
                    // Ends when `stop` is sent or dropped.
                    let shutdown = async {
                        let _ = stop_rx.await;
                    };
                    app.run(proxy_l, admin_l, shutdown)
                        .await
                        .map_err(|e| e.to_string())
                });
                let _ = finished_tx.send(result);
            })
            .expect("spawning fencegate's thread");
        let ((proxy, admin), abandon) = match ready_rx.await {
            Ok(Ok(ready)) => ready,
            Ok(Err(e)) => panic!("fencegate did not start: {e}\n{}", logs.text()),
            Err(_) => panic!("fencegate's thread died\n{}", logs.text()),
        };
        Fencegate {
            proxy: proxy.unwrap(),
            admin: admin.unwrap(),
            clock,
            store,
            epochs,
            _dir: dir,
            logs,
            panics,
            abandon,
            stop: Some(stop_tx),
            finished: Some(finished_rx),
        }
    }

    /// Moves the clock forward to `t` (never back).
    pub fn advance_to(&self, t: SystemTime) {
        if let Ok(by) = t.duration_since(self.clock.now()) {
            self.clock.advance(by);
        }
    }

    /// Moves the clock past the end of `h`'s tenure, plus the grace contenders
    /// wait (and `LastModified`'s resolution): anyone may acquire the lease now.
    pub fn expire_with_grace(&self, h: &Holding) {
        self.advance_to(acquire::free_at(h.expires_at, GRACE) + Duration::from_millis(1));
    }

    /// The graceful shutdown (SIGTERM's): in-flight requests finish, state is
    /// flushed; what `App::run` returned.
    pub async fn stop(mut self) -> Result<(), String> {
        let _ = self.stop.take().map(|s| s.send(()));
        let finished = self.finished.take().expect("running");
        tokio::task::spawn_blocking(move || finished.recv())
            .await
            .unwrap()
            .unwrap_or_else(|_| Err("fencegate's thread died".into()))
    }
}

impl Gateway for Fencegate {
    fn proxy_addr(&self) -> SocketAddr {
        self.proxy
    }

    fn admin_addr(&self) -> SocketAddr {
        self.admin
    }
}

impl Drop for Fencegate {
    fn drop(&mut self) {
        if let Some(finished) = self.finished.take() {
            // Requests a test left at the origin end at once (in doubt) rather
            // than holding up the shutdown.
            self.abandon.cancel();
            drop(self.stop.take());
            match finished.recv_timeout(Duration::from_secs(20)) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => eprintln!("fencegate stopped with an error: {e}"),
                Err(_) => eprintln!("fencegate did not stop within 20 s; left running"),
            }
        }
        if std::thread::panicking() {
            eprintln!("---- fencegate log ----\n{}", self.logs.text());
            return;
        }
        let panics = self.panics.load(Ordering::SeqCst);
        assert_eq!(
            panics,
            0,
            "fencegate panicked (see above)\n---- fencegate log ----\n{}",
            self.logs.text()
        );
    }
}

thread_local! {
    /// The panic count of the fencegate this thread runs, if it runs one.
    static PANICS: RefCell<Option<Arc<AtomicUsize>>> = const { RefCell::new(None) };
}

/// Installs (once) a panic hook that counts panics on fencegate's threads, then
/// reports them as before.
fn count_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let report = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let _ = PANICS.try_with(|p| {
                if let Some(count) = p.borrow().as_ref() {
                    count.fetch_add(1, Ordering::SeqCst);
                }
            });
            report(info)
        }));
    });
}

/// Acquires `lease` for `holder` (SPEC §2) on the workers' handle, now: the clock
/// does not move by itself, so a held lease is a test's mistake (advance the clock
/// past the holder's expiry first: [`Fencegate::expire_with_grace`]).
pub async fn acquire(epochs: &Epochs, lease: &str, holder: &str, ttl: Duration) -> Holding {
    let lease = LeaseName::parse(lease).unwrap();
    acquire::acquire(epochs, &lease, holder, ttl, GRACE, None)
        .await
        .unwrap_or_else(|e| panic!("acquire {lease} for {holder}: {e}"))
}

/// One fencegate's log: a buffer its subscriber's writers share.
#[derive(Clone, Default)]
pub struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    /// Everything logged so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|p| p.into_inner())).into_owned()
    }
}

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;

    fn make_writer(&'a self) -> Logs {
        self.clone()
    }
}

/// A recording origin and an in-process fencegate with one route, `/billing/` on
/// lease `billing` (`route_extra`: more keys of that route).
pub async fn billing_route(refresh_ms: u64, route_extra: &str) -> (Origin, Fencegate) {
    let origin = Origin::start().await;
    let fg = Fencegate::start(
        refresh_ms,
        &route_toml("billing", "billing", &origin, route_extra),
    )
    .await;
    (origin, fg)
}

/// A request body the test feeds chunk by chunk; it ends when the sender drops.
pub struct Fed(pub tokio::sync::mpsc::Receiver<bytes::Bytes>);

impl hyper::body::Body for Fed {
    type Data = bytes::Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, Self::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|c| c.map(|b| Ok(hyper::body::Frame::data(b))))
    }
}
