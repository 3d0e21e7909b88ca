//! Configuration (SPEC §9): TOML, serde with defaults, unknown keys rejected by
//! name, then [`Config::validate`] — all before any port is bound.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::{HeaderName, HeaderValue, Uri};
use serde::Deserialize;

use crate::epoch::LeaseName;

mod cluster;
mod dedup;
mod duration;
mod locate;
mod route;
mod secrets;
mod server;
mod state;
mod store;
mod suggest;
mod summary;
mod telemetry;
#[cfg(test)]
mod tests;

use locate::shown;
use secrets::from_env;
use suggest::with_suggestion;

pub use cluster::{ClusterConfig, MAX_SHARDS};
pub use dedup::DedupConfig;
pub use locate::{locate, Located, CONFIG_ENV, DEFAULT_PLACES};
pub use route::{
    mixed_delivery, BreakerConfig, Delivery, DeriveKey, InDoubtPolicy, Ordering, RetryConfig,
    RouteConfig, RouteKind, MAX_PROTECT_DURATION,
};
pub use server::{LogFormat, ServerConfig, TlsConfig};
pub use state::{StateConfig, StateKind};
pub use store::{StoreConfig, StoreKind};
pub use telemetry::TelemetryConfig;

/// Why a configuration could not be loaded; reported before any port is bound.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// The file that was asked for.
        path: PathBuf,
        /// The I/O failure.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML, or has an unknown key or a mistyped value.
    #[error("config {path}: {message}")]
    Parse {
        /// The file that was read.
        path: PathBuf,
        /// The parser's message, naming the key.
        message: String,
    },
    /// No `--config` was given and none of the default places holds a file.
    #[error("no config file: {tried}; pass --config PATH or set FENCEGATE_CONFIG")]
    NotFound {
        /// The places looked at, in order.
        tried: String,
    },
    /// The file parsed but failed [`Config::validate`].
    #[error("config {path}: {message}")]
    Invalid {
        /// The file that was read.
        path: PathBuf,
        /// Which rule was broken, naming the key.
        message: String,
    },
}

/// The whole configuration file (SPEC §9), as loaded and validated at start-up and on
/// reload.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `[server]`: listeners, limits, logging.
    #[serde(default)]
    pub server: ServerConfig,
    /// `[store]`: where epoch objects live and how they are read (SPEC §2).
    #[serde(default)]
    pub store: StoreConfig,
    /// `[dedup]`: retention of dedup records (SPEC §6).
    #[serde(default)]
    pub dedup: DedupConfig,
    /// `[state]`: where marks and dedup records live.
    #[serde(default)]
    pub state: StateConfig,
    /// `[cluster]` (SPEC §10.2); absent: a single instance (§10.1).
    pub cluster: Option<ClusterConfig>,
    /// `[telemetry]`: where traces are exported (docs/traces.md); absent or
    /// without `otlp_endpoint`: none are.
    #[serde(default)]
    pub telemetry: TelemetryConfig,
    /// `[[route]]`: path prefix → upstream, each protected by one lease (SPEC §3).
    #[serde(rename = "route", default)]
    pub routes: Vec<RouteConfig>,
    /// `fencegate serve --takeover-may-duplicate` (never a config key: an
    /// operator's decision for one start): a single instance may take the
    /// instance guard over from an instance whose deliveries are kept elsewhere.
    #[serde(skip)]
    pub takeover_may_duplicate: bool,
    /// `fencegate serve --claim-state` (never a config key): a database or
    /// `data_dir` holding fencegate's records that nothing attributes to this
    /// set-up (no set-up record, no gate object naming it) is claimed for it
    /// (SPEC §10, "One database, one set-up").
    #[serde(skip)]
    pub claim_state: bool,
}

