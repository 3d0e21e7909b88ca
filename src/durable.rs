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

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use tokio::sync::watch;

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

/// What the flusher publishes to waiters.
#[derive(Debug, Clone, Default)]
struct Flushed {
    /// Every write with sequence ≤ this is durable.
    through: u64,
    /// Every write with sequence ≤ this (and > `through`) failed to become durable.
    failed_through: u64,
    last_error: Option<Arc<str>>,
}

#[derive(Default)]
struct Requests {
    requested: u64,
    stop: bool,
}

struct GroupCommit {
    written: AtomicU64,
    requests: Mutex<Requests>,
    wake: Condvar,
    flushed: watch::Sender<Flushed>,
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
        let existed = dir.join("db").exists() || dir.join("conf").exists();
        std::fs::create_dir_all(dir).map_err(|e| open_err(e.to_string()))?;
        let db = sled::Config::new()
            .path(dir)
            .flush_every_ms(Some(1000))
            .open()
            .map_err(|e| match e {
                sled::Error::Corruption { .. } => DurableError::Damaged {
                    path: path.clone(),
                    detail: e.to_string(),
                },
                other => open_err(other.to_string()),
            })?;
        let meta = db.open_tree("meta").map_err(|e| open_err(e.to_string()))?;
        let has_sentinel = meta
            .get(SENTINEL)
            .map_err(|e| open_err(e.to_string()))?
            .is_some();
        if existed && !has_sentinel {
            return Err(DurableError::Damaged {
                path,
                detail: "sentinel key missing from an existing store".into(),
            });
        }
        if !has_sentinel {
            meta.insert(SENTINEL, &b"1"[..])
                .map_err(|e| open_err(e.to_string()))?;
            db.flush().map_err(|e| open_err(e.to_string()))?;
        }
        let marks = db.open_tree("marks").map_err(|e| open_err(e.to_string()))?;
        let dedup = db.open_tree("dedup").map_err(|e| open_err(e.to_string()))?;
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
        let data_file = File::open(dir.join("db"))
            .map_err(|e| open_err(format!("opening sled's data file: {e}")))?;
        let (tx, _) = watch::channel(Flushed::default());
        let commit = Arc::new(GroupCommit {
            written: AtomicU64::new(0),
            requests: Mutex::new(Requests::default()),
            wake: Condvar::new(),
            flushed: tx,
            batches: AtomicU64::new(0),
            records: AtomicU64::new(0),
            healthy: AtomicBool::new(true),
        });
        let flusher = {
            let (db, commit) = (db.clone(), commit.clone());
            std::thread::Builder::new()
                .name("fencegate-flusher".into())
                .spawn(move || flusher_loop(db, data_file, commit))
                .map_err(|e| open_err(format!("starting the flusher: {e}")))?
        };
        Ok(Arc::new(Durable {
            path,
            db,
            marks,
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
        let v = self
            .marks
            .get(lease.as_str())
            .map_err(|e| DurableError::Write(e.to_string()))?;
        Ok(v.and_then(|v| <[u8; 8]>::try_from(&v[..]).ok())
            .map(|b| Epoch::new(u64::from_be_bytes(b)))
            .unwrap_or(Epoch::NONE))
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
        self.marks
            .fetch_and_update(lease.as_str(), |old| {
                let old = old
                    .and_then(|v| <[u8; 8]>::try_from(v).ok())
                    .map(u64::from_be_bytes)
                    .unwrap_or(0);
                Some(old.max(epoch.get()).to_be_bytes().to_vec())
            })
            .map_err(|e| DurableError::Write(e.to_string()))?;
        crate::failpoint::hit("mark_written_before_flush");
        self.commit().await?;
        crate::failpoint::hit("mark_flushed");
        Ok(())
    }

    /// Waits until every write made before this call is durable (group commit).
    pub async fn commit(&self) -> Result<(), DurableError> {
        let seq = self.commit.written.fetch_add(1, Ordering::SeqCst) + 1;
        {
            let mut r = self
                .commit
                .requests
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if r.requested < seq {
                r.requested = seq;
                self.commit.wake.notify_one();
            }
        }
        let mut rx = self.commit.flushed.subscribe();
        loop {
            {
                let f = rx.borrow_and_update();
                if f.through >= seq {
                    return Ok(());
                }
                if f.failed_through >= seq {
                    return Err(DurableError::Write(
                        f.last_error.as_deref().unwrap_or("flush failed").to_owned(),
                    ));
                }
            }
            if rx.changed().await.is_err() {
                return Err(DurableError::Write("the flusher has stopped".into()));
            }
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

fn flusher_loop(db: sled::Db, data_file: File, c: Arc<GroupCommit>) {
    let mut through = 0u64;
    loop {
        {
            let mut r = c.requests.lock().unwrap_or_else(|p| p.into_inner());
            while r.requested <= through && !r.stop {
                r = c.wake.wait(r).unwrap_or_else(|p| p.into_inner());
            }
            if r.stop && r.requested <= through {
                return;
            }
        }
        // Every write numbered ≤ target was inserted before it was numbered.
        let target = c.written.load(Ordering::SeqCst);
        let res = db
            .flush()
            .map_err(|e| e.to_string())
            .and_then(|_| data_file.sync_data().map_err(|e| format!("fdatasync: {e}")));
        match res {
            Ok(()) => {
                c.batches.fetch_add(1, Ordering::Relaxed);
                c.records.fetch_add(target - through, Ordering::Relaxed);
                through = target;
                c.healthy.store(true, Ordering::Relaxed);
                c.flushed.send_modify(|f| f.through = target);
            }
            Err(e) => {
                tracing::error!(error = %e, "durable flush failed");
                c.healthy.store(false, Ordering::Relaxed);
                c.flushed.send_modify(|f| {
                    f.failed_through = target;
                    f.last_error = Some(e.into());
                });
                // Do not spin on a broken disk: the next request retries.
                let mut r = c.requests.lock().unwrap_or_else(|p| p.into_inner());
                if r.requested <= target {
                    r.requested = target;
                }
                through = target;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
