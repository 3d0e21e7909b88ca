//! fencegate's own state (SPEC §4–§6): each lease's high-water mark (and the epoch
//! its drains completed through) and the dedup records, behind one trait so that
//! a backend can be an embedded store ([`sled`](self::sled), the default) or a
//! database several instances share.
//!
//! Every write carries an [`Owner`]: the generation under which the writer holds
//! the lease's shard (SPEC §10.2: the generation of the shard's owner row;
//! constant in single-instance mode). A backend refuses a write whose generation is older than the one it has
//! stored for that shard ([`StateError::OwnerLost`]), so an instance that lost a
//! shard cannot change its state.
//!
//! What a backend must make durable, and when: a raised mark and a claimed
//! (`in_flight`) record before the call returns (the request is forwarded right
//! after); a `done` record before the call returns (the worker is answered right
//! after). Everything else may be made durable later: a lost `in_doubt` leaves
//! `in_flight`, which start-up turns into `in_doubt`; a lost "drained through"
//! only makes a restart settle longer.

pub mod codec;
pub mod data_dir;
pub mod identity;
pub mod ownership;
pub mod postgres;
pub mod record;
pub mod sled;
pub mod timed;

mod flusher;
pub(crate) mod gather;
mod witness;

use async_trait::async_trait;

/// The PostgreSQL schema's version and epoch mapping (tests and benches name
/// them here).
pub use self::postgres::schema;
use crate::epoch::{Epoch, LeaseName};
pub use ownership::{Generation, OwnerRow, OwnershipStore};
pub use record::{Record, RequestLine, State, StoredResponse, TakeOver};

/// The generation under which an instance writes the state of one shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Owner {
    /// The shard the lease's state belongs to (0 for a single instance).
    pub shard: u32,
    /// The owner generation under which the shard is held (its row's, SPEC
    /// §10.2); older writers are refused.
    pub generation: Generation,
}

impl Owner {
    /// A single instance (SPEC §10.1): one shard, one generation.
    pub const SINGLE: Owner = Owner {
        shard: 0,
        generation: Generation::SINGLE,
    };
}

/// What is kept for one lease.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseMarks {
    /// The durable high-water mark (SPEC §4).
    pub mark: Epoch,
    /// The epoch the lease's drains completed through (SPEC §5); never above `mark`.
    pub drained: Epoch,
}

/// A dedup record's key: route and the worker's (or derived) key.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RecordKey {
    /// The route the key is scoped to (SPEC §6).
    pub route: String,
    /// The worker's `Idempotency-Key`, or the derived one.
    pub key: String,
}

/// A position in a listing of records oldest first ([`StateStore::list`]): the
/// last record's creation time and key. It carries the time so that a page can
/// follow one whose last record was resolved (and so is gone) meanwhile.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ListCursor {
    /// Creation time of the last record listed, ms since the Unix epoch.
    pub created_ms: u64,
    /// Key of the last record listed (breaks ties in time).
    pub key: RecordKey,
}

impl ListCursor {
    /// `{created_ms}/{route}/{key}`: route names have no `/`, keys come last.
    pub fn encode(&self) -> String {
        format!("{}/{}/{}", self.created_ms, self.key.route, self.key.key)
    }

    /// Reads what [`ListCursor::encode`] wrote; `None` for anything else.
    pub fn parse(s: &str) -> Option<ListCursor> {
        let (ms, rest) = s.split_once('/')?;
        let (route, key) = rest.split_once('/')?;
        Some(ListCursor {
            created_ms: ms.parse().ok()?,
            key: RecordKey {
                route: route.to_owned(),
                key: key.to_owned(),
            },
        })
    }
}

/// One page of a listing, and how many records matched in all.
#[derive(Debug, Default)]
pub struct Listing {
    /// This page's records, oldest first.
    pub records: Vec<(RecordKey, Record)>,
    /// How many records matched, across all pages.
    pub total: u64,
}

/// Why the state backend failed; a write failure refuses the request (SPEC §7).
#[derive(Debug, Clone, thiserror::Error)]
pub enum StateError {
    /// The backend could not be opened at start-up.
    #[error("cannot open the state in {path}: {detail}")]
    Open {
        /// Where the state lives.
        path: std::path::PathBuf,
        /// What went wrong.
        detail: String,
    },
    /// The stored state is unreadable: starting empty would forget marks and readmit
    /// stale epochs.
    #[error("the state in {path} is damaged ({detail}); refusing to start from an empty high-water mark. Restore the directory from a backup or, if every lease's epochs are known to be safe, move it aside")]
    Damaged {
        /// Where the state lives.
        path: std::path::PathBuf,
        /// What is damaged.
        detail: String,
    },
    /// A write (or the read before it) failed; nothing is known to be durable.
    #[error("state write failed: {0}")]
    Write(String),
    /// The database belongs to another set-up (SPEC §10: one database, one
    /// set-up): refused at start-up, naming that set-up and the way out.
    #[error("{0}")]
    OtherSetUp(String),
    /// Another instance now owns the shard (SPEC §10.2): this one must stop writing.
    #[error("shard {} is owned under generation {stored}, newer than this instance's {}", .ours.shard, .ours.generation)]
    OwnerLost {
        /// The generation this instance wrote under.
        ours: Owner,
        /// The newer generation stored for the shard.
        stored: Generation,
    },
}

