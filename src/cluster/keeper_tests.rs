//! The keeper and a tenure on paused time (tokio's clock, which every deadline
//! and the wall clock here follow): an in-memory lease store for the prefix's
//! anchor (`{prefix}.gate/0000/`) and the leases' epochs, and a state store
//! that keeps only what a cluster's coordination writes — the ownership rows
//! of `fencegate_owners`, taken, renewed and released exactly as
//! `state/postgres/ownership.rs` does in SQL, and membership beats.
//! Deterministic and fast: balance, the takeover floor, self-fencing,
//! handover, a row cleared by hand and a self-fenced owner's re-take, without
//! processes, S3 or PostgreSQL. Rounds are driven by hand (the keeper's
//! `anchor_round`, `renew_round` and `look_round`), so every instant is known.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;
use tokio::time::{advance, Instant};

use super::*;
use crate::admission::Claim;
use crate::clock::{Clock, StoreClock, TokioClock};
use crate::config::Config;
use crate::epoch::{Epoch, LeaseName};
use crate::gate::Pass;
use crate::lease::{CreateOutcome, LeaseStore, StoredObject};
use crate::state::ownership::{Beats, Generation, Renewed, RowVersion};
use crate::state::record::{Record, State, TakeOver};
use crate::state::{
    Begun, CommitStats, End, LeaseMarks, ListCursor, Listing, RecordKey, Resolution, Resolved,
};

/// Objects in memory, shared by every handle; `LastModified` from the
/// (paused) clock; a handle's `down` refuses every call, as a store cut off
/// from one member.
pub(super) struct MemStore {
    objects: Arc<Mutex<BTreeMap<String, StoredObject>>>,
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
        self.check()?;
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

/// A row of `fencegate_owners`, the columns coordination reads and writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Row {
    pub(super) generation: u64,
    owner: Option<String>,
    advertise: Option<String>,
    renewals: u64,
    ttl_ms: Option<u64>,
    released_generation: Option<u64>,
}

/// The database's tables, shared by every member's handle.
#[derive(Default)]
pub(super) struct Tables {
    pub(super) owners: BTreeMap<u32, Row>,
    /// `fencegate_members`: beats per instance.
    beats: BTreeMap<String, u64>,
}

/// One member's connection to the shared database: `down` fails every call
/// (nothing applied); `unknown` applies a call, then fails its answer (a
/// commit whose outcome the caller never learns); `latency` delays every
/// answer (the call is applied when sent).
pub(super) struct Db {
    tables: Arc<Mutex<Tables>>,
    down: AtomicBool,
    unknown: AtomicBool,
    latency: Mutex<Duration>,
    /// This many renewals from now are sent on a connection that never
    /// answers (a hung backend): nothing applied, no answer.
    hung_renewals: std::sync::atomic::AtomicU32,
}

impl Db {
    async fn call<T>(&self, apply: impl FnOnce(&mut Tables) -> T) -> Result<T, StateError> {
        if self.down.load(Ordering::SeqCst) {
            return Err(StateError::Write("database down (test)".into()));
        }
        let answer = apply(&mut self.tables.lock().unwrap());
        let latency = *self.latency.lock().unwrap();
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        if self.unknown.load(Ordering::SeqCst) {
            return Err(StateError::Write(
                "connection lost after the commit (test)".into(),
            ));
        }
        Ok(answer)
    }
}

