//! fencegate's durable state in sled: the high-water mark of every lease and the
//! dedup records, sharing one durability path — a group commit.
//!
//! One flusher thread owns durability. A writer inserts (cheap, in memory), notes a
//! write sequence number, and awaits the first flush that started after its
//! insert. Each flush is sled's `flush()` (which ends in `sync_file_range` on
//! Linux: enough for a killed process, not for power loss) followed by an
//! `fdatasync` of sled's data file, once per batch. sled 0.34's `flush_async()`
//! hangs when several tasks await it at once (sled#1308), hence the thread.
//!
//! Start-up refuses a store that cannot be opened, reports corruption, or lost
//! its sentinel key — never a silent start from an empty mark.
//!
//! sled alone cannot promise that: on recovery it treats the first message that
//! fails its checksum as a torn write and silently drops it and everything after
//! it, so one flipped byte in the middle of `db` reopens with older marks, or none
//! (measured: tests/it/disk.rs). Hence the *witness*, a small checksummed record
//! kept outside sled: the number of the last group commit and every mark as of
//! that commit. Each commit stores its number in sled, flushes, and only then
//! rewrites the witness, so sled is never behind a witness it wrote; at start-up a
//! sled that is behind its witness (an older commit number, or a lower mark) has
//! lost committed writes and is refused. The witness alternates between two files,
//! so a write torn by a power loss leaves the other, one commit older, intact. It
//! is not synced itself: after a power loss it may lag sled, never lead it.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use tokio::sync::oneshot;

use crate::epoch::{Epoch, LeaseName};

#[derive(Debug, Clone, thiserror::Error)]
pub enum DurableError {
    #[error("cannot open durable state in {path}: {detail}")]
    Open { path: PathBuf, detail: String },
    #[error("durable state in {path} is damaged ({detail}); refusing to start from an empty high-water mark. Restore the directory from a backup or, if every lease's epochs are known to be safe, move it aside")]
    Damaged { path: PathBuf, detail: String },
    #[error("durable write failed: {0}")]
    Write(String),
}

const SENTINEL: &[u8] = b"fencegate-state-v1";
/// In sled's `meta` tree: the number of the last group commit (u64, big-endian).
const COMMIT_SEQ: &[u8] = b"commit-seq";

/// A commit waiting for the flush that covers its write sequence number.
struct Waiter {
    seq: u64,
    done: oneshot::Sender<Result<(), Arc<str>>>,
}

/// Shared by writers and the flusher, under one lock.
#[derive(Default)]
struct Requests {
    requested: u64,
    stop: bool,
    /// Every write with sequence ≤ this is durable.
    through: u64,
    /// Every write with sequence ≤ this (and > `through`) failed to become durable.
    failed_through: u64,
    last_error: Option<Arc<str>>,
    /// Commits not yet covered by a flush. A flush wakes only the ones it covers,
    /// not every waiter (which cost a poll of each waiting request per flush).
    waiters: Vec<Waiter>,
    /// The flusher is waiting for `wake` (only then does a commit notify it).
    idle: bool,
    /// The flusher has stopped: commits fail instead of waiting forever.
    exited: bool,
}

struct GroupCommit {
    written: AtomicU64,
    /// Bumped after every change to the marks tree, so that the flusher reads the
    /// marks (for the witness) only when they changed: with 10,000 leases reading
    /// them made every group commit cost 6.5 ms instead of 0.5.
    marks_version: AtomicU64,
    requests: Mutex<Requests>,
    wake: Condvar,
    batches: AtomicU64,
    records: AtomicU64,
    healthy: AtomicBool,
}

/// Flush statistics, for metrics and benches.
#[derive(Debug, Clone, Copy, Default)]
pub struct CommitStats {
    pub batches: u64,
    pub records: u64,
}

