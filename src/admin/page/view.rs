//! What the page shows, gathered by the admin API: the view it is rendered from.

use super::*;

/// One lease as the page shows it.
#[derive(Debug, Clone)]
pub struct LeaseRow {
    /// The lease's name.
    pub lease: String,
    /// Its durable high-water mark.
    pub mark: u64,
    /// The greatest epoch known in the store.
    pub latest: u64,
    /// The latest epoch's holder, if it is a live acquire.
    pub holder: Option<String>,
    /// On the store's clock.
    pub expires_at: Option<SystemTime>,
    /// Requests admitted whose exchange with the upstream is not over (SPEC §5).
    pub in_flight: usize,
    /// Dedup records in doubt for the lease's routes.
    pub in_doubt: usize,
    /// Drains begun since start-up.
    pub drains_started: u64,
    /// Drains that timed out and aborted requests.
    pub drains_aborted: u64,
    /// The last store call's failure, if it failed.
    pub store_error: Option<String>,
}

/// One route's protection of its destination (SPEC §9), as the page shows it.
#[derive(Debug, Clone)]
pub struct RouteRow {
    /// The route's name.
    pub route: String,
    /// Its upstream, without credentials.
    pub upstream: String,
    /// Requests at the upstream now.
    pub in_flight: usize,
    /// `max_in_flight`, if set.
    pub max_in_flight: Option<usize>,
    /// How long a `Retry-After` still holds it.
    pub held_for: Option<std::time::Duration>,
    /// The breaker's state (`closed`, `open`, `half_open`) and how long it stays
    /// open, if the route has one.
    pub breaker: Option<(&'static str, Option<std::time::Duration>)>,
    /// Requests refused `upstream_held` since start-up.
    pub refused: u64,
}

impl RouteRow {
    /// Whether the row says something an operator should see first.
    pub fn notable(&self) -> bool {
        self.held_for.is_some()
            || self.breaker.is_some_and(|(s, _)| s != "closed")
            || self.max_in_flight.is_some_and(|m| self.in_flight >= m)
    }
}

/// One instance of the cluster (or the single instance), as this one knows it.
#[derive(Debug, Clone)]
pub struct MemberRow {
    /// The instance id.
    pub id: String,
    /// Seen alive at the last heartbeat.
    pub alive: bool,
    /// When this instance last saw it alive (for a gone one).
    pub last_seen: Option<SystemTime>,
    /// Whether it is this instance.
    pub this_instance: bool,
    /// The shards it owns, as last seen.
    pub shards: Vec<u32>,
}

/// One shard of the shard map. A single instance has one, shard 0 of 1, which
/// it holds by its instance guard, a gate lease in the store (SPEC §10.1); a
/// cluster has `shards` of them, each owned through a row of `fencegate_owners`
/// in PostgreSQL (§10.2).
#[derive(Debug, Clone)]
pub struct ShardRow {
    /// The shard's number.
    pub shard: u32,
    /// How many shards there are.
    pub shards: u32,
    /// The instance that owns the shard, if one does: in a cluster the owner of
    /// its row while that tenure may still run; a single instance while it
    /// holds its guard.
    pub owner: Option<String>,
    /// What the owner holds the shard by, if anything.
    pub tenure: Option<Tenure>,
    /// When the tenure ends, as last seen: a cluster's row's `expires_at`, on
    /// the database's clock (shown, never judged on); a single instance's
    /// guard's expiry, on the store's clock.
    pub expires_at: Option<SystemTime>,
    /// Whether the owner is this instance.
    pub this_instance: bool,
    /// Whether this instance forwards the shard's requests now.
    pub serving: bool,
    /// The leases hashed to the shard (of the configured routes).
    pub leases: Vec<String>,
}

/// What a shard's owner holds it by: a number that rises with every new tenure,
/// which means one thing in a cluster and another in a single instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tenure {
    /// A cluster's shard: the `generation` of its row of `fencegate_owners`,
    /// raised by every take and carried by every state write (SPEC §10.2).
    Generation(u64),
    /// A single instance's shard: the epoch of its instance guard, the gate
    /// lease under `{prefix}.gate/0000/` (SPEC §10.1).
    GuardEpoch(u64),
}

