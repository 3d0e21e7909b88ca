//! The keeper and a tenure on paused time (tokio's clock, which every deadline
//! and the wall clock here follow): an in-memory lease store and a state store
//! that keeps only what a cluster's coordination writes (owner generations,
//! membership). Deterministic and fast — balance, takeover, self-fencing and
//! handover without processes, S3 or PostgreSQL.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;

use super::*;
use crate::clock::{Clock, StoreClock, TokioClock};
use crate::config::Config;
use crate::dedup::Dedup;
use crate::epoch::{Epoch, LeaseName};
use crate::lease::{CreateOutcome, LeaseStore, StoredObject};
use crate::state::record::{Record, State, TakeOver};
use crate::state::{
    Begun, CommitStats, End, LeaseMarks, ListCursor, Listing, RecordKey, Resolution, Resolved,
};

/// Objects in memory, `LastModified` from the (paused) clock; `down` refuses
/// every call, as a store cut off.
struct MemStore {
    objects: Mutex<BTreeMap<String, StoredObject>>,
    clock: StoreClock,
    local: Arc<dyn Clock>,
    down: AtomicBool,
}

impl MemStore {
    fn check(&self) -> Result<(), StoreError> {
        if self.down.load(Ordering::SeqCst) {
            return Err(StoreError::Unavailable("cut off (test)".into()));
        }
        Ok(())
    }
}

#[async_trait]
impl LeaseStore for MemStore {
    async fn list(
        &self,
        prefix: &str,
        start_after: Option<&str>,
    ) -> Result<Vec<String>, StoreError> {
        self.check()?;
        let objects = self.objects.lock().unwrap();
        Ok(objects
            .keys()
            .filter(|k| k.starts_with(prefix) && start_after.is_none_or(|s| k.as_str() > s))
            .cloned()
            .collect())
    }
    async fn get(&self, key: &str) -> Result<Option<StoredObject>, StoreError> {
        self.check()?;
        Ok(self.objects.lock().unwrap().get(key).cloned())
    }
    async fn create_if_absent(&self, key: &str, body: Bytes) -> Result<CreateOutcome, StoreError> {
        self.check()?;
        let mut objects = self.objects.lock().unwrap();
        if objects.contains_key(key) {
            return Ok(CreateOutcome::AlreadyExists);
        }
        let last_modified = self.local.now();
        objects.insert(
            key.to_owned(),
            StoredObject {
                body,
                last_modified,
            },
        );
        Ok(CreateOutcome::Created)
    }
    async fn delete(&self, key: &str) -> Result<(), StoreError> {
        self.objects.lock().unwrap().remove(key);
        Ok(())
    }
    fn clock(&self) -> &StoreClock {
        &self.clock
    }
    fn describe(&self) -> String {
        "memory".into()
    }
}

/// Owner generations and membership; no marks or records (none are written
/// by coordination alone).
#[derive(Default)]
struct Coordination {
    generations: Mutex<HashMap<u32, u64>>,
    members: Mutex<BTreeMap<String, tokio::time::Instant>>,
}

