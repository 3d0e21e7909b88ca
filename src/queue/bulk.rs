//! The runner of bulk jobs (SPEC §11, recovering in bulk; [`super::job`]):
//! each job not finished gets a pass each second, or at once when one is
//! made; a pass edits what the job still matches of the leases served here,
//! lease by lease in their queues' order, through the single edits.

use std::sync::Arc;
use std::time::Duration;

use super::job::{Job, JobAction, JobDelta, JobFilter};
use super::{ms, By, Edit, Message, Queue, Sender};
use crate::state::StateError;

/// Messages read per page of a pass.
const PAGE: usize = 500;
/// Progress is written after this many edits (and at a pass's end).
const FLUSH_EVERY: usize = 50;

impl Queue {
    /// Makes a bulk job: counted, written durably, then progressed in the
    /// background (here, and by every member serving a lease it matches).
    pub(crate) async fn start_job(
        self: &Arc<Self>,
        action: JobAction,
        filter: JobFilter,
    ) -> Result<Job, StateError> {
        let (_, matched) = self.store.list(&filter.listing(1)).await?;
        let now = ms(self.ctx.clock.now());
        let job = Job {
            id: format!(
                "{:016x}{:016x}",
                crate::entropy::u64(),
                crate::entropy::u64()
            ),
            action,
            filter,
            matched,
            done: 0,
            refused: 0,
            refused_keys: Vec::new(),
            finished: false,
            created_ms: now,
            updated_ms: now,
        };
        self.store.put_job(&job).await?;
        self.jobs_wake.notify_one();
        Ok(job)
    }

    /// Passes over the jobs not finished until shutdown.
    pub(super) async fn run_jobs(self: Arc<Self>) {
        loop {
            // No queued route: nothing a job could edit (a removed route's
            // messages wait for it), and no read of the database each second
            // for a set-up that does not queue.
            let queued = self.ctx.live.current().routes.iter().any(|r| r.queued);
            let jobs = if queued {
                self.store.jobs().await
            } else {
                Ok(Vec::new())
            };
            match jobs {
                Ok(jobs) => {
                    for job in jobs.into_iter().filter(|j| !j.finished) {
                        if self.ctx.stop.is_cancelled() {
                            return;
                        }
                        if let Err(e) = self.job_pass(&job).await {
                            tracing::warn!(job = job.id, error = %e, "a bulk job's pass stopped; it goes on at the next");
                        }
                    }
                }
                Err(e) => tracing::warn!(error = %e, "cannot read the bulk jobs; trying again"),
            }
            tokio::select! {
                _ = self.ctx.stop.cancelled() => return,
                _ = self.jobs_wake.notified() => {}
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    }

    /// One pass of `job`: what it still matches (less what it refused) is
    /// read whole; none left — it is finished; else the messages of leases
    /// served here are edited, each lease's in its queue's order (`seq`).
    async fn job_pass(self: &Arc<Self>, job: &Job) -> Result<(), StateError> {
        let refused = job.refused_set();
        let mut listing = job.filter.listing(PAGE);
        let mut left = 0u64;
        let mut here: Vec<Message> = Vec::new();
        let live = self.ctx.live.current();
        loop {
            let (page, _) = self.store.list(&listing).await?;
            let full = page.len() == PAGE;
            if let Some(last) = page.last() {
                listing.after = Some((last.route.clone(), last.key.clone()));
            }
            for m in page {
                // What matched when the job was made and has not changed
                // since: an edited message is never edited again (retried, it
                // may fail again), nor one that failed or was accepted later.
                if m.updated_ms > job.created_ms
                    || refused.contains(&(m.route.as_str(), m.key.as_str()))
                {
                    continue;
                }
                // A route no longer configured: its messages wait for it
                // (SPEC §11), and the job does not.
                if live.routes.get(&m.route).is_none_or(|r| !r.queued) {
                    continue;
                }
                left += 1;
                if matches!((self.ctx.owner_of)(&m.lease), Sender::Here(_)) {
                    here.push(m);
                }
            }
            if !full {
                break;
            }
        }
        drop(live);
        let now = || ms(self.ctx.clock.now());
        if left == 0 {
            self.store
                .job_progress(
                    &job.id,
                    &JobDelta {
                        finished: true,
                        at_ms: now(),
                        ..JobDelta::default()
                    },
                )
                .await?;
            tracing::info!(
                job = job.id,
                action = job.action.as_str(),
                "a bulk job finished"
            );
            return Ok(());
        }
        here.sort_by(|a, b| (a.lease.as_str(), a.seq).cmp(&(b.lease.as_str(), b.seq)));
        let mut delta = JobDelta::default();
        for m in here {
            if self.ctx.stop.is_cancelled() {
                break;
            }
            let edited = match job.action {
                // A message whose route a reload removed since the listing
                // is refused `NotServed` (passed over, SPEC §11).
                JobAction::Retry => self.retry(&m.route, &m.key, By::Job).await.map(drop),
                JobAction::Drop => self.drop_message(&m.route, &m.key, By::Job).await.map(drop),
            };
            match edited {
                Ok(()) => delta.done += 1,
                Err(Edit::Superseded(_)) => delta.refused.push(format!("{}/{}", m.route, m.key)),
                // Changed since it was read (a worker's message delivered, an
                // operator's edit): the next pass reads it again.
                Err(Edit::Conflict(_) | Edit::NotFound) => {}
                // Not here any more, or the state failed: the next pass.
                Err(Edit::NotServed) => break,
                Err(Edit::State(e)) => {
                    self.flush(&job.id, &mut delta).await?;
                    return Err(e);
                }
            }
            if delta.done as usize + delta.refused.len() >= FLUSH_EVERY {
                self.flush(&job.id, &mut delta).await?;
            }
        }
        self.flush(&job.id, &mut delta).await
    }

    /// Writes a pass's progress so far (edits already made are durable: a
    /// crash before this write only under-counts them).
    async fn flush(&self, id: &str, delta: &mut JobDelta) -> Result<(), StateError> {
        if delta.done == 0 && delta.refused.is_empty() {
            return Ok(());
        }
        delta.at_ms = ms(self.ctx.clock.now());
        self.store.job_progress(id, delta).await?;
        *delta = JobDelta::default();
        Ok(())
    }
}
