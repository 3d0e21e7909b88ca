//! Configuration (SPEC §9): TOML, serde with defaults, unknown keys rejected by
//! name, then [`Config::validate`] — all before any port is bound.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::{HeaderName, HeaderValue, Uri};
use serde::Deserialize;

use crate::epoch::LeaseName;

/// The longest `max_retry_after`, `breaker.window` and `breaker.cool_down`
/// (SPEC §9): one day.
pub const MAX_PROTECT_DURATION: std::time::Duration = std::time::Duration::from_secs(86_400);

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

/// `[server]`: the listeners and their limits, logging (SPEC §8–§9).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// `host:port`; a host name is resolved once, at load (`localhost:8080`).
    #[serde(deserialize_with = "socket_addr")]
    pub listen: SocketAddr,
    /// Admin API and metrics listener; must differ from `listen`.
    #[serde(deserialize_with = "socket_addr")]
    pub admin_listen: SocketAddr,
    /// Where the sled state lives (marks, dedup records).
    pub data_dir: PathBuf,
    /// Bearer token for mutating admin calls; `FENCEGATE_ADMIN_TOKEN` overrides.
    pub admin_token: Option<String>,
    /// How long SIGTERM waits for in-flight requests.
    #[serde(alias = "shutdown_timeout", deserialize_with = "duration::ms")]
    pub shutdown_timeout_ms: u64,
    /// How long fencegate keeps serving after SIGTERM, with `/readyz` already
    /// failing, before it stops accepting: load balancers and Kubernetes
    /// endpoints take a while to stop sending (SPEC §8).
    #[serde(alias = "shutdown_delay", deserialize_with = "duration::ms")]
    pub shutdown_delay_ms: u64,
    /// Open connections beyond this are closed at accept; the descriptor
    /// budget may lower it ([`crate::budget`]).
    pub max_connections: usize,
    /// The admin listener's connections at once; past it, an idle one is
    /// closed to make room, so that `/livez` is answered (SPEC §8).
    pub admin_max_connections: usize,
    /// Time allowed to receive a request head (slowloris).
    #[serde(alias = "header_read_timeout", deserialize_with = "duration::ms")]
    pub header_read_timeout_ms: u64,
    /// `human` or `json`.
    pub log_format: LogFormat,
    /// One line per request at info (target `fencegate::access`), SPEC §8.
    pub access_log: bool,
    /// The log filter (`info`, `warn,fencegate=debug`, …); `FENCEGATE_LOG`
    /// overrides it. A reload applies a new one.
    pub log_level: String,
    /// TLS on the proxy listener (HTTP/1.1 and HTTP/2 via ALPN).
    pub tls: Option<TlsConfig>,
}

/// `[server.tls]`: PEM certificate chain and private key for the proxy listener.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM certificate chain presented to clients.
    pub cert: PathBuf,
    /// PEM private key for `cert`.
    pub key: PathBuf,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            admin_listen: SocketAddr::from(([127, 0, 0, 1], 9090)),
            data_dir: PathBuf::from("data"),
            admin_token: None,
            shutdown_timeout_ms: 10_000,
            shutdown_delay_ms: 0,
            max_connections: 20_000,
            admin_max_connections: 256,
            header_read_timeout_ms: 10_000,
            log_format: LogFormat::Human,
            access_log: true,
            log_level: "info".into(),
            tls: None,
        }
    }
}

/// A route as SPEC §11's one rule of kinds sees it: its name, its lease and
/// whether it is queued — a configured route, a running one, or the messages
/// a state holds for a name and lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteKind<'a> {
    /// The route's name (its history: dedup records or messages).
    pub name: &'a str,
    /// The lease it is fenced by.
    pub lease: &'a str,
    /// Queued (SPEC §11), or direct.
    pub queued: bool,
}

impl<'a> RouteKind<'a> {
    /// What a configured route is.
    pub fn of(r: &'a RouteConfig) -> RouteKind<'a> {
        RouteKind {
            name: &r.name,
            lease: r.lease.as_str(),
            queued: r.delivery == Delivery::Queued,
        }
    }
}

/// SPEC §11, the one rule of kinds: a lease's requests are all queued or all
/// direct, and so is a route name's history — else a direct request could
/// overtake a queued message, or a key done on one kind be delivered again by
/// the other. The first queued and direct pair sharing a lease or a name, if
/// any. Used on a config (its routes), a reload (the running routes with the
/// new ones) and a state (the messages it holds, as queued routes, with the
/// routes to run).
pub fn mixed_delivery<'a>(
    routes: impl IntoIterator<Item = RouteKind<'a>>,
) -> Option<(RouteKind<'a>, RouteKind<'a>)> {
    let all: Vec<RouteKind<'a>> = routes.into_iter().collect();
    all.iter().filter(|q| q.queued).find_map(|q| {
        all.iter()
            .find(|d| !d.queued && (d.lease == q.lease || d.name == q.name))
            .map(|d| (*q, *d))
    })
}

/// `[server] log_format`: how log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Readable lines for a terminal.
    #[default]
    Human,
    /// One JSON object per line, for log collectors.
    Json,
}

/// `[store] kind`: which lease store backend holds the epoch objects (SPEC §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// S3 or an S3-compatible server.
    S3,
    /// A local directory (one machine; tests and demos).
    #[default]
    Dir,
}

/// `[store]`: the lease store and how often and how patiently it is read (SPEC §2, §4).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// Which backend.
    pub kind: StoreKind,
    /// S3 bucket (required for `s3`).
    pub bucket: Option<String>,
    /// Key prefix for epoch objects: empty or ending in `/`.
    pub prefix: String,
    /// S3-compatible endpoint URL; absent: AWS.
    pub endpoint: Option<String>,
    /// S3 region used for signing.
    pub region: String,
    /// Path-style addressing, which many S3-compatible servers need.
    pub force_path_style: bool,
    /// Directory of the `dir` backend.
    pub path: PathBuf,
    /// How often each lease's epochs are listed, to learn of newer epochs (SPEC §4 rule
    /// 3).
    #[serde(alias = "refresh_interval", deserialize_with = "duration::ms")]
    pub refresh_interval_ms: u64,
    /// How long a contender waits past an epoch's expiry before taking the lease (SPEC
    /// §2).
    #[serde(alias = "grace", deserialize_with = "duration::ms")]
    pub grace_ms: u64,
    /// Bound on each store request; beyond it the store counts as unreachable.
    #[serde(alias = "timeout", deserialize_with = "duration::ms")]
    pub timeout_ms: u64,
    /// TTL of the instance guard's (and a cluster's) gate leases (SPEC §10).
    #[serde(deserialize_with = "duration::human")]
    pub gate_ttl: Duration,
    /// An instance stops forwarding this long before its gate lease ends.
    #[serde(deserialize_with = "duration::human")]
    pub self_fence_margin: Duration,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            kind: StoreKind::Dir,
            bucket: None,
            prefix: "fencegate/".into(),
            endpoint: None,
            region: "us-east-1".into(),
            force_path_style: false,
            path: PathBuf::from("data/leases"),
            refresh_interval_ms: 1000,
            grace_ms: 2000,
            timeout_ms: 2000,
            gate_ttl: Duration::from_secs(10),
            self_fence_margin: Duration::from_secs(2),
        }
    }
}

/// `[state] kind`: which backend holds marks and dedup records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum StateKind {
    /// sled under `data_dir` (one instance).
    #[default]
    Sled,
    /// A PostgreSQL database (SPEC §10).
    Postgres,
}

/// `[state]`: where marks and dedup records live.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StateConfig {
    /// Which backend.
    pub kind: StateKind,
    /// PostgreSQL connection string (`postgres://…` or `key=value …`); `${NAME}`
    /// is read from the environment. Never logged or shown.
    pub url: Option<String>,
    /// Most connections kept open to PostgreSQL.
    pub pool_size: usize,
    /// Extra CA bundle (PEM) trusted for the database's TLS certificate.
    pub ca_file: Option<PathBuf>,
    /// Bound on connecting (shared among the url's hosts) and on every statement.
    #[serde(alias = "timeout", deserialize_with = "duration::ms")]
    pub timeout_ms: u64,
    /// The PostgreSQL schema holding fencegate's tables (SPEC §9): one per
    /// set-up sharing a database. Unset: the connection's own `search_path`
    /// (normally `public`), as before the key existed — setting `public`
    /// explicitly could move an existing set-up off tables its role's
    /// `search_path` found elsewhere.
    pub schema: Option<String>,
    /// sled's page cache in MiB: how much of the marks, dedup records and
    /// queued messages stays resident (sled only).
    pub cache_mb: u64,
    /// Queued messages whose request is kept (not yet delivered nor dropped),
    /// over every route; past it a new one is refused (503 `queue_full`, SPEC
    /// §11). sled only: sled keeps what it writes in memory.
    pub queue_max_messages: u64,
    /// And their bytes as stored.
    pub queue_max_bytes: u64,
}

impl Default for StateConfig {
    fn default() -> Self {
        StateConfig {
            kind: StateKind::Sled,
            url: None,
            pool_size: 16,
            ca_file: None,
            timeout_ms: 2000,
            schema: None,
            cache_mb: 64,
            queue_max_messages: 100_000,
            queue_max_bytes: 256 << 20,
        }
    }
}

