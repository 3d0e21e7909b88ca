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
    /// when nothing newer is listed). Listing starts after `after`'s key, so the
    /// cost does not grow with the lease's history, and nothing depends on old
    /// objects still existing.
    pub async fn latest_after(&self, lease: &LeaseName, after: Epoch) -> Result<Epoch, StoreError> {
        let lp = lease_prefix(&self.prefix, lease);
        let start = (after != Epoch::NONE).then(|| object_key(&self.prefix, lease, after));
        let keys = self.store.list(&lp, start.as_deref()).await?;
        Ok(keys
            .iter()
            .filter_map(|k| epoch_of_key(&lp, k))
            .fold(after, Epoch::max))
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