/// One dedup key in full: the detail view (`/?detail=1&route=R&key=K`).
#[derive(Debug, Clone)]
pub struct KeyDetail {
    /// The route asked for.
    pub route: String,
    /// The key asked for.
    pub key: String,
    /// Its record, or why there is none to show.
    pub record: Result<KeyRecord, String>,
}

/// A dedup record as the detail view shows it.
#[derive(Debug, Clone)]
pub struct KeyRecord {
    /// `in_flight`, `done` or `in_doubt` (shown as "in flight", "done", "in doubt").
    pub state: &'static str,
    /// The route's lease.
    pub lease: Option<String>,
    /// The epoch the request was admitted at.
    pub epoch: u64,
    /// When the key was first claimed.
    pub created: SystemTime,
    /// When the record last changed.
    pub updated: SystemTime,
    /// The request's method and path, when kept.
    pub method: Option<String>,
    /// See `method`.
    pub path: Option<String>,
    /// The upstream's status, when it answered.
    pub status: Option<u16>,
    /// The stored body's size, when stored.
    pub body_bytes: Option<usize>,
}

/// One in-doubt key.
#[derive(Debug, Clone)]
pub struct KeyRow {
    /// The route whose dedup scope holds the key.
    pub route: String,
    /// The dedup key.
    pub key: String,
    /// The epoch the request was admitted at.
    pub epoch: u64,
    /// When the request arrived (fencegate's clock).
    pub created: SystemTime,
    /// When it went in doubt.
    pub updated: SystemTime,
    /// The request's method and path, when the record keeps them.
    pub method: Option<String>,
    /// See `method`.
    pub path: Option<String>,
}

/// Whether the viewer may resolve keys.
#[derive(Debug, Clone)]
pub enum Access {
    /// No admin token configured: the page is read-only.
    ReadOnly,
    /// Logged in: forms carry this token.
    Resolve {
        /// The CSRF token, checked on every form post.
        csrf: String,
    },
}

