//! The command line (SPEC §8): `serve`, `check-config`, `lease ...`, `demo`.
//! `anyhow` lives only here; library modules return typed errors.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use serde_json::json;

use crate::clock::{rfc3339, Clock, SystemClock};
use crate::config::{Config, ConfigError, Located, LogFormat};
use crate::epoch::{Epoch, EpochObject, LeaseName};
use crate::lease::acquire::{self, AcquireError};
use crate::lease::probe::ProbeError;
use crate::lease::{self, Epochs};

#[derive(Parser)]
#[command(
    name = "fencegate",
    version = env!("CARGO_PKG_VERSION"),
    about = "An HTTP gateway that fences stale leaders"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy and admin listeners.
    Serve {
        /// The config file (TOML); relative paths in it are relative to the file.
        /// Default: $FENCEGATE_CONFIG, else the first of ./fencegate.toml,
        /// ./config/fencegate.toml, /etc/fencegate/fencegate.toml that exists.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Log format; overrides [server] log_format.
        #[arg(long, value_parser = ["human", "json"])]
        log_format: Option<String>,
        /// Take the instance guard over from another instance whose marks and
        /// dedup records are kept elsewhere (another data_dir or database, or a
        /// cluster): retries of keys it delivered WILL be forwarded again.
        #[arg(long)]
        takeover_may_duplicate: bool,
        /// This start only: a database or data_dir that holds fencegate's
        /// records but no set-up record, and that no gate object of this
        /// set-up names (a database from before set-up records, a row
        /// deleted after an upgrade), is claimed for this set-up. Say it only
        /// when those records are this set-up's.
        #[arg(long)]
        claim_state: bool,
    },
    /// Validate a config file and print what was understood.
    CheckConfig {
        /// The config file (TOML) to check (default: as for `serve`).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Take part in the lease protocol (SPEC §2) from a shell or CI job.
    Lease {
        #[command(subcommand)]
        action: LeaseCommand,
    },
    /// Play the late-worker story end to end on the embedded defaults.
    Demo,
    /// Run a recording origin (the quick start's destination): answers 200 and
    /// prints every request it receives.
    Origin {
        /// Where to listen.
        #[arg(long, default_value = "127.0.0.1:8081")]
        listen: std::net::SocketAddr,
    },
}

#[derive(Args)]
struct StoreArgs {
    /// The config file whose [store] section names the lease store (default: as
    /// for `serve`).
    #[arg(long)]
    config: Option<PathBuf>,
    /// The lease's name (the `lease` of the routes it protects).
    #[arg(long)]
    lease: String,
    /// `json` (one object) or `env` (`FENCEGATE_EPOCH=…` lines for `eval`).
    #[arg(long, default_value = "json", value_parser = ["json", "env"])]
    format: String,
}

#[derive(Subcommand)]
enum LeaseCommand {
    /// Acquire the lease if it is free (exit 3 if held by another holder).
    Acquire {
        #[command(flatten)]
        store: StoreArgs,
        /// Who holds it (recorded in the epoch object; any stable worker id).
        #[arg(long)]
        holder: String,
        /// How long the tenure lasts, in milliseconds (renew before it ends).
        #[arg(long, default_value_t = 30_000)]
        ttl_ms: u64,
        /// Wait until the lease is free (expiry plus grace on the store's clock).
        #[arg(long)]
        wait: bool,
    },
    /// Renew a tenure: acquire epoch N+1 while holding N (exit 3 if no longer held).
    Renew {
        #[command(flatten)]
        store: StoreArgs,
        /// The holder that acquired the epoch.
        #[arg(long)]
        holder: String,
        /// The epoch held now.
        #[arg(long)]
        epoch: u64,
        /// That epoch's token (printed by acquire).
        #[arg(long)]
        token: String,
        /// How long the new tenure lasts, in milliseconds.
        #[arg(long, default_value_t = 30_000)]
        ttl_ms: u64,
    },
    /// Release a tenure voluntarily.
    Release {
        #[command(flatten)]
        store: StoreArgs,
        /// The holder that acquired the epoch.
        #[arg(long)]
        holder: String,
        /// The epoch held now.
        #[arg(long)]
        epoch: u64,
        /// That epoch's token (printed by acquire).
        #[arg(long)]
        token: String,
    },
    /// Show the latest epoch of a lease.
    Show {
        #[command(flatten)]
        store: StoreArgs,
    },
}

