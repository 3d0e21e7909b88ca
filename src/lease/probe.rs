//! The store self-test (SPEC §2): some S3-compatible servers silently ignore
//! `If-None-Match`, which makes fencing impossible. Before serving, and before any
//! `fencegate lease` command, we conditionally create one probe object twice and
//! refuse to run unless the second create is rejected.
//!
//! What it cannot see: a server that honours the header but checks it without a
//! lock, so that two *concurrent* creates can both win (stock threaded moto does
//! this under load). Only a concurrency test against the real server finds that.

use bytes::Bytes;

use super::{CreateOutcome, LeaseStore, StoreError};
use crate::lease::acquire::fresh_token;

/// Why the store self-test (SPEC §2) refused the store: fencing needs conditional
/// creates.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The second conditional create succeeded: the store ignores `If-None-Match`.
    #[error(
        "{store} ignores conditional writes (a second PutObject with If-None-Match: * on {key} succeeded): \
         fencing is impossible on this store; use a store that supports conditional creates"
    )]
    NotFencing {
        /// The store, described.
        store: String,
        /// The probe object's key.
        key: String,
    },
    /// The store could not be reached or answered an error.
    #[error("store self-test failed on {store}: {source}")]
    Store {
        /// The store, described.
        store: String,
        /// The store's failure.
        #[source]
        source: StoreError,
    },
}

/// Runs the self-test under `{prefix}.probe/`, cleaning up after itself.
pub async fn self_test(store: &dyn LeaseStore, prefix: &str) -> Result<(), ProbeError> {
    let key = format!("{prefix}.probe/{}.json", &fresh_token()[..16]);
    let wrap = |source| ProbeError::Store {
        store: store.describe(),
        source,
    };
    let body = Bytes::from_static(br#"{"probe":true}"#);
    let first = store
        .create_if_absent(&key, body.clone())
        .await
        .map_err(wrap)?;
    let second = store.create_if_absent(&key, body).await;
    let _ = store.delete(&key).await;
    match (first, second.map_err(wrap)?) {
        (_, CreateOutcome::AlreadyExists) => Ok(()),
        (_, CreateOutcome::Created) => Err(ProbeError::NotFencing {
            store: store.describe(),
            key,
        }),
    }
}