pub struct Durable {
    path: PathBuf,
    db: sled::Db,
    marks: sled::Tree,
    /// Per lease, the epoch its drains completed through (SPEC §5: a drain
    /// interrupted by a crash is not forgotten). Never above the mark; when it is
    /// lost or behind, a restart only settles longer, so it needs no flush of its own.
    drained: sled::Tree,
    dedup: sled::Tree,
    commit: Arc<GroupCommit>,
    flusher: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Durable {
    /// Opens (or creates) the state under `dir` and starts the flusher.
    pub fn open(dir: &Path) -> Result<Arc<Durable>, DurableError> {
        let path = dir.to_owned();
        let open_err = |detail: String| DurableError::Open {
            path: path.clone(),
            detail,
        };
        // sled reports damage when it opens and also later, when it first reads a
        // damaged page (here, while the checks below read the trees).
        let sled_err = |e: sled::Error| match e {
            sled::Error::Corruption { .. } => DurableError::Damaged {
                path: path.clone(),
                detail: e.to_string(),
            },
            other => open_err(other.to_string()),
        };
        let existed = dir.join("db").exists() || dir.join("conf").exists();
        std::fs::create_dir_all(dir).map_err(|e| open_err(e.to_string()))?;
        let db = sled::Config::new()
            .path(dir)
            .flush_every_ms(Some(1000))
            .open()
            .map_err(sled_err)?;
        let meta = db.open_tree("meta").map_err(sled_err)?;
        let has_sentinel = meta.get(SENTINEL).map_err(sled_err)?.is_some();
        if existed && !has_sentinel {
            return Err(DurableError::Damaged {
                path,
                detail: "sentinel key missing from an existing store".into(),
            });
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
            let (k, v) = item.map_err(|e| DurableError::Damaged {
                path: path.clone(),
                detail: e.to_string(),
            })?;
            if v.len() != 8 {
                return Err(DurableError::Damaged {
                    path,
                    detail: format!(
                        "mark for {:?} has {} bytes",
                        String::from_utf8_lossy(&k),
                        v.len()
                    ),
                });
            }
        }
        let damaged = |detail: String| DurableError::Damaged {
            path: path.clone(),
            detail,
        };
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
        let witness = witness::Writer::open(dir).map_err(|e| open_err(format!("witness: {e}")))?;
        witness
            .write(seq, &current)
            .map_err(|e| open_err(format!("writing the witness: {e}")))?;
        let data_file = File::open(dir.join("db"))
            .map_err(|e| open_err(format!("opening sled's data file: {e}")))?;
        let commit = Arc::new(GroupCommit {
            written: AtomicU64::new(0),
            requests: Mutex::new(Requests::default()),
            wake: Condvar::new(),
            batches: AtomicU64::new(0),
            records: AtomicU64::new(0),
            healthy: AtomicBool::new(true),
            marks_version: AtomicU64::new(0),
        });
        let flusher = {
            let durable = Flusher {
                db: db.clone(),
                meta,
                marks: marks.clone(),
                data_file,
                witness,
                seq,
                marks_cache: None,
            };
            let commit = commit.clone();
            std::thread::Builder::new()
                .name("fencegate-flusher".into())
                .spawn(move || flusher_loop(durable, commit))
                .map_err(|e| open_err(format!("starting the flusher: {e}")))?
        };
        Ok(Arc::new(Durable {
            path,
            db,
            marks,
            drained,
            dedup,
            commit,
            flusher: Mutex::new(Some(flusher)),
        }))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The dedup tree (records are owned by `dedup`).
    pub fn dedup_tree(&self) -> &sled::Tree {
        &self.dedup
    }

    /// The durable high-water mark of `lease` (0 when none).
    pub fn mark(&self, lease: &LeaseName) -> Result<Epoch, DurableError> {
        epoch_in(&self.marks, lease)
    }

    /// The epoch `lease`'s drains completed through (0 when none recorded), never
    /// above its mark.
    pub fn drained(&self, lease: &LeaseName) -> Result<Epoch, DurableError> {
        Ok(epoch_in(&self.drained, lease)?.min(self.mark(lease)?))
    }

    /// Records that a drain of `lease` completed through `epoch`. Not flushed here:
    /// the next group commit (or sled's own flusher) takes it along, and a record
    /// lost in a crash only makes the restart settle (module doc of `gate`).
    pub fn note_drained(&self, lease: &LeaseName, epoch: Epoch) -> Result<(), DurableError> {
        raise_to(&self.drained, lease, epoch)
    }

    /// Every lease with a mark.
    pub fn marks(&self) -> Vec<(String, Epoch)> {
        self.marks
            .iter()
            .filter_map(Result::ok)
            .filter_map(|(k, v)| {
                let b = <[u8; 8]>::try_from(&v[..]).ok()?;
                Some((
                    String::from_utf8_lossy(&k).into_owned(),
                    Epoch::new(u64::from_be_bytes(b)),
                ))
            })
            .collect()
    }

    /// Raises the mark of `lease` to at least `epoch` and waits until it is durable.
    pub async fn raise_mark(&self, lease: &LeaseName, epoch: Epoch) -> Result<(), DurableError> {
        raise_to(&self.marks, lease, epoch)?;
        // After the write: a flusher that sees this version reads this mark.
        self.commit.marks_version.fetch_add(1, Ordering::SeqCst);
        crate::failpoint::hit("mark_written_before_flush");
        self.commit().await?;
        crate::failpoint::hit("mark_flushed");
        Ok(())
    }

    /// Waits until every write made before this call is durable (group commit).
    pub async fn commit(&self) -> Result<(), DurableError> {
        let seq = self.commit.written.fetch_add(1, Ordering::SeqCst) + 1;
        let done = {
            let mut r = self
                .commit
                .requests
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if r.through >= seq {
                return Ok(());
            }
            if r.failed_through >= seq {
                return Err(DurableError::Write(
                    r.last_error.as_deref().unwrap_or("flush failed").to_owned(),
                ));
            }
            if r.exited {
                return Err(DurableError::Write("the flusher has stopped".into()));
            }
            if r.requested < seq {
                r.requested = seq;
            }
            let (tx, rx) = oneshot::channel();
            r.waiters.push(Waiter { seq, done: tx });
            if r.idle {
                self.commit.wake.notify_one();
            }
            rx
        };
        match done.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(DurableError::Write(e.to_string())),
            Err(_) => Err(DurableError::Write("the flusher has stopped".into())),
        }
    }

    pub fn stats(&self) -> CommitStats {
        CommitStats {
            batches: self.commit.batches.load(Ordering::Relaxed),
            records: self.commit.records.load(Ordering::Relaxed),
        }
    }

    /// Whether the last flush succeeded (readiness).
    pub fn is_healthy(&self) -> bool {
        self.commit.healthy.load(Ordering::Relaxed)
    }

    /// Flushes everything and stops the flusher (shutdown).
    pub async fn close(&self) -> Result<(), DurableError> {
        let res = self.commit().await;
        {
            let mut r = self
                .commit
                .requests
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            r.stop = true;
            self.commit.wake.notify_one();
        }
        let handle = self
            .flusher
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(h) = handle {
            let _ = tokio::task::spawn_blocking(move || h.join()).await;
        }
        res
    }

    /// sled's own handle (benches, admin).
    pub fn db(&self) -> &sled::Db {
        &self.db
    }
}

/// The epoch kept for `lease` in `tree` (0 when none).
fn epoch_in(tree: &sled::Tree, lease: &LeaseName) -> Result<Epoch, DurableError> {
    let v = tree
        .get(lease.as_str())
        .map_err(|e| DurableError::Write(e.to_string()))?;
    Ok(v.and_then(|v| <[u8; 8]>::try_from(&v[..]).ok())
        .map(|b| Epoch::new(u64::from_be_bytes(b)))
        .unwrap_or(Epoch::NONE))
}

/// Raises the epoch kept for `lease` in `tree` to at least `epoch`.
fn raise_to(tree: &sled::Tree, lease: &LeaseName, epoch: Epoch) -> Result<(), DurableError> {
    tree.fetch_and_update(lease.as_str(), |old| {
        let old = old
            .and_then(|v| <[u8; 8]>::try_from(v).ok())
            .map(u64::from_be_bytes)
            .unwrap_or(0);
        Some(old.max(epoch.get()).to_be_bytes().to_vec())
    })
    .map(drop)
    .map_err(|e| DurableError::Write(e.to_string()))
}

/// Every mark, as (lease, epoch): what the witness records.
type Marks = Vec<(Vec<u8>, u64)>;

fn mark_snapshot(marks: &sled::Tree) -> Result<Marks, sled::Error> {
    marks
        .iter()
        .filter_map(|item| match item {
            Ok((k, v)) => <[u8; 8]>::try_from(&v[..])
                .ok()
                .map(|b| Ok((k.to_vec(), u64::from_be_bytes(b)))),
            Err(e) => Some(Err(e)),
        })
        .collect()
}

/// What the flusher thread owns.
struct Flusher {
    db: sled::Db,
    meta: sled::Tree,
    marks: sled::Tree,
    data_file: File,
    witness: witness::Writer,
    /// The number of the last group commit.
    seq: u64,
    /// The marks as last read, with the `marks_version` read before reading them.
    marks_cache: Option<(u64, Marks)>,
}

impl Flusher {
    /// One group commit: number it in sled, flush, fdatasync, then the witness.
    fn commit(&mut self, marks_version: u64) -> Result<(), String> {
        self.seq += 1;
        // Read before the flush: every mark in it is made durable by this flush.
        // Unchanged since the last read (same version): the cached copy is exact.
        // A raise whose write has not bumped the version yet is missing from it,
        // which the witness allows (it is a lower bound on what sled holds); that
        // raise's own commit comes later and reads it.
        let marks = match self.marks_cache.take() {
            Some((v, m)) if v == marks_version => m,
            _ => mark_snapshot(&self.marks).map_err(|e| e.to_string())?,
        };
        self.meta
            .insert(COMMIT_SEQ, &self.seq.to_be_bytes()[..])
            .map_err(|e| e.to_string())?;
        self.db.flush().map_err(|e| e.to_string())?;
        self.data_file
            .sync_data()
            .map_err(|e| format!("fdatasync: {e}"))?;
        let written = self
            .witness
            .write(self.seq, &marks)
            .map_err(|e| format!("writing the witness: {e}"));
        self.marks_cache = Some((marks_version, marks));
        written
    }
}

fn flusher_loop(mut f: Flusher, c: Arc<GroupCommit>) {
    let mut through = 0u64;
    loop {
        {
            let mut r = c.requests.lock().unwrap_or_else(|p| p.into_inner());
            while r.requested <= through && !r.stop {
                r.idle = true;
                r = c.wake.wait(r).unwrap_or_else(|p| p.into_inner());
                r.idle = false;
            }
            if r.stop && r.requested <= through {
                r.exited = true;
                let stopped: Arc<str> = "the flusher has stopped".into();
                for w in r.waiters.drain(..) {
                    let _ = w.done.send(Err(stopped.clone()));
                }
                return;
            }
        }
        // Let writers that are ready to run join this batch first. When they share
        // the CPU with this thread (one core, or a busy machine) this turns one
        // flush per commit into one flush per burst of commits; on an idle CPU it
        // returns at once.
        std::thread::yield_now();
        // Every write numbered ≤ target was inserted before it was numbered.
        let target = c.written.load(Ordering::SeqCst);
        let res = f.commit(c.marks_version.load(Ordering::SeqCst));
        match res {
            Ok(()) => {
                c.batches.fetch_add(1, Ordering::Relaxed);
                c.records.fetch_add(target - through, Ordering::Relaxed);
                through = target;
                c.healthy.store(true, Ordering::Relaxed);
                let mut r = c.requests.lock().unwrap_or_else(|p| p.into_inner());
                r.through = target;
                let covered = take_covered(&mut r.waiters, target);
                drop(r);
                for w in covered {
                    let _ = w.done.send(Ok(()));
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "durable flush failed");
                c.healthy.store(false, Ordering::Relaxed);
                let e: Arc<str> = e.into();
                let mut r = c.requests.lock().unwrap_or_else(|p| p.into_inner());
                r.failed_through = target;
                r.last_error = Some(e.clone());
                // Do not spin on a broken disk: the next request retries.
                if r.requested <= target {
                    r.requested = target;
                }
                let covered = take_covered(&mut r.waiters, target);
                drop(r);
                for w in covered {
                    let _ = w.done.send(Err(e.clone()));
                }
                through = target;
            }
        }
    }
}

/// Removes and returns the waiters whose writes are numbered ≤ `target`.
fn take_covered(waiters: &mut Vec<Waiter>, target: u64) -> Vec<Waiter> {
    let mut covered = Vec::new();
    let mut i = 0;
    while i < waiters.len() {
        if waiters[i].seq <= target {
            covered.push(waiters.swap_remove(i));
        } else {
            i += 1;
        }
    }
    covered
}

/// The witness files (see the module documentation).
mod witness {
    use std::fs::{File, OpenOptions};
    use std::os::unix::fs::FileExt;
    use std::path::Path;

