//! The embedded backend: marks and dedup records in sled under `data_dir`, made
//! durable by one [group commit](super::flusher) and vouched for by a
//! [witness](super::witness).
//!
//! Start-up refuses a store that cannot be opened, reports corruption, lost its
//! sentinel key, or is behind its witness — never a silent start from an empty
//! mark. A record's transitions are compare-and-swap on its key, so two
//! concurrent requests with one key cannot both forward.

use std::collections::{BinaryHeap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

use super::flusher::{mark_snapshot, Flusher, GroupCommit, COMMIT_SEQ};
use super::{
    codec, witness, Begun, CommitStats, End, Generation, LeaseMarks, ListCursor, Listing, Owner,
    Record, RecordKey, Resolution, Resolved, State, StateError, StateStore, TakeOver,
};
use crate::epoch::{Epoch, LeaseName};

const SENTINEL: &[u8] = b"fencegate-state-v1";
/// In sled's `meta` tree, per shard: the newest owner generation that wrote.
const OWNER_PREFIX: &[u8] = b"owner/";

/// sled's page cache unless `[state] cache_mb` says otherwise: what stays
/// resident of marks, dedup records and queued messages once read or written
/// (benches/README.md, "Queued delivery").
const CACHE_BYTES: u64 = 64 << 20;

/// The state in an embedded sled database under `data_dir` (one instance), with group
/// commit.
pub struct SledState {
    path: PathBuf,
    /// The database: the queue (SPEC §11) keeps its own trees in it.
    db: sled::Db,
    meta: sled::Tree,
    marks: sled::Tree,
    /// Per lease, the epoch its drains completed through (SPEC §5: a drain
    /// interrupted by a crash is not forgotten). Never above the mark; when it is
    /// lost or behind, a restart only settles longer, so it needs no flush of its own.
    drained: sled::Tree,
    dedup: sled::Tree,
    commit: Arc<GroupCommit>,
    /// Newest owner generation per shard (a leaf lock: nothing else is taken
    /// under it).
    owners: Mutex<HashMap<u32, u64>>,
}

fn write_err(e: sled::Error) -> StateError {
    StateError::Write(e.to_string())
}

/// `route \0 key`: records of one route are adjacent, ordered by key.
fn db_key(k: &RecordKey) -> Vec<u8> {
    let mut v = Vec::with_capacity(k.route.len() + 1 + k.key.len());
    v.extend_from_slice(k.route.as_bytes());
    v.push(0);
    v.extend_from_slice(k.key.as_bytes());
    v
}

fn record_key(raw: &[u8]) -> Option<RecordKey> {
    let at = raw.iter().position(|b| *b == 0)?;
    Some(RecordKey {
        route: String::from_utf8(raw[..at].to_vec()).ok()?,
        key: String::from_utf8(raw[at + 1..].to_vec()).ok()?,
    })
}

/// The epoch kept for `lease` in `tree` (0 when none).
fn epoch_in(tree: &sled::Tree, lease: &LeaseName) -> Result<Epoch, StateError> {
    let v = tree.get(lease.as_str()).map_err(write_err)?;
    Ok(v.and_then(|v| <[u8; 8]>::try_from(&v[..]).ok())
        .map(|b| Epoch::new(u64::from_be_bytes(b)))
        .unwrap_or(Epoch::NONE))
}

/// Raises the epoch kept for `lease` in `tree` to at least `epoch`.
fn raise_to(tree: &sled::Tree, lease: &LeaseName, epoch: Epoch) -> Result<(), StateError> {
    tree.fetch_and_update(lease.as_str(), |old| {
        let old = old
            .and_then(|v| <[u8; 8]>::try_from(v).ok())
            .map(u64::from_be_bytes)
            .unwrap_or(0);
        Some(old.max(epoch.get()).to_be_bytes().to_vec())
    })
    .map(drop)
    .map_err(write_err)
}

impl SledState {
    /// Opens (or creates) the state under `dir` and starts the flusher.
    pub fn open(dir: &Path) -> Result<Arc<SledState>, StateError> {
        SledState::open_with(dir, CACHE_BYTES)
    }

    /// [`SledState::open`] with a page cache of `cache_bytes`. One sequence:
    /// open, check every tree decodes (sled reports damage on first read),
    /// then start the flusher — nothing is served from a state not read whole.
    pub fn open_with(dir: &Path, cache_bytes: u64) -> Result<Arc<SledState>, StateError> {
        let path = dir.to_owned();
        let open_err = |detail: String| StateError::Open {
            path: path.clone(),
            detail,
        };
        // sled reports damage when it opens and also later, when it first reads a
        // damaged page (here, while the checks below read the trees).
        let sled_err = |e: sled::Error| {
            match e {
            sled::Error::Corruption { .. } => StateError::Damaged {
                path: path.clone(),
                detail: e.to_string(),
            },
            // sled's lock on its directory: say what it means, not "WouldBlock".
            // (sled wraps the lock's WouldBlock in an error of its own kind.)
            sled::Error::Io(io)
                if io.kind() == std::io::ErrorKind::WouldBlock
                    || io.to_string().contains("could not acquire lock") =>
            {
                open_err(
                "another fencegate process uses this data_dir (it holds the directory's lock); \
                 stop it, or give this instance its own data_dir"
                        .into(),
                )
            }
            other => open_err(other.to_string()),
        }
        };
        let damaged = |detail: String| StateError::Damaged {
            path: path.clone(),
            detail,
        };
        let existed = dir.join("db").exists() || dir.join("conf").exists();
        std::fs::create_dir_all(dir).map_err(|e| open_err(e.to_string()))?;
        let db = sled::Config::new()
            .path(dir)
            .flush_every_ms(Some(1000))
            // sled's default page cache is 1 GiB: a queue's backlog stayed
            // resident in it (~2.2 KiB per message).
            .cache_capacity(cache_bytes)
            .open()
            .map_err(sled_err)?;
        let meta = db.open_tree("meta").map_err(sled_err)?;
        let has_sentinel = meta.get(SENTINEL).map_err(sled_err)?.is_some();
        if existed && !has_sentinel {
            return Err(damaged(
                "sentinel key missing from an existing store".into(),
            ));
        }
        if !has_sentinel {
            meta.insert(SENTINEL, &b"1"[..]).map_err(sled_err)?;
            db.flush().map_err(sled_err)?;
        }
        let marks = db.open_tree("marks").map_err(sled_err)?;
        let dedup = db.open_tree("dedup").map_err(sled_err)?;
        let drained = db.open_tree("drained").map_err(sled_err)?;
        // Reading every mark once checks they decode before we serve.
        for item in marks.iter() {
            let (k, v) = item.map_err(|e| damaged(e.to_string()))?;
            if v.len() != 8 {
                return Err(damaged(format!(
                    "mark for {:?} has {} bytes",
                    String::from_utf8_lossy(&k),
                    v.len()
                )));
            }
        }
        let seq = match meta.get(COMMIT_SEQ).map_err(sled_err)? {
            None => 0,
            Some(v) => <[u8; 8]>::try_from(&v[..])
                .map(u64::from_be_bytes)
                .map_err(|_| damaged("the commit number in sled is not 8 bytes".into()))?,
        };
        let current = mark_snapshot(&marks).map_err(sled_err)?;
        match witness::read(dir).map_err(&damaged)? {
            // A new store, or one written before the witness existed.
            None if seq == 0 => {}
            None => {
                return Err(damaged(format!(
                    "sled has {seq} group commits but the witness files ({} and {}) are missing or empty",
                    witness::FILES[0],
                    witness::FILES[1]
                )))
            }
            Some(w) => {
                if seq < w.seq {
                    return Err(damaged(format!(
                        "sled lost committed writes: its last group commit is number {seq}, the witness says {}",
                        w.seq
                    )));
                }
                for (lease, mark) in &w.marks {
                    let in_sled = current
                        .iter()
                        .find(|(l, _)| l == lease)
                        .map_or(0, |(_, m)| *m);
                    if in_sled < *mark {
                        return Err(damaged(format!(
                            "sled lost the high-water mark of lease {:?}: it has {in_sled}, the witness says {mark}",
                            String::from_utf8_lossy(lease)
                        )));
                    }
                }
            }
        }
        let mut owners = HashMap::new();
        for item in meta.scan_prefix(OWNER_PREFIX) {
            let (k, v) = item.map_err(sled_err)?;
            let shard = <[u8; 4]>::try_from(&k[OWNER_PREFIX.len()..]).map(u32::from_be_bytes);
            let generation = <[u8; 8]>::try_from(&v[..]).map(u64::from_be_bytes);
            if let (Ok(s), Ok(g)) = (shard, generation) {
                owners.insert(s, g);
            }
        }
        let witness = witness::Writer::open(dir).map_err(|e| open_err(format!("witness: {e}")))?;
        witness
            .write(seq, &current)
            .map_err(|e| open_err(format!("writing the witness: {e}")))?;
        let data_file = File::open(dir.join("db"))
            .map_err(|e| open_err(format!("opening sled's data file: {e}")))?;
        let commit = GroupCommit::start(Flusher {
            db: db.clone(),
            meta: meta.clone(),
            marks: marks.clone(),
            data_file,
            witness,
            seq,
            marks_cache: None,
        })
        .map_err(|e| open_err(format!("starting the flusher: {e}")))?;
        Ok(Arc::new(SledState {
            path,
            db,
            meta,
            marks,
            drained,
            dedup,
            commit,
            owners: Mutex::new(owners),
        }))
    }

    /// Whether any dedup record of `route` is kept (route history, SPEC §11).
    pub fn holds_records_of(&self, route: &str) -> Result<bool, StateError> {
        let mut prefix = route.as_bytes().to_vec();
        prefix.push(0);
        Ok(self
            .dedup
            .scan_prefix(prefix)
            .next()
            .transpose()
            .map_err(write_err)?
            .is_some())
    }

    /// The sled database, for the queue's trees (made durable by the same
    /// group commit, [`SledState::commit`]).
    pub fn db(&self) -> &sled::Db {
        &self.db
    }

    /// The database's directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Waits until every write made before this call is durable (group commit).
    pub async fn commit(&self) -> Result<(), StateError> {
        self.commit.commit().await
    }

    /// Writes a record without waiting for it to be durable (tools and benches
    /// that fill a store, then [`SledState::commit`] once).
    pub fn put_record(&self, key: &RecordKey, record: &Record) -> Result<(), StateError> {
        self.dedup
            .insert(db_key(key), codec::encode(record))
            .map(drop)
            .map_err(write_err)
    }

    /// Refuses a write of an owner generation older than the shard's newest.
    fn check_owner(&self, owner: Owner) -> Result<(), StateError> {
        let mut owners = self.owners.lock().unwrap_or_else(|p| p.into_inner());
        let stored = owners.entry(owner.shard).or_insert(0);
        let generation = owner.generation.get();
        if generation < *stored {
            return Err(StateError::OwnerLost {
                ours: owner,
                stored: Generation::new(*stored),
            });
        }
        if generation > *stored {
            *stored = generation;
            let mut k = OWNER_PREFIX.to_vec();
            k.extend_from_slice(&owner.shard.to_be_bytes());
            self.meta
                .insert(k, &generation.to_be_bytes()[..])
                .map_err(write_err)?;
        }
        Ok(())
    }

    /// The `in_flight` record is written: makes it durable before the forward.
    async fn claimed(&self) -> Result<Begun, StateError> {
        crate::failpoint::hit("dedup_in_flight_written");
        // Not durable: do not forward. The record stays in flight; it turns in
        // doubt at the next start-up if it did reach the disk.
        self.commit.commit().await?;
        crate::failpoint::hit("dedup_in_flight_flushed");
        Ok(Begun::Claimed)
    }
}

/// In sled's `meta` tree: the state's generation and the generation at which
/// a restore of it was last found (each u64, big-endian), and the set-up the
/// `data_dir` belongs to (JSON) — [`super::identity`], SPEC §10.
const GENERATION: &[u8] = b"state_generation";
const RESTORED: &[u8] = b"state_restored";
const SET_UP: &[u8] = b"set_up";

fn u64_at(meta: &sled::Tree, key: &[u8]) -> Result<u64, StateError> {
    Ok(meta
        .get(key)
        .map_err(write_err)?
        .and_then(|v| <[u8; 8]>::try_from(v.as_ref()).ok())
        .map_or(0, u64::from_be_bytes))
}

#[async_trait]
impl super::identity::Generations for SledState {
    async fn recorded(&self) -> Result<super::identity::Recorded, StateError> {
        Ok(super::identity::Recorded {
            generation: u64_at(&self.meta, GENERATION)?,
            restored: u64_at(&self.meta, RESTORED)?,
        })
    }

    async fn advance(
        &self,
        seen: u64,
        found: bool,
    ) -> Result<super::identity::Recorded, StateError> {
        // One transaction: a renewal's raise in the background and a
        // checkpoint's may run at once.
        let read = |v: Option<sled::IVec>| {
            v.and_then(|v| <[u8; 8]>::try_from(v.as_ref()).ok())
                .map_or(0, u64::from_be_bytes)
        };
        let (generation, restored) = self
            .meta
            .transaction(|tx| {
                let generation = read(tx.get(GENERATION)?).max(seen).saturating_add(1);
                tx.insert(GENERATION, &generation.to_be_bytes()[..])?;
                let mut restored = read(tx.get(RESTORED)?);
                if found && restored <= seen {
                    restored = generation;
                    tx.insert(RESTORED, &restored.to_be_bytes()[..])?;
                }
                Ok::<_, sled::transaction::ConflictableTransactionError<()>>((generation, restored))
            })
            .map_err(|e| StateError::Write(format!("the state's generation: {e:?}")))?;
        self.commit().await?;
        Ok(super::identity::Recorded {
            generation,
            restored,
        })
    }
}

impl SledState {
    /// The set-up this `data_dir` was recorded under (SPEC §10), as JSON.
    pub fn set_up_record(&self) -> Result<Option<Vec<u8>>, StateError> {
        Ok(self
            .meta
            .get(SET_UP)
            .map_err(write_err)?
            .map(|v| v.to_vec()))
    }

    /// Records the set-up this `data_dir` belongs to; durable on return.
    pub async fn record_set_up(&self, json: &[u8]) -> Result<(), StateError> {
        self.meta.insert(SET_UP, json).map_err(write_err)?;
        self.commit().await
    }

    /// Whether any mark, dedup record or queued message is kept: state that
    /// some set-up wrote.
    pub fn holds_records(&self) -> Result<bool, StateError> {
        for tree in ["marks", "dedup", "queue"] {
            let t = self.db.open_tree(tree).map_err(write_err)?;
            if t.first().map_err(write_err)?.is_some() {
                return Ok(true);
            }
        }
        Ok(false)
    }
}

#[async_trait]
impl StateStore for SledState {
    async fn marks(&self, lease: &LeaseName) -> Result<LeaseMarks, StateError> {
        let mark = epoch_in(&self.marks, lease)?;
        Ok(LeaseMarks {
            mark,
            drained: epoch_in(&self.drained, lease)?.min(mark),
        })
    }

    async fn raise_mark(
        &self,
        owner: Owner,
        lease: &LeaseName,
        epoch: Epoch,
    ) -> Result<(), StateError> {
        self.check_owner(owner)?;
        raise_to(&self.marks, lease, epoch)?;
        // After the write: a flusher that sees this version reads this mark.
        self.commit.marks_changed();
        crate::failpoint::hit("mark_written_before_flush");
        self.commit.commit().await?;
        crate::failpoint::hit("mark_flushed");
        Ok(())
    }

    async fn claim_shard(&self, owner: Owner) -> Result<(), StateError> {
        self.check_owner(owner)?;
        self.commit.commit().await
    }

    async fn note_drained(
        &self,
        owner: Owner,
        lease: &LeaseName,
        epoch: Epoch,
    ) -> Result<(), StateError> {
        self.check_owner(owner)?;
        raise_to(&self.drained, lease, epoch)
    }

    async fn begin(
        &self,
        owner: Owner,
        key: &RecordKey,
        fresh: &Record,
        rules: TakeOver,
    ) -> Result<Begun, StateError> {
        self.check_owner(owner)?;
        let k = db_key(key);
        // Most keys are new: claim them with one compare-and-swap from "absent"
        // instead of a read and then a swap (each walks sled's tree). A key that
        // exists comes back with its current value and takes the general path.
        let mut current = match self
            .dedup
            .compare_and_swap(&k, None::<&[u8]>, Some(codec::encode(fresh)))
            .map_err(write_err)?
        {
            Ok(()) => return self.claimed().await,
            Err(e) => e.current,
        };
        loop {
            let existing = current.as_ref().and_then(|v| codec::decode(v));
            let write = match &existing {
                // An undecodable record is treated as absent.
                None => fresh.clone(),
                Some(rec) => match rec.taken_over_by(fresh, &rules) {
                    Some(r) => r,
                    None => return Ok(Begun::Exists(rec.clone())),
                },
            };
            match self
                .dedup
                .compare_and_swap(&k, current.as_ref(), Some(codec::encode(&write)))
                .map_err(write_err)?
            {
                Ok(()) => return self.claimed().await,
                // Raced with another request of this key: look again.
                Err(e) => current = e.current,
            }
        }
    }

    async fn finish(&self, owner: Owner, key: &RecordKey, end: End) -> Result<(), StateError> {
        self.check_owner(owner)?;
        let k = db_key(key);
        // Only the outcome is written, and only over the key's `in_flight`
        // record: the rest stays as the claim wrote it — a resend's claim keeps
        // the first claim's creation time (`Record::taken_over_by`), which the
        // resend's own ticket does not know. As PostgreSQL does.
        let (state, updated_ms, response) = match end {
            End::Delete => (None, 0, None),
            End::InDoubt(r) => (Some(State::InDoubt), r.updated_ms, None),
            End::Done(r) => (Some(State::Done), r.updated_ms, r.response),
        };
        let mut current = self.dedup.get(&k).map_err(write_err)?;
        loop {
            let claim = current
                .as_ref()
                .and_then(|v| codec::decode(v))
                .filter(|r| r.state == State::InFlight);
            let Some(claim) = claim else {
                return Err(StateError::Write(
                    "the key's record is no longer this request's in-flight record".into(),
                ));
            };
            let new = state.map(|state| {
                codec::encode(&Record {
                    state,
                    updated_ms,
                    response: response.clone(),
                    ..claim
                })
            });
            match self
                .dedup
                .compare_and_swap(&k, current.as_ref(), new)
                .map_err(write_err)?
            {
                Ok(()) => break,
                Err(e) => current = e.current,
            }
        }
        // Only `done` is awaited as durable: a crash before an unknown outcome or
        // a delete is flushed leaves `in_flight`, which start-up turns into
        // `in_doubt` anyway.
        if state == Some(State::Done) {
            self.commit.commit().await?;
            crate::failpoint::hit("dedup_done_flushed");
        }
        Ok(())
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StateError> {
        let v = self.dedup.get(db_key(key)).map_err(write_err)?;
        Ok(v.and_then(|v| codec::decode(&v)))
    }

    async fn resolve(
        &self,
        owner: Owner,
        key: &RecordKey,
        how: Resolution,
        now_ms: u64,
    ) -> Result<Resolved, StateError> {
        self.check_owner(owner)?;
        let k = db_key(key);
        let current = self.dedup.get(&k).map_err(write_err)?;
        let Some(rec) = current.as_ref().and_then(|v| codec::decode(v)) else {
            return Ok(Resolved::Missing);
        };
        if rec.state != State::InDoubt {
            return Ok(Resolved::NotInDoubt(rec.state));
        }
        let new = match how {
            Resolution::NotDelivered => None,
            Resolution::Delivered => Some(codec::encode(&rec.delivered(now_ms))),
        };
        if self
            .dedup
            .compare_and_swap(&k, current, new)
            .map_err(write_err)?
            .is_err()
        {
            // Changed under us: a resend claimed it.
            return Ok(Resolved::NotInDoubt(State::InFlight));
        }
        self.commit.commit().await?;
        Ok(match how {
            Resolution::Delivered => Resolved::Done,
            Resolution::NotDelivered => Resolved::Deleted,
        })
    }

    async fn list(
        &self,
        state: State,
        route: Option<&str>,
        after: Option<&ListCursor>,
        limit: usize,
    ) -> Result<Listing, StateError> {
        let prefix = route.map(|r| {
            let mut p = r.as_bytes().to_vec();
            p.push(0);
            p
        });
        // `route \0 key` orders as (route, key) does: 0 sorts below every byte
        // of a route name.
        let after = after.map(|a| (a.created_ms, db_key(&a.key)));
        // Oldest first needs every record of the state: one scan that peeks at
        // state and age, keeping the `limit` oldest past `after` in a heap. Off
        // the runtime's threads.
        let tree = self.dedup.clone();
        tokio::task::spawn_blocking(move || {
            let mut total = 0u64;
            let mut heap: BinaryHeap<(u64, sled::IVec, sled::IVec)> = BinaryHeap::new();
            let items = match &prefix {
                Some(p) => tree.scan_prefix(p),
                None => tree.iter(),
            };
            for item in items {
                let (k, v) = item.map_err(write_err)?;
                let Some((s, created)) = codec::peek(&v) else {
                    continue;
                };
                if s != state {
                    continue;
                }
                total += 1;
                if limit == 0
                    || after
                        .as_ref()
                        .is_some_and(|(ms, key)| (created, &k[..]) <= (*ms, &key[..]))
                {
                    continue;
                }
                if heap.len() < limit {
                    heap.push((created, k, v));
                } else if heap
                    .peek()
                    .is_some_and(|(ms, key, _)| (created, &k[..]) < (*ms, &key[..]))
                {
                    heap.pop();
                    heap.push((created, k, v));
                }
            }
            let records = heap
                .into_sorted_vec()
                .into_iter()
                .filter_map(|(_, k, v)| Some((record_key(&k)?, codec::decode(&v)?)))
                .collect();
            Ok(Listing { records, total })
        })
        .await
        .map_err(|e| StateError::Write(format!("the listing stopped: {e}")))?
    }

    async fn sweep(&self, rules: TakeOver) -> Result<usize, StateError> {
        // A full scan: off the runtime's threads.
        let tree = self.dedup.clone();
        tokio::task::spawn_blocking(move || {
            let mut n = 0;
            for item in tree.iter() {
                let (k, v) = item.map_err(write_err)?;
                let expired = codec::decode(&v).is_none_or(|r| r.expired(&rules));
                if expired
                    && tree
                        .compare_and_swap(&k, Some(v), None::<&[u8]>)
                        .is_ok_and(|r| r.is_ok())
                {
                    n += 1;
                }
            }
            Ok(n)
        })
        .await
        .map_err(|e| StateError::Write(format!("the sweep stopped: {e}")))?
    }

    async fn recover(&self, owner: Owner, now_ms: u64) -> Result<usize, StateError> {
        self.check_owner(owner)?;
        let mut n = 0;
        for item in self.dedup.iter() {
            let (k, v) = item.map_err(write_err)?;
            if let Some(mut r) = codec::decode(&v) {
                if r.state == State::InFlight {
                    r.state = State::InDoubt;
                    r.updated_ms = now_ms;
                    self.dedup.insert(k, codec::encode(&r)).map_err(write_err)?;
                    n += 1;
                }
            }
        }
        if n > 0 {
            self.commit.commit().await?;
        }
        Ok(n)
    }

    fn is_healthy(&self) -> bool {
        self.commit.is_healthy()
    }

    async fn check(&self) -> Result<(), StateError> {
        if self.commit.is_healthy() {
            Ok(())
        } else {
            Err(StateError::Write("the last flush failed".into()))
        }
    }

    fn stats(&self) -> CommitStats {
        self.commit.stats()
    }

    async fn close(&self) -> Result<(), StateError> {
        self.commit.close().await
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::state::witness;

    /// Opens the state in `dir` once an earlier handle's sled has let go of the
    /// directory's lock: sled's own background flusher keeps it for up to its
    /// flush interval after the last handle is dropped. (A restarted process never
    /// waits: the old one's exit released it.) Reopening at once failed under load.
    pub(crate) async fn open_when_free(dir: &Path) -> Result<Arc<SledState>, StateError> {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            match SledState::open(dir) {
                Err(StateError::Open { detail, .. })
                    if detail.contains("another fencegate process")
                        && tokio::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await
                }
                r => return r,
            }
        }
    }

    /// Opens the state in `dir`, raises `lease`'s mark to `epoch`, closes it.
    async fn raise_and_close(dir: &Path, lease: &LeaseName, epoch: u64) {
        let d = open_when_free(dir).await.unwrap();
        d.raise_mark(Owner::SINGLE, lease, Epoch::new(epoch))
            .await
            .unwrap();
        d.close().await.unwrap();
    }

    /// The flusher reads the marks only when they changed; a raise after a commit
    /// that used the cached copy still reaches the witness, and commits without a
    /// raise carry the marks along.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_witness_follows_every_raise() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (
            LeaseName::parse("a").unwrap(),
            LeaseName::parse("b").unwrap(),
        );
        let d = open_when_free(dir.path()).await.unwrap();
        let witnessed = || {
            let w = witness::read(dir.path()).unwrap().unwrap();
            (w.seq, w.marks)
        };
        d.raise_mark(Owner::SINGLE, &a, Epoch::new(5))
            .await
            .unwrap();
        d.commit().await.unwrap();
        d.commit().await.unwrap();
        let (seq1, marks) = witnessed();
        assert_eq!(marks, vec![(b"a".to_vec(), 5)]);
        d.raise_mark(Owner::SINGLE, &b, Epoch::new(2))
            .await
            .unwrap();
        d.raise_mark(Owner::SINGLE, &a, Epoch::new(9))
            .await
            .unwrap();
        let (seq2, marks) = witnessed();
        assert!(seq2 > seq1);
        assert_eq!(marks, vec![(b"a".to_vec(), 9), (b"b".to_vec(), 2)]);
        d.commit().await.unwrap();
        assert_eq!(witnessed().1, marks);
        d.close().await.unwrap();
    }

    /// A write under an older owner generation than the shard's newest is
    /// refused, and the newest generation survives a reopen.
    #[tokio::test]
    async fn a_write_of_a_superseded_owner_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let lease = LeaseName::parse("l").unwrap();
        let gen = |generation| Owner {
            shard: 3,
            generation: Generation::new(generation),
        };
        {
            let d = open_when_free(dir.path()).await.unwrap();
            d.raise_mark(gen(5), &lease, Epoch::new(1)).await.unwrap();
            let r = d.raise_mark(gen(4), &lease, Epoch::new(2)).await;
            assert!(
                matches!(r, Err(StateError::OwnerLost { stored, .. }) if stored == Generation::new(5)),
                "{r:?}"
            );
            // Another shard has its own generation.
            d.raise_mark(
                Owner {
                    shard: 1,
                    generation: Generation::SINGLE,
                },
                &lease,
                Epoch::new(1),
            )
            .await
            .unwrap();
            d.close().await.unwrap();
        }
        let d = open_when_free(dir.path()).await.unwrap();
        assert!(d.note_drained(gen(4), &lease, Epoch::new(1)).await.is_err());
        assert_eq!(d.marks(&lease).await.unwrap().mark, Epoch::new(1));
        d.close().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn marks_survive_reopen_and_batches_form() {
        let dir = tempfile::tempdir().unwrap();
        let lease = LeaseName::parse("l").unwrap();
        {
            let d = open_when_free(dir.path()).await.unwrap();
            assert_eq!(d.marks(&lease).await.unwrap().mark, Epoch::NONE);
            d.raise_mark(Owner::SINGLE, &lease, Epoch::new(5))
                .await
                .unwrap();
            d.raise_mark(Owner::SINGLE, &lease, Epoch::new(3))
                .await
                .unwrap(); // never lowers
            let mut tasks = Vec::new();
            for _ in 0..64 {
                let d = d.clone();
                tasks.push(tokio::spawn(async move { d.commit().await }));
            }
            for t in tasks {
                t.await.unwrap().unwrap();
            }
            let s = d.stats();
            assert!(s.batches < 66, "{s:?}");
            d.close().await.unwrap();
        }
        let d = open_when_free(dir.path()).await.unwrap();
        assert_eq!(d.marks(&lease).await.unwrap().mark, Epoch::new(5));
    }
    /// Copies sled's own files (everything but the witness) from `from` to `to`.
    fn copy_sled_files(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().into_string().unwrap();
            if e.path().is_file() && !witness::FILES.contains(&name.as_str()) {
                std::fs::copy(e.path(), to.join(&name)).unwrap();
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sled_behind_its_witness_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let old = tempfile::tempdir().unwrap();
        let lease = LeaseName::parse("l").unwrap();
        raise_and_close(dir.path(), &lease, 3).await;
        copy_sled_files(dir.path(), old.path());
        raise_and_close(dir.path(), &lease, 9).await;
        // sled's files roll back to mark 3 (as a silently dropped log tail would);
        // the witness remembers 9.
        copy_sled_files(old.path(), dir.path());
        match open_when_free(dir.path()).await {
            Err(StateError::Damaged { detail, .. }) => {
                assert!(detail.contains("lost"), "{detail}")
            }
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("opened a sled that lost mark 9"),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_witness_must_exist_and_one_damaged_slot_is_survivable() {
        let dir = tempfile::tempdir().unwrap();
        let lease = LeaseName::parse("l").unwrap();
        raise_and_close(dir.path(), &lease, 4).await;
        let slots: Vec<Vec<u8>> = witness::FILES
            .iter()
            .map(|f| std::fs::read(dir.path().join(f)).unwrap())
            .collect();
        let newest = (0..2)
            .max_by_key(|&i| witness::decode(&slots[i]).unwrap().seq)
            .unwrap();
        // Both gone: refused.
        for f in witness::FILES {
            std::fs::remove_file(dir.path().join(f)).unwrap();
        }
        assert!(matches!(
            open_when_free(dir.path()).await,
            Err(StateError::Damaged { .. })
        ));
        // The newest slot torn: the other one (one commit older) still vouches.
        for (i, f) in witness::FILES.iter().enumerate() {
            let mut b = slots[i].clone();
            if i == newest {
                let mid = b.len() / 2;
                b[mid] ^= 0x40;
            }
            std::fs::write(dir.path().join(f), b).unwrap();
        }
        let d = open_when_free(dir.path()).await.unwrap();
        assert_eq!(d.marks(&lease).await.unwrap().mark, Epoch::new(4));
        d.close().await.unwrap();
        drop(d);
        // Both damaged: refused.
        for f in witness::FILES {
            std::fs::write(dir.path().join(f), b"not a witness").unwrap();
        }
        assert!(matches!(
            open_when_free(dir.path()).await,
            Err(StateError::Damaged { .. })
        ));
    }
}