/// Exit codes: 0 ok, 1 runtime error, 2 bad config or usage, 3 lease held.
const EXIT_ERROR: u8 = 1;
const EXIT_CONFIG: u8 = 2;
const EXIT_HELD: u8 = 3;

/// The `fencegate` command line: parses arguments, runs the subcommand, and maps its
/// outcome to the exit code (0 ok, 1 error, 2 config or usage, 3 lease held).
/// `commit` is the binary's build stamp (`--version`, `fencegate_build_info`):
/// the binary reads it, so that a new commit relinks the binary without making
/// the library's own code depend on it.
pub fn main(commit: &'static str) -> ExitCode {
    crate::metrics::set_commit(commit);
    let version: &'static str =
        Box::leak(format!("{} ({commit})", env!("CARGO_PKG_VERSION")).into_boxed_str());
    let parsed = Cli::command()
        .version(version)
        .try_get_matches()
        .and_then(|m| Cli::from_arg_matches(&m));
    let cli = match parsed {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { EXIT_CONFIG } else { 0 });
        }
    };
    match cli.command {
        Command::CheckConfig { config } => {
            match locate_config(config).and_then(|at| Ok((Config::load(&at.path)?, at))) {
                Ok((cfg, at)) => {
                    for w in cfg.warnings() {
                        eprintln!("fencegate: warning: {w}");
                    }
                    print!("{}", cfg.summary());
                    // What `serve` would split here: it raises the soft limit
                    // to the hard one first (SPEC §9 "Limits").
                    let limit = crate::budget::Nofile::read().hard;
                    match crate::budget::Budget::derive(&cfg, limit) {
                        Ok(b) => println!("descriptors   {}", b.summary()),
                        Err(e) => {
                            eprintln!("fencegate: {e}");
                            return ExitCode::from(EXIT_CONFIG);
                        }
                    }
                    println!("config {} ({}) is valid", at.path.display(), at.via);
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("fencegate: {e}");
                    ExitCode::from(EXIT_CONFIG)
                }
            }
        }
        Command::Serve {
            config,
            log_format,
            takeover_may_duplicate,
            claim_state,
        } => {
            // Until the config is read, only --log-format says how to log: a file
            // that does not load is reported in that format (stderr is one format).
            let asked = match log_format.as_deref() {
                Some("json") => Some(LogFormat::Json),
                Some(_) => Some(LogFormat::Human),
                None => None,
            };
            let loaded = locate_config(config).and_then(|at| Ok((Config::load(&at.path)?, at)));
            let (cfg, at) = match loaded {
                Ok((c, at)) => (
                    Config {
                        takeover_may_duplicate,
                        claim_state,
                        ..c
                    },
                    at,
                ),
                Err(e) => {
                    fatal(asked.unwrap_or(LogFormat::Human), &e.to_string());
                    return ExitCode::from(EXIT_CONFIG);
                }
            };
            let format = asked.unwrap_or(cfg.server.log_format);
            let set_log = init_tracing_with(format, &server_filter(&cfg.server.log_level));
            // The first log line: which file this process runs on, and on how
            // many threads (`runtime`).
            tracing::info!(
                config = %at.path.display(),
                via = at.via,
                threads = if one_cpu() { "one (current-thread scheduler)" } else { "a worker per CPU" },
                "config loaded"
            );
            report(
                format,
                runtime().and_then(|rt| rt.block_on(serve(cfg, at.path, set_log))),
            )
        }
        Command::Lease { action } => {
            let _ = init_tracing(LogFormat::Human);
            match runtime().and_then(|rt| rt.block_on(lease_command(action))) {
                Ok(code) => code,
                Err(e) => {
                    eprintln!("fencegate: {}", one_line(&e));
                    ExitCode::from(lease_error_code(&e))
                }
            }
        }
        Command::Origin { listen } => {
            match runtime().and_then(|rt| rt.block_on(crate::demo::serve_origin(listen))) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("fencegate origin: {}", one_line(&e));
                    ExitCode::from(EXIT_ERROR)
                }
            }
        }
        Command::Demo => {
            // The demo's story goes to stdout; fencegate's own logs only when asked.
            let _ = init_tracing_with(LogFormat::Human, "warn");
            match runtime().and_then(|rt| rt.block_on(crate::demo::run())) {
                Ok(true) => ExitCode::SUCCESS,
                Ok(false) => ExitCode::from(EXIT_ERROR),
                Err(e) => {
                    eprintln!("fencegate demo: {}", one_line(&e));
                    ExitCode::from(EXIT_ERROR)
                }
            }
        }
    }
}