    use sha2::{Digest, Sha256};

    pub const FILES: [&str; 2] = ["witness.0", "witness.1"];
    const MAGIC: &[u8; 8] = b"FGWITNS1";

    #[derive(Debug, PartialEq, Eq)]
    pub struct Witness {
        pub seq: u64,
        pub marks: Vec<(Vec<u8>, u64)>,
    }

    /// `MAGIC, seq u64, n u32, n × (len u16, lease, mark u64), SHA-256 of the rest`.
    pub fn encode(seq: u64, marks: &[(Vec<u8>, u64)]) -> Vec<u8> {
        let mut out = Vec::with_capacity(52 + marks.len() * 80);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&seq.to_be_bytes());
        out.extend_from_slice(&(marks.len() as u32).to_be_bytes());
        for (lease, mark) in marks {
            out.extend_from_slice(&(lease.len() as u16).to_be_bytes());
            out.extend_from_slice(lease);
            out.extend_from_slice(&mark.to_be_bytes());
        }
        let sum = Sha256::digest(&out);
        out.extend_from_slice(&sum);
        out
    }

    pub fn decode(raw: &[u8]) -> Option<Witness> {
        let (body, sum) = raw.split_at_checked(raw.len().checked_sub(32)?)?;
        if Sha256::digest(body)[..] != sum[..] || !body.starts_with(MAGIC) {
            return None;
        }
        let mut r = &body[MAGIC.len()..];
        let mut take = |n: usize| -> Option<&[u8]> {
            let (a, b) = r.split_at_checked(n)?;
            r = b;
            Some(a)
        };
        let seq = u64::from_be_bytes(take(8)?.try_into().ok()?);
        let n = u32::from_be_bytes(take(4)?.try_into().ok()?);
        let mut marks = Vec::new();
        for _ in 0..n {
            let len = u16::from_be_bytes(take(2)?.try_into().ok()?);
            let lease = take(usize::from(len))?.to_vec();
            marks.push((lease, u64::from_be_bytes(take(8)?.try_into().ok()?)));
        }
        r.is_empty().then_some(Witness { seq, marks })
    }

