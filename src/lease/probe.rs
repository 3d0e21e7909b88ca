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
    let first = patiently(|| store.create_if_absent(&key, body.clone()))
        .await
        .map_err(wrap)?;
    let second = patiently(|| store.create_if_absent(&key, body.clone())).await;
    let _ = store.delete(&key).await;
    match (first, second.map_err(wrap)?) {
        (_, CreateOutcome::AlreadyExists) => Ok(()),
        (_, CreateOutcome::Created) => Err(ProbeError::NotFencing {
            store: store.describe(),
            key,
        }),
    }
}

/// Calls that time out are tried again, up to [`TRIES`] in all: start-up is in
/// no hurry, and a first call to a cold endpoint (or on a busy machine) can
/// outlast `[store] timeout_ms`, which is sized for requests. A retried create
/// that finds its own earlier write gets `AlreadyExists`, which the test reads
/// as it would a second create's: correct either way. Any other failure (a
/// refused connection, a denied call) is said at once.
async fn patiently<T, F, Fut>(mut call: F) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let mut tries = 1;
    loop {
        match call().await {
            Err(StoreError::Unavailable(why)) if tries < TRIES && timed_out(&why) => {
                // Said only at debug: a start that then fails says it in one
                // line, and one that then succeeds has nothing to say.
                tracing::debug!(error = %why, "the store self-test's call timed out; trying again");
                tries += 1;
            }
            other => return other,
        }
    }
}

/// Calls of the self-test, each within `[store] timeout_ms`.
const TRIES: u32 = 4;

fn timed_out(why: &str) -> bool {
    let why = why.to_ascii_lowercase();
    why.contains("timeout") || why.contains("timed out")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A call that times out twice, then answers, is waited for; a refused
    /// connection is said at once.
    #[tokio::test]
    async fn a_call_that_timed_out_is_tried_again_and_a_refusal_is_not() {
        let calls = AtomicU32::new(0);
        let r = patiently(|| async {
            match calls.fetch_add(1, Ordering::SeqCst) {
                0 | 1 => Err(StoreError::Unavailable(
                    "operation timeout (after 1.5s)".into(),
                )),
                _ => Ok(7),
            }
        })
        .await;
        assert_eq!((r.ok(), calls.load(Ordering::SeqCst)), (Some(7), 3));

        let calls = AtomicU32::new(0);
        let r: Result<(), _> = patiently(|| async {
            calls.fetch_add(1, Ordering::SeqCst);
            Err(StoreError::Unavailable(
                "Connection refused (os error 111)".into(),
            ))
        })
        .await;
        assert!(r.is_err());
        assert_eq!(calls.load(Ordering::SeqCst), 1);

        let calls = AtomicU32::new(0);
        let r: Result<(), _> = patiently(|| async {
            calls.fetch_add(1, Ordering::SeqCst);
            Err(StoreError::Unavailable("request timed out".into()))
        })
        .await;
        assert!(r.is_err());
        assert_eq!(calls.load(Ordering::SeqCst), TRIES);
    }
}
