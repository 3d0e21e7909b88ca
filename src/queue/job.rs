//! Recovering in bulk (SPEC §11): an operator's retry or drop of every message
//! matching a filter when it is made, as one job kept in the state beside the messages. Each
//! message is edited exactly as a single retry or drop edits it (so a retry
//! goes to the end of its lease's queue, and one superseded by a newer epoch
//! of its lease is refused); a lease's messages are edited in acceptance
//! order, so those retried together keep it. The job is driven by the filter,
//! not by a list taken at its start: it edits what matches and was last
//! changed no later than the job was made — an edited message has changed
//! since, and so has one failing or accepted later — and the refused are kept
//! with the job and passed over; so a job resumed after a restart, or by
//! another member of a cluster, edits nothing twice. It is done once a pass
//! finds nothing left to edit.

use serde::{Deserialize, Serialize};

use super::message::{ListedBy, Listing, Status};

/// What a job does to each message it matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobAction {
    /// A failed message back to the end of its lease's queue.
    Retry,
    /// A pending or failed message dropped.
    Drop,
}

impl JobAction {
    /// As the API names it.
    pub fn as_str(self) -> &'static str {
        match self {
            JobAction::Retry => "retry",
            JobAction::Drop => "drop",
        }
    }
}

/// Which messages a job edits (the listing's filters, SPEC §11).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobFilter {
    /// Only this route's.
    pub route: Option<String>,
    /// Only this lease's.
    pub lease: Option<String>,
    /// The status matched: `failed` for a retry; `pending` or `failed` for a drop.
    pub status: String,
    /// At or after this time (ms), by `by`.
    pub since_ms: Option<u64>,
    /// Before this time (ms), by `by`.
    pub until_ms: Option<u64>,
    /// `accepted` or `updated`.
    pub by_updated: bool,
}

impl JobFilter {
    /// The listing of what the job may still edit, from the first page.
    pub fn listing(&self, limit: usize) -> Listing {
        Listing {
            route: self.route.clone(),
            lease: self.lease.clone(),
            status: Status::parse(&self.status),
            since_ms: self.since_ms,
            until_ms: self.until_ms,
            by: if self.by_updated {
                ListedBy::Updated
            } else {
                ListedBy::Accepted
            },
            after: None,
            limit,
        }
    }
}

/// The most refused keys a job lists (all are counted).
pub const REFUSED_LISTED: usize = 1000;

/// A bulk job and its progress.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Job {
    /// Random, hex.
    pub id: String,
    /// Retry or drop.
    pub action: JobAction,
    /// Which messages.
    pub filter: JobFilter,
    /// Messages matching when it was made.
    pub matched: u64,
    /// Messages edited.
    pub done: u64,
    /// Messages refused (a retry superseded by a newer epoch of its lease).
    pub refused: u64,
    /// The refused, as `route/key` — passed over by every later pass; the
    /// first [`REFUSED_LISTED`] are listed.
    pub refused_keys: Vec<String>,
    /// Done: a pass found nothing left to edit.
    pub finished: bool,
    /// When it was made (ms since the epoch).
    pub created_ms: u64,
    /// When it last progressed.
    pub updated_ms: u64,
}

/// Jobs as the API lists them: newest first (then by id, for a stable order).
pub fn newest_first(jobs: &mut [Job]) {
    jobs.sort_by(|a, b| b.created_ms.cmp(&a.created_ms).then(a.id.cmp(&b.id)));
}

/// Progress of one pass over part of a job, applied to it atomically.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobDelta {
    /// Messages edited.
    pub done: u64,
    /// Newly refused, as `route/key`.
    pub refused: Vec<String>,
    /// The pass found nothing left to edit.
    pub finished: bool,
    /// When.
    pub at_ms: u64,
}

impl Job {
    /// `delta` applied: counts added, refused keys kept (each once).
    pub fn apply(&mut self, delta: &JobDelta) {
        self.done += delta.done;
        for k in &delta.refused {
            if !self.refused_keys.contains(k) {
                self.refused += 1;
                self.refused_keys.push(k.clone());
            }
        }
        self.finished |= delta.finished;
        self.updated_ms = self.updated_ms.max(delta.at_ms);
    }

    /// The (route, key) this job refused: a later pass passes them over.
    pub fn refused_set(&self) -> std::collections::HashSet<(&str, &str)> {
        // A route's name has no `/`: the first one ends it.
        self.refused_keys
            .iter()
            .filter_map(|k| k.split_once('/'))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delta_counts_each_refused_key_once() {
        let mut j = Job {
            id: "j".into(),
            action: JobAction::Retry,
            filter: JobFilter::default(),
            matched: 3,
            done: 0,
            refused: 0,
            refused_keys: vec![],
            finished: false,
            created_ms: 1,
            updated_ms: 1,
        };
        let d = JobDelta {
            done: 2,
            refused: vec!["r/k".into()],
            finished: false,
            at_ms: 5,
        };
        j.apply(&d);
        j.apply(&d);
        assert_eq!((j.done, j.refused, j.updated_ms), (4, 1, 5));
        let refused = j.refused_set();
        assert!(refused.contains(&("r", "k")));
        assert!(!refused.contains(&("r", "k2")) && !refused.contains(&("r/k", "")));
    }
}