    /// The newest valid witness; `None` when both files are absent or empty.
    pub fn read(dir: &Path) -> Result<Option<Witness>, String> {
        let mut best: Option<Witness> = None;
        let mut invalid = Vec::new();
        for name in FILES {
            let raw = match std::fs::read(dir.join(name)) {
                Ok(raw) => raw,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(format!("reading the witness {name}: {e}")),
            };
            if raw.is_empty() {
                continue;
            }
            match decode(&raw) {
                Some(w) if best.as_ref().is_none_or(|b| b.seq < w.seq) => best = Some(w),
                Some(_) => {}
                None => invalid.push(name),
            }
        }
        match best {
            // One slot torn or damaged: the other is at most one commit older.
            Some(w) => Ok(Some(w)),
            None if invalid.is_empty() => Ok(None),
            None => Err(format!(
                "the witness is unreadable ({} failed its checksum)",
                invalid.join(" and ")
            )),
        }
    }

    pub struct Writer {
        files: [File; 2],
    }

    impl Writer {
        pub fn open(dir: &Path) -> std::io::Result<Writer> {
            let open = |name: &str| {
                OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(dir.join(name))
            };
            Ok(Writer {
                files: [open(FILES[0])?, open(FILES[1])?],
            })
        }

        /// Overwrites the slot of `seq` (the other keeps the previous commit).
        pub fn write(&self, seq: u64, marks: &[(Vec<u8>, u64)]) -> std::io::Result<()> {
            let buf = encode(seq, marks);
            let f = &self.files[(seq % 2) as usize];
            f.write_all_at(&buf, 0)?;
            if f.metadata()?.len() > buf.len() as u64 {
                f.set_len(buf.len() as u64)?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let d = Durable::open(dir.path()).unwrap();
        let witnessed = || {
            let w = witness::read(dir.path()).unwrap().unwrap();
            (w.seq, w.marks)
        };
        d.raise_mark(&a, Epoch::new(5)).await.unwrap();
        d.commit().await.unwrap();
        d.commit().await.unwrap();
        let (seq1, marks) = witnessed();
        assert_eq!(marks, vec![(b"a".to_vec(), 5)]);
        d.raise_mark(&b, Epoch::new(2)).await.unwrap();
        d.raise_mark(&a, Epoch::new(9)).await.unwrap();
        let (seq2, marks) = witnessed();
        assert!(seq2 > seq1);
        assert_eq!(marks, vec![(b"a".to_vec(), 9), (b"b".to_vec(), 2)]);
        d.commit().await.unwrap();
        assert_eq!(witnessed().1, marks);
        d.close().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn marks_survive_reopen_and_batches_form() {
        let dir = tempfile::tempdir().unwrap();
        let lease = LeaseName::parse("l").unwrap();
        {
            let d = Durable::open(dir.path()).unwrap();
            assert_eq!(d.mark(&lease).unwrap(), Epoch::NONE);
            d.raise_mark(&lease, Epoch::new(5)).await.unwrap();
            d.raise_mark(&lease, Epoch::new(3)).await.unwrap(); // never lowers
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
        let d = Durable::open(dir.path()).unwrap();
        assert_eq!(d.mark(&lease).unwrap(), Epoch::new(5));
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
        {
            let d = Durable::open(dir.path()).unwrap();
            d.raise_mark(&lease, Epoch::new(3)).await.unwrap();
            d.close().await.unwrap();
        }
        copy_sled_files(dir.path(), old.path());
        {
            let d = Durable::open(dir.path()).unwrap();
            d.raise_mark(&lease, Epoch::new(9)).await.unwrap();
            d.close().await.unwrap();
        }
        // sled's files roll back to mark 3 (as a silently dropped log tail would);
        // the witness remembers 9.
        copy_sled_files(old.path(), dir.path());
        match Durable::open(dir.path()) {
            Err(DurableError::Damaged { detail, .. }) => {
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
        {
            let d = Durable::open(dir.path()).unwrap();
            d.raise_mark(&lease, Epoch::new(4)).await.unwrap();
            d.close().await.unwrap();
        }
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
            Durable::open(dir.path()),
            Err(DurableError::Damaged { .. })
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
        let d = Durable::open(dir.path()).unwrap();
        assert_eq!(d.mark(&lease).unwrap(), Epoch::new(4));
        d.close().await.unwrap();
        drop(d);
        // Both damaged: refused.
        for f in witness::FILES {
            std::fs::write(dir.path().join(f), b"not a witness").unwrap();
        }
        assert!(matches!(
            Durable::open(dir.path()),
            Err(DurableError::Damaged { .. })
        ));
    }

    #[test]
    fn witness_codec_round_trips_and_rejects_damage() {
        let marks = vec![(b"billing".to_vec(), 7), (b"a".to_vec(), u64::MAX)];
        let raw = witness::encode(42, &marks);
        assert_eq!(
            witness::decode(&raw),
            Some(witness::Witness { seq: 42, marks })
        );
        for i in 0..raw.len() {
            let mut b = raw.clone();
            b[i] ^= 1;
            assert_eq!(witness::decode(&b), None, "flip at {i}");
            assert_eq!(witness::decode(&raw[..i]), None, "cut at {i}");
        }
    }
}
