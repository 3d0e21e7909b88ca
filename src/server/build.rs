//! Start-up wiring: each component built by its own function, handed what it
//! needs, in an order that needs no late wiring — the lease store and its
//! self-test; the state and what it proves of the set-up that wrote it (SPEC
//! §10: one database, one set-up; a copied `data_dir` refuses); this
//! instance's place (the instance guard, or a cluster member); traces; the
//! queue (SPEC §11); then the proxy, the admin API and the background tasks.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{build_live, drain_timeouts, App, StartError};
use crate::admin::Admin;
use crate::clock::Clock;
use crate::cluster::guard::InstanceGuard;
use crate::cluster::Cluster;
use crate::config::{Config, StateKind};
use crate::dedup::Dedup;
use crate::fence::Fences;
use crate::lease::{self, Epochs, LeaseStore};
use crate::live::LiveConfig;
use crate::metrics::Metrics;
use crate::proxy::Proxy;
use crate::queue::{Queue, QueueStore};
use crate::shared::{Mode, Shared};
use crate::state::identity::Generations;
use crate::state::postgres::set_up_record::OurSetUp;
use crate::state::postgres::PostgresState;
use crate::state::sled::SledState;
use crate::state::timed::StateMetrics;
use crate::state::{Owner, StateError, StateStore};
use crate::telemetry::Telemetry;

pub(super) async fn build_on(
    cfg: &Config,
    clock: Arc<dyn Clock>,
    store: Option<Arc<dyn LeaseStore>>,
) -> Result<App, StartError> {
    for w in cfg.warnings() {
        tracing::warn!("{w}");
    }
    // Logged once serving begins (a refused start says why first).
    let budget = crate::budget::Budget::derive(cfg, crate::budget::Nofile::read().soft)?;
    let upstreams = crate::budget::Upstreams::new(&budget);
    let store = match store {
        Some(s) => s,
        None => lease::open(&cfg.store, clock.clone()).await?,
    };
    lease::probe::self_test(store.as_ref(), &cfg.store.prefix).await?;
    let mut state = OpenedState::open(cfg, &store).await?;
    let (durable, state_metrics) = crate::state::timed::Timed::wrap(state.durable.clone());
    let durable: Arc<dyn StateStore> = durable;
    let epochs = Epochs::new(store.clone(), cfg.store.prefix.clone());
    let dedup = Arc::new(Dedup::new(durable.clone(), clock.clone(), cfg.dedup.ttl));
    let refresh = Duration::from_millis(cfg.store.refresh_interval_ms);
    let fences = Fences::new(epochs.clone(), durable.clone(), refresh);
    let mode = take_place(cfg, &mut state, &store, &fences, &durable, &dedup).await?;
    let metrics = Metrics::new();
    let live = LiveConfig::new(build_live(cfg, &fences, &mode, &metrics, &upstreams).await?);
    let stop = CancellationToken::new();
    // From here tasks run (the trace exporter first): a start refused later
    // stops them.
    let mut refused = StopIfRefused(Some(stop.clone()));
    let (telemetry, exporter) = start_telemetry(cfg, &metrics, &stop)?;
    let queue = match open_queue(&state, state_metrics.clone())? {
        None => None,
        Some(queue_store) => Some(
            build_queue(
                cfg,
                queue_store,
                QueueParts {
                    live: &live,
                    mode: &mode,
                    durable: &durable,
                    fences: &fences,
                    clock: &clock,
                    stop: &stop,
                    epochs: &epochs,
                    telemetry: telemetry.clone(),
                },
            )
            .await?,
        ),
    };
    let shared = Arc::new(Shared {
        queue: queue.clone(),
        state: durable,
        state_metrics,
        store,
        fences: fences.clone(),
        dedup: dedup.clone(),
        mode: mode.clone(),
        live: live.clone(),
        stopping: Default::default(),
        upstreams: upstreams.clone(),
    });
    crate::metrics::collect::register(&metrics, shared.clone());
    let proxy = Arc::new(Proxy::new(
        &shared,
        metrics.clone(),
        peer_client(&mode, &upstreams)?,
        clock.clone(),
        telemetry,
    ));
    let tasks = start_tasks(cfg, &shared, &state, &metrics, &stop).await?;
    let admin = Arc::new(Admin::new(
        shared.clone(),
        metrics.clone(),
        Duration::from_millis(cfg.store.timeout_ms),
    ));
    refused.0 = None;
    Ok(App {
        shared,
        proxy,
        admin,
        metrics,
        drain_timeouts: drain_timeouts(cfg),
        stop,
        tasks,
        exporter,
        shutdown_timeout: Duration::from_millis(cfg.server.shutdown_timeout_ms),
        shutdown_delay: Duration::from_millis(cfg.server.shutdown_delay_ms),
        max_connections: budget.client_connections,
        admin_max_connections: budget.admin_connections,
        budget,
        header_read_timeout: Duration::from_millis(cfg.server.header_read_timeout_ms),
    })
}