fn no_records() -> StateError {
    StateError::Write("no records here (coordination only)".into())
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[async_trait]
impl StateStore for Db {
    async fn marks(&self, _: &LeaseName) -> Result<LeaseMarks, StateError> {
        self.call(|_| LeaseMarks::default()).await
    }
    async fn raise_mark(&self, _: Owner, _: &LeaseName, _: Epoch) -> Result<(), StateError> {
        self.call(|_| ()).await
    }
    async fn note_drained(&self, _: Owner, _: &LeaseName, _: Epoch) -> Result<(), StateError> {
        self.call(|_| ()).await
    }
    async fn begin(
        &self,
        _: Owner,
        _: &RecordKey,
        _: &Record,
        _: TakeOver,
    ) -> Result<Begun, StateError> {
        Err(no_records())
    }
    async fn finish(&self, _: Owner, _: &RecordKey, _: End) -> Result<(), StateError> {
        Err(no_records())
    }
    async fn get(&self, _: &RecordKey) -> Result<Option<Record>, StateError> {
        Err(no_records())
    }
    async fn resolve(
        &self,
        _: Owner,
        _: &RecordKey,
        _: Resolution,
        _: u64,
    ) -> Result<Resolved, StateError> {
        Err(no_records())
    }
    async fn list(
        &self,
        _: State,
        _: Option<&str>,
        _: Option<&ListCursor>,
        _: usize,
    ) -> Result<Listing, StateError> {
        Err(no_records())
    }
    async fn sweep(&self, _: TakeOver) -> Result<usize, StateError> {
        Err(no_records())
    }
    async fn recover(&self, _: Owner, _: u64) -> Result<usize, StateError> {
        self.call(|_| 0).await
    }
    /// `INSERT (shard, generation) ON CONFLICT DO UPDATE … WHERE o.generation <
    /// EXCLUDED.generation`, then the stored generation is compared.
    async fn claim_shard(&self, owner: Owner) -> Result<(), StateError> {
        let stored = self
            .call(|t| {
                let row = t.owners.entry(owner.shard).or_insert(Row {
                    generation: owner.generation.get(),
                    owner: None,
                    advertise: None,
                    renewals: 0,
                    ttl_ms: None,
                    released_generation: None,
                });
                row.generation = row.generation.max(owner.generation.get());
                Generation::new(row.generation)
            })
            .await?;
        if stored > owner.generation {
            return Err(StateError::OwnerLost {
                ours: owner,
                stored,
            });
        }
        Ok(())
    }
    fn is_healthy(&self) -> bool {
        !self.down.load(Ordering::SeqCst)
    }
    async fn check(&self) -> Result<(), StateError> {
        self.call(|_| ()).await
    }
    fn stats(&self) -> CommitStats {
        CommitStats::default()
    }
    async fn close(&self) -> Result<(), StateError> {
        Ok(())
    }
}

#[async_trait]
impl OwnershipStore for Db {
    async fn owner_rows(&self) -> Result<Vec<OwnerRow>, StateError> {
        self.call(|t| {
            t.owners
                .iter()
                .map(|(shard, r)| OwnerRow {
                    shard: *shard,
                    generation: Generation::new(r.generation),
                    owner: r.owner.clone(),
                    advertise: r.advertise.clone(),
                    renewals: r.renewals,
                    expires_at: None,
                    ttl: r.ttl_ms.map(Duration::from_millis),
                    released: r.released_generation == Some(r.generation) && r.owner.is_none(),
                })
                .collect()
        })
        .await
    }
    /// `INSERT … ON CONFLICT (shard) DO NOTHING` for a shard never taken, else
    /// `UPDATE … WHERE generation = $seen AND renewals = $seen`, raising the
    /// generation.
    async fn take_shard(
        &self,
        shard: u32,
        seen: Option<RowVersion>,
        id: &str,
        advertise: &str,
        ttl: Duration,
    ) -> Result<Option<Generation>, StateError> {
        self.call(|t| match seen {
            None => {
                if t.owners.contains_key(&shard) {
                    return None;
                }
                t.owners.insert(
                    shard,
                    Row {
                        generation: 1,
                        owner: Some(id.to_owned()),
                        advertise: Some(advertise.to_owned()),
                        renewals: 0,
                        ttl_ms: Some(millis(ttl)),
                        released_generation: None,
                    },
                );
                Some(Generation::FIRST)
            }
            Some(RowVersion {
                generation,
                renewals,
            }) => {
                let row = t.owners.get_mut(&shard)?;
                if row.generation != generation.get() || row.renewals != renewals {
                    return None;
                }
                row.generation += 1;
                row.owner = Some(id.to_owned());
                row.advertise = Some(advertise.to_owned());
                row.renewals = 0;
                row.ttl_ms = Some(millis(ttl));
                Some(Generation::new(row.generation))
            }
        })
        .await
    }
    /// One `UPDATE … FROM unnest(shards, generations) WHERE o.generation =
    /// h.generation AND o.owner = $id`, `renewals + 1`, `ttl_ms`.
    async fn renew_shards(
        &self,
        id: &str,
        held: &[Owner],
        ttl: Duration,
        _patience: Duration,
    ) -> Result<Vec<Renewed>, StateError> {
        let hung = self
            .hung_renewals
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if hung.is_ok() {
            return std::future::pending().await;
        }
        self.call(|t| {
            let mut renewed = Vec::new();
            for &h in held {
                if let Some(row) = t.owners.get_mut(&h.shard) {
                    if row.generation == h.generation.get() && row.owner.as_deref() == Some(id) {
                        row.renewals += 1;
                        row.ttl_ms = Some(millis(ttl));
                        renewed.push(Renewed {
                            owner: h,
                            renewals: row.renewals,
                        });
                    }
                }
            }
            renewed
        })
        .await
    }
    /// `UPDATE … SET owner = NULL, advertise = NULL, released_generation =
    /// generation WHERE shard = $1 AND generation = $2 AND owner = $3`.
    async fn release_shard(&self, id: &str, held: Owner) -> Result<bool, StateError> {
        self.call(|t| match t.owners.get_mut(&held.shard) {
            Some(row)
                if row.generation == held.generation.get() && row.owner.as_deref() == Some(id) =>
            {
                row.owner = None;
                row.advertise = None;
                row.released_generation = Some(row.generation);
                true
            }
            _ => false,
        })
        .await
    }
    async fn beat(&self, id: &str) -> Result<Vec<Beats>, StateError> {
        self.call(|t| {
            *t.beats.entry(id.to_owned()).or_default() += 1;
            t.beats
                .iter()
                .map(|(i, n)| Beats {
                    instance: i.clone(),
                    count: *n,
                })
                .collect()
        })
        .await
    }
    async fn leave(&self, id: &str) -> Result<(), StateError> {
        self.call(|t| {
            t.beats.remove(id);
        })
        .await
    }
}

const TTL: Duration = Duration::from_secs(6);
const MARGIN: Duration = Duration::from_secs(2);
const GRACE: Duration = Duration::from_millis(500);
const MS: Duration = Duration::from_millis(1);

/// The shared store and database, and the clock everything follows.
pub(super) struct World {
    pub(super) clock: Arc<dyn Clock>,
    objects: Arc<Mutex<BTreeMap<String, StoredObject>>>,
    pub(super) tables: Arc<Mutex<Tables>>,
    /// The database's generations, shared by the members as its tables are.
    generations: Arc<crate::state::identity::InMemory>,
}

/// A member, and its own handles on the store and the database.
struct Member {
    c: Arc<Cluster>,
    db: Arc<Db>,
}

impl std::ops::Deref for Member {
    type Target = Arc<Cluster>;
    fn deref(&self) -> &Arc<Cluster> {
        &self.c
    }
}

impl World {
    pub(super) fn new() -> World {
        World {
            clock: TokioClock::new(SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000)),
            objects: Arc::default(),
            tables: Arc::default(),
            generations: Arc::default(),
        }
    }

    pub(super) fn store(&self) -> Arc<MemStore> {
        Arc::new(MemStore {
            objects: self.objects.clone(),
            clock: StoreClock::new(self.clock.clone()),
            local: self.clock.clone(),
            down: AtomicBool::new(false),
        })
    }

    pub(super) fn db(&self) -> Arc<Db> {
        Arc::new(Db {
            tables: self.tables.clone(),
            down: AtomicBool::new(false),
            unknown: AtomicBool::new(false),
            latency: Mutex::new(Duration::ZERO),
            hung_renewals: std::sync::atomic::AtomicU32::new(0),
        })
    }

    /// The row of `shard` as the database holds it.
    fn row(&self, shard: u32) -> Option<Row> {
        self.tables.lock().unwrap().owners.get(&shard).cloned()
    }

    /// A member `id` of a `shards`-shard cluster whose `gate_ttl` is `ttl`.
    async fn member(&self, id: &str, shards: u32, ttl: Duration) -> Member {
        let text = format!(
            "[store]\nkind = \"dir\"\nprefix = \"p/\"\ngate_ttl = \"{}ms\"\nself_fence_margin = \"2s\"\ngrace_ms = 500\n\
             [state]\nkind = \"postgres\"\nurl = \"postgres://fg@127.0.0.1/fg\"\n\
             [cluster]\ninstance_id = \"{id}\"\nadvertise = \"http://{id}\"\nshards = {shards}\npeer_token = \"0123456789abcdef\"\n\
             [[route]]\nname = \"r\"\npath_prefix = \"/r/\"\nupstream = \"http://127.0.0.1:1/\"\nlease = \"billing\"\ndrain_timeout_ms = 100\n",
            ttl.as_millis()
        );
        let cfg = Config::parse(&text).unwrap();
        assert_eq!(cfg.store.gate_ttl, ttl);
        let store: Arc<dyn LeaseStore> = self.store();
        let db = self.db();
        let state: Arc<dyn StateStore> = db.clone();
        let epochs = crate::lease::Epochs::new(store.clone(), "p/");
        let fences = crate::fence::Fences::new(epochs, state.clone(), Duration::from_secs(1));
        let dedup = Arc::new(crate::dedup::Dedup::new(
            state.clone(),
            self.clock.clone(),
            Duration::from_secs(60),
        ));
        let c = Cluster::new(
            &cfg,
            store,
            fences,
            state,
            db.clone(),
            dedup,
            crate::cluster::Database {
                schema: "public",
                id: None,
                generations: self.generations.clone(),
            },
        )
        .await
        .unwrap();
        Member { c, db }
    }

    /// A worker's request on lease `billing` admitted by `m`'s fence (its
    /// shard served there): in flight until the pass is dropped. The lease's
    /// first epoch is acquired on the first call.
    async fn admit(&self, m: &Cluster) -> Pass {
        self.admit_to(&m.tenures.fences).await
    }

    /// A worker's request on lease `billing` admitted by its fence in
    /// `fences` (running: its shard served), as [`World::admit`].
    pub(super) async fn admit_to(&self, fences: &crate::fence::Fences) -> Pass {
        let lease = LeaseName::parse("billing").unwrap();
        let epochs = crate::lease::Epochs::new(self.store(), "p/");
        let h = crate::lease::acquire::acquire(
            &epochs,
            &lease,
            "worker",
            Duration::from_secs(3600),
            GRACE,
            None,
        )
        .await
        .unwrap();
        let fence = fences.get(&lease).expect("the lease's fence runs here");
        fence
            .admit(
                Claim {
                    epoch: h.epoch,
                    token: Some(h.token.as_bytes()),
                },
                true,
                Duration::from_millis(100),
            )
            .await
            .unwrap()
    }
}

