//! The lease store (SPEC §2): where epoch objects live, behind one trait.
//!
//! Two backends: [`s3`] (any S3-compatible endpoint) and [`dir`] (the embedded
//! default for one host). [`acquire`] is the worker-side algorithm on top, and
//! [`probe`] the start-up self-test that refuses stores which ignore
//! `If-None-Match`. The trait speaks in raw keys so that a fault-injecting wrapper
//! can sit in front of either backend.

pub mod acquire;
pub mod dir;
pub mod probe;
pub mod s3;

use std::sync::Arc;
use std::time::SystemTime;

use async_trait::async_trait;
use bytes::Bytes;

use crate::clock::StoreClock;
use crate::epoch::{epoch_of_key, lease_prefix, object_key, Epoch, EpochObject, LeaseName};

/// An object as read back from the store.
#[derive(Debug, Clone)]
pub struct StoredObject {
    /// The object's bytes.
    pub body: Bytes,
    /// The store's `LastModified` (1 s resolution on S3).
    pub last_modified: SystemTime,
}

/// The answer to a conditional create.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CreateOutcome {
    /// Our write created the object.
    Created,
    /// The key already existed (412, or 409 ConditionalRequestConflict). Note the
    /// existing object may be our own, written by an earlier attempt whose
    /// response was lost: callers that care read it back ([`acquire`]).
    AlreadyExists,
}

/// Store failures, classified by what a caller may conclude from them.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store could not be reached or did not answer in time, or answered 5xx.
    /// For a create this is the *uncertain result*: it may have been applied.
    #[error("lease store unavailable: {0}")]
    Unavailable(String),
    /// The store answered and refused (auth, missing bucket, bad request...).
    #[error("lease store refused the call: {0}")]
    Refused(String),
}

/// Where epoch objects are kept. Implementations must make `create_if_absent`
/// atomic: of any number of concurrent creates of one key, exactly one succeeds.
#[async_trait]
pub trait LeaseStore: Send + Sync + 'static {
    /// All keys under `prefix` that sort after `start_after`, ascending.
    async fn list(
        &self,
        prefix: &str,
        start_after: Option<&str>,
    ) -> Result<Vec<String>, StoreError>;
    /// At most `max` (≥ 1) of the keys [`LeaseStore::list`] gives, the first
    /// ones: one call on S3 (`max-keys`). The default lists every key.
    async fn list_first(
        &self,
        prefix: &str,
        start_after: Option<&str>,
        max: usize,
    ) -> Result<Vec<String>, StoreError> {
        let mut keys = self.list(prefix, start_after).await?;
        keys.truncate(max);
        Ok(keys)
    }
    /// The folders directly under `prefix` (each ending in `/`): which shard
    /// gate leases exist (SPEC §10), read in one call on S3 (a delimiter
    /// listing), whatever old epochs were deleted. The default lists every key.
    async fn list_folders(&self, prefix: &str) -> Result<Vec<String>, StoreError> {
        let mut folders: Vec<String> = Vec::new();
        for key in self.list(prefix, None).await? {
            if let Some((folder, _)) = key[prefix.len().min(key.len())..].split_once('/') {
                let f = format!("{prefix}{folder}/");
                if folders.last() != Some(&f) {
                    folders.push(f);
                }
            }
        }
        folders.dedup();
        Ok(folders)
    }
    /// The object at `key`, or `None` when it does not exist.
    async fn get(&self, key: &str) -> Result<Option<StoredObject>, StoreError>;
    /// Creates `key` only if it does not exist (`If-None-Match: *`).
    async fn create_if_absent(&self, key: &str, body: Bytes) -> Result<CreateOutcome, StoreError>;
    /// Deletes `key` (probe clean-up and tests; epoch objects are never deleted by fencegate).
    async fn delete(&self, key: &str) -> Result<(), StoreError>;
    /// The store's clock as estimated from its responses.
    fn clock(&self) -> &StoreClock;
    /// A short human description (kind and location) for logs and errors.
    fn describe(&self) -> String;
}

/// Keys read in the first listing of [`Epochs::latest_after`] (S3's page).
const PAGE: usize = 1000;

/// Typed access to the epoch objects of one store and prefix.
#[derive(Clone)]
pub struct Epochs {
    store: Arc<dyn LeaseStore>,
    prefix: String,
}

impl Epochs {
    /// Epoch objects of `store` under `prefix`.
    pub fn new(store: Arc<dyn LeaseStore>, prefix: impl Into<String>) -> Epochs {
        Epochs {
            store,
            prefix: prefix.into(),
        }
    }

    /// The store underneath.
    pub fn store(&self) -> &Arc<dyn LeaseStore> {
        &self.store
    }

