//! A [`LeaseStore`] in front of a real one (the `dir` store, or S3) whose faults
//! a test sets per operation: the uncertain results of SPEC §2 (a create applied
//! whose answer was lost, a rival's create landing first), a store that is down,
//! one that ignores `If-None-Match`, and a slow one.
//!
//! Faults are [`Rule`]s: an operation, optionally one key, a [`Fault`], and how
//! many times it fires (every time by default). The first rule that matches a call
//! fires; a call no rule matches goes straight to the inner store. Every call is
//! counted, faulted or not ([`FaultStore::calls`]).

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use fencegate::clock::StoreClock;
use fencegate::lease::{CreateOutcome, LeaseStore, StoreError, StoredObject};

/// A [`LeaseStore`] operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    List,
    Get,
    Create,
    Delete,
}

/// What a rule does to a call.
#[derive(Debug, Clone)]
pub enum Fault {
    /// Refused before it reaches the store, so nothing is applied: the store is
    /// down (`StoreError::Unavailable`).
    Unavailable,
    /// Passed on and applied, then the answer is lost (timeout, reset, 5xx):
    /// `StoreError::Unavailable`, the uncertain result.
    LoseResponse,
    /// Create: passed on and applied, then answered "already exists", as when the
    /// SDK's automatic retry of a create whose first answer was lost gets 412.
    AppliedThenExists,
    /// Create: a rival's object with this body lands on the key first; ours is then
    /// passed on (and refused by the store), and its answer is lost if `lost`.
    RivalFirst { body: Bytes, lost: bool },
    /// Create: `If-None-Match` is ignored; whatever is there is overwritten and the
    /// answer is "created".
    IgnoreIfNoneMatch,
    /// Waits this long, then passes the call on.
    Delay(Duration),
}

/// When a [`Fault`] applies.
#[derive(Debug, Clone)]
pub struct Rule {
    op: Op,
    key: Option<String>,
    /// How many more times it fires; `None`: always.
    left: Option<usize>,
    fault: Fault,
}

impl Rule {
    /// `fault` on every call of `op`, whatever the key.
    pub fn new(op: Op, fault: Fault) -> Rule {
        Rule {
            op,
            key: None,
            left: None,
            fault,
        }
    }

    /// Only calls for this key (for a list: this prefix).
    pub fn key(mut self, key: impl Into<String>) -> Rule {
        self.key = Some(key.into());
        self
    }

    /// Only the next `n` matching calls.
    pub fn times(mut self, n: usize) -> Rule {
        self.left = Some(n);
        self
    }

    /// Only the next matching call.
    pub fn once(self) -> Rule {
        self.times(1)
    }
}

#[derive(Default)]
struct State {
    rules: Vec<Rule>,
    /// Every call: operation and key.
    calls: Vec<(Op, String)>,
    /// Faults fired.
    fired: usize,
}

/// See the module docs.
pub struct FaultStore {
    inner: Arc<dyn LeaseStore>,
    state: Mutex<State>,
}

impl FaultStore {
    pub fn new(inner: Arc<dyn LeaseStore>) -> Arc<FaultStore> {
        Arc::new(FaultStore {
            inner,
            state: Mutex::default(),
        })
    }

    /// The store behind the faults.
    pub fn inner(&self) -> &Arc<dyn LeaseStore> {
        &self.inner
    }

    /// Adds a rule after the existing ones.
    pub fn add(&self, rule: Rule) {
        let any_op = matches!(
            rule.fault,
            Fault::Unavailable | Fault::LoseResponse | Fault::Delay(_)
        );
        assert!(
            any_op || rule.op == Op::Create,
            "{:?} is a fault of creates, not of {:?}",
            rule.fault,
            rule.op
        );
        self.state().rules.push(rule);
    }

    /// Removes every rule: the store behaves again.
    pub fn clear(&self) {
        self.state().rules.clear();
    }

