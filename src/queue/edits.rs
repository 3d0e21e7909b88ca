//! An operator's retry and drop of a queued message (SPEC §11 "Status and
//! operator's actions"), under the lock that orders edits.

use std::sync::Arc;

use super::{ms, Edit, Message, Queue, Requeued, Status};
use crate::state::Owner;

/// Which edit: a retry needs its lease served here (it may be sent); a drop
/// never sends.
#[derive(Clone, Copy)]
enum Action {
    Retry,
    Drop,
}

/// Who edits: an operator's call for one message, or a bulk job.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum By {
    /// An operator's retry or drop of that one message; a drop may take a
    /// message whose lease no route names now (SPEC §11: a removed route's
    /// messages wait "until it is back, or an operator drops them").
    Operator,
    /// A bulk job: a message whose route is not configured and queued now
    /// is passed over (SPEC §11) — checked here, under `edits`, since the
    /// job listed it before a reload may have removed its route.
    Job,
}

impl Queue {
    /// The message an operator acts on, and the owner to write it under:
    /// pending or failed, and its lease served here (SPEC §11) — or, for a
    /// drop, no route naming its lease now and this instance the one that
    /// would serve it (a removed route's messages wait for it "or an
    /// operator drops them"); a job's, its route configured and queued now.
    /// Called with `edits` held.
    async fn editable(
        &self,
        route: &str,
        key: &str,
        action: Action,
        by: By,
    ) -> Result<(Message, Owner), Edit> {
        let m = self.store.get(route, key).await?.ok_or(Edit::NotFound)?;
        if !matches!(m.status, Status::Pending | Status::Failed) {
            return Err(Edit::Conflict(m.status));
        }
        if by == By::Job && !self.routed(&m.route) {
            return Err(Edit::NotServed);
        }
        let owner = (self.ctx.owner_of)(&m.lease)
            .owner()
            .or_else(|| match (action, by) {
                (Action::Drop, By::Operator) => (self.ctx.drop_owner_of)(&m.lease).owner(),
                _ => None,
            });
        Ok((m, owner.ok_or(Edit::NotServed)?))
    }

    /// Whether `route` is configured, and queued, in the running config.
    fn routed(&self, route: &str) -> bool {
        self.ctx
            .live
            .current()
            .routes
            .get(route)
            .is_some_and(|r| r.queued)
    }

    /// An operator's retry (SPEC §11): a pending message is due now; a failed
    /// one goes back to the end of its lease's queue — unless a message of a
    /// newer epoch of its lease was sent or waits, which it would then follow
    /// (the order rule has no exemption, not even an operator's).
    pub(crate) async fn retry(
        self: &Arc<Self>,
        route: &str,
        key: &str,
        by: By,
    ) -> Result<Message, Edit> {
        // A restored state's lease is fenced first: its retry of an older
        // epoch's message is then refused as superseded.
        if let Some(m) = self.store.get(route, key).await? {
            if let Some(owner) = (self.ctx.owner_of)(&m.lease).owner() {
                self.fence_if_restored(&m.lease, owner).await?;
            }
        }
        let _edit = self.edits.lock().await;
        let (mut m, owner) = self.editable(route, key, Action::Retry, by).await?;
        let now = ms(self.ctx.clock.now());
        let m = match m.status {
            Status::Pending => {
                m.next_attempt_ms = now;
                m.updated_ms = now;
                self.store.put(owner, &m).await?;
                m
            }
            Status::Failed => match self.store.requeue(owner, route, key, now).await? {
                Requeued::Done(m) => *m,
                Requeued::Gone => return Err(Edit::NotFound),
                Requeued::NotFailed(s) => return Err(Edit::Conflict(s)),
                Requeued::Superseded(e) => return Err(Edit::Superseded(e)),
            },
            other => return Err(Edit::Conflict(other)),
        };
        self.wake(&m.lease);
        Ok(m)
    }

    /// An operator's drop (SPEC §11): a pending or failed message is settled
    /// `dropped`; the messages behind it go on.
    pub(crate) async fn drop_message(
        self: &Arc<Self>,
        route: &str,
        key: &str,
        by: By,
    ) -> Result<Message, Edit> {
        let _edit = self.edits.lock().await;
        let (mut m, owner) = self.editable(route, key, Action::Drop, by).await?;
        m.status = Status::Dropped;
        m.updated_ms = ms(self.ctx.clock.now());
        self.store.settle(owner, &m).await?;
        self.wake(&m.lease);
        Ok(m)
    }
}
