//! A [`StateStore`] in front of a real one (sled or PostgreSQL) whose faults a
//! test sets per operation — the state store's counterpart of
//! `tests/common/fault_store.rs` (the lease store's), after slatedb's
//! `failing_object_store.rs`:
//!
//! - [`Fault::Fail`]: refused before it reaches the store, so nothing is applied
//!   (the database is away, the disk refuses the write);
//! - [`Fault::Unknown`]: passed on and applied, then the answer is lost (the
//!   connection dropped after the commit) — the uncertain result a caller must
//!   reconcile by reading back;
//! - [`Fault::Latency`]: waits before passing the call on and again before
//!   answering (a slow database, a slow fsync).
//!
//! Faults are [`Rule`]s: an operation (or any), optionally one key (a record's
//! `route/key`, a lease's name, a shard's number), a [`Fault`], and how many
//! times it fires (every time by default). The first rule that matches a call
//! fires; a call no rule matches goes straight to the inner store. Every call is
//! counted, faulted or not ([`FaultState::calls`]).

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use fencegate::epoch::{Epoch, LeaseName};
use fencegate::state::{
    Begun, CommitStats, End, LeaseMarks, ListCursor, Listing, Owner, Record, RecordKey, Resolution,
    Resolved, State, StateError, StateStore, TakeOver,
};

/// A [`StateStore`] operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Marks,
    RaiseMark,
    NoteDrained,
    Begin,
    Finish,
    Get,
    Resolve,
    List,
    Sweep,
    Recover,
    ClaimShard,
    Check,
}

/// What a rule does to a call.
#[derive(Debug, Clone, Copy)]
pub enum Fault {
    /// Refused before the store sees it: nothing applied.
    Fail,
    /// Applied by the store, then its answer is lost.
    Unknown,
    /// This long before the call is passed on, and again before it is answered.
    Latency(Duration),
}

/// When a [`Fault`] applies.
#[derive(Debug, Clone)]
pub struct Rule {
    /// `None`: every operation.
    op: Option<Op>,
    key: Option<String>,
    /// How many more times it fires; `None`: always.
    left: Option<usize>,
    fault: Fault,
}

impl Rule {
    /// `fault` on every call of `op`, whatever the key.
    pub fn new(op: Op, fault: Fault) -> Rule {
        Rule {
            op: Some(op),
            key: None,
            left: None,
            fault,
        }
    }

    /// `fault` on every call of every operation.
    pub fn any(fault: Fault) -> Rule {
        Rule {
            op: None,
            key: None,
            left: None,
            fault,
        }
    }

    /// Only calls for this key (`route/key`, a lease name, or a shard number).
    pub fn key(mut self, key: impl Into<String>) -> Rule {
        self.key = Some(key.into());
        self
    }

    /// Only the next matching call.
    pub fn once(mut self) -> Rule {
        self.left = Some(1);
        self
    }
}

#[derive(Default)]
struct Book {
    rules: Vec<Rule>,
    calls: Vec<(Op, String)>,
    fired: usize,
}

/// See the module docs.
pub struct FaultState {
    inner: Arc<dyn StateStore>,
    book: Mutex<Book>,
}

/// The error a faulted call returns.
fn injected(what: &str) -> StateError {
    StateError::Write(format!("injected: {what}"))
}

fn record_key(k: &RecordKey) -> String {
    format!("{}/{}", k.route, k.key)
}

impl FaultState {
    pub fn new(inner: Arc<dyn StateStore>) -> Arc<FaultState> {
        Arc::new(FaultState {
            inner,
            book: Mutex::default(),
        })
    }

    /// Adds a rule ahead of the existing ones (a test's fault wins over the
    /// harness's standing latency).
    pub fn add(&self, rule: Rule) {
        self.book().rules.insert(0, rule);
    }

    /// Calls of `op` so far, faulted or not.
    pub fn calls(&self, op: Op) -> usize {
        self.book().calls.iter().filter(|(o, _)| *o == op).count()
    }

    /// How many faults other than latency have fired.
    pub fn fired(&self) -> usize {
        self.book().fired
    }

