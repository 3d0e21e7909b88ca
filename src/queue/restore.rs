//! A restored or copied state's queue, fenced (SPEC §10, identity and
//! generations): what may have been sent after the copy is not sent again
//! out of order.

use super::{QueueStore, Status};
use crate::state::{Owner, StateError};

/// What the fence of a restored state did ([`fence_restored`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Fenced {
    /// Messages of an epoch below their lease's latest, failed unsent.
    pub failed: u64,
    /// Messages of the latest epoch, to be sent again as unknown outcomes.
    pub unknown: u64,
}

/// SPEC §10, identity and generations: a state found older than its own gate
/// objects (a copy, a restored backup) does not know what was sent from it
/// after the copy — a message of a newer epoch of `lease`, or this very
/// message. Before anything of it is sent: each message that may still be
/// sent and is of an epoch below the lease's latest listed epoch is failed
/// unsent (a newer one may have reached the destination; an operator's retry
/// of it is refused as superseded, for `sent` is raised to that epoch); each
/// one of the latest epoch accepted before this process started is marked
/// `delivering`, so that its next attempt is counted as an unknown outcome,
/// as after a crash. Idempotent: a crash in the middle runs it again.
pub(crate) async fn fence_restored(
    store: &dyn QueueStore,
    epochs: &crate::lease::Epochs,
    owner: Owner,
    lease: &str,
    now_ms: u64,
    started_ms: u64,
) -> Result<Fenced, StateError> {
    const ALL: usize = 1 << 40;
    let mut out = Fenced::default();
    let Ok(name) = crate::epoch::LeaseName::parse(lease) else {
        return Ok(out);
    };
    let latest = epochs
        .latest_after(&name, crate::epoch::Epoch::NONE)
        .await
        .map_err(|e| StateError::Write(format!("the lease store, fencing a restored state: {e}")))?
        .get();
    for status in [Status::Pending, Status::Delivering] {
        let (msgs, _) = store
            .list(&super::Listing {
                lease: Some(lease.to_owned()),
                status: Some(status),
                limit: ALL,
                ..Default::default()
            })
            .await?;
        for mut m in msgs {
            if m.epoch < latest {
                m.status = Status::Failed;
                m.updated_ms = now_ms;
                m.last_error = Some(format!(
                    "not sent: this state was restored from an older copy, and lease {lease} is at epoch {latest} — a message of that epoch may have reached the destination since the copy (SPEC §10, identity and generations)"
                ));
                store.settle(owner, &m).await?;
                out.failed += 1;
            } else if m.status == Status::Pending && m.accepted_ms < started_ms {
                m.status = Status::Delivering;
                m.updated_ms = now_ms;
                store.put(owner, &m).await?;
                out.unknown += 1;
            } else if m.status == Status::Delivering {
                out.unknown += 1;
            }
        }
    }
    store.raise_sent(owner, lease, latest).await?;
    Ok(out)
}