/// Finds the config file: `--config`, `$FENCEGATE_CONFIG`, then the default
/// places (SPEC §8).
fn locate_config(explicit: Option<PathBuf>) -> Result<Located, ConfigError> {
    crate::config::locate(
        explicit,
        std::env::var_os(crate::config::CONFIG_ENV),
        Path::exists,
    )
}

/// Says why `serve` stops, once, on stderr in the log format: `fencegate: …`,
/// or one JSON line shaped like the log's (stderr stays one format).
fn fatal(format: LogFormat, message: &str) {
    match format {
        LogFormat::Human => eprintln!("fencegate: {message}"),
        LogFormat::Json => eprintln!(
            "{}",
            json!({
                "timestamp": rfc3339(SystemClock.now()),
                "level": "ERROR",
                "target": "fencegate",
                "message": message,
            })
        ),
    }
}

fn report(format: LogFormat, r: anyhow::Result<()>) -> ExitCode {
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Once, on one line (no ERROR log line repeating it).
            fatal(format, &one_line(&e));
            // A state backend that cannot be opened as configured (a database
            // unreachable, a newer schema, synchronous_commit off) is the
            // operator's to fix, like a bad config file.
            use crate::cluster::guard::GuardError;
            use crate::server::StartError;
            let config_like = matches!(
                e.downcast_ref::<StartError>(),
                Some(
                    StartError::State(
                        crate::state::StateError::Open { .. }
                            | crate::state::StateError::OtherSetUp(_)
                    ) | StartError::Guard(
                        GuardError::Held { .. }
                            | GuardError::OtherMode { .. }
                            | GuardError::OtherState { .. }
                            | GuardError::SharedId { .. },
                    ) | StartError::Budget(_)
                        | StartError::Cluster(
                            crate::cluster::ClusterError::OtherSetUp { .. }
                                | crate::cluster::ClusterError::OlderBuild { .. }
                        )
                )
            );
            ExitCode::from(if config_like { EXIT_CONFIG } else { EXIT_ERROR })
        }
    }
}

/// An error and its causes on one line, each cause said once: a wrapper whose
/// message already quotes its source (`store self-test failed on …: {source}`)
/// is not followed by that source again.
fn one_line(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let m = cause.to_string();
        if out.contains(&m) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&m);
    }
    out.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The runtime: with one CPU to run on (the process's affinity, a cgroup
/// quota of one, or `TOKIO_WORKER_THREADS=1`) one thread runs everything, on
/// tokio's current-thread scheduler; with more, a worker per CPU. On one CPU
/// the multi-thread scheduler still hands every connection from the thread
/// that accepts to its one worker and parks and wakes through a shared queue
/// (benches/README.md, "Where the time goes": the current-thread scheduler
/// halved the context switches per request).
fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    let mut b = if one_cpu() {
        tokio::runtime::Builder::new_current_thread()
    } else {
        tokio::runtime::Builder::new_multi_thread()
    };
    b.enable_all().build().context("starting the tokio runtime")
}

/// Whether this process has one CPU to run on; `TOKIO_WORKER_THREADS` (which
/// tokio's multi-thread scheduler reads too) decides when set.
fn one_cpu() -> bool {
    match std::env::var("TOKIO_WORKER_THREADS") {
        Ok(v) => v.trim() == "1",
        Err(_) => std::thread::available_parallelism().is_ok_and(|n| n.get() == 1),
    }
}

fn init_tracing(format: LogFormat) -> Option<crate::server::reload::SetLogFilter> {
    init_tracing_with(format, &server_filter("info"))
}

/// `[server] log_level` with the AWS SDK's chatter kept at warn unless named.
fn server_filter(level: &str) -> String {
    let mut f = level.to_owned();
    for quiet in ["aws_config", "aws_smithy_runtime"] {
        if !level.contains(quiet) {
            f.push_str(&format!(",{quiet}=warn"));
        }
    }
    // Each credential provider that finds nothing warns with a dump of its
    // error; fencegate's own line says what was tried and what to set.
    if !level.contains("aws_config") {
        f.push_str(",aws_config::meta::credentials=error");
    }
    f
}