/// Lets spawned takeovers, handovers and stops run to their end (time
/// stands still: nothing here sleeps).
pub(super) async fn settle() {
    for _ in 0..40 {
        tokio::task::yield_now().await;
    }
}

/// The anchor's round: its read (which a renewal needs, answered within a
/// third of `gate_ttl`) and a create when one is due.
async fn anchor(m: &Cluster) {
    let conflict = m.anchor_round().await;
    m.set_conflict(conflict);
}

/// A renewal round (after the anchor's, at the same instant: the window then
/// counts from the renewal's send), then what it started.
async fn renew(m: &Arc<Cluster>) {
    anchor(m).await;
    m.renew_round().await;
    settle().await;
}

/// A look (and balance), then the takeovers and handovers it started.
async fn look(m: &Arc<Cluster>) {
    m.look_round().await;
    settle().await;
}

/// A whole keeper round of each member: anchor, renewal and beat, look.
async fn rounds(members: &[&Member]) {
    for m in members {
        anchor(m).await;
        m.renew_round().await;
        m.look_round().await;
        settle().await;
    }
}

fn serving(c: &Cluster) -> Vec<u32> {
    (0..c.shards)
        .filter(|s| c.by_shard[*s as usize].serving().is_some())
        .collect()
}

fn generation(c: &Cluster, shard: u32) -> u64 {
    c.by_shard[shard as usize]
        .serving()
        .map_or(0, Generation::get)
}

