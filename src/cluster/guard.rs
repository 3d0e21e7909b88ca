//! The instance guard (SPEC §10.1): a single instance holds the gate lease of
//! shard 0 of a one-shard set-up, `{prefix}.gate/0000/{epoch:020}.json`, for as
//! long as it serves, so that two instances on one lease store (each with its own
//! marks and dedup records) cannot both forward.
//!
//! - The holder is an instance id generated once and kept in `data_dir`
//!   (`instance-id`), and each gate object records the process that wrote it
//!   ([`crate::process`]): the same instance restarted after a kill -9 takes its
//!   gate back at once when the old process is provably gone (same boot, pid
//!   namespace and user, that pid no longer running since that start time); an
//!   instance with another `data_dir` — or the same id from a process not
//!   provably gone: a copied `data_dir`, another machine — waits for the expiry
//!   plus `grace_ms` (on the store's clock, its earliest reading), like any
//!   contender (at start-up: exit 2, naming the holder), and then says loudly
//!   that the old instance's dedup records are elsewhere.
//! - A running instance whose renewal finds a newer gate epoch under its own id
//!   written by another process stops forwarding at once, says so once (two
//!   processes share the id: `data_dir` was copied), and from then on waits for
//!   the guard like any other instance.
//! - A gate lease held by another live instance, or a live gate object of a
//!   cluster set-up under the same prefix, stops start-up (exit 2, naming it).
//! - The lease is renewed every third of `gate_ttl` by creating the next gate
//!   epoch (SPEC §2's algorithm, read-back of uncertain results included).
//!   Forwarding is allowed only until `gate_ttl − self_fence_margin` after the
//!   moment the latest create was *sent* (this instance's monotonic clock, so the
//!   store's and the local wall clocks do not matter); an instance that cannot
//!   renew stops forwarding there (503 `shard_unavailable`) and resumes when it
//!   holds the lease again.
//! - A graceful stop writes a `release` gate object: the same instance (its
//!   `data_dir`) starts again at once; another believes only its own seal's
//!   release, so it waits `gate_ttl + grace_ms` after the object (SPEC §10).

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::epoch::{EpochObject, EpochRecord, LeaseName};
use crate::lease::acquire::{self, AcquireError, Holding};
use crate::lease::{Epochs, LeaseStore, StoreError};
use crate::process::ProcessId;
use crate::set_up::SetUp;
use crate::state::identity::{Generations, Stamp};

/// The file in `data_dir` that keeps this instance's id.
pub const ID_FILE: &str = "instance-id";

