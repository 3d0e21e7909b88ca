//! The descriptor budget (SPEC §9 "Limits"): what the process may hold open,
//! derived at start-up from `RLIMIT_NOFILE`, so that clients can never take the
//! descriptors the instance's own store calls need.
//!
//! Every socket and file is a descriptor. A flood of client connections used to
//! run the process out of them; then the lease store could not be read, the
//! instance guard lapsed and requests on connections already accepted were
//! refused. Here the limit is split once, in this order:
//!
//! 1. **reserved** — the runtime and sled's files, the lease store's
//!    connections, the state store's (PostgreSQL's pool), trace export, and the
//!    admin listener's connections (its cap, plus one to close a connection
//!    past it): never used by clients;
//! 2. **client connections** — `[server] max_connections`, or less when the
//!    limit leaves less: closed at accept past it;
//! 3. **upstream** — requests at an upstream (forwarded, relayed to a peer,
//!    a queued delivery's attempt) at once, and idle pooled connections per
//!    upstream host. One such request holds at most two sockets (its own, and
//!    one its pool may still be opening for another), so the upstream share is
//!    counted twice for them, once for the idle ones.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::{Config, StateKind};

/// The runtime (epoll, wakers), stdio, sled's files, the config and the log.
const BASE: u64 = 64;
/// The lease store: S3 connections, or the `dir` store's files.
const LEASE_STORE: u64 = 64;
/// sled's state beyond [`BASE`] (a blob read opens a file).
const SLED: u64 = 16;
/// PostgreSQL beyond its pool: a connection being replaced while the old one closes.
const POSTGRES_SPARE: u64 = 8;
/// Trace export's connections.
const TELEMETRY: u64 = 8;
/// Below this many descriptors for connections, the instance refuses to start.
const MIN_FOR_CONNECTIONS: u64 = 64;

/// The process's descriptor limit (`RLIMIT_NOFILE`), soft and hard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nofile {
    /// The limit the process runs under.
    pub soft: u64,
    /// What the soft limit may be raised to.
    pub hard: u64,
    /// The soft limit before [`Nofile::raise`] raised it, if it did.
    pub raised_from: Option<u64>,
}

impl Nofile {
    /// Reads the limit.
    pub fn read() -> Nofile {
        let (soft, hard) = rlimit::Resource::NOFILE.get().unwrap_or((1024, 1024));
        Nofile {
            soft,
            hard,
            raised_from: None,
        }
    }

    /// Raises the soft limit to the hard one (as nginx's `worker_rlimit_nofile`
    /// and most servers do): the hard limit is what the operator granted.
    pub fn raise() -> Nofile {
        let before = Nofile::read();
        if before.soft >= before.hard
            || rlimit::Resource::NOFILE
                .set(before.hard, before.hard)
                .is_err()
        {
            return before;
        }
        Nofile {
            raised_from: Some(before.soft),
            ..Nofile::read()
        }
    }
}

/// How the descriptor limit is split (the module docs say why so).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Budget {
    /// `RLIMIT_NOFILE` as the process runs under it.
    pub limit: u64,
    /// Never used by client or upstream connections.
    pub reserved: u64,
    /// The admin listener's connections at once (`[server] admin_max_connections`).
    pub admin_connections: usize,
    /// The proxy listener's connections at once.
    pub client_connections: usize,
    /// Requests at an upstream at once, over every route and peer.
    pub upstream_requests: usize,
    /// Idle pooled connections kept per upstream host.
    pub idle_per_host: usize,
    /// `[server] max_connections` was lowered to fit.
    pub clients_lowered: bool,
}

/// The limit leaves too little for connections: the start is refused (exit 2).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.text())]
pub struct TooFew {
    /// The limit.
    pub limit: u64,
    /// What the instance reserves for itself.
    pub reserved: u64,
}

impl TooFew {
    fn text(&self) -> String {
        format!(
            "the descriptor limit (RLIMIT_NOFILE) is {}: after the {} fencegate keeps for its \
             stores and admin listener, fewer than {MIN_FOR_CONNECTIONS} are left for connections; \
             raise it (ulimit -n, LimitNOFILE=, the container's nofile ulimit) or lower \
             [server] admin_max_connections",
            self.limit, self.reserved
        )
    }
}

impl Budget {
    /// Splits `limit` for `cfg`.
    pub fn derive(cfg: &Config, limit: u64) -> Result<Budget, TooFew> {
        let state = match cfg.state.kind {
            StateKind::Sled => SLED,
            StateKind::Postgres => cfg.state.pool_size as u64 + POSTGRES_SPARE,
        };
        let telemetry = if cfg.telemetry.otlp_endpoint.is_some() {
            TELEMETRY
        } else {
            0
        };
        let fixed = BASE + LEASE_STORE + state + telemetry;
        // The admin listener's cap gives way first when the limit is small: a
        // few connections answer probes and scrapes.
        let admin = (cfg.server.admin_max_connections as u64)
            .min(limit.saturating_sub(fixed) / 8)
            .max(8);
        let reserved = fixed + admin + 1;
        let available = limit.saturating_sub(reserved);
        if available < MIN_FOR_CONNECTIONS {
            return Err(TooFew { limit, reserved });
        }
        // Two fifths for clients, two for upstream requests (counted twice),
        // one for idle pooled connections.
        let share = available / 5;
        let clients = (cfg.server.max_connections as u64).min(share * 2);
        let upstream_requests = (available - clients - share) / 2;
        let hosts = upstream_hosts(cfg).max(1);
        Ok(Budget {
            limit,
            reserved,
            admin_connections: admin as usize,
            client_connections: clients as usize,
            upstream_requests: upstream_requests.max(1) as usize,
            idle_per_host: (share / hosts).clamp(1, u64::from(u32::MAX)) as usize,
            clients_lowered: clients < cfg.server.max_connections as u64,
        })
    }

