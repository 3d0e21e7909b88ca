//! The part of the configuration a reload (SIGHUP, SPEC §8) replaces while
//! fencegate runs: the routes (with their upstream headers and clients), the admin
//! token, the proxy listener's TLS certificate and the access-log switch. It is one
//! value swapped whole: a request, a connection or an admin call takes a snapshot
//! once and sees one consistent config to its end, however many reloads happen
//! meanwhile (an in-flight request on a removed route finishes on it).
//!
//! Everything else is fixed for the life of the process (`server::reload` says
//! which keys, and refuses a reload that changes them).

use std::sync::Arc;

use arc_swap::ArcSwap;

use crate::epoch::TokenHash;
use crate::routes::RouteTable;

/// One consistent snapshot of what may change live.
pub struct Live {
    pub routes: RouteTable,
    /// Hash of the admin token: compared in constant time, never kept in clear.
    pub admin_token: Option<TokenHash>,
    /// The proxy listener's TLS (its presence is fixed; its certificate is not).
    pub tls: Option<tokio_rustls::TlsAcceptor>,
    /// `[server] access_log`.
    pub access_log: bool,
}

/// The current [`Live`], replaced whole by a reload.
pub struct LiveConfig(ArcSwap<Live>);

impl LiveConfig {
    pub fn new(live: Live) -> Arc<LiveConfig> {
        Arc::new(LiveConfig(ArcSwap::from_pointee(live)))
    }

    /// The current snapshot; a caller that awaits keeps it to its end.
    pub fn current(&self) -> Arc<Live> {
        self.0.load_full()
    }

    /// Replaces the snapshot; holders of the old one keep it until they drop it.
    pub fn replace(&self, live: Live) -> Arc<Live> {
        self.0.swap(Arc::new(live))
    }
}