    /// The key prefix (`[store] prefix`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The greatest epoch of `lease` that sorts after `after` (or `after` itself
    /// when nothing newer is listed). Nothing depends on old objects still
    /// existing, and the cost does not grow with the lease's history: one page
    /// of [`PAGE`] keys after `after`'s key; when that page is full (a long
    /// history, or `after` far behind), a galloping search by "the first epoch
    /// after `x`" (one `max-keys` listing each) finds the latest in about
    /// 2·log₂(epochs) calls instead of paging through every object — a
    /// cluster's anchor gains ~13,000 objects a day, a busy lease more.
    pub async fn latest_after(&self, lease: &LeaseName, after: Epoch) -> Result<Epoch, StoreError> {
        let lp = lease_prefix(&self.prefix, lease);
        let start = (after != Epoch::NONE).then(|| object_key(&self.prefix, lease, after));
        let keys = self.store.list_first(&lp, start.as_deref(), PAGE).await?;
        let seen = keys
            .iter()
            .filter_map(|k| epoch_of_key(&lp, k))
            .fold(after, Epoch::max);
        if keys.len() < PAGE {
            return Ok(seen);
        }
        // Invariants: `lo` exists (or is `after`); no epoch after `hi` exists.
        let mut lo = seen.get();
        let mut step = PAGE as u64;
        let mut hi = loop {
            let probe = lo.saturating_add(step);
            match self.first_after(lease, &lp, probe).await? {
                Some(e) => {
                    lo = e;
                    step = step.saturating_mul(2);
                }
                None => break probe,
            }
        };
        while hi > lo.saturating_add(1) {
            let mid = lo + (hi - lo) / 2;
            match self.first_after(lease, &lp, mid).await? {
                // Beyond `hi` only if created during the search.
                Some(e) => {
                    lo = e;
                    hi = hi.max(e);
                }
                None => hi = mid,
            }
        }
        Ok(match self.first_after(lease, &lp, lo).await? {
            Some(e) => Epoch::new(e),
            None => Epoch::new(lo),
        })
    }

    /// The smallest epoch of `lease` above `x` that exists, if any (keys that
    /// are not epoch objects are skipped; a page of nothing but such keys
    /// falls back to a whole listing, which they make no worse than before).
    async fn first_after(
        &self,
        lease: &LeaseName,
        lp: &str,
        x: u64,
    ) -> Result<Option<u64>, StoreError> {
        if x == u64::MAX {
            return Ok(None);
        }
        let start = object_key(&self.prefix, lease, Epoch::new(x));
        let keys = self.store.list_first(lp, Some(&start), 16).await?;
        if let Some(e) = keys.iter().find_map(|k| epoch_of_key(lp, k)) {
            return Ok(Some(e.get()));
        }
        if keys.len() < 16 {
            return Ok(None);
        }
        let all = self.store.list(lp, Some(&start)).await?;
        Ok(all.iter().find_map(|k| epoch_of_key(lp, k)).map(Epoch::get))
    }

    /// Reads and interprets one epoch object; `None` when it does not exist.
    pub async fn read(
        &self,
        lease: &LeaseName,
        epoch: Epoch,
    ) -> Result<Option<EpochObject>, StoreError> {
        let key = object_key(&self.prefix, lease, epoch);
        Ok(self
            .store
            .get(&key)
            .await?
            .map(|o| EpochObject::from_stored(lease, epoch, &o.body, o.last_modified)))
    }

    /// Conditionally creates an epoch object.
    pub async fn create(
        &self,
        lease: &LeaseName,
        epoch: Epoch,
        body: Bytes,
    ) -> Result<CreateOutcome, StoreError> {
        self.store
            .create_if_absent(&object_key(&self.prefix, lease, epoch), body)
            .await
    }

    /// The store's clock, estimated (admission rule 4).
    pub fn store_now(&self) -> SystemTime {
        self.store.clock().now()
    }
}

