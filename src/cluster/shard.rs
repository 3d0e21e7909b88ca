//! A shard as this instance holds or sees it (SPEC §10.2): its ownership row in
//! the database, its forwarding window and abort deadline, and when the row was
//! last seen to change — and the views `/v1/cluster` and the page show.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use crate::epoch::LeaseName;
use crate::state::ownership::RowVersion;
use crate::state::{Generation, OwnerRow};

/// A shard's ownership row as last read, and since when it has read so.
#[derive(Debug, Clone, Default)]
pub(super) struct Seen {
    /// The row (`None`: the shard was never taken).
    pub(super) row: Option<OwnerRow>,
    /// When a read first returned the row's current `(generation, renewals,
    /// owner)`: the answer's arrival, after the commit that wrote it. A tenure
    /// is over `gate_ttl + grace_ms` after this, on this monotonic clock.
    pub(super) since: Option<Instant>,
}

impl Seen {
    /// The row's version a take is conditioned on.
    pub(super) fn taken_from(&self) -> Option<RowVersion> {
        self.row.as_ref().map(|r| RowVersion {
            generation: r.generation,
            renewals: r.renewals,
        })
    }

    /// When a contender may take the shard: at once for no row or a released
    /// one; otherwise `ttl + grace` after the row was first seen as it is —
    /// the owner's `ttl` when it is longer than the contender's.
    pub(super) fn free_at(&self, ttl: Duration, grace: Duration) -> Option<Instant> {
        let wait = |r: &OwnerRow| r.ttl.map_or(ttl, |t| t.max(ttl)) + grace;
        match (&self.row, self.since) {
            (None, _) => None,
            (Some(r), _) if r.released => None,
            (Some(r), Some(since)) => Some(since + wait(r)),
            (Some(r), None) => Some(Instant::now() + wait(r)),
        }
    }

    /// Whether a contender may take it now.
    pub(super) fn is_free(&self, ttl: Duration, grace: Duration) -> bool {
        self.free_at(ttl, grace)
            .is_none_or(|at| Instant::now() >= at)
    }

    /// The owner named by the row while its tenure may still run.
    pub(super) fn owner(&self, ttl: Duration, grace: Duration) -> Option<&OwnerRow> {
        self.row
            .as_ref()
            .filter(|r| r.owner.is_some() && !self.is_free(ttl, grace))
    }
}

pub(super) struct Shard {
    /// The configured leases of this shard, with their longest drain timeout.
    pub(super) leases: Vec<(LeaseName, Duration)>,
    /// The generation of the tenure being served here; 0 when not served
    /// (no take writes generation 0): [`Shard::serving`].
    serving: AtomicU64,
    /// When forwards on the shard may start, and when what is in flight is
    /// aborted (every lease alike): from the send of the latest renewal that
    /// succeeded.
    pub(super) window: super::window::Window,
    /// The generation of the row this instance owns, if it owns it.
    pub(super) holding: Mutex<Option<Generation>>,
    /// Serializes a shard's row operations: a renewal's outcome never races a
    /// release.
    pub(super) op: tokio::sync::Mutex<()>,
    /// A takeover or a handover task is running.
    pub(super) busy: AtomicBool,
    /// Tenures of this shard stopped here whose requests may still be in
    /// flight (until their abort deadline): a new tenure here starts after
    /// them, as a successor elsewhere would.
    pub(super) stopping: std::sync::Arc<tokio::sync::watch::Sender<usize>>,
    pub(super) seen: Mutex<Seen>,
}

impl Shard {
    /// A shard whose configured leases are `leases` (each with its longest
    /// drain timeout), neither held nor served here.
    pub(super) fn new(leases: Vec<(LeaseName, Duration)>) -> Shard {
        Shard {
            leases,
            serving: AtomicU64::new(0),
            window: super::window::Window::new(),
            holding: Mutex::new(None),
            op: tokio::sync::Mutex::new(()),
            busy: AtomicBool::new(false),
            stopping: std::sync::Arc::new(tokio::sync::watch::Sender::new(0)),
            seen: Mutex::new(Seen::default()),
        }
    }

    /// The generation of the tenure served here now, if one is.
    pub(super) fn serving(&self) -> Option<Generation> {
        match self.serving.load(Ordering::SeqCst) {
            0 => None,
            n => Some(Generation::new(n)),
        }
    }

    /// Serves the tenure of `generation` from now on.
    pub(super) fn serve(&self, generation: Generation) {
        self.serving.store(generation.get(), Ordering::SeqCst);
    }

    /// The names of the shard's leases.
    pub(super) fn lease_names(&self) -> Vec<LeaseName> {
        self.leases.iter().map(|(l, _)| l.clone()).collect()
    }

    /// Until no stopped tenure of the shard here has requests in flight.
    pub(super) async fn previous_tenure_ended(&self) {
        let mut stopped = self.stopping.subscribe();
        if *stopped.borrow() > 0 {
            tracing::info!("waiting for the requests of a stopped tenure of the shard to end");
            let _ = stopped.wait_for(|n| *n == 0).await;
        }
    }

    /// Serves nothing from now on; returns the tenure that was served.
    pub(super) fn unserve(&self) -> Option<Generation> {
        match self.serving.swap(0, Ordering::SeqCst) {
            0 => None,
            n => Some(Generation::new(n)),
        }
    }
}

/// A shard as this instance last saw it.
#[derive(Debug, Clone)]
pub struct ShardStatus {
    /// The shard's number.
    pub shard: u32,
    /// The instance owning the shard, if its tenure may still run.
    pub owner: Option<String>,
    /// How peers reach the owner's proxy (relaying, SPEC §10.2).
    pub advertise: Option<String>,
    /// The tenure's generation (every state write carries it).
    pub generation: u64,
    /// The tenure's renewals so far.
    pub renewals: u64,
    /// Shard 0 only: the epoch of the prefix's anchor, `{prefix}.gate/0000/`.
    pub anchor_epoch: Option<u64>,
    /// The row's expiry on the database's clock (shown, never judged on).
    pub expires_at: Option<SystemTime>,
    /// Whether this instance forwards the shard's requests now.
    pub served_here: bool,
    /// The leases of the configured routes that hash to the shard.
    pub leases: Vec<String>,
    /// Shard 0 only: why the anchor's latest gate object was not trusted.
    pub untrusted: Option<String>,
}

/// A shard as `/v1/cluster` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ShardView {
    /// The shard's number.
    pub shard: u32,
    /// The instance owning the shard, if its tenure may still run.
    pub owner: Option<String>,
    /// How peers reach the owner's proxy.
    pub advertise: Option<String>,
    /// The tenure's generation.
    pub generation: u64,
    /// The tenure's renewals so far.
    pub renewals: u64,
    /// Shard 0 only: the epoch of the prefix's anchor gate object.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub anchor_epoch: Option<u64>,
    /// On the database's clock, RFC 3339 (shown, never judged on).
    pub expires_at: Option<String>,
    /// Whether this instance forwards the shard's requests now.
    pub served_here: bool,
    /// The leases of the configured routes that hash to the shard.
    pub leases: Vec<String>,
    /// Why the anchor's latest gate object was not trusted, if it was not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub untrusted: Option<String>,
}