    fn book(&self) -> std::sync::MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts the call and takes the fault of the first matching rule, if any.
    fn fault_for(&self, op: Op, key: &str) -> Option<Fault> {
        let mut book = self.book();
        book.calls.push((op, key.to_owned()));
        let rule = book.rules.iter_mut().find(|r| {
            r.op.is_none_or(|o| o == op)
                && r.key.as_deref().is_none_or(|k| k == key)
                && r.left != Some(0)
        })?;
        if let Some(n) = rule.left.as_mut() {
            *n -= 1;
        }
        let fault = rule.fault;
        if !matches!(fault, Fault::Latency(_)) {
            book.fired += 1;
        }
        Some(fault)
    }

    /// Runs `call` (on the inner store) under the fault for `op` on `key`.
    async fn around<T, F>(&self, op: Op, key: &str, call: F) -> Result<T, StateError>
    where
        F: Future<Output = Result<T, StateError>>,
    {
        match self.fault_for(op, key) {
            None => call.await,
            Some(Fault::Fail) => Err(injected("refused before the store")),
            Some(Fault::Unknown) => {
                call.await?;
                Err(injected("applied, then the answer was lost"))
            }
            Some(Fault::Latency(d)) => {
                tokio::time::sleep(d).await;
                let r = call.await;
                tokio::time::sleep(d).await;
                r
            }
        }
    }
}

#[async_trait]
impl StateStore for FaultState {
    async fn marks(&self, lease: &LeaseName) -> Result<LeaseMarks, StateError> {
        self.around(Op::Marks, lease.as_str(), self.inner.marks(lease))
            .await
    }

    async fn raise_mark(
        &self,
        owner: Owner,
        lease: &LeaseName,
        epoch: Epoch,
    ) -> Result<(), StateError> {
        let call = self.inner.raise_mark(owner, lease, epoch);
        self.around(Op::RaiseMark, lease.as_str(), call).await
    }

    async fn note_drained(
        &self,
        owner: Owner,
        lease: &LeaseName,
        epoch: Epoch,
    ) -> Result<(), StateError> {
        let call = self.inner.note_drained(owner, lease, epoch);
        self.around(Op::NoteDrained, lease.as_str(), call).await
    }

    async fn begin(
        &self,
        owner: Owner,
        key: &RecordKey,
        fresh: &Record,
        rules: TakeOver,
    ) -> Result<Begun, StateError> {
        let call = self.inner.begin(owner, key, fresh, rules);
        self.around(Op::Begin, &record_key(key), call).await
    }

    async fn finish(&self, owner: Owner, key: &RecordKey, end: End) -> Result<(), StateError> {
        let call = self.inner.finish(owner, key, end);
        self.around(Op::Finish, &record_key(key), call).await
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StateError> {
        self.around(Op::Get, &record_key(key), self.inner.get(key))
            .await
    }

    async fn resolve(
        &self,
        owner: Owner,
        key: &RecordKey,
        how: Resolution,
        now_ms: u64,
    ) -> Result<Resolved, StateError> {
        let call = self.inner.resolve(owner, key, how, now_ms);
        self.around(Op::Resolve, &record_key(key), call).await
    }

    async fn list(
        &self,
        state: State,
        route: Option<&str>,
        after: Option<&ListCursor>,
        limit: usize,
    ) -> Result<Listing, StateError> {
        let call = self.inner.list(state, route, after, limit);
        self.around(Op::List, route.unwrap_or(""), call).await
    }

    async fn sweep(&self, rules: TakeOver) -> Result<usize, StateError> {
        self.around(Op::Sweep, "", self.inner.sweep(rules)).await
    }

    async fn recover(&self, owner: Owner, now_ms: u64) -> Result<usize, StateError> {
        let call = self.inner.recover(owner, now_ms);
        self.around(Op::Recover, &owner.shard.to_string(), call)
            .await
    }

    async fn claim_shard(&self, owner: Owner) -> Result<(), StateError> {
        let call = self.inner.claim_shard(owner);
        self.around(Op::ClaimShard, &owner.shard.to_string(), call)
            .await
    }

    fn is_healthy(&self) -> bool {
        self.inner.is_healthy()
    }

    async fn check(&self) -> Result<(), StateError> {
        self.around(Op::Check, "", self.inner.check()).await
    }

    fn stats(&self) -> CommitStats {
        self.inner.stats()
    }

    async fn close(&self) -> Result<(), StateError> {
        self.inner.close().await
    }
}