/// Cancels the start's `stop` when dropped armed: start-up returned an error
/// after background tasks began, and a refused start leaves nothing running
/// (it matters in-process, where the runtime outlives the refusal).
struct StopIfRefused(Option<CancellationToken>);

impl Drop for StopIfRefused {
    fn drop(&mut self) {
        if let Some(stop) = self.0.take() {
            stop.cancel();
        }
    }
}

/// The state as opened, before this instance holds its place: the store
/// (sled or PostgreSQL) and what start-up found of who wrote it.
struct OpenedState {
    durable: Arc<dyn StateStore>,
    generations: Arc<dyn Generations>,
    /// On sled: the database (and what the queue's trees open on).
    sled: Option<Arc<SledState>>,
    /// On PostgreSQL: the database, opened, not yet migrated nor written.
    database: Option<Arc<PostgresState>>,
    /// The schema in use (PostgreSQL).
    schema: Option<String>,
    /// The database's id (`fencegate_identity`), made before this
    /// instance's first gate object names it.
    database_id: Option<String>,
    /// What the set-up check allows: held once the place is (PostgreSQL).
    may_hold: Option<crate::state::postgres::set_up_record::MayHold>,
    /// The same for a `data_dir`, and the instance id it was checked under.
    data_dir_may: Option<(crate::state::data_dir::MayHold, String)>,
}

impl OpenedState {
    /// Opens the configured state and checks, before this instance writes its
    /// own gate object (whose state would vouch for any database), that it is
    /// this set-up's (SPEC §10: one database, one set-up); a copied
    /// `data_dir` under another set-up refuses the same way. The database's id
    /// is read before the check (gate objects name it) and made after it.
    async fn open(cfg: &Config, store: &Arc<dyn LeaseStore>) -> Result<OpenedState, StartError> {
        let mut opened = match cfg.state.kind {
            StateKind::Sled => {
                let sled = SledState::open_with(
                    &cfg.server.data_dir,
                    cfg.state.cache_mb.saturating_mul(1 << 20),
                )?;
                OpenedState {
                    durable: sled.clone(),
                    generations: sled.clone(),
                    sled: Some(sled),
                    database: None,
                    schema: None,
                    database_id: None,
                    may_hold: None,
                    data_dir_may: None,
                }
            }
            StateKind::Postgres => {
                // Claimed (and migrated) once this instance holds its place in
                // the store — the guard, or the cluster's checks.
                let pg = PostgresState::open(&cfg.state).await?;
                OpenedState {
                    durable: pg.clone(),
                    generations: pg.clone(),
                    sled: None,
                    schema: Some(pg.schema().to_owned()),
                    database: Some(pg),
                    database_id: None,
                    may_hold: None,
                    data_dir_may: None,
                }
            }
        };
        if let Some(pg) = &opened.database {
            let known = pg.database_id().await?;
            let state =
                crate::set_up::state_of(&cfg.state, "", opened.schema.as_deref(), known.as_deref());
            let may = pg
                .check_set_up(
                    OurSetUp::of(cfg, &state),
                    store,
                    known.as_deref(),
                    cfg.claim_state,
                )
                .await?;
            opened.may_hold = Some(may);
            opened.database_id = Some(pg.ensure_database_id().await?);
        }
        if let Some(sled) = &opened.sled {
            let id = crate::cluster::guard::instance_id(&cfg.server.data_dir)?;
            let may = crate::state::data_dir::check(sled, store, cfg, &id).await?;
            opened.data_dir_may = Some((may, id));
        }
        Ok(opened)
    }