fn stopping(c: &Cluster, shard: u32) -> usize {
    *c.by_shard[shard as usize].stopping.borrow()
}

fn assert_apart(a: &Cluster, b: &Cluster) {
    let (sa, sb) = (serving(a), serving(b));
    assert!(
        sa.iter().all(|s| !sb.contains(s)),
        "a {sa:?} and b {sb:?} share a shard"
    );
}

/// Shares: two members of a four-shard cluster end with two shards each, and
/// never both serve one (balance, SPEC §10.2) — the first took them all, the
/// second joins and the first hands two over.
#[tokio::test(start_paused = true)]
async fn two_members_end_with_two_shards_each_and_never_share_one() {
    let w = World::new();
    let a = w.member("a", 4, TTL).await;
    for _ in 0..40 {
        rounds(&[&a]).await;
        advance(TTL / 3).await;
    }
    assert_eq!(serving(&a), vec![0, 1, 2, 3], "alone, a serves every shard");
    let b = w.member("b", 4, TTL).await;
    for _ in 0..40 {
        rounds(&[&a, &b]).await;
        assert_apart(&a, &b);
        advance(TTL / 3).await;
    }
    assert_eq!((serving(&a).len(), serving(&b).len()), (2, 2));
    // Long into its tenures, each names itself the owner of what it serves
    // (its own renewals count as seen: the view's owner stayed empty once
    // gate_ttl + grace had passed since its take).
    for m in [&a, &b] {
        for v in m.shard_statuses() {
            if v.served_here {
                assert_eq!(v.owner.as_deref(), Some(m.id.as_str()), "shard {}", v.shard);
            }
        }
    }
    assert_eq!(a.handovers.load(Ordering::SeqCst), 2, "handed over: two");
    assert_eq!(b.handovers.load(Ordering::SeqCst), 0);
    for s in 0..4 {
        let row = w.row(s).unwrap();
        let owner = if serving(&a).contains(&s) { "a" } else { "b" };
        assert_eq!(row.owner.as_deref(), Some(owner), "shard {s}");
    }
}