/// A queued route's figures (SPEC §11), as the metrics give them.
#[derive(Debug, Clone)]
pub struct QueueRoute {
    /// The route's name.
    pub route: String,
    /// Its lease (whose queue its messages are in).
    pub lease: String,
    /// Messages not settled, pending or being delivered
    /// (`fencegate_queue_depth`).
    pub depth: u64,
    /// Failed messages, kept until an operator retries or drops them or the
    /// `[dedup] ttl` sweeps them.
    pub failed: u64,
    /// When the oldest message not settled was accepted (its lease's head, as
    /// `fencegate_queue_oldest_pending_seconds`), if there is one.
    pub oldest: Option<SystemTime>,
    /// Whether its deliveries are paused (SPEC §11): by the route or by its
    /// lease, and since when.
    pub paused: Option<(&'static str, SystemTime)>,
}

/// A queued message not delivered: pending, delivering or failed.
#[derive(Debug, Clone)]
pub struct MessageRow {
    /// The route it was accepted on.
    pub route: String,
    /// Its dedup key.
    pub key: String,
    /// The lease whose queue it is in.
    pub lease: String,
    /// The epoch it was accepted at.
    pub epoch: u64,
    /// Its place in its lease's queue.
    pub seq: u64,
    /// `pending`, `delivering` or `failed`.
    pub status: &'static str,
    /// Attempts started.
    pub attempts: u32,
    /// The destination's last status, if it answered.
    pub last_status: Option<u16>,
    /// Why the last attempt failed.
    pub last_error: Option<String>,
    /// When a pending message's next attempt may start.
    pub next_attempt: Option<SystemTime>,
}

/// The queue panel: shown only when a route is queued.
#[derive(Debug, Clone, Default)]
pub struct QueuePanel {
    /// Each queued route's figures, by name.
    pub routes: Vec<QueueRoute>,
    /// This page of their messages not delivered: route by route, failed
    /// ones first, then the one being delivered, then the pending ones.
    pub messages: Vec<MessageRow>,
    /// How many such messages there are in all.
    pub messages_total: u64,
    /// Index of the first row in `messages`.
    pub offset: usize,
    /// Why the queue could not be read, if it could not.
    pub error: Option<String>,
    /// The latest bulk jobs (SPEC §11, recovering in bulk), newest first.
    pub jobs: Vec<JobRow>,
}

/// A bulk job as the page lists it.
#[derive(Debug, Clone)]
pub struct JobRow {
    /// Its id.
    pub id: String,
    /// `retry` or `drop`.
    pub action: &'static str,
    /// The route it is limited to, if any.
    pub route: Option<String>,
    /// `running` or `finished`.
    pub state: &'static str,
    /// Matched when it was made, edited, refused.
    pub matched: u64,
    /// Edited.
    pub done: u64,
    /// Refused (superseded by a newer epoch).
    pub refused: u64,
}

/// A line about what the viewer just did.
#[derive(Debug, Clone)]
pub struct Notice {
    /// What to say.
    pub text: String,
    /// The action was refused (shown as an alert).
    pub refused: bool,
}

impl Notice {
    /// An action done.
    pub fn done(text: String) -> Notice {
        Notice {
            text,
            refused: false,
        }
    }
}

/// The store and the state backend.
#[derive(Debug, Clone)]
pub struct StoreHealth {
    /// The lease store, as configured (kind and location).
    pub store: String,
    /// Store minus local clock (upper end of the estimate), ms.
    pub clock_offset_ms: i64,
    /// Whether the state backend answered.
    pub state_ok: bool,
    /// Leases whose last store call failed.
    pub leases_failing: usize,
}

/// Everything the page shows.
#[derive(Debug, Clone)]
pub struct PageView {
    /// This instance's id (or host) in the page title.
    pub instance: String,
    /// fencegate's version.
    pub version: &'static str,
    /// This instance's clock (record times).
    pub now: SystemTime,
    /// The store's clock (lease and instance guard expiries).
    pub store_now: SystemTime,
    /// The store and state backend's health.
    pub health: StoreHealth,
    /// This page of the lease table, and where it starts.
    pub leases: Vec<LeaseRow>,
    /// How many leases there are in all.
    pub leases_total: usize,
    /// Index of the first row in `leases`.
    pub leases_offset: usize,
    /// Routes and how they protect their destinations (at most
    /// [`ROUTES_SHOWN`], notable ones first), and how many there are.
    pub routes: Vec<RouteRow>,
    /// See `routes`.
    pub routes_total: usize,
    /// The shard map.
    pub shards: Vec<ShardRow>,
    /// The instances: this one, and in a cluster every one seen since start-up.
    pub members: Vec<MemberRow>,
    /// In a cluster: requests this instance relayed to their shard's owner.
    pub relayed: Option<u64>,
    /// The key asked for in the detail view.
    pub detail: Option<KeyDetail>,
    /// This page of the in-doubt keys, oldest first.
    pub keys: Vec<KeyRow>,
    /// How many in-doubt keys there are in all.
    pub keys_total: u64,
    /// The cursor of the next page, if there may be one.
    pub keys_next: Option<String>,
    /// Whether this is a later page (a link back to the first).
    pub keys_paged: bool,
    /// Why the keys could not be listed, if they could not.
    pub keys_error: Option<String>,
    /// Why this instance forwards nothing, or trusts no owner of some shard
    /// (another set-up on the prefix, an untrusted gate object: SPEC §10).
    pub fence_problems: Vec<String>,
    /// The queued routes and their messages; `None` when no route is queued
    /// (the page then says nothing of queues).
    pub queue: Option<QueuePanel>,
    /// Whether the resolve, retry and drop buttons are shown.
    pub access: Access,
    /// A line about what the viewer just did.
    pub notice: Option<Notice>,
}