/// Logs to stderr; `FENCEGATE_LOG` (or `RUST_LOG`) overrides `default_filter`.
/// Returns what changes the filter later (a reload's `[server] log_level`).
fn init_tracing_with(
    format: LogFormat,
    default_filter: &str,
) -> Option<crate::server::reload::SetLogFilter> {
    use tracing_subscriber::EnvFilter;
    // The variable's filter keeps the AWS SDK's chatter quiet as the default
    // does, unless it names the SDK's targets itself.
    let filter = match crate::server::reload::log_override() {
        Some(var) => std::env::var(var)
            .ok()
            .and_then(|v| EnvFilter::try_new(server_filter(&v)).ok()),
        None => None,
    }
    .unwrap_or_else(|| EnvFilter::new(default_filter));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        // Flat: the event's fields beside timestamp, level and target (SPEC §8).
        LogFormat::Json => {
            let b = b
                .json()
                .flatten_event(true)
                .with_current_span(false)
                .with_span_list(false)
                .with_filter_reloading();
            let handle = b.reload_handle();
            b.try_init().ok()?;
            Some(filter_setter(handle))
        }
        LogFormat::Human => {
            let b = b
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .with_filter_reloading();
            let handle = b.reload_handle();
            b.try_init().ok()?;
            Some(filter_setter(handle))
        }
    }
}

/// What changes the running log filter to `[server] log_level`.
fn filter_setter<S>(
    handle: tracing_subscriber::reload::Handle<tracing_subscriber::EnvFilter, S>,
) -> crate::server::reload::SetLogFilter
where
    S: tracing::Subscriber + 'static,
{
    Arc::new(move |spec: &str| {
        let f = tracing_subscriber::EnvFilter::try_new(server_filter(spec))
            .map_err(|e| e.to_string())?;
        handle.reload(f).map_err(|e| e.to_string())
    })
}

async fn serve(
    cfg: Config,
    path: PathBuf,
    set_log: Option<crate::server::reload::SetLogFilter>,
) -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    // Installed before anything listens, so a SIGTERM right after the ready line
    // is a graceful shutdown, not the default kill (and a SIGHUP never kills).
    let term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    // Watched from now on, start-up included: a second signal while starting
    // exits at once too, and a first one is kept for when serving begins.
    let stop_requested = watch_signals(term, int);
    let mut hup = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
    // The descriptor budget is split from the hard limit (SPEC §9 "Limits").
    let nofile = crate::budget::Nofile::raise();
    if let Some(from) = nofile.raised_from {
        tracing::info!(
            from,
            to = nofile.soft,
            "raised the descriptor limit (RLIMIT_NOFILE) to its hard limit"
        );
    }
    let app = crate::server::build(&cfg, Arc::new(SystemClock)).await?;
    let reloader = app.reloader(path, set_log);
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            tracing::info!("SIGHUP: reloading the config");
            reloader.reload_and_log().await;
        }
    });
    let proxy_l = crate::server::bind(cfg.server.listen).await?;
    let admin_l = crate::server::bind(cfg.server.admin_listen).await?;
    let (p, a) = (proxy_l.local_addr()?, admin_l.local_addr()?);
    tracing::info!(proxy = %p, admin = %a, "fencegate listening");
    // One machine-readable line on stdout: how tests and scripts learn the ports.
    println!(
        "{}",
        json!({"event": "listening", "proxy": p.to_string(), "admin": a.to_string()})
    );
    app.run(proxy_l, admin_l, stop_requested).await?;
    Ok(())
}

/// Watches SIGTERM and SIGINT from the moment it is called: the returned future
/// resolves once the first has come (even if it came during start-up); a second
/// one exits at once, whenever it comes.
fn watch_signals(
    mut term: tokio::signal::unix::Signal,
    mut int: tokio::signal::unix::Signal,
) -> impl std::future::Future<Output = ()> {
    let (first, mut seen) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tracing::info!("signal received; a second signal exits immediately");
        let _ = first.send(true);
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tracing::warn!("second signal, exiting now");
        std::process::exit(130);
    });
    async move {
        // An error means the watcher is gone: it never returns but by exiting.
        let _ = seen.wait_for(|came| *came).await;
    }
}

/// A bad config file or argument for a lease command (exit code 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct UsageError(String);