/// Shares, starting together: each of two members that see each other takes
/// its two shards and not one more — nothing is handed over, and no member
/// ever holds above its share.
#[tokio::test(start_paused = true)]
async fn two_members_starting_together_take_their_share_and_no_more() {
    let w = World::new();
    let a = w.member("a", 4, TTL).await;
    let b = w.member("b", 4, TTL).await;
    // Each sees the other's beat change before its first look.
    for m in [&a, &b, &a, &b] {
        anchor(m).await;
        m.renew_round().await;
    }
    assert_eq!(a.members(), vec!["a", "b"]);
    for _ in 0..40 {
        for m in [&a, &b] {
            look(m).await;
            assert!(serving(m).len() <= 2, "{} took {:?}", m.id, serving(m));
            assert_apart(&a, &b);
        }
        advance(TTL / 3).await;
        for m in [&a, &b] {
            renew(m).await;
        }
    }
    assert_eq!((serving(&a).len(), serving(&b).len()), (2, 2));
    let handed = a.handovers.load(Ordering::SeqCst) + b.handovers.load(Ordering::SeqCst);
    assert_eq!(handed, 0, "nothing to hand over: no one took too many");
}

/// Drives `owner`'s last renewal, then only `contender`'s rounds every 100 ms
/// (a look each, the anchor and a renewal round every second), until it
/// serves shard 0. Returns when the contender first saw the last renewal
/// (the arrival of its read) and when it took the shard.
async fn die_and_wait(w: &World, owner: &Member, contender: &Member) -> (Instant, Instant) {
    advance(Duration::from_secs(1)).await;
    renew(owner).await;
    let renewals = w.row(0).unwrap().renewals;
    assert!(renewals > 0, "renewed");
    // The owner dies now: it runs no more rounds.
    advance(Duration::from_millis(300)).await;
    let mut first_seen = None;
    let start = Instant::now();
    for step in 0u32.. {
        if step.is_multiple_of(10) {
            renew(contender).await;
        }
        look(contender).await;
        let seen = lock(&contender.by_shard[0].seen).clone();
        if first_seen.is_none() && seen.row.as_ref().is_some_and(|r| r.renewals == renewals) {
            first_seen = Some(Instant::now());
            assert_eq!(seen.since, first_seen, "counted from the read's arrival");
        }
        if serving(contender) == vec![0] {
            return (first_seen.unwrap(), Instant::now());
        }
        let row = w.row(0).unwrap();
        assert_eq!(
            (row.owner.as_deref(), row.renewals),
            (Some(owner.id()), renewals),
            "the row is the dead owner's until the contender takes it"
        );
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "never taken over"
        );
        advance(Duration::from_millis(100)).await;
    }
    unreachable!()
}

/// Takeover: a member that dies is replaced only once the contender has seen
/// its row's `(generation, renewals)` unchanged for `gate_ttl + grace_ms` on
/// its own clock — never sooner, and at the first look after (SPEC §10.2).
#[tokio::test(start_paused = true)]
async fn a_dead_owners_shard_is_taken_only_after_gate_ttl_and_grace_unchanged() {
    let w = World::new();
    let a = w.member("a", 1, TTL).await;
    rounds(&[&a]).await;
    assert_eq!(serving(&a), vec![0]);
    let b = w.member("b", 1, TTL).await;
    rounds(&[&b]).await;
    assert!(serving(&b).is_empty());
    let (seen, taken) = die_and_wait(&w, &a, &b).await;
    assert_eq!(
        taken.duration_since(seen),
        TTL + GRACE,
        "taken at gate_ttl + grace after the row was first seen unchanged"
    );
    let row = w.row(0).unwrap();
    assert_eq!((row.generation, row.owner.as_deref()), (2, Some("b")));
    assert_eq!(generation(&b, 0), 2);
    assert_eq!(b.takeovers.load(Ordering::SeqCst), 1);
}