impl StateConfig {
    /// The connection string with `${NAME}` read from the environment.
    pub fn resolved_url(&self) -> Result<String, String> {
        let raw = self
            .url
            .as_deref()
            .ok_or("[state] kind = \"postgres\" needs url")?;
        from_env("[state] url", raw)
    }

    /// `timeout_ms` as a [`Duration`].
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }
}

/// `[cluster]`: this instance's place among several (SPEC §10.2).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// Unique among the instances, stable across restarts: the holder of its gate
    /// leases. `${NAME}` is read from the environment at load (one file for every
    /// member, e.g. a Kubernetes pod's name).
    pub instance_id: String,
    /// URL of this instance's proxy listener, as peers reach it; `${NAME}` is read
    /// from the environment at load (e.g. built from a pod's IP).
    pub advertise: String,
    /// The same on every instance; changing it needs every instance stopped.
    #[serde(default = "default_shards")]
    pub shards: u32,
    /// Shared secret between instances; `${NAME}` is read from the environment.
    /// Never logged, never forwarded upstream.
    pub peer_token: String,
}

/// A secret's value: `${NAME}` is read from the environment, anything else is literal.
fn from_env(key: &str, raw: &str) -> Result<String, String> {
    match raw.strip_prefix("${").and_then(|r| r.strip_suffix('}')) {
        Some(var) => std::env::var(var)
            .map_err(|_| format!("{key} reads ${{{var}}}, which is not set in the environment")),
        None => Ok(raw.to_owned()),
    }
}

/// The most shards `[cluster] shards` allows (four digits in a gate lease's name).
pub const MAX_SHARDS: u32 = 9999;

fn default_shards() -> u32 {
    16
}

impl ClusterConfig {
    /// The peer token with `${NAME}` read from the environment.
    pub fn resolved_peer_token(&self) -> Result<String, String> {
        from_env("[cluster] peer_token", &self.peer_token)
    }
}

/// `[telemetry]`: OTLP/HTTP trace export (SPEC §9, docs/traces.md).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// The collector's base URL (`http://collector:4318`): spans are POSTed to
    /// `{otlp_endpoint}/v1/traces`. None: no span is made or exported.
    pub otlp_endpoint: Option<String>,
    /// The `service.name` resource attribute.
    pub service_name: String,
    /// Of the requests that come without a sampled parent, the share traced
    /// (0.0–1.0); a worker's `traceparent` decides for its own requests.
    pub sample_ratio: f64,
    /// Spans waiting for export beyond this are dropped (and counted), never waited for.
    pub max_queue_spans: usize,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            otlp_endpoint: None,
            service_name: "fencegate".into(),
            sample_ratio: 1.0,
            max_queue_spans: 4096,
        }
    }
}

/// `[dedup]`: how long finished dedup records are kept (SPEC §6).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DedupConfig {
    /// Retention of dedup records, human-readable ("24h", "90m").
    #[serde(deserialize_with = "duration::human")]
    pub ttl: Duration,
    /// How often expired records are swept.
    #[serde(deserialize_with = "duration::human")]
    pub sweep_interval: Duration,
}

impl Default for DedupConfig {
    fn default() -> Self {
        DedupConfig {
            ttl: Duration::from_secs(24 * 3600),
            sweep_interval: Duration::from_secs(60),
        }
    }
}

/// Every duration takes either form: an integer number of milliseconds, or a
/// human-readable string ("1500ms", "2s", "24h"). The `*_ms` keys also answer to
/// their name without `_ms` (`timeout = "10s"`); the old names keep working.
/// Secrets read from the file without ever quoting them in an error: serde's
/// type errors name the value they got ("invalid type: string \"whsec_…\""),
/// and load errors are logged and printed by `check-config`.
mod secrets {
    use serde::de::{self, Deserializer, SeqAccess, Visitor};
    use std::fmt;

    struct List;

    const EXPECTED: &str = "a list of secrets, e.g. [\"${WEBHOOK_SECRET}\"]";

    impl<'de> Visitor<'de> for List {
        type Value = Vec<String>;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str(EXPECTED)
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<String>, A::Error> {
            let mut out = Vec::new();
            while let Some(v) = seq.next_element::<Secret>()? {
                out.push(v.0);
            }
            Ok(out)
        }

        // Any other type: an error that says what was expected, not what came.
        fn visit_str<E: de::Error>(self, _: &str) -> Result<Vec<String>, E> {
            Err(E::custom(format!(
                "a string where {EXPECTED} goes (its value not shown)"
            )))
        }

        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Vec<String>, E> {
            Err(E::custom(format!("expected {EXPECTED}")))
        }

        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Vec<String>, E> {
            Err(E::custom(format!("expected {EXPECTED}")))
        }

        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Vec<String>, E> {
            Err(E::custom(format!("expected {EXPECTED}")))
        }

        fn visit_map<A: de::MapAccess<'de>>(self, _: A) -> Result<Vec<String>, A::Error> {
            Err(de::Error::custom(format!("expected {EXPECTED}")))
        }
    }

    /// One list item: a string, else an error without the value.
    struct Secret(String);

    impl<'de> de::Deserialize<'de> for Secret {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Secret, D::Error> {
            struct One;
            impl<'de> Visitor<'de> for One {
                type Value = Secret;
                fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                    f.write_str("a secret (a string)")
                }
                fn visit_str<E: de::Error>(self, v: &str) -> Result<Secret, E> {
                    Ok(Secret(v.to_owned()))
                }
                fn visit_string<E: de::Error>(self, v: String) -> Result<Secret, E> {
                    Ok(Secret(v))
                }
            }
            d.deserialize_str(One)
        }
    }

    pub(super) fn list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
        d.deserialize_any(List)
    }
}

mod duration {
    use serde::de::{Deserializer, Error, Visitor};
    use std::time::Duration;

    struct Either;

    impl Visitor<'_> for Either {
        type Value = Duration;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a duration: milliseconds as an integer, or a string such as \"1500ms\", \"2s\", \"24h\"")
        }

        fn visit_u64<E: Error>(self, v: u64) -> Result<Duration, E> {
            Ok(Duration::from_millis(v))
        }

        fn visit_i64<E: Error>(self, v: i64) -> Result<Duration, E> {
            u64::try_from(v)
                .map(Duration::from_millis)
                .map_err(|_| E::custom(format!("{v}: a duration cannot be negative")))
        }

        fn visit_str<E: Error>(self, s: &str) -> Result<Duration, E> {
            humantime::parse_duration(s).map_err(|e| {
                E::custom(format!(
                    "{s:?} is not a duration ({e}): write milliseconds (1500) or a number with a unit (\"1500ms\", \"2s\", \"24h\")"
                ))
            })
        }
    }

    pub(super) fn human<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        d.deserialize_any(Either)
    }

    pub(super) fn ms<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        human(d).map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }

    pub(super) fn ms_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        ms(d).map(Some)
    }

    /// A list of durations, each as [`human`] reads one.
    pub(super) fn list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Duration>, D::Error> {
        #[derive(serde::Deserialize)]
        struct One(#[serde(deserialize_with = "human")] Duration);
        let v: Vec<One> = serde::Deserialize::deserialize(d)?;
        Ok(v.into_iter().map(|o| o.0).collect())
    }
}

/// `host:port`, an IP address or a host name resolved now (the first IPv4
/// address when there is one: `localhost` is then 127.0.0.1).
fn socket_addr<'de, D: serde::Deserializer<'de>>(d: D) -> Result<SocketAddr, D::Error> {
    use std::net::ToSocketAddrs;
    let s = String::deserialize(d)?;
    if let Ok(a) = s.parse() {
        return Ok(a);
    }
    let addrs: Vec<SocketAddr> = s
        .to_socket_addrs()
        .map_err(|e| serde::de::Error::custom(format!("{s:?} is not host:port ({e})")))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| serde::de::Error::custom(format!("{s:?} resolves to no address")))
}

/// `[[route]] derive_key`: the dedup key used when the worker sends none (SPEC §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DeriveKey {
    /// A hash of route, method, path and query, and body: identical requests
    /// deduplicate.
    #[default]
    Content,
    /// A fresh key each time; nothing is recorded.
    None,
}

/// `[[route]] delivery`: forward while the worker waits, or accept into the
/// queue and deliver later (SPEC §11).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Delivery {
    /// Forwarded while the worker waits (SPEC §3–§6).
    #[default]
    Direct,
    /// Written durably, answered 202, delivered in order with retries (SPEC §11).
    Queued,
}

/// `[[route]] ordering` of a queued route (SPEC §11).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Ordering {
    /// One message of a lease at a time, in acceptance order.
    #[default]
    Lease,
    /// An epoch's messages in parallel (up to `max_in_flight`, else 16); the
    /// next epoch's only once none of this one is left.
    None,
}

/// `[[route]] retry` of a queued route: the waits between its attempts.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryConfig {
    /// The wait before attempt n+1 is `schedule[n-1]` (±20%); after the last,
    /// the message has failed.
    #[serde(deserialize_with = "duration::list")]
    pub schedule: Vec<Duration>,
}

