//! A shard's gate lease as this instance holds or sees it (SPEC §10.2): the
//! lease, its forwarding window and abort deadline, and the latest gate object
//! read from the store — and the views `/v1/cluster` and the page show.

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use super::set_up::Verdict;
use crate::epoch::{Epoch, LeaseName};
use crate::lease::acquire::{self, Holding};

/// The latest gate object seen for a shard.
#[derive(Debug, Clone, Default)]
pub(super) struct Seen {
    pub(super) epoch: Epoch,
    /// The holder of a live acquire (not expired on the store's clock).
    pub(super) owner: Option<String>,
    /// The holder named by the latest acquire, live or not (for logs).
    pub(super) holder: Option<String>,
    pub(super) advertise: Option<String>,
    pub(super) expires_at: Option<SystemTime>,
    /// A contender may take it now (SPEC §2 step 2, with `grace_ms`).
    pub(super) free: bool,
    /// The latest gate object as read (objects are immutable: read once per
    /// epoch; judged again at every look).
    pub(super) status: Option<acquire::LeaseStatus>,
    /// What the latest gate object is to this cluster (`None`: no object).
    pub(super) verdict: Option<Verdict>,
}

impl Seen {
    /// Whether the latest gate object is one of this set-up's (shard 0: the
    /// prefix's anchor, [`crate::setup`]).
    pub(super) fn ours(&self) -> bool {
        self.verdict == Some(Verdict::Ours)
    }
}

pub(super) struct ShardLease {
    pub(super) name: LeaseName,
    /// The configured leases of this shard, with their longest drain timeout.
    pub(super) leases: Vec<(LeaseName, Duration)>,
    /// The generation of the tenure being served here; 0 when not served.
    pub(super) serving: AtomicU64,
    /// When forwards on the shard may start, and when what is in flight is
    /// aborted (every lease alike).
    pub(super) window: super::window::Window,
    /// The gate epoch held (renewals, takeover and release go through `op`).
    pub(super) holding: Mutex<Option<Holding>>,
    /// Serializes the gate's store operations: a renewal never races a release.
    pub(super) op: tokio::sync::Mutex<()>,
    /// A takeover or a handover task is running.
    pub(super) busy: AtomicBool,
    pub(super) seen: Mutex<Seen>,
}

/// A shard's gate lease as this instance last saw it.
#[derive(Debug, Clone)]
pub struct ShardLeaseView {
    /// The shard's number.
    pub shard: u32,
    /// The instance holding the shard's gate lease, if the lease is live.
    pub owner: Option<String>,
    /// How peers reach the owner's proxy (relaying, SPEC §10.2).
    pub advertise: Option<String>,
    /// The epoch of the shard's latest gate object.
    pub gate_epoch: u64,
    /// On the store's clock.
    pub expires_at: Option<SystemTime>,
    /// Whether this instance forwards the shard's requests now.
    pub served_here: bool,
    /// The leases of the configured routes that hash to the shard.
    pub leases: Vec<String>,
    /// Why the latest gate object was not trusted, if it was not.
    pub untrusted: Option<String>,
}

/// A shard as `/v1/cluster` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ShardView {
    /// The shard's number.
    pub shard: u32,
    /// The instance holding the shard's gate lease, if the lease is live.
    pub owner: Option<String>,
    /// How peers reach the owner's proxy.
    pub advertise: Option<String>,
    /// The epoch of the shard's latest gate object.
    pub gate_epoch: u64,
    /// On the store's clock, RFC 3339.
    pub expires_at: Option<String>,
    /// Whether this instance forwards the shard's requests now.
    pub served_here: bool,
    /// The leases of the configured routes that hash to the shard.
    pub leases: Vec<String>,
    /// Why the latest gate object was not trusted, if it was not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub untrusted: Option<String>,
}