/// Takeover across `gate_ttl`s: an owner whose `gate_ttl` is longer than the
/// contender's writes it in its row (`ttl_ms`), and the contender waits the
/// owner's (the owner aborts what it has in flight that long after a send).
#[tokio::test(start_paused = true)]
async fn a_contender_waits_the_owners_longer_gate_ttl() {
    let long = Duration::from_secs(10);
    let w = World::new();
    let a = w.member("a", 1, long).await;
    rounds(&[&a]).await;
    assert_eq!(serving(&a), vec![0]);
    assert_eq!(w.row(0).unwrap().ttl_ms, Some(10_000));
    let b = w.member("b", 1, TTL).await;
    rounds(&[&b]).await;
    let (seen, taken) = die_and_wait(&w, &a, &b).await;
    assert_eq!(
        taken.duration_since(seen),
        long + GRACE,
        "the owner's gate_ttl counts when longer"
    );
    assert_eq!(w.row(0).unwrap().ttl_ms, Some(6_000), "b wrote its own");
}

/// A renewal sent on a connection that hangs (its backend stopped) costs no
/// window: after a fifth of `gate_ttl` a second goes beside it on another
/// connection, renews, and the shard's deadline moves as for any renewal.
#[tokio::test(start_paused = true)]
async fn a_renewal_on_a_hung_connection_is_hedged_by_a_second() {
    let w = World::new();
    let a = w.member("a", 1, TTL).await;
    rounds(&[&a]).await;
    assert_eq!(serving(&a), vec![0]);
    advance(Duration::from_secs(1)).await;
    anchor(&a).await;
    let before = w.row(0).unwrap().renewals;
    a.db.hung_renewals.store(1, Ordering::SeqCst);
    let sent = Instant::now();
    // Paused time: without the second renewal this would wait for ever.
    tokio::time::timeout(TTL, a.renew_round())
        .await
        .expect("the renewal answered, by its second");
    assert_eq!(
        sent.elapsed(),
        TTL / 5,
        "the second renewal went after a fifth of gate_ttl"
    );
    assert_eq!(
        w.row(0).unwrap().renewals,
        before + 1,
        "the hung one applied nothing, the second renewed"
    );
    let g = &a.by_shard[0];
    assert_eq!(a.forward_deadline(g), sent + TTL - MARGIN);
    assert_eq!(serving(&a), vec![0]);
}

/// Self-fencing: an owner cut off from the database forwards until
/// `gate_ttl − self_fence_margin` after its last successful renewal was *sent*
/// (not confirmed) and not a moment later; what is in flight is aborted at
/// `gate_ttl` after that send; a renewal whose outcome is unknown extends
/// nothing, though it committed.
#[tokio::test(start_paused = true)]
async fn an_owner_cut_off_stops_forwarding_at_ttl_minus_margin_after_the_send() {
    let w = World::new();
    let a = w.member("a", 1, TTL).await;
    rounds(&[&a]).await;
    let owner = Owner {
        shard: 0,
        generation: Generation::new(generation(&a, 0)),
    };
    assert_eq!(owner.generation, Generation::FIRST);
    assert!(a.may_forward(owner));
    let pass = w.admit(&a).await;
    let aborted: Arc<Mutex<Option<Instant>>> = Arc::default();
    let request = {
        let aborted = aborted.clone();
        tokio::spawn(async move {
            pass.aborted().await;
            *aborted.lock().unwrap() = Some(Instant::now());
        })
    };
    // A renewal answered 300 ms after its send.
    advance(Duration::from_secs(1)).await;
    anchor(&a).await;
    *a.db.latency.lock().unwrap() = Duration::from_millis(300);
    let sent = Instant::now();
    a.renew_round().await;
    assert_eq!(
        sent.elapsed(),
        Duration::from_millis(600),
        "the renewal and the beat, each answered 300 ms late"
    );
    *a.db.latency.lock().unwrap() = Duration::ZERO;
    let g = &a.by_shard[0];
    assert_eq!(a.forward_deadline(g), sent + TTL - MARGIN);
    assert_eq!(a.abort_deadline(g), sent + TTL);
    // A renewal that commits but whose answer is lost extends nothing.
    advance(Duration::from_secs(1)).await;
    a.db.unknown.store(true, Ordering::SeqCst);
    let before = w.row(0).unwrap().renewals;
    renew(&a).await;
    a.db.unknown.store(false, Ordering::SeqCst);
    assert_eq!(w.row(0).unwrap().renewals, before + 1, "it committed");
    assert_eq!(
        a.forward_deadline(g),
        sent + TTL - MARGIN,
        "extended nothing"
    );
    assert_eq!(a.abort_deadline(g), sent + TTL);
    // Then the database is down.
    a.db.down.store(true, Ordering::SeqCst);
    advance(Duration::from_secs(1)).await;
    renew(&a).await;
    look(&a).await;
    advance((sent + TTL - MARGIN - MS) - Instant::now()).await;
    settle().await;
    assert!(a.may_forward(owner), "still inside its window");
    assert_eq!(serving(&a), vec![0]);
    advance(MS).await;
    settle().await;
    assert!(!a.may_forward(owner), "forwarded past gate_ttl − margin");
    assert!(serving(&a).is_empty(), "the watcher stopped the shard");
    assert_eq!(stopping(&a, 0), 1, "its request still in flight");
    advance((sent + TTL - MS) - Instant::now()).await;
    settle().await;
    assert_eq!(*aborted.lock().unwrap(), None, "aborted before gate_ttl");
    advance(MS).await;
    settle().await;
    assert_eq!(
        *aborted.lock().unwrap(),
        Some(sent + TTL),
        "aborted at gate_ttl"
    );
    request.await.unwrap(); // the request ends: its pass is dropped
    settle().await;
    assert_eq!(stopping(&a, 0), 0);
}