impl Default for RetryConfig {
    /// Svix's shape: 5 s, 30 s, 5 min, 30 min, 2 h.
    fn default() -> RetryConfig {
        RetryConfig {
            schedule: [5, 30, 300, 1800, 7200]
                .into_iter()
                .map(Duration::from_secs)
                .collect(),
        }
    }
}

/// `[[route]] in_doubt`: what a repeat of an in-doubt key gets (SPEC §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum InDoubtPolicy {
    /// 409 `dedup_in_doubt` until an operator resolves the key.
    #[default]
    Reject,
    /// Forward it again: for upstreams that tolerate a duplicate.
    Resend,
}

impl DeriveKey {
    /// The config's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            DeriveKey::Content => "content",
            DeriveKey::None => "none",
        }
    }
}

impl InDoubtPolicy {
    /// The config's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            InDoubtPolicy::Reject => "reject",
            InDoubtPolicy::Resend => "resend",
        }
    }
}

/// `[[route]]`: one path prefix mapped to an upstream and the lease that fences it
/// (SPEC §3, §9).
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// Names the route in logs, metrics, dedup scopes and admin calls.
    pub name: String,
    /// Requests whose path starts with this go to this route.
    pub path_prefix: String,
    /// Upstream base URL; the prefix is replaced by its path.
    pub upstream: String,
    /// The lease whose epochs admit requests on this route (SPEC §4).
    pub lease: LeaseName,
    /// Bound on one upstream exchange; past it the outcome is in doubt (SPEC §6).
    #[serde(
        default = "d_timeout",
        alias = "timeout",
        deserialize_with = "duration::ms"
    )]
    pub timeout_ms: u64,
    /// Whether `X-Lease-Token` must be sent and checked (SPEC §4 rule 2).
    #[serde(default = "d_true")]
    pub require_token: bool,
    /// Header carrying the dedup key upstream (SPEC §3).
    #[serde(default = "d_dedup_header")]
    pub dedup_header: String,
    /// Key used when the worker sends none.
    #[serde(default)]
    pub derive_key: DeriveKey,
    /// What a repeat of an in-doubt key gets.
    #[serde(default)]
    pub in_doubt: InDoubtPolicy,
    /// Upstream statuses that delete the dedup record instead of keeping it `done`, so
    /// a retry is forwarded.
    #[serde(default = "d_retryable")]
    pub retryable_statuses: Vec<u16>,
    /// Larger request bodies are refused (413).
    #[serde(default = "d_mib")]
    pub max_body_bytes: usize,
    /// Larger responses are not kept for replay; a repeat gets 409 `dedup_done`.
    #[serde(default = "d_mib")]
    pub max_replay_bytes: usize,
    /// A queued route's messages whose request is kept, and their bytes: past
    /// either a new message is refused (503 `queue_full`, SPEC §11); none: only
    /// `[state]`'s bound over every route.
    pub queue_max_messages: Option<u64>,
    /// See `queue_max_messages`.
    pub queue_max_bytes: Option<u64>,
    /// How long a raise waits for lower epochs in flight before aborting them (SPEC
    /// §5); absent: `timeout_ms`.
    #[serde(
        default,
        alias = "drain_timeout",
        deserialize_with = "duration::ms_opt"
    )]
    pub drain_timeout_ms: Option<u64>,
    /// Headers set on every forwarded request; `${NAME}` reads the environment.
    /// Values are secrets: never logged or printed.
    #[serde(default)]
    pub upstream_headers: BTreeMap<String, String>,
    /// PEM bundle of extra CA certificates trusted for this route's https upstream.
    pub ca_file: Option<PathBuf>,
    /// Protecting the destination (SPEC §9, `crate::protect`): requests at the
    /// upstream at once; beyond it a request is refused (503 `upstream_held`).
    pub max_in_flight: Option<usize>,
    /// Hold the route while a 429/503's `Retry-After` runs.
    #[serde(default = "d_true")]
    pub honor_retry_after: bool,
    /// The longest hold a `Retry-After` sets (the worker still gets it as sent).
    #[serde(default = "d_max_retry_after", deserialize_with = "duration::human")]
    pub max_retry_after: Duration,
    /// The route's circuit breaker; absent: none.
    pub breaker: Option<BreakerConfig>,
    /// Requests to the upstream per second, minute or hour (`"50/s"`), per
    /// instance: beyond it a direct request is refused (503 `upstream_held`,
    /// detail `rate`) and a queued attempt waits its turn. Absent: none.
    #[serde(default, deserialize_with = "crate::protect::rate::deserialize")]
    pub rate: Option<crate::protect::rate::Rate>,
    /// How many requests may go at once after a quiet spell (the bucket's
    /// size); default a second's worth of `rate`, at least 1.
    pub rate_burst: Option<u32>,
    /// PEM certificate chain shown to an https upstream that asks for one
    /// (mutual TLS); needs `client_key`. Re-read on reload.
    pub client_cert: Option<PathBuf>,
    /// PEM private key of `client_cert`. Never logged or printed.
    pub client_key: Option<PathBuf>,
    /// Standard Webhooks secrets (`whsec_…`, `${NAME}` reads the environment):
    /// when set, every forwarded request is signed with each, and its body is
    /// read whole first (up to `max_body_bytes`). Never logged or printed.
    #[serde(default, deserialize_with = "secrets::list")]
    pub signing_secrets: Vec<String>,
    /// `"queued"`: accept durably, answer 202, deliver in order with retries
    /// (SPEC §11).
    #[serde(default)]
    pub delivery: Delivery,
    /// A queued route's delivery order.
    #[serde(default)]
    pub ordering: Ordering,
    /// A queued route's retry schedule.
    #[serde(default)]
    pub retry: RetryConfig,
}

/// `[[route]] breaker`: `failures` consecutive upstream failures within `window`
/// open it for `cool_down`; then one probe request decides (SPEC §9).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BreakerConfig {
    /// Consecutive failures that open it.
    #[serde(default = "d_breaker_failures")]
    pub failures: u32,
    /// They must fall within this long of each other.
    #[serde(default = "d_breaker_window", deserialize_with = "duration::human")]
    pub window: Duration,
    /// How long it stays open before a probe.
    #[serde(default = "d_breaker_cool_down", deserialize_with = "duration::human")]
    pub cool_down: Duration,
}

fn d_max_retry_after() -> Duration {
    Duration::from_secs(300)
}
fn d_breaker_failures() -> u32 {
    5
}
fn d_breaker_window() -> Duration {
    Duration::from_secs(10)
}
fn d_breaker_cool_down() -> Duration {
    Duration::from_secs(5)
}

impl std::fmt::Debug for RouteConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouteConfig")
            .field("name", &self.name)
            .field("path_prefix", &self.path_prefix)
            .field("upstream", &self.upstream)
            .field("lease", &self.lease)
            .field(
                "upstream_headers",
                &self.upstream_headers.keys().collect::<Vec<_>>(),
            )
            .field("client_cert", &self.client_cert)
            .field("signing_secrets", &self.signing_secrets.len())
            .finish_non_exhaustive()
    }
}

fn d_timeout() -> u64 {
    10_000
}
fn d_true() -> bool {
    true
}
fn d_dedup_header() -> String {
    "Idempotency-Key".into()
}
fn d_retryable() -> Vec<u16> {
    vec![429, 502, 503, 504]
}
fn d_mib() -> usize {
    1 << 20
}