#[async_trait]
impl StateStore for Coordination {
    async fn marks(&self, _: &LeaseName) -> Result<LeaseMarks, StateError> {
        Ok(LeaseMarks::default())
    }
    async fn raise_mark(&self, _: Owner, _: &LeaseName, _: Epoch) -> Result<(), StateError> {
        Ok(())
    }
    async fn note_drained(&self, _: Owner, _: &LeaseName, _: Epoch) -> Result<(), StateError> {
        Ok(())
    }
    async fn begin(
        &self,
        _: Owner,
        _: &RecordKey,
        _: &Record,
        _: TakeOver,
    ) -> Result<Begun, StateError> {
        Err(StateError::Write("no records here".into()))
    }
    async fn finish(&self, _: Owner, _: &RecordKey, _: End) -> Result<(), StateError> {
        Err(StateError::Write("no records here".into()))
    }
    async fn get(&self, _: &RecordKey) -> Result<Option<Record>, StateError> {
        Ok(None)
    }
    async fn resolve(
        &self,
        _: Owner,
        _: &RecordKey,
        _: Resolution,
        _: u64,
    ) -> Result<Resolved, StateError> {
        Err(StateError::Write("no records here".into()))
    }
    async fn list(
        &self,
        _: State,
        _: Option<&str>,
        _: Option<&ListCursor>,
        _: usize,
    ) -> Result<Listing, StateError> {
        Ok(Listing::default())
    }
    async fn sweep(&self, _: TakeOver) -> Result<usize, StateError> {
        Ok(0)
    }
    async fn recover(&self, _: Owner, _: u64) -> Result<usize, StateError> {
        Ok(0)
    }
    async fn claim_shard(&self, owner: Owner) -> Result<(), StateError> {
        let mut g = self.generations.lock().unwrap();
        let stored = g.entry(owner.shard).or_default();
        if *stored > owner.generation {
            return Err(StateError::OwnerLost {
                ours: owner,
                stored: *stored,
            });
        }
        *stored = owner.generation;
        Ok(())
    }
    async fn heartbeat(&self, id: &str, ttl: Duration) -> Result<Vec<String>, StateError> {
        let now = tokio::time::Instant::now();
        let mut m = self.members.lock().unwrap();
        m.insert(id.to_owned(), now);
        m.retain(|_, seen| now.duration_since(*seen) <= ttl);
        Ok(m.keys().cloned().collect())
    }
    async fn leave(&self, id: &str) -> Result<(), StateError> {
        self.members.lock().unwrap().remove(id);
        Ok(())
    }
    fn is_healthy(&self) -> bool {
        true
    }
    async fn check(&self) -> Result<(), StateError> {
        Ok(())
    }
    fn stats(&self) -> CommitStats {
        CommitStats::default()
    }
    async fn close(&self) -> Result<(), StateError> {
        Ok(())
    }
}

const TTL: Duration = Duration::from_secs(6);
const MARGIN: Duration = Duration::from_secs(2);
const GRACE: Duration = Duration::from_millis(500);

struct World {
    clock: Arc<dyn Clock>,
    state: Arc<Coordination>,
}

impl World {
    fn new() -> World {
        World {
            clock: TokioClock::new(SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000)),
            state: Arc::new(Coordination::default()),
        }
    }

    fn store(&self) -> Arc<MemStore> {
        Arc::new(MemStore {
            objects: Mutex::new(BTreeMap::new()),
            clock: StoreClock::new(self.clock.clone()),
            local: self.clock.clone(),
            down: AtomicBool::new(false),
        })
    }

    /// A member `id` of a `shards`-shard cluster on `store` (its own handle on
    /// the shared objects, so that one member can be cut off alone).
    async fn member(&self, id: &str, shards: u32, store: Arc<dyn LeaseStore>) -> Arc<Cluster> {
        let text = format!(
            "[store]\nkind = \"dir\"\nprefix = \"p/\"\ngate_ttl = \"6s\"\nself_fence_margin = \"2s\"\ngrace_ms = 500\n\
             [cluster]\ninstance_id = \"{id}\"\nadvertise = \"http://{id}\"\nshards = {shards}\npeer_token = \"0123456789abcdef\"\n\
             [[route]]\nname = \"r\"\npath_prefix = \"/r/\"\nupstream = \"http://127.0.0.1:1/\"\nlease = \"billing\"\ndrain_timeout_ms = 100\n"
        );
        let cfg = Config::parse(&text).unwrap();
        let state: Arc<dyn StateStore> = self.state.clone();
        let epochs = crate::lease::Epochs::new(store.clone(), "p/");
        let fences = crate::fence::Fences::new(epochs, state.clone(), Duration::from_secs(1));
        let dedup = Arc::new(Dedup::new(
            state.clone(),
            self.clock.clone(),
            Duration::from_secs(60),
        ));
        Cluster::new(&cfg, store, fences, state, dedup)
            .await
            .unwrap()
    }
}

/// Lets spawned takeovers and handovers run to their end (time stands still).
async fn settle() {
    for _ in 0..200 {
        tokio::task::yield_now().await;
    }
}

/// One keeper round of each member, then the tasks it started.
async fn rounds(members: &[&Arc<Cluster>]) {
    for m in members {
        m.round().await;
    }
    settle().await;
}

fn serving(c: &Cluster) -> Vec<u32> {
    (0..c.shards)
        .filter(|s| c.gates[*s as usize].serving.load(Ordering::SeqCst) != 0)
        .collect()
}