/// Why a single instance may not take the instance guard (SPEC §10.1): each case is one
/// that would let two instances forward for one prefix, or lose what was delivered.
#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    /// Another live instance holds the guard.
    #[error("another fencegate instance ({holder:?}) holds the instance guard of this lease store and prefix until {}; two instances on one store would each keep their own marks and dedup records. Stop it, or wait until its gate lease ends (plus grace_ms)", crate::clock::rfc3339(*.until))]
    Held {
        /// The other instance's id.
        holder: String,
        /// When its gate lease ends, on the store's clock.
        until: std::time::SystemTime,
    },
    /// A cluster uses this store and prefix.
    #[error("a fencegate cluster (mode {mode:?}, {shards} shards, instance {holder:?}) uses this lease store and prefix; a single instance and a cluster never share a prefix")]
    OtherMode {
        /// The mode its gate object names.
        mode: String,
        /// Its shard count.
        shards: u32,
        /// The instance that wrote the gate object.
        holder: String,
    },
    /// The last holder kept its state elsewhere: taking over would repeat its deliveries.
    #[error("the instance guard was last held by instance {holder:?}, which keeps its marks and dedup records in {}; this instance keeps them in {ours}. Taking over would forward again the retries of keys it delivered. Give this instance the same state (that data_dir, or the same [state] database), or accept duplicates for this start with `fencegate serve --takeover-may-duplicate`", .theirs.as_deref().unwrap_or("a place it did not name"))]
    OtherState {
        /// The last holder's id.
        holder: String,
        /// Where it kept its state, if it said.
        theirs: Option<String>,
        /// Where this instance keeps its state.
        ours: String,
    },
    /// Acquiring the gate lease failed.
    #[error("the instance guard: {0}")]
    Acquire(#[from] AcquireError),
    /// The state's generation could not be read or raised.
    #[error("the instance guard: the state's generation: {0}")]
    State(#[from] crate::state::StateError),
    /// The lease store failed.
    #[error("the instance guard: {0}")]
    Store(#[from] StoreError),
    /// The instance id file could not be read or written.
    #[error("the instance id in {path}: {detail}")]
    Id {
        /// The id file.
        path: String,
        /// What went wrong.
        detail: String,
    },
    /// The guard is held under this instance's own id by a process that is not
    /// provably gone.
    #[error("this instance's own id {id:?} holds the instance guard of this lease store and prefix until {}, written by another process ({other}) that is not provably gone. If this data_dir was copied, two processes share instance id {id}: give one a fresh data_dir (a new instance-id). If it was moved from a machine where that process no longer runs, start again after that time plus grace_ms", crate::clock::rfc3339(*.until))]
    SharedId {
        /// This instance's id.
        id: String,
        /// The other process, as its gate object names it.
        other: String,
        /// When the gate lease ends, on the store's clock.
        until: std::time::SystemTime,
    },
}

/// The instance guard (SPEC §10.1): the gate lease one single instance holds on its
/// store and prefix, so no second instance forwards with its own marks; renewed in the
/// background and self-fencing before it lapses.
pub struct InstanceGuard {
    epochs: Epochs,
    shard: LeaseName,
    id: String,
    advertise: String,
    ttl: Duration,
    margin: Duration,
    grace: Duration,
    /// When forwarding is allowed, and when what is in flight is aborted.
    window: crate::cluster::window::Window,
    holding: tokio::sync::Mutex<Option<Holding>>,
    /// Where this instance keeps deliveries ([`crate::set_up::state_of`]).
    state_id: String,
    /// Seals this instance's gate objects ([`KEY_FILE`]).
    key: crate::set_up::GateKey,
    /// A cluster found live under the prefix after taking the guard (nothing is
    /// forwarded while it is set).
    conflict: std::sync::Mutex<Option<String>>,
    /// This process as its gate objects record it (`None` without `/proc`: then
    /// nothing of its own is taken back at once).
    me: Option<ProcessId>,
    /// Set once another process was found holding the guard under this id: from
    /// then on nothing is taken back at once.
    shared_id: AtomicBool,
    /// Told when a renewal finds the tenure taken: what is in flight is aborted.
    lost: tokio::sync::Notify,
    /// One renewal at a time: the loop's, or a checkpoint's out of turn.
    renewing: tokio::sync::Mutex<()>,
    /// The state's generation ([`crate::state::identity`]): carried by each
    /// gate object, raised past it once the object is written.
    stamp: Stamp,
}

/// This instance's id, created once in `data_dir`.
pub fn instance_id(data_dir: &Path) -> Result<String, GuardError> {
    kept(data_dir, ID_FILE, || {
        format!("fg-{}", &acquire::fresh_token()[..16])
    })
}

/// The file in `data_dir` that keeps the secret this instance seals its gate
/// objects with (SPEC §10: only its own objects are believed).
pub const KEY_FILE: &str = "gate-key";

/// This instance's gate-object secret, created once in `data_dir`.
fn gate_secret(data_dir: &Path) -> Result<String, GuardError> {
    kept(data_dir, KEY_FILE, acquire::fresh_token)
}

/// The value kept in `data_dir/file`, made by `make` and written the first time
/// (to a temporary name, then renamed: never half written).
fn kept(data_dir: &Path, file: &str, make: impl FnOnce() -> String) -> Result<String, GuardError> {
    let path = data_dir.join(file);
    let err = |detail: String| GuardError::Id {
        path: path.display().to_string(),
        detail,
    };
    match std::fs::read_to_string(&path) {
        Ok(s) if !s.trim().is_empty() => return Ok(s.trim().to_owned()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e.to_string())),
    }
    std::fs::create_dir_all(data_dir).map_err(|e| err(e.to_string()))?;
    let value = make();
    let tmp = data_dir.join(format!("{file}.tmp"));
    std::fs::write(&tmp, format!("{value}\n"))
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(|e| err(e.to_string()))?;
    Ok(value)
}

/// This process as gate objects record it, or `None` (said once) without `/proc`.
fn this_process() -> Option<ProcessId> {
    let me = ProcessId::current();
    if me.is_none() {
        tracing::warn!("cannot tell this process's boot id, pid and start time from /proc: after a restart this instance waits for its own gate lease to end (plus grace_ms) like any other");
    }
    me
}

#[async_trait::async_trait]
impl crate::state::identity::Checkpoint for InstanceGuard {
    /// A renewal out of turn, and the raise after it. One that finds the
    /// tenure lost leaves it to the loop to notice.
    async fn checkpoint(&self) -> bool {
        let _one = self.renewing.lock().await;
        let Some(current) = self.holding.lock().await.clone() else {
            return false;
        };
        matches!(self.take_raised(Some(&current), true).await, Ok(true))
    }
}

impl InstanceGuard {
    /// Takes the instance guard at start-up, or says who holds it. `schema`:
    /// the PostgreSQL schema the state is in, if it is in PostgreSQL. One
    /// start-up sequence (SPEC §10.1: the guard's epoch, its wait for a
    /// predecessor, the state's generation), read top to bottom.
    pub async fn acquire(
        cfg: &Config,
        store: Arc<dyn LeaseStore>,
        advertise: String,
        database: Option<(&str, &str)>,
        gens: Arc<dyn Generations>,
    ) -> Result<Arc<InstanceGuard>, GuardError> {
        let id = instance_id(&cfg.server.data_dir)?;
        let state_id = crate::set_up::state_of(
            &cfg.state,
            &id,
            database.map(|d| d.0),
            database.map(|d| d.1),
        );
        let key = crate::set_up::GateKey::from_secret(
            gate_secret(&cfg.server.data_dir)?.as_bytes(),
            &format!("{}.gate/", cfg.store.prefix),
        );
        // The state's generation before anything of this start is written:
        // compared, once the guard is held, with the gate objects naming it.
        let generation = gens.recorded().await?;
        let guard = Arc::new(InstanceGuard {
            epochs: Epochs::new(store, format!("{}.gate/", cfg.store.prefix)),
            shard: crate::set_up::shard_name(0),
            id,
            advertise,
            ttl: cfg.store.gate_ttl,
            margin: cfg.store.self_fence_margin,
            grace: Duration::from_millis(cfg.store.grace_ms),
            window: crate::cluster::window::Window::new(),
            holding: tokio::sync::Mutex::new(None),
            state_id,
            key,
            conflict: std::sync::Mutex::new(None),
            me: this_process(),
            shared_id: AtomicBool::new(false),
            lost: tokio::sync::Notify::new(),
            renewing: tokio::sync::Mutex::new(()),
            stamp: Stamp::new(gens),
        });
        let before = acquire::status(&guard.epochs, &guard.shard).await?;
        let free = guard.is_free(&before);
        // Garbage at the latest epoch hides nothing: the checks read the latest
        // gate object that parses.
        let last = guard.last_record(&before).await?;
        let previous = last.as_ref().map(|r| r.holder.clone());
        // SPEC §10.1: an instance whose deliveries are elsewhere is not taken
        // over from without the operator's word. Decided on the holder read
        // before the take, whether or not its lease was over then: one that
        // ends between that read and the take is taken over from all the
        // same, and the take is undone.
        let mut other_state = None;
        if last.is_none()
            && before.latest != crate::epoch::Epoch::NONE
            && !cfg.takeover_may_duplicate
        {
            // Garbage all the way down: whoever held the guard is unknown, and
            // so is where it kept its deliveries.
            other_state = Some(GuardError::OtherState {
                holder: "an instance no readable gate object names".into(),
                theirs: None,
                ours: guard.state_id.clone(),
            });
        }
        if let Some(rec) = last {
            if SetUp::of(&rec) != SetUp::Single && !free {
                return Err(GuardError::OtherMode {
                    mode: rec.mode.unwrap_or_default(),
                    shards: rec.shards.unwrap_or(0),
                    holder: rec.holder,
                });
            }
            // The same state, not the same instance id: a data_dir moved
            // to another database (or schema) is another state. An object
            // from before database ids names the database by its address
            // only: the same instance at that address is the same state.
            // With `--claim-state` the operator says the records here are
            // this set-up's: the same instance's earlier objects named them
            // under the id the claim replaced.
            let shares = match rec.state.as_deref() {
                Some(s) if s == crate::set_up::without_database_id(&guard.state_id) => {
                    rec.holder == guard.id
                }
                Some(_) if cfg.claim_state && rec.holder == guard.id => true,
                Some(s) => crate::set_up::same_state(s, &guard.state_id),
                None => rec.holder == guard.id,
            };
            if !shares && !cfg.takeover_may_duplicate {
                other_state = Some(GuardError::OtherState {
                    holder: rec.holder,
                    theirs: rec.state,
                    ours: guard.state_id.clone(),
                });
            }
        }
        if free {
            if let Some(refused) = other_state.take() {
                return Err(refused);
            }
        }
        // (A live holder is refused here, by name and with its expiry.)
        match guard.take(None).await {
            Ok(()) => {}
            Err(GuardError::Acquire(AcquireError::Held {
                holder, expires_at, ..
            })) => {
                return Err(GuardError::Held {
                    holder,
                    until: expires_at,
                })
            }
            Err(e) => return Err(e),
        }
        if let Some(refused) = other_state {
            // Its lease ended between the read and the take. The release
            // names the refused holder's state, not ours: nothing was served
            // here, and the holder coming back finds its own state last.
            let theirs = match &refused {
                GuardError::OtherState { theirs, .. } => theirs.clone(),
                _ => None,
            };
            guard.release_as(theirs).await;
            return Err(refused);
        }
        guard.after_take().await?;
        // SPEC §10, identity and generations: a gate object naming this
        // state at or above its generation was written after the state was
        // copied — a copy, or a restored backup. Looked at only once the
        // guard is held (an instance refused records nothing), and recorded
        // (durably, with the raise) before anything is sent, so that a crash
        // before a lease's fence finds it again. No other writer of this
        // state's objects runs now: the guard keeps one instance per prefix.
        let latest = guard
            .epochs
            .latest_after(&guard.shard, crate::epoch::Epoch::NONE)
            .await?;
        // A state never raised has sent nothing a fence would hold back.
        let seen = match generation.generation {
            0 => None,
            _ => {
                crate::set_up::generation_seen(&guard.epochs, &guard.shard, latest, &guard.state_id)
                    .await?
            }
        };
        guard
            .stamp
            .find(&guard.state_id, generation, seen, None)
            .await?;
        match previous.as_deref() {
            Some(h) if h != guard.id => tracing::warn!(
                previous = h,
                instance = %guard.id,
                "took over the instance guard from another instance (--takeover-may-duplicate, or the same state): retries of keys it delivered are forwarded again unless both share the state"
            ),
            _ => tracing::info!(instance = %guard.id, "holding the instance guard"),
        }
        Ok(guard)
    }

    /// After a create that (re)took the guard: every other shard gate lease
    /// ever used under the prefix (a cluster's) must be free — a cluster serves
    /// nothing without shard 0 ([`crate::set_up`]), but one that held it until
    /// just now may still hold others. Looked at after our own create, so a
    /// cluster member taking a shard at the same time sees us, or we see it;
    /// and found by probing (`.gate/NNNN/` whose first object exists), not by
    /// what the object before ours claims, which may be garbage. On a conflict
    /// the guard is released and nothing is forwarded.
    async fn after_take(&self) -> Result<(), GuardError> {
        let shards = crate::set_up::shards_in_use(&self.epochs).await?;
        for shard in 1..shards {
            let name = crate::set_up::shard_name(shard);
            let st = acquire::status(&self.epochs, &name).await?;
            if self.is_free(&st) {
                continue;
            }
            let (theirs, holder) = match &st.record {
                Some(r) => (SetUp::of(r), r.holder.clone()),
                None => (SetUp::Cluster { shards }, String::new()),
            };
            let err = GuardError::OtherMode {
                mode: theirs.mode().into(),
                shards: theirs.shards().max(shards),
                holder,
            };
            tracing::error!(error = %err, "a cluster still holds gate leases under this prefix: releasing the instance guard, forwarding nothing");
            self.set_conflict(Some(err.to_string()));
            self.release().await;
            return Err(err);
        }
        self.set_conflict(None);
        Ok(())
    }

    /// Whether a gate lease's latest object lets this instance in now: nothing
    /// a single instance reads can be authenticated, so only a release that
    /// proves its tenure is final at once ([`crate::set_up::gate_free`]).
    fn is_free(&self, st: &acquire::LeaseStatus) -> bool {
        crate::set_up::gate_free(st, self.own(st), self.ttl, self.grace)
    }

    /// Whether the latest gate object is this instance's own: sealed with its
    /// key (from its `data_dir`) where it lies, under its id. Only such an
    /// object is believed: taken back after a restart, its release final.
    fn own(&self, st: &acquire::LeaseStatus) -> bool {
        st.record.as_ref().is_some_and(|r| {
            r.holder == self.id
                && r.lease == self.shard.as_str()
                && r.epoch == st.latest.get()
                && self.key.verifies(r)
        })
    }

    /// The generation at which this state was last found restored or copied
    /// (0: never): each lease's queue is fenced for it before its messages
    /// are sent ([`crate::queue::Queue::fence_if_restored`]).
    pub fn restored(&self) -> u64 {
        self.stamp.restored()
    }

    /// The latest gate object of shard 0 that parses (garbage written over it
    /// says nothing of who held the guard), from `st`'s own read and a few
    /// epochs back at most.
    async fn last_record(
        &self,
        st: &acquire::LeaseStatus,
    ) -> Result<Option<EpochRecord>, StoreError> {
        if let Some(r) = &st.record {
            return Ok(Some(r.clone()));
        }
        let mut e = st.latest.get().saturating_sub(1);
        for _ in 1..32 {
            if e == 0 {
                break;
            }
            if let Some(r) = self.latest_record(crate::epoch::Epoch::new(e)).await? {
                return Ok(Some(r));
            }
            e -= 1;
        }
        Ok(None)
    }

    fn set_conflict(&self, why: Option<String>) {
        *self.conflict.lock().unwrap_or_else(|p| p.into_inner()) = why;
    }

    /// Why this instance forwards nothing, if another set-up holds the prefix.
    pub fn conflict(&self) -> Option<String> {
        self.conflict
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The raw record of the latest gate object (for its mode and shard count).
    async fn latest_record(
        &self,
        latest: crate::epoch::Epoch,
    ) -> Result<Option<EpochRecord>, StoreError> {
        if latest == crate::epoch::Epoch::NONE {
            return Ok(None);
        }
        let key = crate::epoch::object_key(self.epochs.prefix(), &self.shard, latest);
        Ok(self
            .epochs
            .store()
            .get(&key)
            .await?
            .and_then(|o| serde_json::from_slice(&o.body).ok()))
    }

    /// Creates the next gate epoch: a renewal of `current`, or an acquire (taking
    /// back our own at once when its process is provably gone, anyone else's only
    /// when free). Forwarding is then allowed until `gate_ttl − self_fence_margin`
    /// after the create was sent.
    async fn take(&self, current: Option<&Holding>) -> Result<(), GuardError> {
        self.take_raised(current, false).await.map(drop)
    }

    /// [`InstanceGuard::take`], and the state's generation raised past the
    /// object once it is written — waited for when `checkpoint` (then
    /// whether the object is one, [`Stamp::written`]), in the background
    /// otherwise ([`Stamp::written_soon`]).
    async fn take_raised(
        &self,
        current: Option<&Holding>,
        checkpoint: bool,
    ) -> Result<bool, GuardError> {
        let stamped = self.stamp.next();
        let sent = Instant::now();
        let decorate = self.decorate(stamped);
        let reclaim = |r: &EpochRecord| self.may_reclaim(r);
        let free = |st: &acquire::LeaseStatus| self.is_free(st);
        let rules = acquire::GateRules {
            free: &free,
            reclaim: (current.is_none() && !self.shared_id.load(Ordering::SeqCst))
                .then_some(&reclaim as acquire::Reclaim<'_>),
        };
        let held = match acquire::acquire_with(
            &self.epochs,
            &self.shard,
            &self.id,
            self.ttl,
            self.grace,
            current.map(|h| (h.epoch, h.token.as_str())),
            Some(&rules),
            &decorate,
        )
        .await
        {
            Ok(held) => held,
            Err(AcquireError::Held {
                holder,
                epoch,
                expires_at,
                ..
            }) if holder == self.id => {
                let other = match self.latest_record(epoch).await {
                    Ok(Some(EpochRecord {
                        process: Some(p), ..
                    })) => p.to_string(),
                    _ => "a process the gate object does not name: an older fencegate".into(),
                };
                return Err(GuardError::SharedId {
                    id: holder,
                    other,
                    until: expires_at,
                });
            }
            Err(e) => {
                // Its object may have landed all the same: raise past it.
                self.stamp.written_soon();
                return Err(e.into());
            }
        };
        self.window.extend(sent, self.ttl, self.margin);
        *self.holding.lock().await = Some(held);
        if checkpoint {
            return Ok(self.stamp.written(stamped).await);
        }
        self.stamp.written_soon();
        Ok(false)
    }

    /// What this instance writes into each of its gate objects: its set-up,
    /// where it keeps deliveries, the process, and its seal (last: over the rest).
    fn decorate(&self, stamped: Option<u64>) -> impl Fn(&mut EpochRecord) + Sync + '_ {
        move |r: &mut EpochRecord| {
            r.advertise = Some(self.advertise.clone());
            SetUp::Single.stamp(r);
            r.state = Some(self.state_id.clone());
            r.process = self.me.clone();
            r.state_generation = stamped;
            self.key.seal(r);
        }
    }

    /// Whether the gate object `r`, an acquire under this instance's id, may be
    /// taken back at once: this process wrote it, or its process is provably gone.
    fn may_reclaim(&self, r: &EpochRecord) -> bool {
        // Only an object this instance sealed (a forged one could name any
        // process), at the epoch it names (checked by the caller).
        if !self.key.verifies(r) {
            return false;
        }
        match (&self.me, &r.process) {
            (Some(me), Some(p)) => p == me || p.provably_gone(me),
            _ => false,
        }
    }

    /// After a renewal found its tenure lost: whether the latest gate epoch is
    /// under this instance's id but not this process's (two processes share the
    /// id). If so, forwarding stops at once and it is said once, at error level.
    async fn check_shared_id(&self, lost: Option<&Holding>) {
        if self.shared_id.load(Ordering::SeqCst) {
            return;
        }
        let known = lost.map_or(crate::epoch::Epoch::NONE, |h| h.epoch);
        let Ok(st) = acquire::status_after(&self.epochs, &self.shard, known).await else {
            return; // the next round looks again
        };
        let Some(rec) = &st.record else {
            return;
        };
        if rec.holder != self.id {
            return;
        }
        let ours = match (&rec.process, &self.me) {
            (Some(p), Some(me)) => p == me,
            // No process to compare: our own create only if it carries our token.
            _ => lost.is_some_and(|h| {
                let hash = crate::epoch::TokenHash::of(h.token.as_bytes());
                h.epoch == st.latest
                    && matches!(&st.object, Some(EpochObject::Acquire { token, .. }) if token.matches(&hash))
            }),
        };
        if ours || self.shared_id.swap(true, Ordering::SeqCst) {
            return;
        }
        self.window.close();
        let other = rec.process.as_ref().map_or_else(
            || "a process the gate object does not name (an older fencegate)".to_owned(),
            ProcessId::to_string,
        );
        tracing::error!(
            instance = %self.id,
            gate_epoch = %st.latest,
            other = %other,
            "two processes share instance id {}: data_dir was copied; give one a fresh data_dir. Another process ({other}) holds the instance guard under this id; this one stopped forwarding and waits for the guard like any other instance",
            self.id
        );
    }

    /// Whether this instance may start a forward now.
    pub fn may_forward(&self) -> bool {
        self.window.is_open()
    }

    /// The gate epoch this instance holds and when it ends (store's clock), if it
    /// holds one (the operator's page).
    pub async fn held(&self) -> Option<(crate::epoch::Epoch, std::time::SystemTime)> {
        self.holding
            .lock()
            .await
            .as_ref()
            .map(|h| (h.epoch, h.expires_at))
    }

    /// This instance's id, as written in the gate object.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Renews every third of `gate_ttl` until `stop`; a failed renewal is retried
    /// every second, taking the lease back (ours) or waiting for it (another's).
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        let mut wait = self.ttl / 3;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
            let one = self.renewing.lock().await;
            let current = self.holding.lock().await.clone();
            let renewed = match self.take(current.as_ref()).await {
                // Our tenure ended or was taken: acquire afresh (taken under our
                // own id by another process: stop at once and wait like anyone),
                // and look for a cluster that may have held the prefix meanwhile.
                Err(GuardError::Acquire(AcquireError::NotHolder { .. })) => {
                    // Someone created the next gate epoch: our tenure is over
                    // now, whatever our window said — stop, and abort what is
                    // in flight (`abort_at_expiry`).
                    self.window.close();
                    self.lost.notify_one();
                    self.check_shared_id(current.as_ref()).await;
                    match self.take(None).await {
                        Ok(()) => self.after_take().await,
                        Err(e) => Err(e),
                    }
                }
                other => other,
            };
            drop(one);
            wait = match renewed {
                Ok(()) => self.ttl / 3,
                Err(e) => {
                    let deadline_passed = !self.may_forward();
                    if matches!(e, GuardError::SharedId { .. })
                        && self.shared_id.load(Ordering::SeqCst)
                    {
                        // Said once, at error level, when it was found.
                        tracing::debug!(error = %e, "waiting for the instance guard");
                    } else {
                        tracing::warn!(error = %e, stopped_forwarding = deadline_passed, "could not renew the instance guard; retrying");
                    }
                    Duration::from_secs(1).min(self.ttl / 3)
                }
            };
        }
    }

    /// Aborts every request in flight when the guard's gate lease may have
    /// ended — `gate_ttl` after the latest create was sent, with no renewal
    /// since — as a cluster's owner does for its shard (SPEC §10.2): a successor
    /// may take the lease `grace_ms` later, and a request of this instance still
    /// streaming to the destination then could complete after the successor's
    /// newer epoch.
    pub async fn abort_at_expiry(
        self: Arc<Self>,
        fences: Arc<crate::fence::Fences>,
        also: Box<dyn Fn() + Send + Sync>,
        stop: CancellationToken,
    ) {
        let mut aborted_for = None;
        loop {
            let abort_at = self.window.abort_at_ms();
            let now = self.window.now_ms();
            let wait = if abort_at == 0 || aborted_for == Some(abort_at) {
                // Not held yet, or aborted already: look again for a renewal.
                Duration::from_millis(100)
            } else if now < abort_at {
                Duration::from_millis(abort_at - now)
            } else {
                tracing::warn!(
                    "the instance guard's gate lease was not renewed within gate_ttl: requests in flight are aborted"
                );
                for f in fences.all() {
                    f.abort_in_flight();
                }
                also();
                aborted_for = Some(abort_at);
                continue;
            };
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
                _ = self.lost.notified() => {
                    tracing::warn!("the instance guard's gate lease was taken: requests in flight are aborted");
                    for f in fences.all() {
                        f.abort_in_flight();
                    }
                    also();
                }
            }
        }
    }

    /// Graceful stop: a `release` gate object, so that a successor starts at once.
    pub async fn release(&self) {
        self.release_as(None).await
    }

    /// [`InstanceGuard::release`], its object naming `state` instead of this
    /// instance's (an undone take: see `acquire`).
    async fn release_as(&self, state: Option<String>) {
        let Some(h) = self.holding.lock().await.take() else {
            return;
        };
        self.window.close();
        let stamped = self.stamp.next();
        let ours = self.decorate(stamped);
        let decorate = |r: &mut EpochRecord| {
            ours(r);
            if let Some(s) = &state {
                r.state = Some(s.clone());
                self.key.seal(r);
            }
        };
        match acquire::release_with(
            &self.epochs,
            &self.shard,
            &self.id,
            h.epoch,
            &h.token,
            &decorate,
        )
        .await
        {
            Ok(e) => {
                self.stamp.written(stamped).await;
                tracing::info!(gate_epoch = %e, "released the instance guard")
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not release the instance guard; a successor waits for its expiry")
            }
        }
    }
}