/// What [`StateStore::begin`] found.
#[derive(Debug)]
pub enum Begun {
    /// The key is claimed (`in_flight`, durable): forward.
    Claimed,
    /// A record the claim may not take over: answer from it.
    Exists(Record),
}

/// How a claimed key ends ([`StateStore::finish`]).
#[derive(Debug)]
pub enum End {
    /// The key is free again (nothing sent, or a retryable status).
    Delete,
    /// The outcome is unknown.
    InDoubt(Record),
    /// The upstream answered: durable on return.
    Done(Record),
}

/// An operator's resolution of an in-doubt key (SPEC §8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Resolution {
    /// The request reached the destination: the record becomes `done`.
    Delivered,
    /// It did not: the record is deleted, so a retry is forwarded.
    NotDelivered,
}

impl Resolution {
    /// The name the admin API takes (and logs) for it.
    pub fn as_str(self) -> &'static str {
        match self {
            Resolution::Delivered => "delivered",
            Resolution::NotDelivered => "not_delivered",
        }
    }
}

/// What [`StateStore::resolve`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolved {
    /// Delivered: the record is `done`, without a stored response body.
    Done,
    /// Not delivered: the record is gone.
    Deleted,
    /// No such key.
    Missing,
    /// The key is not in doubt (its state, as found).
    NotInDoubt(State),
}

/// Group-commit figures, for metrics and benches.
#[derive(Debug, Clone, Copy, Default)]
pub struct CommitStats {
    /// Commits made (each one fsync or transaction).
    pub batches: u64,
    /// Records written by those commits.
    pub records: u64,
}

/// Marks and dedup records. See the module documentation for durability.
#[async_trait]
pub trait StateStore: Send + Sync + 'static {
    /// The lease's mark and drained-through epoch (zero when none).
    async fn marks(&self, lease: &LeaseName) -> Result<LeaseMarks, StateError>;

    /// Raises the mark of `lease` to at least `epoch`; durable on return.
    async fn raise_mark(
        &self,
        owner: Owner,
        lease: &LeaseName,
        epoch: Epoch,
    ) -> Result<(), StateError>;

    /// Records that a drain of `lease` completed through `epoch`.
    async fn note_drained(
        &self,
        owner: Owner,
        lease: &LeaseName,
        epoch: Epoch,
    ) -> Result<(), StateError>;

    /// Claims `key` with `fresh` (an `in_flight` record), unless a record exists
    /// that `fresh` may not take over ([`Record::taken_over_by`]). Atomic: two
    /// concurrent claims of one key never both succeed.
    async fn begin(
        &self,
        owner: Owner,
        key: &RecordKey,
        fresh: &Record,
        rules: TakeOver,
    ) -> Result<Begun, StateError>;

    /// Ends a claimed key: writes the outcome (state, `updated_ms`, response)
    /// over the key's `in_flight` record, whose other fields stay as the claim
    /// wrote them (a resend keeps the first claim's creation time). Fails, and
    /// changes nothing, when the key's record is no longer in flight.
    async fn finish(&self, owner: Owner, key: &RecordKey, end: End) -> Result<(), StateError>;

    /// The key's record, if there is one.
    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StateError>;

    /// Resolves an in-doubt key; durable on return.
    async fn resolve(
        &self,
        owner: Owner,
        key: &RecordKey,
        how: Resolution,
        now_ms: u64,
    ) -> Result<Resolved, StateError>;

    /// Up to `limit` records in `state` (on `route` if given), oldest first — by
    /// creation time, then route and key — after `after`; and how many there are.
    async fn list(
        &self,
        state: State,
        route: Option<&str>,
        after: Option<&ListCursor>,
        limit: usize,
    ) -> Result<Listing, StateError>;

    /// Removes expired records ([`Record::expired`]); returns how many.
    async fn sweep(&self, rules: TakeOver) -> Result<usize, StateError>;

    /// Start-up: every `in_flight` record of `owner`'s shard becomes `in_doubt`
    /// (its writer died mid-request); returns how many. Durable on return.
    async fn recover(&self, owner: Owner, now_ms: u64) -> Result<usize, StateError>;

    /// A takeover (SPEC §10.2): from now on the shard's state is written under
    /// `owner.generation`, and a write of an older generation fails. Durable on
    /// return. [`StateError::OwnerLost`] when a newer generation holds it already.
    async fn claim_shard(&self, owner: Owner) -> Result<(), StateError>;

    /// Whether the last write reached the disk or database.
    fn is_healthy(&self) -> bool;

    /// Why this instance must forward nothing because its database now
    /// belongs to another set-up (SPEC §10), if it does; checked per request.
    fn set_up_conflict(&self) -> Option<String> {
        None
    }

    /// Readiness: the backend can take a write now (the database answers).
    async fn check(&self) -> Result<(), StateError>;

    /// Group-commit figures since start-up.
    fn stats(&self) -> CommitStats;

    /// Makes everything durable and stops background work (shutdown).
    async fn close(&self) -> Result<(), StateError>;
}