/// Exit code for a failed lease command: 2 for configuration problems (a bad
/// config, a bad lease name, a store that cannot fence), 1 for the rest.
fn lease_error_code(e: &anyhow::Error) -> u8 {
    let config = e.downcast_ref::<UsageError>().is_some()
        || matches!(
            e.downcast_ref::<ProbeError>(),
            Some(ProbeError::NotFencing { .. })
        );
    if config {
        EXIT_CONFIG
    } else {
        EXIT_ERROR
    }
}

/// Prints a lease command's result: one JSON object, or with `env` one
/// `FENCEGATE_<FIELD>='value'` line per field (`eval "$(fencegate lease acquire
/// … --format env)"` sets `$FENCEGATE_EPOCH` and `$FENCEGATE_TOKEN`).
fn print_result(v: &serde_json::Value, env: bool) {
    let Some(fields) = v.as_object().filter(|_| env) else {
        println!("{v}");
        return;
    };
    for (k, v) in fields {
        let v = match v {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Null => String::new(),
            other => other.to_string(),
        };
        // Single quotes: nothing inside is expanded; a quote in a value is closed,
        // escaped and reopened.
        println!(
            "FENCEGATE_{}='{}'",
            k.to_uppercase(),
            v.replace('\'', "'\\''")
        );
    }
}

/// Refuses a TTL of 0 (the tenure would be over before it began) and warns
/// below 3 s on S3, whose `Last-Modified` — the tenure's start on the store's
/// clock — has a resolution of 1 s.
fn check_ttl(ttl_ms: u64, kind: crate::config::StoreKind) -> Result<(), UsageError> {
    if ttl_ms == 0 {
        return Err(UsageError(
            "--ttl-ms 0: the lease would have expired when acquired; give it a positive TTL (default 30000)".into(),
        ));
    }
    if kind == crate::config::StoreKind::S3 && ttl_ms < 3000 {
        eprintln!(
            "fencegate: warning: --ttl-ms {ttl_ms} is below 3000: S3 dates an epoch to the second, so up to a second of it may be gone when it is written"
        );
    }
    Ok(())
}

/// Loads only what the lease commands need: the `[store]` section.
fn load_store_config(path: &Path) -> Result<Config, UsageError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| UsageError(format!("cannot read config {}: {e}", path.display())))?;
    let mut cfg =
        Config::parse(&text).map_err(|e| UsageError(format!("config {}: {e}", path.display())))?;
    cfg.resolve_paths(path);
    cfg.validate_store()
        .map_err(|e| UsageError(format!("config {}: {e}", path.display())))?;
    Ok(cfg)
}