/// Handover: a graceful leave releases every row (`released_generation`), and
/// the other member takes them at its next look, without waiting at all.
#[tokio::test(start_paused = true)]
async fn a_graceful_leave_hands_shards_over_at_the_next_look() {
    let w = World::new();
    let a = w.member("a", 2, TTL).await;
    rounds(&[&a]).await;
    advance(TTL / 3).await;
    rounds(&[&a]).await;
    assert_eq!(serving(&a), vec![0, 1]);
    let b = w.member("b", 2, TTL).await;
    rounds(&[&b]).await;
    assert!(serving(&b).is_empty());
    a.leave().await;
    assert!(serving(&a).is_empty());
    assert_eq!(a.handovers.load(Ordering::SeqCst), 2);
    for s in 0..2 {
        let row = w.row(s).unwrap();
        assert_eq!((row.owner, row.released_generation), (None, Some(1)));
    }
    let left = Instant::now();
    look(&b).await;
    assert_eq!(serving(&b), vec![0, 1], "taken at once after the release");
    assert_eq!(left.elapsed(), Duration::ZERO);
    assert_eq!(w.row(0).unwrap().generation, 2);
}

/// A row whose owner was cleared by hand (`owner = NULL` without a release:
/// no `released_generation`) is not free at once: it is watched like a live
/// row. The owner's next renewal finds it lost and stops at once.
#[tokio::test(start_paused = true)]
async fn a_row_cleared_by_hand_is_not_free_and_its_owner_finds_it_lost() {
    let w = World::new();
    let a = w.member("a", 1, TTL).await;
    rounds(&[&a]).await;
    advance(TTL / 3).await;
    rounds(&[&a]).await;
    assert_eq!(serving(&a), vec![0]);
    let b = w.member("b", 1, TTL).await;
    rounds(&[&b]).await;
    advance(Duration::from_millis(100)).await;
    {
        // UPDATE fencegate_owners SET owner = NULL, advertise = NULL
        let mut t = w.tables.lock().unwrap();
        let row = t.owners.get_mut(&0).unwrap();
        row.owner = None;
        row.advertise = None;
    }
    advance(Duration::from_millis(100)).await;
    look(&b).await;
    let seen_at = Instant::now();
    let seen = lock(&b.by_shard[0].seen).clone();
    assert!(!seen.row.as_ref().unwrap().released, "not a release");
    assert!(serving(&b).is_empty(), "not free at once");
    assert_eq!(seen.free_at(TTL, GRACE), Some(seen_at + TTL + GRACE));
    // The owner's next renewal: no row of its own any more.
    advance(Duration::from_millis(100)).await;
    renew(&a).await;
    assert!(serving(&a).is_empty(), "lost: stopped at once");
    assert_eq!(*lock(&a.by_shard[0].holding), None);
    assert_eq!(stopping(&a, 0), 0, "nothing left in flight");
    // The contender takes it once watched for gate_ttl + grace.
    loop {
        advance(Duration::from_millis(100)).await;
        if seen_at.elapsed().as_millis().is_multiple_of(1000) {
            renew(&b).await;
        }
        look(&b).await;
        if serving(&b) == vec![0] {
            break;
        }
        assert!(seen_at.elapsed() < TTL + GRACE, "not taken when free");
    }
    assert_eq!(seen_at.elapsed(), TTL + GRACE);
    assert_eq!(w.row(0).unwrap().owner.as_deref(), Some("b"));
}

