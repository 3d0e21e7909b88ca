//! `[server]` (SPEC §9): listeners, TLS, limits, logging.

use super::*;

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

impl Config {
    pub(super) fn validate_server(&self) -> Result<(), String> {
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
}