/// `fencegate lease acquire|renew|release|show` (SPEC §2 from a shell). One
/// function for the four, on purpose: they share the store's set-up, its
/// self-test and the output format, and each arm is a few lines of its own.
async fn lease_command(cmd: LeaseCommand) -> anyhow::Result<ExitCode> {
    let store_args = match &cmd {
        LeaseCommand::Acquire { store, .. }
        | LeaseCommand::Renew { store, .. }
        | LeaseCommand::Release { store, .. }
        | LeaseCommand::Show { store } => store,
    };
    let at = locate_config(store_args.config.clone()).map_err(|e| UsageError(e.to_string()))?;
    let cfg = load_store_config(&at.path)?;
    let lease = LeaseName::parse(&store_args.lease).map_err(UsageError)?;
    let env = store_args.format == "env";
    let out = |v: serde_json::Value| print_result(&v, env);
    if let LeaseCommand::Acquire { ttl_ms, .. } | LeaseCommand::Renew { ttl_ms, .. } = &cmd {
        check_ttl(*ttl_ms, cfg.store.kind)?;
    }
    let store = lease::open(&cfg.store, Arc::new(SystemClock)).await?;
    lease::probe::self_test(store.as_ref(), &cfg.store.prefix).await?;
    let epochs = Epochs::new(store, cfg.store.prefix.clone());
    let grace = Duration::from_millis(cfg.store.grace_ms);
    let held_or = |e: AcquireError| -> anyhow::Result<ExitCode> {
        if env && e.is_held() {
            // Nothing a shell could use as its own: `eval "$(…)"` of this
            // unsets what an earlier run set, says why on stderr, and fails
            // (another holder's epoch, set, would be sent with no token).
            println!("unset FENCEGATE_EPOCH FENCEGATE_TOKEN FENCEGATE_EXPIRES_AT");
            println!(
                "echo 'fencegate: {} (nothing was acquired: exit 3)' >&2",
                e.to_string().replace('\'', "")
            );
            println!("false");
            // Said once: by the `echo` above, which `eval` runs (the quick
            // start's way); a second line here printed it twice.
            return Ok(ExitCode::from(EXIT_HELD));
        }
        if let AcquireError::Held {
            lease,
            epoch,
            holder,
            expires_at,
        } = &e
        {
            out(
                json!({"lease": lease.as_str(), "epoch": epoch.get(), "holder": holder, "expires_at": rfc3339(*expires_at)}),
            );
        }
        if let AcquireError::NotHolder { lease, epoch, why } = &e {
            out(
                json!({"lease": lease.as_str(), "epoch": epoch.get(), "held": false, "reason": why}),
            );
        }
        if e.is_held() {
            eprintln!("fencegate: {e}");
            Ok(ExitCode::from(EXIT_HELD))
        } else {
            Err(e.into())
        }
    };
    let print_holding = |h: &acquire::Holding| {
        out(json!({
            "lease": h.lease.as_str(),
            "epoch": h.epoch.get(),
            "token": h.token,
            "holder": h.holder,
            "expires_at": rfc3339(h.expires_at),
        }));
    };
    match cmd {
        LeaseCommand::Acquire {
            holder,
            ttl_ms,
            wait,
            ..
        } => {
            let ttl = Duration::from_millis(ttl_ms);
            let mut backoff = Duration::from_millis(100);
            loop {
                match acquire::acquire(&epochs, &lease, &holder, ttl, grace, None).await {
                    Ok(h) => {
                        print_holding(&h);
                        return Ok(ExitCode::SUCCESS);
                    }
                    Err(AcquireError::Held {
                        holder: other,
                        expires_at,
                        epoch,
                        ..
                    }) if wait => {
                        let free_at = acquire::free_at(expires_at, grace);
                        let until = free_at
                            .duration_since(epochs.store().clock().earliest())
                            .unwrap_or(Duration::ZERO);
                        let pause = until.clamp(Duration::from_millis(50), backoff);
                        eprintln!(
                            "fencegate: lease {lease} held by {other:?} at epoch {epoch}, expiring {}; free after grace at {}; waiting {} ms",
                            rfc3339(expires_at),
                            rfc3339(free_at),
                            pause.as_millis()
                        );
                        tokio::time::sleep(pause).await;
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                    }
                    Err(e) => return held_or(e),
                }
            }
        }
        LeaseCommand::Renew {
            holder,
            epoch,
            token,
            ttl_ms,
            ..
        } => match acquire::renew(
            &epochs,
            &lease,
            &holder,
            Epoch::new(epoch),
            &token,
            Duration::from_millis(ttl_ms),
        )
        .await
        {
            Ok(h) => {
                print_holding(&h);
                Ok(ExitCode::SUCCESS)
            }
            Err(e) => held_or(e),
        },
        LeaseCommand::Release {
            holder,
            epoch,
            token,
            ..
        } => match acquire::release(&epochs, &lease, &holder, Epoch::new(epoch), &token).await {
            Ok(rel) => {
                out(
                    json!({"lease": lease.as_str(), "epoch": rel.get(), "holder": holder, "kind": "release", "released_epoch": epoch}),
                );
                Ok(ExitCode::SUCCESS)
            }
            Err(e) => held_or(e),
        },
        LeaseCommand::Show { .. } => {
            let st = acquire::status(&epochs, &lease).await?;
            let (kind, holder, expires_at) = match &st.object {
                Some(EpochObject::Acquire {
                    holder, expires_at, ..
                }) => ("acquire", Some(holder.clone()), Some(rfc3339(*expires_at))),
                Some(EpochObject::Release { holder }) => ("release", Some(holder.clone()), None),
                Some(EpochObject::Invalid { .. }) => ("invalid", None, None),
                None => ("none", None, None),
            };
            out(json!({
                "lease": lease.as_str(),
                "epoch": st.latest.get(),
                "kind": kind,
                "holder": holder,
                "expires_at": expires_at,
                "free": st.is_free(grace),
                "store_now": rfc3339(st.store_now),
            }));
            Ok(ExitCode::SUCCESS)
        }
    }
}