/// Opens the store named by the `[store]` section.
pub async fn open(
    cfg: &crate::config::StoreConfig,
    clock: Arc<dyn crate::clock::Clock>,
) -> Result<Arc<dyn LeaseStore>, StoreError> {
    use crate::config::StoreKind;
    Ok(match cfg.kind {
        StoreKind::Dir => Arc::new(dir::DirStore::open(&cfg.path, clock).map_err(|e| {
            StoreError::Refused(format!("cannot open dir store {}: {e}", cfg.path.display()))
        })?),
        StoreKind::S3 => {
            let settings = s3::S3Settings {
                bucket: cfg.bucket.clone().unwrap_or_default(),
                endpoint: cfg.endpoint.clone(),
                region: cfg.region.clone(),
                force_path_style: cfg.force_path_style,
                timeout: std::time::Duration::from_millis(cfg.timeout_ms),
                static_credentials: None,
            };
            Arc::new(s3::S3Store::connect(&settings, clock).await)
        }
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    use super::*;
    use crate::clock::SystemClock;

    /// Keys only, in memory; counts listing calls.
    struct Keys {
        keys: Mutex<BTreeSet<String>>,
        lists: AtomicUsize,
        clock: StoreClock,
    }

    #[async_trait]
    impl LeaseStore for Keys {
        async fn list(
            &self,
            prefix: &str,
            start_after: Option<&str>,
        ) -> Result<Vec<String>, StoreError> {
            // Counted per page of 1,000, as S3 would answer.
            let keys: Vec<String> = self
                .keys
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .filter(|k| k.starts_with(prefix) && start_after.is_none_or(|s| k.as_str() > s))
                .cloned()
                .collect();
            self.lists
                .fetch_add(keys.len() / 1000 + 1, Ordering::Relaxed);
            Ok(keys)
        }
        async fn list_first(
            &self,
            prefix: &str,
            start_after: Option<&str>,
            max: usize,
        ) -> Result<Vec<String>, StoreError> {
            self.lists.fetch_add(1, Ordering::Relaxed);
            let keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
            let from = start_after.unwrap_or(prefix).to_owned();
            Ok(keys
                .range(from..)
                .filter(|k| start_after.is_none_or(|s| k.as_str() > s))
                .take_while(|k| k.starts_with(prefix))
                .take(max)
                .cloned()
                .collect())
        }
        async fn get(&self, _: &str) -> Result<Option<StoredObject>, StoreError> {
            Ok(None)
        }
        async fn create_if_absent(&self, key: &str, _: Bytes) -> Result<CreateOutcome, StoreError> {
            let new = self
                .keys
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(key.to_owned());
            Ok(if new {
                CreateOutcome::Created
            } else {
                CreateOutcome::AlreadyExists
            })
        }
        async fn delete(&self, key: &str) -> Result<(), StoreError> {
            self.keys
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(key);
            Ok(())
        }
        fn clock(&self) -> &StoreClock {
            &self.clock
        }
        fn describe(&self) -> String {
            "keys".into()
        }
    }

    fn history(
        epochs: impl IntoIterator<Item = u64>,
        extra: &[&str],
    ) -> (Arc<Keys>, Epochs, LeaseName) {
        let lease = LeaseName::parse("anchor").expect("valid");
        let mut keys: BTreeSet<String> = epochs
            .into_iter()
            .map(|e| object_key("p/", &lease, Epoch::new(e)))
            .collect();
        keys.extend(extra.iter().map(|k| (*k).to_owned()));
        // A neighbour whose keys sort right after this lease's.
        keys.insert(object_key(
            "p/",
            &LeaseName::parse("anchos").expect("valid"),
            Epoch::new(9),
        ));
        let store = Arc::new(Keys {
            keys: Mutex::new(keys),
            lists: AtomicUsize::new(0),
            clock: StoreClock::new(Arc::new(SystemClock)),
        });
        (store.clone(), Epochs::new(store, "p/"), lease)
    }

    /// The latest epoch of a long history is found in a few dozen one-key
    /// listings, not by paging through it (a year of a cluster's anchor is
    /// ~4.7 million objects: 4,700 pages at every start-up); old epochs
    /// deleted by a lifecycle rule and keys that are not epochs change nothing.
    #[tokio::test]
    async fn the_latest_of_a_long_history_takes_a_few_listings() {
        for (from, to) in [
            (1u64, 5),
            (1, 999),
            (1, 1000),
            (1, 1001),
            (1, 250_000),
            (240_000, 250_000),
            (7, 4_100),
        ] {
            let (store, epochs, lease) = history(
                from..=to,
                &[
                    "p/anchor/zz-not-an-epoch",
                    "p/anchor/00000000000000000003.tmp",
                ],
            );
            for after in [Epoch::NONE, Epoch::new(from), Epoch::new(to)] {
                store.lists.store(0, Ordering::Relaxed);
                let got = epochs.latest_after(&lease, after).await.expect("listed");
                let calls = store.lists.load(Ordering::Relaxed);
                assert_eq!(got, Epoch::new(to), "{from}..={to} after {after:?}");
                eprintln!("{from}..={to} after {after:?}: {calls} listings");
                assert!(
                    calls <= 2 + 2 * 64 - (to.leading_zeros() as usize) * 2,
                    "{from}..={to}: {calls} listings"
                );
            }
        }
        // Nothing yet, and `after` beyond everything listed.
        let (_, epochs, lease) = history([], &[]);
        assert_eq!(
            epochs
                .latest_after(&lease, Epoch::NONE)
                .await
                .expect("listed"),
            Epoch::NONE
        );
        let (_, epochs, lease) = history(1..=3, &[]);
        assert_eq!(
            epochs
                .latest_after(&lease, Epoch::new(8))
                .await
                .expect("listed"),
            Epoch::new(8)
        );
    }
}