impl RouteConfig {
    /// `timeout_ms` as a [`Duration`].
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }

    /// How long a drain waits (SPEC §5): `drain_timeout_ms`, else `timeout_ms`.
    pub fn drain_timeout(&self) -> Duration {
        Duration::from_millis(self.drain_timeout_ms.unwrap_or(self.timeout_ms))
    }

    /// The keys that protect the destination (SPEC §9), each error naming its key.
    /// Durations are bounded ([`MAX_PROTECT_DURATION`]): an instant that far
    /// ahead must stay representable (a huge `cool_down` once panicked).
    fn validate_protection(&self) -> Result<(), String> {
        let name = &self.name;
        if self.max_in_flight == Some(0) {
            return Err(format!(
                "route {name:?}: max_in_flight must be at least 1 (leave it out for no limit)"
            ));
        }
        if self.max_retry_after.is_zero() {
            return Err(format!(
                "route {name:?}: max_retry_after must be positive (honor_retry_after = false turns holding off)"
            ));
        }
        if self.max_retry_after > MAX_PROTECT_DURATION {
            return Err(format!(
                "route {name:?}: max_retry_after must be at most \"1d\""
            ));
        }
        match (self.rate, self.rate_burst) {
            (None, Some(_)) => {
                return Err(format!(
                    "route {name:?}: rate_burst needs rate (e.g. rate = \"50/s\")"
                ))
            }
            (Some(_), Some(0)) => {
                return Err(format!("route {name:?}: rate_burst must be at least 1"))
            }
            _ => {}
        }
        if let Some(b) = &self.breaker {
            if b.failures == 0 {
                return Err(format!(
                    "route {name:?}: breaker.failures must be at least 1 (leave breaker out for none)"
                ));
            }
            if b.window.is_zero() || b.cool_down.is_zero() {
                return Err(format!(
                    "route {name:?}: breaker.window and breaker.cool_down must be positive"
                ));
            }
            if b.window > MAX_PROTECT_DURATION || b.cool_down > MAX_PROTECT_DURATION {
                return Err(format!(
                    "route {name:?}: breaker.window and breaker.cool_down must be at most \"1d\""
                ));
            }
        }
        Ok(())
    }

    /// `signing_secrets` with `${NAME}` read from the environment (none: the
    /// route does not sign).
    pub fn resolve_signing_secrets(&self) -> Result<Vec<String>, String> {
        self.signing_secrets
            .iter()
            .enumerate()
            .map(|(i, raw)| from_env(&format!("route {:?}: signing_secrets[{i}]", self.name), raw))
            .collect()
    }

    /// The route's Standard Webhooks signer, if it signs: secrets resolved and
    /// decoded (an error names the secret by position, never by value).
    pub fn signer(&self) -> Result<Option<crate::forward::sign::Signer>, String> {
        if self.signing_secrets.is_empty() {
            return Ok(None);
        }
        crate::forward::sign::Signer::new(&self.resolve_signing_secrets()?)
            .map(Some)
            .map_err(|e| format!("route {:?}: {e}", self.name))
    }

    /// The route's TLS client certificate and key, read and checked to match
    /// (none: no client certificate).
    pub fn client_identity(&self) -> Result<Option<crate::forward::client_auth::Identity>, String> {
        match (&self.client_cert, &self.client_key) {
            (None, None) => Ok(None),
            (Some(c), Some(k)) => crate::forward::client_auth::Identity::load(c, k)
                .map(Some)
                .map_err(|e| format!("route {:?}: {e}", self.name)),
            _ => Err(format!(
                "route {:?}: client_cert and client_key go together: set both or neither",
                self.name
            )),
        }
    }

    /// Resolves `upstream_headers`, reading `${NAME}` values from the environment.
    pub fn resolve_upstream_headers(&self) -> Result<Vec<(HeaderName, HeaderValue)>, String> {
        let mut out = Vec::new();
        for (name, raw) in &self.upstream_headers {
            let hn = HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
                format!(
                    "route {:?}: upstream_headers: invalid header name {name:?}",
                    self.name
                )
            })?;
            let value = match raw.strip_prefix("${").and_then(|r| r.strip_suffix('}')) {
                Some(var) => std::env::var(var).map_err(|_| {
                    format!(
                        "route {:?}: upstream_headers.{name} reads ${{{var}}}, which is not set in the environment",
                        self.name
                    )
                })?,
                None => raw.clone(),
            };
            let mut hv = HeaderValue::from_str(&value).map_err(|_| {
                format!(
                    "route {:?}: upstream_headers.{name}: value is not a valid header value",
                    self.name
                )
            })?;
            hv.set_sensitive(true);
            out.push((hn, hv));
        }
        Ok(out)
    }
}

/// Where the config file was found (SPEC §8): the first of `--config`,
/// `$FENCEGATE_CONFIG`, `./fencegate.toml`, `./config/fencegate.toml` and
/// `/etc/fencegate/fencegate.toml` that is given or exists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    /// The file, absolute (so are the paths resolved against it).
    pub path: PathBuf,
    /// How it was chosen, for the first log line: `--config`,
    /// `$FENCEGATE_CONFIG` or `default`.
    pub via: &'static str,
}

/// The environment variable naming the config file when `--config` is not given.
pub const CONFIG_ENV: &str = "FENCEGATE_CONFIG";

/// The default places, after `--config` and `$FENCEGATE_CONFIG`, in order.
pub const DEFAULT_PLACES: [&str; 3] = [
    "fencegate.toml",
    "config/fencegate.toml",
    "/etc/fencegate/fencegate.toml",
];

/// Finds the config file: `explicit` (`--config`) if given, else `env` (the
/// value of `$FENCEGATE_CONFIG`, if set and not empty), else the first of
/// [`DEFAULT_PLACES`] that `exists` (relative ones against the working
/// directory). The file itself is not read: a given path that does not exist is
/// reported when it is loaded.
pub fn locate(
    explicit: Option<PathBuf>,
    env: Option<std::ffi::OsString>,
    exists: impl Fn(&Path) -> bool,
) -> Result<Located, ConfigError> {
    let absolute = |p: PathBuf| std::path::absolute(&p).unwrap_or(p);
    if let Some(p) = explicit {
        return Ok(Located {
            path: absolute(p),
            via: "--config",
        });
    }
    if let Some(p) = env.filter(|v| !v.is_empty()) {
        return Ok(Located {
            path: absolute(PathBuf::from(p)),
            via: "$FENCEGATE_CONFIG",
        });
    }
    for place in DEFAULT_PLACES {
        if exists(Path::new(place)) {
            return Ok(Located {
                path: absolute(PathBuf::from(place)),
                via: "default",
            });
        }
    }
    Err(ConfigError::NotFound {
        tried: format!(
            "no --config, {CONFIG_ENV} unset, and none of {} exists",
            DEFAULT_PLACES.join(", ")
        ),
    })
}

/// A path as the summary shows it: resolved the way the OS will (symlinks and
/// `..` of its nearest existing ancestor), so an operator sees where it is.
fn shown(p: &Path) -> String {
    let mut rest = Vec::new();
    let mut at = p;
    loop {
        if let Ok(real) = std::fs::canonicalize(at) {
            let mut out = real;
            out.extend(rest.iter().rev());
            return out.display().to_string();
        }
        match (at.parent(), at.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_owned());
                at = parent;
            }
            _ => return p.display().to_string(),
        }
    }
}

/// serde's "unknown field `x`, expected one of `a`, `b`" (or "unknown variant")
/// with the closest expected name added: "… — did you mean `a`?".
fn with_suggestion(message: &str) -> String {
    let guess = (|| {
        let rest = message
            .strip_prefix("unknown field `")
            .or_else(|| message.strip_prefix("unknown variant `"))?;
        let (typed, expected) = rest.split_once('`')?;
        let typed = typed.to_ascii_lowercase();
        let best = expected
            .split('`')
            .skip(1)
            .step_by(2)
            .map(|name| (edit_distance(&typed, &name.to_ascii_lowercase()), name))
            .min()?;
        // Close enough to be a typo: a third of the name, at least two edits.
        (best.0 <= (typed.chars().count() / 3).max(2)).then(|| best.1.to_owned())
    })();
    match guess {
        Some(name) => {
            let (head, tail) = message.split_once(", expected").unwrap_or((message, ""));
            if tail.is_empty() {
                format!("{head} — did you mean `{name}`?")
            } else {
                format!("{head} — did you mean `{name}`? (expected{tail})")
            }
        }
        None => message.to_owned(),
    }
}