/// A self-fenced owner whose renewal succeeds again starts a new tenure (a
/// new generation) only once the stopped tenure's requests have ended — here
/// aborted at `gate_ttl` after the last renewal sent before the cut — and
/// keeps renewing its row meanwhile.
#[tokio::test(start_paused = true)]
async fn a_self_fenced_owner_takes_its_row_again_after_the_stopped_tenures_requests() {
    let w = World::new();
    let a = w.member("a", 1, TTL).await;
    rounds(&[&a]).await;
    let pass = w.admit(&a).await;
    let request = tokio::spawn(async move {
        pass.aborted().await;
        // the request ends: its pass is dropped
    });
    advance(Duration::from_secs(1)).await;
    let sent = Instant::now();
    renew(&a).await;
    a.db.down.store(true, Ordering::SeqCst);
    advance(TTL - MARGIN).await;
    settle().await;
    assert!(serving(&a).is_empty(), "self-fenced");
    assert_eq!(stopping(&a, 0), 1);
    // The database is back: the renewal succeeds, the row is still a's.
    a.db.down.store(false, Ordering::SeqCst);
    advance(Duration::from_millis(500)).await;
    renew(&a).await;
    assert_eq!(w.row(0).unwrap().renewals, 2);
    assert!(a.by_shard[0].busy.load(Ordering::SeqCst), "a re-take waits");
    while Instant::now() < sent + TTL - MS {
        advance(Duration::from_millis(100).min(sent + TTL - MS - Instant::now())).await;
        settle().await;
        assert!(serving(&a).is_empty(), "served beside the stopped tenure");
        assert_eq!(w.row(0).unwrap().generation, 1, "taken before it ended");
    }
    renew(&a).await; // renewed meanwhile
    assert_eq!(w.row(0).unwrap().renewals, 3);
    advance(MS).await;
    settle().await;
    request.await.unwrap();
    settle().await;
    assert_eq!(stopping(&a, 0), 0);
    assert_eq!(Instant::now(), sent + TTL);
    assert_eq!(serving(&a), vec![0], "a new tenure once the old one ended");
    assert_eq!(generation(&a, 0), 2);
    assert_eq!(w.row(0).unwrap().generation, 2);
}

/// A renewal in flight when a graceful leave starts, answered while the
/// handover drains a request: the row must stay under the tenure whose
/// request is still in flight until that request has ended and the row is
/// released (SPEC §10.2: every state write of an owner is conditioned on its
/// generation; a handover lets what is in flight finish, then releases).
#[tokio::test(start_paused = true)]
async fn a_renewal_answered_during_a_graceful_leave_does_not_take_the_shard_again() {
    let w = World::new();
    let a = w.member("a", 1, TTL).await;
    rounds(&[&a]).await;
    assert_eq!(generation(&a, 0), 1);
    let pass = w.admit(&a).await;
    // The keeper's last renewal, sent as the server begins to stop: its
    // answer arrives 50 ms later.
    advance(Duration::from_secs(1)).await;
    anchor(&a).await;
    *a.db.latency.lock().unwrap() = Duration::from_millis(50);
    let renewal = {
        let c = a.c.clone();
        tokio::spawn(async move { c.renew_round().await })
    };
    tokio::task::yield_now().await;
    let start = Instant::now();
    let leave = {
        let c = a.c.clone();
        tokio::spawn(async move { c.leave().await })
    };
    // The request in flight is answered 80 ms into the handover's drain
    // (drain_timeout 100 ms); its outcome is written under generation 1.
    advance(Duration::from_millis(80)).await;
    settle().await;
    let at_answer = w.row(0).unwrap();
    drop(pass);
    renewal.await.unwrap();
    leave.await.unwrap();
    let end = w.row(0).unwrap();
    assert!(start.elapsed() >= Duration::from_millis(80));
    assert_eq!(
        at_answer.generation, 1,
        "the shard was taken again (generation {}) while its request was in flight: its outcome, written under generation 1, is refused",
        at_answer.generation
    );
    assert_eq!(
        (end.owner, end.released_generation),
        (None, Some(end.generation))
    );
}