    /// Calls of `op` so far (for `key` only, if given), faulted or not.
    pub fn calls(&self, op: Op, key: Option<&str>) -> usize {
        self.state()
            .calls
            .iter()
            .filter(|(o, k)| *o == op && key.is_none_or(|key| k == key))
            .count()
    }

    /// How many faults have fired.
    pub fn fired(&self) -> usize {
        self.state().fired
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts the call and takes the fault of the first matching rule, if any.
    fn fault_for(&self, op: Op, key: &str) -> Option<Fault> {
        let mut st = self.state();
        st.calls.push((op, key.to_owned()));
        let rule = st.rules.iter_mut().find(|r| {
            r.op == op && r.key.as_deref().is_none_or(|k| k == key) && r.left != Some(0)
        })?;
        if let Some(n) = rule.left.as_mut() {
            *n -= 1;
        }
        let fault = rule.fault.clone();
        st.fired += 1;
        Some(fault)
    }
}

fn down(what: &str) -> StoreError {
    StoreError::Unavailable(format!("injected: {what}"))
}

/// The faults every operation knows, around the call to the inner store.
async fn around<T, F>(fault: Option<Fault>, call: impl FnOnce() -> F) -> Result<T, StoreError>
where
    F: Future<Output = Result<T, StoreError>>,
{
    match fault {
        None => call().await,
        Some(Fault::Unavailable) => Err(down("store unavailable")),
        Some(Fault::LoseResponse) => {
            call().await?;
            Err(down("response lost"))
        }
        Some(Fault::Delay(d)) => {
            tokio::time::sleep(d).await;
            call().await
        }
        Some(f) => unreachable!("{f:?} is a fault of creates only (checked when added)"),
    }
}

#[async_trait]
impl LeaseStore for FaultStore {
    async fn list(
        &self,
        prefix: &str,
        start_after: Option<&str>,
    ) -> Result<Vec<String>, StoreError> {
        around(self.fault_for(Op::List, prefix), || {
            self.inner.list(prefix, start_after)
        })
        .await
    }

    async fn list_first(
        &self,
        prefix: &str,
        start_after: Option<&str>,
        max: usize,
    ) -> Result<Vec<String>, StoreError> {
        around(self.fault_for(Op::List, prefix), || {
            self.inner.list_first(prefix, start_after, max)
        })
        .await
    }

    async fn get(&self, key: &str) -> Result<Option<StoredObject>, StoreError> {
        around(self.fault_for(Op::Get, key), || self.inner.get(key)).await
    }

    async fn create_if_absent(&self, key: &str, body: Bytes) -> Result<CreateOutcome, StoreError> {
        match self.fault_for(Op::Create, key) {
            Some(Fault::AppliedThenExists) => {
                let out = self.inner.create_if_absent(key, body).await?;
                assert_eq!(out, CreateOutcome::Created, "{key} was already there");
                Ok(CreateOutcome::AlreadyExists)
            }
            Some(Fault::RivalFirst { body: rival, lost }) => {
                let out = self.inner.create_if_absent(key, rival).await?;
                assert_eq!(out, CreateOutcome::Created, "{key} was already there");
                let ours = self.inner.create_if_absent(key, body).await?;
                assert_eq!(
                    ours,
                    CreateOutcome::AlreadyExists,
                    "{key}: after the rival's"
                );
                if lost {
                    Err(down("response lost"))
                } else {
                    Ok(ours)
                }
            }
            Some(Fault::IgnoreIfNoneMatch) => {
                self.inner.delete(key).await?;
                let out = self.inner.create_if_absent(key, body).await?;
                assert_eq!(out, CreateOutcome::Created, "{key} was recreated meanwhile");
                Ok(out)
            }
            fault => around(fault, || self.inner.create_if_absent(key, body)).await,
        }
    }

    async fn delete(&self, key: &str) -> Result<(), StoreError> {
        around(self.fault_for(Op::Delete, key), || self.inner.delete(key)).await
    }

    fn clock(&self) -> &StoreClock {
        self.inner.clock()
    }

    fn describe(&self) -> String {
        format!("fault-injecting wrapper over {}", self.inner.describe())
    }
}
