//! The sled backend's group commit: one flusher thread owns durability.
//!
//! A writer inserts (cheap, in memory), notes a write sequence number, and awaits
//! the first flush that started after its insert. Each flush is sled's `flush()`
//! (which ends in `sync_file_range` on Linux: enough for a killed process, not for
//! power loss) followed by an `fdatasync` of sled's data file, once per batch, and
//! then the [witness](super::witness). sled 0.34's `flush_async()` hangs when
//! several tasks await it at once (sled#1308), hence the thread.

use std::fs::File;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use tokio::sync::oneshot;

use super::witness;
use super::{CommitStats, StateError};

/// In sled's `meta` tree: the number of the last group commit (u64, big-endian).
pub(super) const COMMIT_SEQ: &[u8] = b"commit-seq";

/// A commit waiting for the flush that covers its write sequence number.
struct Waiter {
    seq: u64,
    done: oneshot::Sender<Result<(), Arc<str>>>,
}

/// Shared by writers and the flusher, under one lock (a leaf: nothing else is
/// locked while it is held).
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

pub(super) struct GroupCommit {
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
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// Every mark, as (lease, epoch): what the witness records.
pub(super) type Marks = Vec<(Vec<u8>, u64)>;

pub(super) fn mark_snapshot(marks: &sled::Tree) -> Result<Marks, sled::Error> {
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
pub(super) struct Flusher {
    pub db: sled::Db,
    pub meta: sled::Tree,
    pub marks: sled::Tree,
    pub data_file: File,
    pub witness: witness::Writer,
    /// The number of the last group commit.
    pub seq: u64,
    /// The marks as last read, with the `marks_version` read before reading them.
    pub marks_cache: Option<(u64, Marks)>,
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

impl GroupCommit {
    /// Starts the flusher thread.
    pub(super) fn start(flusher: Flusher) -> std::io::Result<Arc<GroupCommit>> {
        let commit = Arc::new(GroupCommit {
            written: AtomicU64::new(0),
            requests: Mutex::new(Requests::default()),
            wake: Condvar::new(),
            batches: AtomicU64::new(0),
            records: AtomicU64::new(0),
            healthy: AtomicBool::new(true),
            marks_version: AtomicU64::new(0),
            thread: Mutex::new(None),
        });
        let c = commit.clone();
        let handle = std::thread::Builder::new()
            .name("fencegate-flusher".into())
            .spawn(move || flusher_loop(flusher, c))?;
        *commit.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(handle);
        Ok(commit)
    }

    /// After a write to the marks tree: a flusher that sees this version reads it.
    pub(super) fn marks_changed(&self) {
        self.marks_version.fetch_add(1, Ordering::SeqCst);
    }

    /// Waits until every write made before this call is durable.
    pub(super) async fn commit(&self) -> Result<(), StateError> {
        let seq = self.written.fetch_add(1, Ordering::SeqCst) + 1;
        let done = {
            let mut r = self.requests.lock().unwrap_or_else(|p| p.into_inner());
            if r.through >= seq {
                return Ok(());
            }
            if r.failed_through >= seq {
                return Err(StateError::Write(
                    r.last_error.as_deref().unwrap_or("flush failed").to_owned(),
                ));
            }
            if r.exited {
                return Err(StateError::Write("the flusher has stopped".into()));
            }
            if r.requested < seq {
                r.requested = seq;
            }
            let (tx, rx) = oneshot::channel();
            r.waiters.push(Waiter { seq, done: tx });
            if r.idle {
                self.wake.notify_one();
            }
            rx
        };
        match done.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(StateError::Write(e.to_string())),
            Err(_) => Err(StateError::Write("the flusher has stopped".into())),
        }
    }

    pub(super) fn stats(&self) -> CommitStats {
        CommitStats {
            batches: self.batches.load(Ordering::Relaxed),
            records: self.records.load(Ordering::Relaxed),
        }
    }

    /// Whether the last flush succeeded (readiness).
    pub(super) fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Flushes everything and stops the flusher thread.
    pub(super) async fn close(&self) -> Result<(), StateError> {
        let res = self.commit().await;
        {
            let mut r = self.requests.lock().unwrap_or_else(|p| p.into_inner());
            r.stop = true;
            self.wake.notify_one();
        }
        let handle = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = handle {
            let _ = tokio::task::spawn_blocking(move || h.join()).await;
        }
        res
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