    /// Holds the database for this set-up (migrated, recorded) once this
    /// instance holds its place in the store.
    async fn claim_database(&mut self, store: &Arc<dyn LeaseStore>) -> Result<(), StateError> {
        match (&self.database, self.may_hold.take()) {
            (Some(pg), Some(may)) => pg.hold_set_up(may, store).await,
            _ => Ok(()),
        }
    }
}

/// This instance's place: a single instance serves every lease behind its
/// instance guard; a cluster member serves the shards it takes (their fences
/// start at takeover). The state is claimed once the place is held.
async fn take_place(
    cfg: &Config,
    state: &mut OpenedState,
    store: &Arc<dyn LeaseStore>,
    fences: &Arc<Fences>,
    durable: &Arc<dyn StateStore>,
    dedup: &Arc<Dedup>,
) -> Result<Mode, StartError> {
    let place = state.schema.as_deref().zip(state.database_id.as_deref());
    if cfg.cluster.is_none() {
        let guard = InstanceGuard::acquire(
            cfg,
            store.clone(),
            format!("http://{}", cfg.server.listen),
            place,
            state.generations.clone(),
        )
        .await?;
        state.claim_database(store).await?;
        if let (Some(sled), Some((may, id))) = (&state.sled, state.data_dir_may.take()) {
            crate::state::data_dir::hold(may, sled, store, cfg, &id).await?;
        }
        let recovered = dedup.recover(Owner::SINGLE).await?;
        if recovered > 0 {
            tracing::warn!(
                records = recovered,
                "dedup records left in flight by a previous run are now in doubt"
            );
        }
        return Ok(Mode::Single(guard));
    }
    // A cluster keeps its owner rows in the database its state is in
    // (config validation: [cluster] needs [state] kind = "postgres").
    let Some(owners) = state.database.clone() else {
        return Err(StartError::State(StateError::Open {
            path: "[state]".into(),
            detail: "[cluster] needs [state] kind = \"postgres\"".into(),
        }));
    };
    let cluster = Cluster::new(
        cfg,
        store.clone(),
        fences.clone(),
        durable.clone(),
        owners,
        dedup.clone(),
        crate::cluster::Database {
            schema: state.schema.as_deref().unwrap_or("public"),
            id: state.database_id.as_deref(),
            generations: state.generations.clone(),
        },
    )
    .await?;
    state.claim_database(store).await?;
    Ok(Mode::Cluster(cluster))
}

/// Trace export (`[telemetry]`): its own pooled client (system roots), its
/// own task. Started before what traces (the proxy, the queue's attempts).
#[allow(clippy::type_complexity)]
fn start_telemetry(
    cfg: &Config,
    metrics: &Arc<Metrics>,
    stop: &CancellationToken,
) -> Result<(Option<Arc<Telemetry>>, Option<tokio::task::JoinHandle<()>>), StartError> {
    if cfg.telemetry.otlp_endpoint.is_none() {
        return Ok((None, None));
    }
    let tls = crate::forward::tls_config(None, None).map_err(StartError::Tls)?;
    let started = Telemetry::start(
        &cfg.telemetry,
        cfg.cluster.as_ref().map(|c| c.instance_id.as_str()),
        metrics,
        crate::forward::client(tls, Duration::from_secs(1), 4),
        stop.clone(),
    )
    .map_err(StartError::Telemetry)?;
    Ok(started.map(|s| (s.telemetry, s.exporter)).unzip())
}