/// Levenshtein distance, by characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (row[j + 1] + 1)
                .min(row[j] + 1)
                .min(diag + usize::from(ca != *cb));
            diag = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
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

    fn validate_telemetry(&self) -> Result<(), String> {
        let t = &self.telemetry;
        if let Some(e) = &t.otlp_endpoint {
            let uri: Uri = e
                .parse()
                .map_err(|_| format!("[telemetry] otlp_endpoint {e:?} is not a URL"))?;
            if !matches!(uri.scheme_str(), Some("http" | "https"))
                || uri.authority().is_none_or(|a| a.as_str().contains('@'))
                || uri.query().is_some()
            {
                return Err(format!(
                    "[telemetry] otlp_endpoint {e:?} must be an http:// or https:// URL without credentials or a query (spans go to its /v1/traces)"
                ));
            }
        }
        if !(0.0..=1.0).contains(&t.sample_ratio) {
            return Err(format!(
                "[telemetry] sample_ratio ({}) must be between 0.0 and 1.0",
                t.sample_ratio
            ));
        }
        if t.max_queue_spans == 0 || t.service_name.is_empty() {
            return Err(
                "[telemetry] max_queue_spans must be positive and service_name not empty".into(),
            );
        }
        Ok(())
    }

    fn validate_cluster(&self) -> Result<(), String> {
        let Some(c) = &self.cluster else {
            return Ok(());
        };
        if self.state.kind != StateKind::Postgres {
            return Err("[cluster] needs [state] kind = \"postgres\": every instance must see the same marks and dedup records".into());
        }
        if c.instance_id.is_empty()
            || c.instance_id.len() > 64
            || !c
                .instance_id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        {
            return Err(format!(
                "[cluster] instance_id {:?} must be 1-64 characters of [A-Za-z0-9._-]",
                c.instance_id
            ));
        }
        let uri: Uri = c
            .advertise
            .parse()
            .map_err(|_| format!("[cluster] advertise {:?} is not a URL", c.advertise))?;
        if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.authority().is_none() {
            return Err(format!(
                "[cluster] advertise {:?} must be an http:// or https:// URL of this instance's proxy listener",
                c.advertise
            ));
        }
        if !(1..=MAX_SHARDS).contains(&c.shards) {
            return Err(format!(
                "[cluster] shards ({}) must be between 1 and 9999",
                c.shards
            ));
        }
        if c.resolved_peer_token()?.len() < 16 {
            return Err("[cluster] peer_token must be at least 16 characters".into());
        }
        Ok(())
    }

    fn validate_state(&self) -> Result<(), String> {
        let s = &self.state;
        if s.cache_mb == 0 {
            return Err("[state] cache_mb must be at least 1".into());
        }
        if s.kind == StateKind::Postgres {
            s.resolved_url()?;
            if s.pool_size == 0 {
                return Err("[state] pool_size must be at least 1".into());
            }
            if s.timeout_ms == 0 {
                return Err("[state] timeout_ms must be at least 1".into());
            }
            if let Some(ca) = &s.ca_file {
                if !ca.is_file() {
                    return Err(format!(
                        "[state] ca_file {} is not a readable file",
                        ca.display()
                    ));
                }
            }
            if let Some(schema) = &s.schema {
                check_schema_name(schema)?;
            }
        } else if s.url.is_some() {
            return Err(
                "[state] url is set but kind is \"sled\": set kind = \"postgres\" or remove url"
                    .into(),
            );
        } else if s.schema.is_some() {
            return Err(
                "[state] schema is set but kind is \"sled\": a schema names where fencegate's tables live in PostgreSQL"
                    .into(),
            );
        }
        Ok(())
    }

    fn validate_server(&self) -> Result<(), String> {
        let (p, a) = (self.server.listen, self.server.admin_listen);
        let overlap = p.ip() == a.ip() || p.ip().is_unspecified() || a.ip().is_unspecified();
        if p.port() != 0 && p.port() == a.port() && overlap {
            return Err(format!(
                "[server] listen ({p}) and admin_listen ({a}) are the same address: give admin_listen its own port"
            ));
        }
        if let Some(tls) = &self.server.tls {
            for (what, p) in [("cert", &tls.cert), ("key", &tls.key)] {
                if !p.exists() {
                    return Err(format!(
                        "[server.tls] {what} {} does not exist",
                        p.display()
                    ));
                }
            }
        }
        tracing_subscriber::EnvFilter::try_new(&self.server.log_level).map_err(|e| {
            format!(
                "[server] log_level {:?} is not a log filter: {e}",
                self.server.log_level
            )
        })?;
        if self.server.max_connections == 0
            || self.server.admin_max_connections == 0
            || self.server.header_read_timeout_ms == 0
        {
            return Err(
                "[server] max_connections, admin_max_connections and header_read_timeout_ms must be positive".into(),
            );
        }
        Ok(())
    }

    /// The `[store]` section alone (all the `lease` commands need).
    pub fn validate_store(&self) -> Result<(), String> {
        let s = &self.store;
        if s.kind == StoreKind::S3 && s.bucket.as_deref().is_none_or(str::is_empty) {
            return Err("[store] kind = \"s3\" needs a bucket".into());
        }
        if !s.prefix.is_empty() && !s.prefix.ends_with('/') {
            return Err(format!(
                "[store] prefix {:?} must be empty or end with '/'",
                s.prefix
            ));
        }
        if s.refresh_interval_ms == 0 || s.timeout_ms == 0 {
            return Err("[store] refresh_interval_ms and timeout_ms must be positive".into());
        }
        if s.self_fence_margin >= s.gate_ttl {
            return Err(format!(
                "[store] self_fence_margin ({}) must be shorter than gate_ttl ({})",
                humantime::format_duration(s.self_fence_margin),
                humantime::format_duration(s.gate_ttl)
            ));
        }
        if s.gate_ttl < Duration::from_millis(3 * s.timeout_ms) {
            return Err(format!(
                "[store] gate_ttl ({}) must be at least three store call timeouts ({} ms): it is renewed every third of it",
                humantime::format_duration(s.gate_ttl),
                3 * s.timeout_ms
            ));
        }
        if let Some(ep) = &s.endpoint {
            let uri: Uri = ep
                .parse()
                .map_err(|_| format!("[store] endpoint {ep:?} is not a URL"))?;
            if uri.scheme().is_none() || uri.authority().is_none() {
                return Err(format!("[store] endpoint {ep:?} needs a scheme and host"));
            }
        }
        Ok(())
    }

    fn validate_routes(&self) -> Result<(), String> {
        if self.routes.is_empty() {
            return Err("no [[route]] configured: fencegate would refuse every request".into());
        }
        let mut names = HashSet::new();
        let mut prefixes = HashSet::new();
        for r in &self.routes {
            LeaseName::parse(&r.name).map_err(|_| {
                format!("route name {:?} must match [a-z0-9][a-z0-9._-]{{0,62}} (it appears in admin URLs)", r.name)
            })?;
            if !names.insert(r.name.as_str()) {
                return Err(format!("route name {:?} is used twice", r.name));
            }
            if !r.path_prefix.starts_with('/') || !r.path_prefix.ends_with('/') {
                return Err(format!(
                    "route {:?}: path_prefix {:?} must start and end with '/'",
                    r.name, r.path_prefix
                ));
            }
            if !prefixes.insert(r.path_prefix.as_str()) {
                return Err(format!(
                    "path_prefix {:?} is used by two routes",
                    r.path_prefix
                ));
            }
            let uri: Uri = r.upstream.parse().map_err(|_| {
                format!("route {:?}: upstream {:?} is not a URL", r.name, r.upstream)
            })?;
            match uri.scheme_str() {
                Some("http" | "https") => {}
                _ => {
                    return Err(format!(
                        "route {:?}: upstream {:?} must be http:// or https://",
                        r.name, r.upstream
                    ))
                }
            }
            if uri.authority().is_none() || uri.query().is_some() {
                return Err(format!(
                    "route {:?}: upstream {:?} needs a host and no query",
                    r.name, r.upstream
                ));
            }
            if r.timeout_ms == 0 {
                return Err(format!("route {:?}: timeout_ms must be positive", r.name));
            }
            HeaderName::from_bytes(r.dedup_header.as_bytes()).map_err(|_| {
                format!(
                    "route {:?}: dedup_header {:?} is not a header name",
                    r.name, r.dedup_header
                )
            })?;
            for s in &r.retryable_statuses {
                if !(100..=599).contains(s) {
                    return Err(format!(
                        "route {:?}: retryable status {s} is not an HTTP status",
                        r.name
                    ));
                }
            }
            r.resolve_upstream_headers()?;
            r.validate_protection()?;
            if let Some(ca) = &r.ca_file {
                if !ca.exists() {
                    return Err(format!(
                        "route {:?}: ca_file {} does not exist",
                        r.name,
                        ca.display()
                    ));
                }
            }
            if r.client_identity()?.is_some() && uri.scheme_str() != Some("https") {
                return Err(format!(
                    "route {:?}: client_cert needs an https:// upstream (it is shown in the TLS handshake)",
                    r.name
                ));
            }
            if r.signer()?.is_some() {
                let signed = crate::forward::sign::SIGNED_HEADERS;
                if let Some(h) = r
                    .upstream_headers
                    .keys()
                    .find(|h| signed.iter().any(|s| s.as_str().eq_ignore_ascii_case(h)))
                {
                    return Err(format!(
                        "route {:?}: upstream_headers sets {h}, which signing_secrets sets on every request",
                        r.name
                    ));
                }
            }
            self.validate_queued(r)?;
        }
        // SPEC §11: the queue's order is the lease's epoch order only if no
        // direct request of the lease can overtake a queued message (once,
        // over every route).
        if let Some((q, d)) = mixed_delivery(self.routes.iter().map(RouteKind::of)) {
            return Err(format!(
                "lease {}: route {:?} is queued and route {:?} is direct; a lease's routes are all queued or all direct (a direct request could reach a destination before an older queued message)",
                q.lease, q.name, d.name
            ));
        }
        Ok(())
    }

    /// SPEC §11: a queued route's keys, and what it may not share.
    fn validate_queued(&self, r: &RouteConfig) -> Result<(), String> {
        if r.delivery != Delivery::Queued {
            return Ok(());
        }
        if let Some(o) = self.routes.iter().find(|o| {
            o.lease == r.lease && o.delivery == Delivery::Queued && o.ordering != r.ordering
        }) {
            return Err(format!(
                "lease {}: queued routes {:?} and {:?} order it differently; a lease's queue has one ordering",
                r.lease, r.name, o.name
            ));
        }
        if r.retry.schedule.len() > 20 {
            return Err(format!(
                "route {:?}: retry.schedule has {} steps; at most 20",
                r.name,
                r.retry.schedule.len()
            ));
        }
        if let Some(d) = r
            .retry
            .schedule
            .iter()
            .find(|d| d.is_zero() || **d > Duration::from_secs(7 * 86_400))
        {
            return Err(format!(
                "route {:?}: retry.schedule step {} must be positive and at most 7 days",
                r.name,
                humantime::format_duration(*d)
            ));
        }
        Ok(())
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

    /// A readable summary for `check-config` (never prints secret values).
    pub fn summary(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        let s = &self.store;
        let _ = writeln!(
            out,
            "listen        {}{}",
            self.server.listen,
            if self.server.tls.is_some() {
                " (TLS: HTTP/1.1 and HTTP/2 via ALPN)"
            } else {
                ""
            }
        );
        let _ = writeln!(out, "admin_listen  {}", self.server.admin_listen);
        let _ = writeln!(out, "data_dir      {}", shown(&self.server.data_dir));
        let _ = writeln!(
            out,
            "shutdown      serve {} ms not ready, then drain up to {} ms",
            self.server.shutdown_delay_ms, self.server.shutdown_timeout_ms
        );
        let _ = writeln!(
            out,
            "admin_token   {}",
            if self.server.admin_token.is_some() {
                "set (mutating admin calls enabled)"
            } else {
                "not set in config"
            }
        );
        match s.kind {
            StoreKind::Dir => {
                let _ = writeln!(
                    out,
                    "store         dir at {} (prefix {:?})",
                    shown(&s.path),
                    s.prefix
                );
            }
            StoreKind::S3 => {
                let _ = writeln!(
                    out,
                    "store         s3 bucket {} at {} region {} path-style {} (prefix {:?})",
                    s.bucket.as_deref().unwrap_or("?"),
                    s.endpoint.as_deref().unwrap_or("AWS"),
                    s.region,
                    s.force_path_style,
                    s.prefix
                );
            }
        }
        let _ = writeln!(
            out,
            "              refresh every {} ms, grace {} ms, call timeout {} ms",
            s.refresh_interval_ms, s.grace_ms, s.timeout_ms
        );
        let _ = writeln!(
            out,
            "dedup ttl     {}",
            humantime::format_duration(self.dedup.ttl)
        );
        let _ = match &self.telemetry.otlp_endpoint {
            None => writeln!(out, "traces        off"),
            Some(e) => writeln!(
                out,
                "traces        OTLP/HTTP to {}/v1/traces as {:?}, sample_ratio {}, queue {} spans",
                e.trim_end_matches('/'),
                self.telemetry.service_name,
                self.telemetry.sample_ratio,
                self.telemetry.max_queue_spans
            ),
        };
        let _ = match self.state.kind {
            StateKind::Sled => writeln!(out, "state         sled in data_dir"),
            // The connection string may hold a password: never shown.
            StateKind::Postgres => writeln!(
                out,
                "state         postgres (url hidden), schema {}, pool {}, timeout {} ms{}",
                self.state
                    .schema
                    .as_deref()
                    .unwrap_or("the connection's search_path"),
                self.state.pool_size,
                self.state.timeout_ms,
                self.state
                    .ca_file
                    .as_ref()
                    .map_or(String::new(), |c| format!(", CA {}", shown(c)))
            ),
        };
        match &self.cluster {
            None => {
                let _ = writeln!(out, "mode          single instance (instance guard)");
            }
            Some(c) => {
                let _ = writeln!(
                    out,
                    "mode          cluster: instance {} of {} shards, advertise {} (peer token hidden)",
                    c.instance_id, c.shards, c.advertise
                );
            }
        }
        for r in &self.routes {
            let _ = writeln!(out, "route {:?}", r.name);
            let _ = writeln!(
                out,
                "  {} -> {}  (lease {})",
                r.path_prefix, r.upstream, r.lease
            );
            let _ = writeln!(
                out,
                "  timeout {} ms, drain {} ms, token {}, derive_key {}, in_doubt {}, dedup_header {}",
                r.timeout_ms,
                r.drain_timeout().as_millis(),
                if r.require_token { "required" } else { "not required" },
                r.derive_key.as_str(),
                r.in_doubt.as_str(),
                r.dedup_header
            );
            let _ = writeln!(
                out,
                "  protects its upstream: max_in_flight {}, Retry-After {}, breaker {}, rate {}",
                r.max_in_flight.map_or("none".into(), |n| n.to_string()),
                if r.honor_retry_after {
                    format!(
                        "honoured up to {}",
                        humantime::format_duration(r.max_retry_after)
                    )
                } else {
                    "not honoured".into()
                },
                r.breaker.map_or("none".into(), |b| format!(
                    "{} failures within {}, cool-down {}",
                    b.failures,
                    humantime::format_duration(b.window),
                    humantime::format_duration(b.cool_down)
                )),
                r.rate.map_or("none".into(), |rate| format!(
                    "{rate} (burst {}, per instance)",
                    r.rate_burst.unwrap_or_else(|| rate.default_burst())
                ))
            );
            match r.delivery {
                Delivery::Direct => {
                    let _ = writeln!(out, "  delivery direct");
                }
                Delivery::Queued => {
                    let steps: Vec<String> = r
                        .retry
                        .schedule
                        .iter()
                        .map(|d| humantime::format_duration(*d).to_string())
                        .collect();
                    let _ = writeln!(
                        out,
                        "  delivery queued (ordering {}), retries after {}; keeps at most {} messages and {} bytes (all routes: {} and {})",
                        match r.ordering {
                            Ordering::Lease => "lease",
                            Ordering::None => "none",
                        },
                        steps.join(", "),
                        r.queue_max_messages.map_or("any".into(), |n| n.to_string()),
                        r.queue_max_bytes.map_or("any".into(), |n| n.to_string()),
                        self.state.queue_max_messages,
                        self.state.queue_max_bytes,
                    );
                }
            }
            if !r.upstream_headers.is_empty() {
                let names: Vec<_> = r.upstream_headers.keys().map(String::as_str).collect();
                let _ = writeln!(out, "  sets headers {} (values hidden)", names.join(", "));
            }
            if let Some(ca) = &r.ca_file {
                let _ = writeln!(out, "  trusts CA {}", shown(ca));
            }
            if let (Some(c), Some(k)) = (&r.client_cert, &r.client_key) {
                let _ = writeln!(
                    out,
                    "  client certificate {} (key {}, matches)",
                    shown(c),
                    shown(k)
                );
            }
            if !r.signing_secrets.is_empty() {
                let _ = writeln!(
                    out,
                    "  signs Standard Webhooks with {} secret(s) (values hidden); body read whole up to {} bytes",
                    r.signing_secrets.len(),
                    r.max_body_bytes
                );
            }
        }
        out
    }
}