/// Shares: two members of a four-shard cluster end with two shards each, and
/// never both serve one (balance, SPEC §10.2), after the first took them all.
#[tokio::test(start_paused = true)]
async fn two_members_end_with_two_shards_each_and_never_share_one() {
    let w = World::new();
    let store = w.store();
    let a = w.member("a", 4, store.clone()).await;
    for _ in 0..3 {
        rounds(&[&a]).await;
        tokio::time::advance(TTL / 3).await;
    }
    assert_eq!(serving(&a), vec![0, 1, 2, 3], "alone, a serves every shard");
    let b = w.member("b", 4, store.clone()).await;
    for _ in 0..12 {
        rounds(&[&a, &b]).await;
        let (sa, sb) = (serving(&a), serving(&b));
        assert!(
            sa.iter().all(|s| !sb.contains(s)),
            "a {sa:?} and b {sb:?} share a shard"
        );
        tokio::time::advance(TTL / 3).await;
    }
    assert_eq!((serving(&a).len(), serving(&b).len()), (2, 2));
}

/// Takeover: a member that dies is replaced only once its gate lease has
/// expired plus grace and `LastModified`'s resolution on the store's clock —
/// never sooner (SPEC §10.2).
#[tokio::test(start_paused = true)]
async fn a_dead_owners_shard_is_taken_only_after_its_gate_lease_grace_and_resolution() {
    let w = World::new();
    let store = w.store();
    let a = w.member("a", 1, store.clone()).await;
    rounds(&[&a]).await;
    assert_eq!(serving(&a), vec![0]);
    let b = w.member("b", 1, store.clone()).await;
    rounds(&[&b]).await;
    // a dies now: its last create was sent at this instant.
    let died = tokio::time::Instant::now();
    let floor = TTL + GRACE + Duration::from_secs(1);
    let mut taken = None;
    while taken.is_none() {
        tokio::time::advance(Duration::from_millis(250)).await;
        rounds(&[&b]).await;
        if serving(&b) == vec![0] {
            taken = Some(died.elapsed());
        }
        assert!(died.elapsed() < Duration::from_secs(30), "never taken over");
    }
    let taken = taken.unwrap();
    assert!(
        taken > floor,
        "taken over {taken:?} after the death, before {floor:?}"
    );
    assert!(
        taken <= floor + TTL / 3 + Duration::from_millis(500),
        "{taken:?}"
    );
}

/// Self-fencing: an owner cut off from the store forwards until
/// `gate_ttl − self_fence_margin` after its last create was sent and not a
/// moment later, and its window's abort deadline is `gate_ttl` after it.
#[tokio::test(start_paused = true)]
async fn an_owner_cut_off_stops_forwarding_at_ttl_minus_margin() {
    let w = World::new();
    let shared = w.store();
    let a = w.member("a", 1, shared.clone()).await;
    rounds(&[&a]).await;
    let renewed = tokio::time::Instant::now();
    let generation = a.gates[0].serving.load(Ordering::SeqCst);
    let owner = Owner {
        shard: 0,
        generation,
    };
    assert!(a.may_forward(owner));
    shared.down.store(true, Ordering::SeqCst);
    let deadline = a.gates[0].window.abort_deadline();
    assert_eq!(deadline.duration_since(renewed), TTL);
    // (A round now would spend its renewal's retries against the dead store;
    // the window does not wait for it.)
    tokio::time::advance(TTL - MARGIN - Duration::from_millis(5)).await;
    settle().await;
    assert!(a.may_forward(owner), "still inside its window");
    tokio::time::advance(Duration::from_millis(10)).await;
    settle().await;
    assert!(!a.may_forward(owner), "forwarded past gate_ttl − margin");
    assert!(serving(&a).is_empty(), "the watcher stopped the shard");
}

/// Handover: a graceful stop releases every shard with a sealed release, and
/// the other member takes them at its next round, without waiting for expiry.
#[tokio::test(start_paused = true)]
async fn a_graceful_leave_hands_shards_over_at_the_next_round() {
    let w = World::new();
    let store = w.store();
    let a = w.member("a", 2, store.clone()).await;
    rounds(&[&a]).await;
    tokio::time::advance(TTL / 3).await;
    rounds(&[&a]).await;
    assert_eq!(serving(&a), vec![0, 1]);
    let b = w.member("b", 2, store.clone()).await;
    rounds(&[&b]).await;
    a.leave().await;
    assert!(serving(&a).is_empty());
    let left = tokio::time::Instant::now();
    rounds(&[&b]).await;
    tokio::time::advance(Duration::from_millis(100)).await;
    rounds(&[&b]).await;
    assert_eq!(serving(&b), vec![0, 1], "taken at once after the release");
    assert!(left.elapsed() < TTL / 3);
}