/// SPEC §11: the queue is kept beside the marks — trees on sled, or tables in
/// PostgreSQL (migrated by now) — and measured like every state call (`op`
/// `queue_*`).
fn open_queue(
    state: &OpenedState,
    metrics: StateMetrics,
) -> Result<Option<Arc<dyn QueueStore>>, StartError> {
    let store: Arc<dyn QueueStore> = match (&state.sled, &state.database) {
        (Some(sled), _) => {
            Arc::new(crate::queue::sled::SledQueue::open(sled.clone()).map_err(StartError::State)?)
        }
        (None, Some(pg)) => Arc::new(crate::queue::postgres::PgQueue::new(pg.clone())),
        (None, None) => return Ok(None),
    };
    Ok(Some(crate::queue::timed::TimedQueue::wrap(store, metrics)))
}

/// What the queue's deliverers need of the rest of fencegate.
struct QueueParts<'a> {
    live: &'a Arc<LiveConfig>,
    mode: &'a Mode,
    durable: &'a Arc<dyn StateStore>,
    fences: &'a Arc<Fences>,
    clock: &'a Arc<dyn Clock>,
    stop: &'a CancellationToken,
    epochs: &'a Epochs,
    telemetry: Option<Arc<Telemetry>>,
}

/// The queue, following this instance's place: a cluster's tenures start and
/// stop its deliverers. Refuses to start where a direct route would overtake
/// messages still queued for its lease (SPEC §11: a config that changed since
/// they were accepted).
async fn build_queue(
    cfg: &Config,
    store: Arc<dyn QueueStore>,
    parts: QueueParts<'_>,
) -> Result<Arc<Queue>, StartError> {
    let mode = parts.mode;
    let q = Queue::new(
        store,
        crate::queue::Context {
            live: parts.live.clone(),
            owner_of: owner_of(mode, parts.durable, parts.fences),
            drop_owner_of: drop_owner_of(mode, parts.durable),
            clock: parts.clock.clone(),
            stop: parts.stop.clone(),
            abandon: CancellationToken::new(),
            checkpoint: Some(match mode {
                Mode::Single(guard) => guard.clone() as Arc<dyn crate::state::identity::Checkpoint>,
                Mode::Cluster(c) => c.clone() as Arc<dyn crate::state::identity::Checkpoint>,
            }),
            restored: match mode {
                Mode::Single(guard) => guard.restored(),
                Mode::Cluster(c) => c.restored(),
            },
            epochs: parts.epochs.clone(),
            telemetry: parts.telemetry,
        },
    );
    if let Mode::Cluster(c) = mode {
        c.follow(Arc::new(crate::queue::FollowTenures(q.clone())));
    }
    if let Some(detail) = crate::queue::conflict(q.store.as_ref(), &cfg.routes).await? {
        return Err(StartError::State(StateError::Open {
            path: cfg.server.data_dir.clone(),
            detail,
        }));
    }
    Ok(q)
}

/// SPEC §10 applied to the queue: a lease's messages are sent from where its
/// fence runs — every lease's on a single instance, the leases of the shards
/// served here in a cluster — while the state is this set-up's and the
/// instance may forward.
fn owner_of(
    mode: &Mode,
    durable: &Arc<dyn StateStore>,
    fences: &Arc<Fences>,
) -> crate::queue::OwnerOf {
    use crate::queue::Sender;
    let (mode, state, fences) = (mode.clone(), durable.clone(), fences.clone());
    Box::new(move |lease| {
        let fence = crate::epoch::LeaseName::parse(lease)
            .ok()
            .and_then(|l| fences.get(&l));
        let Some(owner) = fence.map(|f| f.owner()) else {
            return match mode {
                Mode::Cluster(_) => Sender::Elsewhere,
                Mode::Single(_) => Sender::Later,
            };
        };
        if state.set_up_conflict().is_none() && mode.may_forward(owner) {
            Sender::Here(owner)
        } else {
            Sender::Later
        }
    })
}