/// `[state] schema`: an unquoted PostgreSQL identifier (lowercase letters,
/// digits, `_`; at most 63 bytes; not `pg_…`, which PostgreSQL reserves), so
/// that it goes into `search_path` and `CREATE SCHEMA` without quoting.
fn check_schema_name(name: &str) -> Result<(), String> {
    let first_ok = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    let rest_ok = name
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !first_ok || !rest_ok || name.len() > 63 {
        return Err(format!(
            "[state] schema {name:?} must be 1 to 63 lowercase letters, digits or '_', not starting with a digit"
        ));
    }
    if name.starts_with("pg_") {
        return Err(format!(
            "[state] schema {name:?}: names starting with pg_ are reserved by PostgreSQL"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {

    /// `[state] cache_mb`: 64 unless set; 0 is refused, by name.
    #[test]
    fn the_sled_cache_is_64_mib_unless_set_and_never_zero() {
        let base = "[[route]]\nname = \"r\"\npath_prefix = \"/r/\"\nupstream = \"http://u/\"\nlease = \"l\"\n";
        assert_eq!(Config::parse(base).unwrap().state.cache_mb, 64);
        let set = Config::parse(&format!("[state]\ncache_mb = 256\n{base}")).unwrap();
        set.validate().unwrap();
        assert_eq!(set.state.cache_mb, 256);
        let zero = Config::parse(&format!("[state]\ncache_mb = 0\n{base}")).unwrap();
        let e = zero.validate().unwrap_err();
        assert!(e.contains("[state] cache_mb must be at least 1"), "{e}");
    }

    #[test]
    fn protection_keys_parse_and_bad_values_are_named() {
        let base = "[[route]]\nname = \"r\"\npath_prefix = \"/r/\"\nupstream = \"http://u/\"\nlease = \"l\"\n";
        let c = Config::parse(&format!(
            "{base}max_in_flight = 4\nhonor_retry_after = false\nmax_retry_after = \"30s\"\n[route.breaker]\nfailures = 2\ncool_down = \"1s\"\n"
        ))
        .unwrap();
        c.validate().unwrap();
        let r = &c.routes[0];
        assert_eq!(r.max_in_flight, Some(4));
        assert!(!r.honor_retry_after);
        assert_eq!(r.max_retry_after, Duration::from_secs(30));
        assert_eq!(
            r.breaker,
            Some(BreakerConfig {
                failures: 2,
                window: Duration::from_secs(10),
                cool_down: Duration::from_secs(1),
            })
        );
        let d = Config::parse(base).unwrap();
        let r = &d.routes[0];
        assert_eq!(
            (r.max_in_flight, r.honor_retry_after, r.breaker),
            (None, true, None)
        );
        assert_eq!(r.max_retry_after, Duration::from_secs(300));
        for (extra, says) in [
            ("max_in_flight = 0", "max_in_flight must be at least 1"),
            ("max_retry_after = 0", "max_retry_after must be positive"),
            (
                "breaker = { failures = 0 }",
                "breaker.failures must be at least 1",
            ),
            (
                "breaker = { cool_down = 0 }",
                "breaker.window and breaker.cool_down",
            ),
            (
                "max_retry_after = \"25h\"",
                "max_retry_after must be at most",
            ),
            (
                "breaker = { cool_down = \"300000000000y\" }",
                "breaker.window and breaker.cool_down must be at most",
            ),
            (
                "breaker = { window = \"2d\" }",
                "breaker.window and breaker.cool_down must be at most",
            ),
        ] {
            let e = Config::parse(&format!("{base}{extra}\n"))
                .and_then(|c| c.validate())
                .unwrap_err();
            assert!(
                e.contains(says) && e.contains("route \"r\""),
                "{extra}: {e}"
            );
        }
        let e = Config::parse(&format!("{base}breaker = {{ failurez = 2 }}\n")).unwrap_err();
        assert!(e.contains("failurez"), "{e}");
    }
    use super::*;

    #[test]
    fn the_rule_of_kinds_finds_a_shared_lease_or_name() {
        let k = |name, lease, queued| RouteKind {
            name,
            lease,
            queued,
        };
        assert_eq!(
            mixed_delivery([k("a", "l", true), k("b", "m", false)]),
            None
        );
        assert_eq!(
            mixed_delivery([k("a", "l", true), k("b", "l", false)]),
            Some((k("a", "l", true), k("b", "l", false))),
            "a lease's routes"
        );
        assert_eq!(
            mixed_delivery([k("b", "m", false), k("b", "l", true)]),
            Some((k("b", "l", true), k("b", "m", false))),
            "a name's history"
        );
        assert_eq!(mixed_delivery([k("a", "l", true), k("b", "l", true)]), None);
    }

    const MIN: &str = r#"
[[route]]
name = "billing"
path_prefix = "/billing/"
upstream = "http://127.0.0.1:1/v1/"
lease = "billing"
"#;

    #[test]
    fn defaults_fill_in() {
        let c = Config::parse(MIN).unwrap();
        c.validate().unwrap();
        let r = &c.routes[0];
        assert!(r.require_token);
        assert_eq!(r.dedup_header, "Idempotency-Key");
        assert_eq!(r.retryable_statuses, vec![429, 502, 503, 504]);
        assert_eq!(r.max_body_bytes, 1 << 20);
        assert_eq!(r.drain_timeout(), Duration::from_millis(10_000));
        assert_eq!(c.store.refresh_interval_ms, 1000);
        assert_eq!(c.store.grace_ms, 2000);
        assert_eq!(c.dedup.ttl, Duration::from_secs(86400));
    }

    #[test]
    fn telemetry_is_off_unless_an_endpoint_is_set() {
        let c = Config::parse(MIN).unwrap();
        assert_eq!(c.telemetry.otlp_endpoint, None);
        assert!(c.summary().contains("traces        off"));
        let on = |extra: &str| {
            Config::parse(&format!(
                "[telemetry]\notlp_endpoint = \"http://collector:4318/\"\n{extra}\n{MIN}"
            ))
            .unwrap()
        };
        let c = on("");
        c.validate().unwrap();
        assert_eq!(c.telemetry.service_name, "fencegate");
        assert_eq!(c.telemetry.sample_ratio, 1.0);
        assert!(c
            .summary()
            .contains("OTLP/HTTP to http://collector:4318/v1/traces"));
        for (extra, says) in [
            ("sample_ratio = 1.5", "sample_ratio"),
            ("max_queue_spans = 0", "max_queue_spans"),
            ("service_name = \"\"", "service_name"),
        ] {
            let e = on(extra).validate().unwrap_err();
            assert!(e.contains(says), "{extra}: {e}");
        }
        for bad in [
            "collector:4318",
            "ftp://collector",
            "http://user:pass@collector:4318",
            "http://collector:4318/?k=v",
        ] {
            let c =
                Config::parse(&format!("[telemetry]\notlp_endpoint = \"{bad}\"\n{MIN}")).unwrap();
            let e = c.validate().unwrap_err();
            assert!(e.contains("otlp_endpoint"), "{bad}: {e}");
        }
        assert!(Config::parse(&format!("[telemetry]\nendpoint = \"x\"\n{MIN}")).is_err());
    }

    #[test]
    fn a_dedup_ttl_shorter_than_a_request_can_last_is_warned_about() {
        assert!(Config::parse(MIN).unwrap().warnings().is_empty());
        let c = Config::parse(&format!("[dedup]\nttl = \"15s\"\n{MIN}")).unwrap();
        let w = c.warnings();
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("\"billing\"") && w[0].contains("20s"),
            "{}",
            w[0]
        );
    }

    #[test]
    fn durations_take_either_form_under_either_name() {
        let c = Config::parse(&format!(
            "[server]\nshutdown_timeout = \"3s\"\nheader_read_timeout_ms = 1500\nshutdown_delay = \"5s\"\n\
             [store]\ngrace_ms = \"2500ms\"\nrefresh_interval = 250\ngate_ttl = 12000\n\
             [dedup]\nttl = \"1h\"\n{MIN}timeout = \"4s\"\ndrain_timeout = \"1s\"\n"
        ))
        .unwrap();
        assert_eq!(c.server.shutdown_timeout_ms, 3000);
        assert_eq!(c.server.header_read_timeout_ms, 1500);
        assert_eq!(c.server.shutdown_delay_ms, 5000);
        assert_eq!(Config::parse(MIN).unwrap().server.shutdown_delay_ms, 0);
        assert_eq!(c.store.grace_ms, 2500);
        assert_eq!(c.store.refresh_interval_ms, 250);
        assert_eq!(c.store.gate_ttl, Duration::from_secs(12));
        assert_eq!(c.dedup.ttl, Duration::from_secs(3600));
        assert_eq!(c.routes[0].timeout_ms, 4000);
        assert_eq!(c.routes[0].drain_timeout(), Duration::from_secs(1));
        let e = Config::parse(&format!("{MIN}timeout = \"soon\"\n")).unwrap_err();
        assert!(e.contains("soon"), "{e}");
        let e = Config::parse(&format!("{MIN}timeout = 1\ntimeout_ms = 2\n")).unwrap_err();
        assert!(e.contains("duplicate"), "{e}");
    }

    #[test]
    fn listen_takes_a_host_name() {
        let c = Config::parse(&format!("[server]\nlisten = \"localhost:8085\"\n{MIN}")).unwrap();
        assert_eq!(c.server.listen, SocketAddr::from(([127, 0, 0, 1], 8085)));
        assert!(Config::parse(&format!("[server]\nlisten = \"localhost\"\n{MIN}")).is_err());
    }

    #[test]
    fn listen_and_admin_listen_must_differ() {
        for (l, a) in [
            ("127.0.0.1:8080", "127.0.0.1:8080"),
            ("0.0.0.0:8080", "127.0.0.1:8080"),
        ] {
            let c = Config::parse(&format!(
                "[server]\nlisten = \"{l}\"\nadmin_listen = \"{a}\"\n{MIN}"
            ))
            .unwrap();
            let e = c.validate().unwrap_err();
            assert!(e.contains("admin_listen"), "{e}");
        }
        let c = Config::parse(&format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{MIN}"
        ))
        .unwrap();
        c.validate().unwrap();
    }

    #[test]
    fn relative_paths_follow_the_config_file() {
        let mut c = Config::parse(&format!(
            "[server]\ndata_dir = \"state\"\n[store]\npath = \"/abs/leases\"\n{MIN}"
        ))
        .unwrap();
        c.resolve_paths(Path::new("/etc/fencegate/fencegate.toml"));
        assert_eq!(c.server.data_dir, Path::new("/etc/fencegate/state"));
        assert_eq!(c.store.path, Path::new("/abs/leases"));
    }

    #[test]
    fn a_typo_gets_a_did_you_mean() {
        let e = Config::parse("[server]\nlisten = \"127.0.0.1:1\"\nlistne = 1\n").unwrap_err();
        assert!(
            e.starts_with(
                "line 3: unknown field `listne` — did you mean `listen`? (expected one of"
            ),
            "{e}"
        );
        let e = Config::parse("[server]\nshutdown_timeout = \"ten seconds\"\n").unwrap_err();
        assert!(
            e.starts_with("line 2, shutdown_timeout: \"ten seconds\" is not a duration"),
            "names the key: {e}"
        );
        let e = Config::parse(&format!("{MIN}drain_timout_ms = 5\n")).unwrap_err();
        assert!(e.contains("did you mean `drain_timeout_ms`?"), "{e}");
        let e = Config::parse(&format!("[sever]\n{MIN}")).unwrap_err();
        assert!(e.contains("did you mean `server`?"), "{e}");
        let e = Config::parse(&format!("{MIN}derive_key = \"contnet\"\n")).unwrap_err();
        assert!(e.contains("did you mean `content`?"), "{e}");
        // Nothing close: no guess.
        let e = Config::parse(&format!("{MIN}colour = 5\n")).unwrap_err();
        assert!(
            e.contains("unknown field `colour`") && !e.contains("did you mean"),
            "{e}"
        );
    }

    #[test]
    fn unknown_keys_are_named() {
        let e = Config::parse(&format!("{MIN}\ntimeout_msec = 5\n")).unwrap_err();
        assert!(e.contains("timeout_msec"), "{e}");
        let e = Config::parse("[server]\nlisten = \"127.0.0.1:1\"\nlistne = 1\n").unwrap_err();
        assert!(e.contains("listne"), "{e}");
    }

    #[test]
    fn validation_catches_cross_field_errors() {
        let bad = [
            (MIN.replace("\"billing\"\npath", "\"Bad Name\"\npath"), "route name"),
            (MIN.replace("/billing/", "billing"), "path_prefix"),
            (MIN.replace("http://127.0.0.1:1/v1/", "ftp://x/"), "http://"),
            (format!("[store]\nkind = \"s3\"\n{MIN}"), "bucket"),
            (format!("{MIN}\n[[route]]\nname=\"b\"\npath_prefix=\"/billing/\"\nupstream=\"http://x/\"\nlease=\"b\"\n"), "two routes"),
            (format!("{MIN}upstream_headers = {{ Authorization = \"${{FENCEGATE_SURELY_UNSET_VAR}}\" }}\n"), "FENCEGATE_SURELY_UNSET_VAR"),
        ];
        for (text, needle) in bad {
            let err = Config::parse(&text).and_then(|c| c.validate()).unwrap_err();
            assert!(err.contains(needle), "{needle}: {err}");
        }
    }

    /// Issue 29: `signing_secrets` and `client_cert`/`client_key` — paths follow
    /// the config file, and the cross-key rules are named.
    #[test]
    fn signing_and_client_certificate_keys_are_checked() {
        let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        let mut c = Config::parse(&format!(
            "{MIN}client_cert = \"certs/c.pem\"\nclient_key = \"/abs/c.key\"\n"
        ))
        .unwrap();
        c.resolve_paths(Path::new("/etc/fencegate/fencegate.toml"));
        assert_eq!(
            c.routes[0].client_cert.as_deref(),
            Some(Path::new("/etc/fencegate/certs/c.pem"))
        );
        assert_eq!(
            c.routes[0].client_key.as_deref(),
            Some(Path::new("/abs/c.key"))
        );
        let c = Config::parse(&format!("{MIN}signing_secrets = [\"{secret}\"]\n")).unwrap();
        c.validate().unwrap();
        assert!(c.routes[0].signer().unwrap().is_some());
        assert!(!format!("{:?}", c.routes[0]).contains(&secret[6..]));
        let bad = [
            (
                format!("{MIN}signing_secrets = [\"{secret}\"]\nupstream_headers = {{ Webhook-Signature = \"x\" }}\n"),
                "upstream_headers sets Webhook-Signature",
            ),
            (format!("{MIN}client_key = \"k.pem\"\n"), "set both or neither"),
        ];
        for (text, needle) in bad {
            let err = Config::parse(&text).and_then(|c| c.validate()).unwrap_err();
            assert!(err.contains(needle), "{needle}: {err}");
        }
        // A client certificate on a plain-http upstream is refused (files valid).
        let dir = tempfile::tempdir().unwrap();
        let ck = rcgen::generate_simple_self_signed(vec!["c.test".into()]).unwrap();
        std::fs::write(dir.path().join("c.pem"), ck.cert.pem()).unwrap();
        std::fs::write(dir.path().join("c.key"), ck.signing_key.serialize_pem()).unwrap();
        let mut c = Config::parse(&format!(
            "{MIN}client_cert = \"c.pem\"\nclient_key = \"c.key\"\n"
        ))
        .unwrap();
        c.resolve_paths(&dir.path().join("fencegate.toml"));
        let err = c.validate().unwrap_err();
        assert!(err.contains("needs an https:// upstream"), "{err}");
    }

    /// `signing_secrets` of any other type than a list of strings is refused
    /// without its value in the error (the error is logged and printed).
    #[test]
    fn signing_secrets_of_the_wrong_type_are_refused_unquoted() {
        let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        for value in [
            format!("\"{secret}\""),
            "4242424242".to_owned(),
            "true".to_owned(),
            format!("{{ s = \"{secret}\" }}"),
            format!("[\"{secret}\", 4242424242]"),
        ] {
            let err = Config::parse(&format!("{MIN}signing_secrets = {value}\n")).unwrap_err();
            assert!(err.contains("secret"), "{value}: {err}");
            assert!(!err.contains(&secret[6..]), "{value}: {err}");
        }
    }

    /// `[state] schema` (SPEC §9): an unquoted identifier, PostgreSQL only;
    /// each wrong value refused with the rule it breaks.
    #[test]
    fn the_state_schema_is_an_identifier_of_postgres() {
        let pg = |schema: &str| {
            format!("[state]\nkind = \"postgres\"\nurl = \"postgres://fg@127.0.0.1/fg\"\nschema = \"{schema}\"\n{MIN}")
        };
        for good in ["fg_staging", "_x", "prod2", &"a".repeat(63)] {
            let c = Config::parse(&pg(good)).unwrap();
            c.validate().unwrap();
            assert_eq!(c.state.schema.as_deref(), Some(good));
        }
        let long = "a".repeat(64);
        for (bad, needle) in [
            ("", "lowercase letters"),
            ("Staging", "lowercase letters"),
            ("2fg", "not starting with a digit"),
            ("fg-staging", "lowercase letters"),
            ("fg staging", "lowercase letters"),
            ("fg\\\"; DROP", "lowercase letters"),
            (long.as_str(), "63"),
            ("pg_fg", "reserved"),
        ] {
            let err = Config::parse(&pg(bad))
                .and_then(|c| c.validate())
                .unwrap_err();
            assert!(err.contains(needle), "{bad:?}: {err}");
        }
        let sled = format!("[state]\nschema = \"fg\"\n{MIN}");
        let err = Config::parse(&sled).and_then(|c| c.validate()).unwrap_err();
        assert!(err.contains("kind is \"sled\""), "{err}");
    }

    /// `[cluster]` (SPEC §10.2): its rules, each named in the error.
    #[test]
    fn cluster_keys_are_checked() {
        let pg = "[state]\nkind = \"postgres\"\nurl = \"postgres://fg@127.0.0.1/fg\"\n";
        let cluster = |body: &str| format!("{pg}[cluster]\n{body}\n{MIN}");
        let good = "instance_id = \"fg-a\"\nadvertise = \"http://10.0.0.1:8080\"\npeer_token = \"0123456789abcdef\"";
        let c = Config::parse(&cluster(good)).unwrap();
        c.validate().unwrap();
        assert_eq!(c.cluster.as_ref().map(|c| c.shards), Some(16));
        let bad = [
            (format!("[cluster]\n{good}\n{MIN}"), "kind = \"postgres\""),
            (cluster(&good.replace("fg-a", "fg a")), "instance_id"),
            (
                cluster(&good.replace("http://10.0.0.1:8080", "10.0.0.1:8080")),
                "advertise",
            ),
            (cluster(&format!("{good}\nshards = 0")), "shards"),
            (
                cluster(&good.replace("0123456789abcdef", "short")),
                "peer_token",
            ),
            (
                cluster(&good.replace("0123456789abcdef", "${FENCEGATE_SURELY_UNSET_VAR}")),
                "FENCEGATE_SURELY_UNSET_VAR",
            ),
        ];
        for (text, needle) in bad {
            let err = Config::parse(&text).and_then(|c| c.validate()).unwrap_err();
            assert!(err.contains(needle), "{needle}: {err}");
        }
        let e = Config::parse(&cluster(&format!("{good}\nshard = 4"))).unwrap_err();
        assert!(e.contains("shard"), "{e}");
    }

    /// One file for every member of a Kubernetes Deployment: `instance_id` and
    /// `advertise` may name environment variables (the pod's name, its IP).
    #[test]
    fn cluster_id_and_advertise_may_come_from_the_environment() {
        std::env::set_var("FENCEGATE_CONFIG_TEST_POD", "fencegate-7d9f-x2x");
        std::env::set_var("FENCEGATE_CONFIG_TEST_ADV", "http://10.1.2.3:8080");
        let text = "[state]\nkind = \"postgres\"\nurl = \"postgres://fg@127.0.0.1/fg\"\n\
                    [cluster]\ninstance_id = \"${FENCEGATE_CONFIG_TEST_POD}\"\n\
                    advertise = \"${FENCEGATE_CONFIG_TEST_ADV}\"\npeer_token = \"0123456789abcdef\"\n";
        let mut c = Config::parse(&format!("{text}{MIN}")).unwrap();
        c.resolve_env().unwrap();
        c.validate().unwrap();
        let k = c.cluster.unwrap();
        assert_eq!(
            (k.instance_id.as_str(), k.advertise.as_str()),
            ("fencegate-7d9f-x2x", "http://10.1.2.3:8080")
        );
        let mut c = Config::parse(&format!(
            "{}{MIN}",
            text.replace("FENCEGATE_CONFIG_TEST_ADV", "FENCEGATE_SURELY_UNSET_VAR")
        ))
        .unwrap();
        let e = c.resolve_env().unwrap_err();
        assert!(
            e.contains("[cluster] advertise reads ${FENCEGATE_SURELY_UNSET_VAR}"),
            "{e}"
        );
    }
}