    /// One line for the start-up log and `check-config`.
    pub fn summary(&self) -> String {
        format!(
            "{} descriptors: {} reserved (stores, {} admin connections), {} client connections{}, \
             {} upstream requests at once, {} idle upstream connections per host",
            self.limit,
            self.reserved,
            self.admin_connections,
            self.client_connections,
            if self.clients_lowered {
                " (max_connections lowered to fit)"
            } else {
                ""
            },
            self.upstream_requests,
            self.idle_per_host,
        )
    }
}

/// The upstream share of the budget: a place per request at an upstream
/// (forwarded, relayed, or a queued delivery's attempt), and how many idle
/// connections each upstream host's pool keeps.
#[derive(Debug)]
pub struct Upstreams {
    slots: Arc<Semaphore>,
    /// The budget's requests at once.
    pub limit: usize,
    /// Idle pooled connections per host.
    pub idle_per_host: usize,
}

/// One request's place under [`Upstreams`]: released when dropped.
#[derive(Debug)]
pub struct UpstreamSlot(#[allow(dead_code)] OwnedSemaphorePermit);

impl Upstreams {
    /// The share `budget` gives.
    pub fn new(budget: &Budget) -> Arc<Upstreams> {
        Arc::new(Upstreams {
            slots: Arc::new(Semaphore::new(budget.upstream_requests)),
            limit: budget.upstream_requests,
            idle_per_host: budget.idle_per_host,
        })
    }

    /// A place now, if one is free (a worker's request: refused otherwise).
    pub fn try_slot(&self) -> Option<UpstreamSlot> {
        self.slots
            .clone()
            .try_acquire_owned()
            .ok()
            .map(UpstreamSlot)
    }

    /// A place, once one is free (a queued delivery waits its turn). `None`
    /// only if the budget were closed, which nothing does.
    pub async fn slot(&self) -> Option<UpstreamSlot> {
        self.slots
            .clone()
            .acquire_owned()
            .await
            .ok()
            .map(UpstreamSlot)
    }

    /// Requests at an upstream now.
    pub fn in_use(&self) -> usize {
        self.limit.saturating_sub(self.slots.available_permits())
    }
}

/// Distinct upstream hosts (`host:port`), plus one for cluster peers.
fn upstream_hosts(cfg: &Config) -> u64 {
    let mut hosts: Vec<String> = cfg
        .routes
        .iter()
        .map(|r| {
            r.upstream
                .parse::<http::Uri>()
                .ok()
                .and_then(|u| u.authority().map(|a| a.to_string()))
                .unwrap_or_else(|| r.upstream.clone())
        })
        .collect();
    hosts.sort();
    hosts.dedup();
    hosts.len() as u64 + u64::from(cfg.cluster.is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: &str) -> Config {
        let text = format!(
            "[server]\n{extra}\n[[route]]\nname = \"a\"\npath_prefix = \"/a/\"\nupstream = \"http://127.0.0.1:1/\"\nlease = \"a\"\n"
        );
        toml::from_str(&text).expect("config")
    }

    #[test]
    fn the_parts_never_add_up_to_more_than_the_limit() {
        for limit in [400u64, 1024, 4096, 65_536, 1 << 20] {
            let b = Budget::derive(&cfg(""), limit).expect("enough");
            // Worst case: every client connection open, every upstream request
            // holding two sockets, every host's idle pool full (one host here).
            let worst = b.reserved
                + b.client_connections as u64
                + 2 * b.upstream_requests as u64
                + b.idle_per_host as u64;
            assert!(worst <= limit, "{limit}: {b:?} adds up to {worst}");
        }
    }

    #[test]
    fn max_connections_is_a_ceiling_the_limit_may_lower() {
        let b = Budget::derive(&cfg("max_connections = 100"), 1 << 20).unwrap();
        assert_eq!((b.client_connections, b.clients_lowered), (100, false));
        let b = Budget::derive(&cfg(""), 4096).unwrap();
        assert!(
            b.clients_lowered && b.client_connections < 4096 / 2,
            "{b:?}"
        );
    }

    #[test]
    fn too_small_a_limit_is_refused_with_what_to_do() {
        let e = Budget::derive(&cfg(""), 200).unwrap_err();
        assert!(e.to_string().contains("ulimit -n"), "{e}");
    }

    #[test]
    fn the_admin_cap_gives_way_on_a_small_limit() {
        let b = Budget::derive(&cfg(""), 1024).unwrap();
        assert!(
            b.admin_connections < 256 && b.admin_connections >= 8,
            "{b:?}"
        );
        let b = Budget::derive(&cfg(""), 65_536).unwrap();
        assert_eq!(b.admin_connections, 256);
    }
}