/// SPEC §11: a removed route's messages wait for it "or an operator drops
/// them" — the owner to drop one under when no route names its lease: a
/// single instance's own, a cluster member's tenure of the lease's shard;
/// under the conditions [`owner_of`] puts on a sender (the state is this
/// set-up's, the instance may forward under that owner).
fn drop_owner_of(mode: &Mode, durable: &Arc<dyn StateStore>) -> crate::queue::OwnerOf {
    use crate::cluster::Placement;
    use crate::queue::Sender;
    let (mode, state) = (mode.clone(), durable.clone());
    Box::new(move |lease| {
        let Ok(name) = crate::epoch::LeaseName::parse(lease) else {
            return Sender::Later;
        };
        let owner = match &mode {
            Mode::Single(_) => Owner::SINGLE,
            Mode::Cluster(c) => match c.place(crate::cluster::shard_of(&name, c.shards())) {
                Placement::Local(owner) => owner,
                Placement::Peer { .. } => return Sender::Elsewhere,
                Placement::Unavailable => return Sender::Later,
            },
        };
        if state.set_up_conflict().is_none() && mode.may_forward(owner) {
            Sender::Here(owner)
        } else {
            Sender::Later
        }
    })
}

/// Peers are reached over plain HTTP or TLS with the system's roots (a
/// cluster's relays).
fn peer_client(
    mode: &Mode,
    upstreams: &crate::budget::Upstreams,
) -> Result<Option<crate::forward::HttpsClient>, StartError> {
    match mode {
        Mode::Single(_) => Ok(None),
        Mode::Cluster(_) => {
            let tls = crate::forward::tls_config(None, None).map_err(StartError::Tls)?;
            Ok(Some(crate::forward::client(
                tls,
                Duration::from_secs(1),
                upstreams.idle_per_host,
            )))
        }
    }
}

/// The background tasks: the fences' refresh, the guard's or the cluster's
/// keeper, the dedup sweeper; a single instance's abort at its guard's
/// expiry (queued attempts out are cut with forwarded requests); the queue's
/// deliverers resumed and its sweeper; the set-up record's watch
/// (PostgreSQL).
async fn start_tasks(
    cfg: &Config,
    shared: &Arc<Shared>,
    state: &OpenedState,
    metrics: &Arc<Metrics>,
    stop: &CancellationToken,
) -> Result<Vec<tokio::task::JoinHandle<()>>, StartError> {
    let (mode, fences, queue) = (&shared.mode, &shared.fences, &shared.queue);
    let keeper = match mode {
        Mode::Single(guard) => tokio::spawn(guard.clone().run(stop.clone())),
        Mode::Cluster(cluster) => tokio::spawn(cluster.clone().run(stop.clone())),
    };
    let mut tasks = vec![
        tokio::spawn(crate::fence::refresh_all(
            fences.refresh().clone(),
            stop.clone(),
        )),
        keeper,
        tokio::spawn(
            shared
                .dedup
                .clone()
                .run_sweeper(cfg.dedup.sweep_interval, stop.clone()),
        ),
    ];
    if let Mode::Single(guard) = mode {
        tasks.push(tokio::spawn(guard.clone().abort_at_expiry(
            fences.clone(),
            match queue.clone() {
                Some(q) => Box::new(move || q.cut_attempts()),
                None => Box::new(|| {}),
            },
            stop.clone(),
        )));
    }
    if let Some(q) = queue {
        q.register(metrics);
        let resumed = q.start().await.map_err(StartError::State)?;
        if resumed > 0 {
            tracing::info!(
                leases = resumed,
                "queued messages left by a previous run are delivered"
            );
        }
        tasks.push(tokio::spawn(
            q.clone()
                .run_sweeper(cfg.dedup.ttl, cfg.dedup.sweep_interval),
        ));
    }
    if let Some(pg) = state.database.clone() {
        let every = (cfg.store.gate_ttl / 4).max(Duration::from_millis(100));
        let stop = stop.clone();
        tasks.push(tokio::spawn(
            async move { pg.watch_set_up(every, stop).await },
        ));
    }
    Ok(tasks)
}