impl Config {
    /// Reads, parses and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let mut cfg = Config::parse(&text).map_err(|message| ConfigError::Parse {
            path: path.to_owned(),
            message,
        })?;
        cfg.resolve_paths(path);
        cfg.resolve_env().map_err(|message| ConfigError::Invalid {
            path: path.to_owned(),
            message,
        })?;
        cfg.validate().map_err(|message| ConfigError::Invalid {
            path: path.to_owned(),
            message,
        })?;
        Ok(cfg)
    }

    /// Makes every relative path in the file relative to the file's directory,
    /// not to wherever the command happens to run (`lease show` from another
    /// directory must read the same store the server uses).
    pub fn resolve_paths(&mut self, file: &Path) {
        let base = file.parent().unwrap_or(Path::new(""));
        let fix = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        };
        fix(&mut self.server.data_dir);
        if let Some(tls) = &mut self.server.tls {
            fix(&mut tls.cert);
            fix(&mut tls.key);
        }
        fix(&mut self.store.path);
        if let Some(ca) = &mut self.state.ca_file {
            fix(ca);
        }
        for r in &mut self.routes {
            for p in [&mut r.ca_file, &mut r.client_cert, &mut r.client_key]
                .into_iter()
                .flatten()
            {
                fix(p);
            }
        }
    }

    /// Reads the `${NAME}` values that are not secrets from the environment, once:
    /// a cluster member's `instance_id` and `advertise`, so that every member of a
    /// Kubernetes Deployment can share one file. (Secrets stay unresolved in the
    /// config and are read where used, so no summary can show them.)
    pub fn resolve_env(&mut self) -> Result<(), String> {
        if let Some(c) = &mut self.cluster {
            c.instance_id = from_env("[cluster] instance_id", &c.instance_id)?;
            c.advertise = from_env("[cluster] advertise", &c.advertise)?;
        }
        Ok(())
    }

    /// Parses TOML. A parse error names the line, its key and what is wrong
    /// but never quotes the line's value: it may hold a password (`[state]
    /// url`) or a credential (`upstream_headers`).
    pub fn parse(text: &str) -> Result<Config, String> {
        toml::from_str(text).map_err(|e| {
            let at = e.span().map(|s| s.start.min(text.len()));
            let line = at.map(|at| text[..at].matches('\n').count() + 1);
            // The key of that line, when it is a plain one (`timeout_ms = …`).
            let key = line
                .and_then(|n| text.lines().nth(n - 1))
                .and_then(|l| l.split_once('='))
                .map(|(k, _)| k.trim())
                .filter(|k| {
                    !k.is_empty()
                        && k.bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
                });
            let message = with_suggestion(e.message().trim_end());
            // Not when the message names it already (an unknown field).
            let key = key.filter(|k| !message.contains(&format!("`{k}`")));
            match (line, key) {
                (Some(n), Some(k)) => format!("line {n}, {k}: {message}"),
                (Some(n), None) => format!("line {n}: {message}"),
                _ => message,
            }
        })
    }

    /// Checks what serde cannot: cross-field rules, URLs, header names, env values.
    pub fn validate(&self) -> Result<(), String> {
        self.validate_server()?;
        self.validate_store()?;
        self.validate_state()?;
        self.validate_cluster()?;
        self.validate_telemetry()?;
        self.validate_routes()
    }

    /// Settings that are valid but probably not what the operator meant; printed
    /// by `check-config` and logged by `serve`.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        for r in &self.routes {
            let longest = r.timeout() + r.drain_timeout();
            if self.dedup.ttl < longest {
                out.push(format!(
                    "[dedup] ttl ({}) is shorter than route {:?}'s timeout_ms + drain_timeout_ms ({}): \
                     a finished key can be forgotten while a retry of it may still come; \
                     in-flight and in-doubt records never expire{}",
                    humantime::format_duration(self.dedup.ttl),
                    r.name,
                    humantime::format_duration(longest),
                    if self.dedup.ttl < Duration::from_secs(1) {
                        " (a number without a unit is milliseconds: write ttl = \"24h\" for a day)"
                    } else {
                        ""
                    },
                ));
            }
        }
        out
    }
}
