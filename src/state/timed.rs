//! State-store latency and errors (SPEC §10.2's metrics), measured around any
//! backend: [`Timed`] wraps a [`StateStore`] and records how long each call took
//! and how each failed, so a slow or failing database shows on a dashboard before
//! workers see 503s.
//!
//! The series are made once, at start-up (one histogram and one error counter per
//! operation and kind): the request path touches them without a labelled lookup.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::{
    Begun, CommitStats, End, LeaseMarks, ListCursor, Listing, Owner, Record, RecordKey, Resolution,
    Resolved, State, StateError, StateStore, TakeOver,
};
use crate::epoch::{Epoch, LeaseName};

/// The state store's operations, as the `op` label names them — the queue's
/// (SPEC §11) among them: it is kept in the same store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
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
    Close,
    QueueAccept,
    QueueRead,
    QueueAttempt,
    QueueWrite,
    QueueSettle,
    QueueDurable,
    QueueSweep,
}

impl Op {
    const ALL: [Op; 20] = [
        Op::Marks,
        Op::RaiseMark,
        Op::NoteDrained,
        Op::Begin,
        Op::Finish,
        Op::Get,
        Op::Resolve,
        Op::List,
        Op::Sweep,
        Op::Recover,
        Op::ClaimShard,
        Op::Check,
        Op::Close,
        Op::QueueAccept,
        Op::QueueRead,
        Op::QueueAttempt,
        Op::QueueWrite,
        Op::QueueSettle,
        Op::QueueDurable,
        Op::QueueSweep,
    ];

    fn as_str(self) -> &'static str {
        match self {
            Op::Marks => "marks",
            Op::RaiseMark => "raise_mark",
            Op::NoteDrained => "note_drained",
            Op::Begin => "begin",
            Op::Finish => "finish",
            Op::Get => "get",
            Op::Resolve => "resolve",
            Op::List => "list",
            Op::Sweep => "sweep",
            Op::Recover => "recover",
            Op::ClaimShard => "claim_shard",
            Op::Check => "check",
            Op::Close => "close",
            Op::QueueAccept => "queue_accept",
            Op::QueueRead => "queue_read",
            Op::QueueAttempt => "queue_attempt",
            Op::QueueWrite => "queue_write",
            Op::QueueSettle => "queue_settle",
            Op::QueueDurable => "queue_durable",
            Op::QueueSweep => "queue_sweep",
        }
    }
}

/// How a call failed, as the `kind` label names it: the disk or database did not
/// take it (or found its data damaged), or a newer owner holds the shard.
fn kind(e: &StateError) -> usize {
    match e {
        StateError::OwnerLost { .. } => 1,
        StateError::Write(_)
        | StateError::Open { .. }
        | StateError::Damaged { .. }
        | StateError::OtherSetUp(_) => 0,
    }
}
const KINDS: [&str; 2] = ["unavailable", "owner_lost"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabel {
    op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    op: &'static str,
    kind: &'static str,
}

/// The series one [`Timed`] store writes, registered by [`crate::metrics`].
#[derive(Clone)]
pub struct StateMetrics {
    durations: Family<OpLabel, Histogram, fn() -> Histogram>,
    errors: Family<ErrorLabels, Counter>,
    by_op: Arc<[(Histogram, [Counter; 2]); Op::ALL.len()]>,
}

fn duration_histogram() -> Histogram {
    // 20 µs (sled without a flush) to ~5 s (a statement timeout).
    Histogram::new(exponential_buckets(0.000_02, 2.0, 18))
}

impl StateMetrics {
    fn new() -> StateMetrics {
        let durations = Family::<OpLabel, Histogram, fn() -> Histogram>::new_with_constructor(
            duration_histogram,
        );
        let errors = Family::<ErrorLabels, Counter>::default();
        let by_op = Op::ALL.map(|op| {
            let h = durations
                .get_or_create(&OpLabel { op: op.as_str() })
                .clone();
            let e = KINDS.map(|kind| {
                errors
                    .get_or_create(&ErrorLabels {
                        op: op.as_str(),
                        kind,
                    })
                    .clone()
            });
            (h, e)
        });
        StateMetrics {
            durations,
            errors,
            by_op: Arc::new(by_op),
        }
    }

    /// Adds `fencegate_state_duration_seconds` and its error counter to `registry`.
    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "fencegate_state_duration_seconds",
            "State store (sled or PostgreSQL) call latency by operation, failures included",
            self.durations.clone(),
        );
        registry.register(
            "fencegate_state_errors",
            "Failed state store calls by operation and kind (unavailable: the disk or database did not take it; owner_lost: a newer owner holds the shard)",
            self.errors.clone(),
        );
    }

    /// Runs `f`, counting it as one call of `op` (its time and failure).
    pub(crate) async fn measure<T>(
        &self,
        op: Op,
        f: impl std::future::Future<Output = Result<T, StateError>>,
    ) -> Result<T, StateError> {
        let start = crate::clock::stopwatch();
        let r = f.await;
        self.record(op, start.elapsed(), &r);
        r
    }

    /// Counts one call of `op` that took `took` and ended `r`.
    fn record<T>(&self, op: Op, took: Duration, r: &Result<T, StateError>) {
        let (h, errors) = &self.by_op[op as usize];
        h.observe(took.as_secs_f64());
        if let Err(e) = r {
            errors[kind(e)].inc();
        }
    }
}

/// A [`StateStore`] that measures the one it wraps.
pub struct Timed {
    inner: Arc<dyn StateStore>,
    metrics: StateMetrics,
}

impl Timed {
    /// Wraps a backend so each call's latency and failure are measured.
    pub fn wrap(inner: Arc<dyn StateStore>) -> (Arc<Timed>, StateMetrics) {
        let metrics = StateMetrics::new();
        let t = Arc::new(Timed {
            inner,
            metrics: metrics.clone(),
        });
        (t, metrics)
    }

    async fn timed<T>(
        &self,
        op: Op,
        f: impl std::future::Future<Output = Result<T, StateError>>,
    ) -> Result<T, StateError> {
        self.metrics.measure(op, f).await
    }
}

#[async_trait]
impl StateStore for Timed {
    async fn marks(&self, lease: &LeaseName) -> Result<LeaseMarks, StateError> {
        self.timed(Op::Marks, self.inner.marks(lease)).await
    }

    async fn raise_mark(
        &self,
        owner: Owner,
        lease: &LeaseName,
        epoch: Epoch,
    ) -> Result<(), StateError> {
        self.timed(Op::RaiseMark, self.inner.raise_mark(owner, lease, epoch))
            .await
    }

    async fn note_drained(
        &self,
        owner: Owner,
        lease: &LeaseName,
        epoch: Epoch,
    ) -> Result<(), StateError> {
        self.timed(
            Op::NoteDrained,
            self.inner.note_drained(owner, lease, epoch),
        )
        .await
    }

    async fn begin(
        &self,
        owner: Owner,
        key: &RecordKey,
        fresh: &Record,
        rules: TakeOver,
    ) -> Result<Begun, StateError> {
        self.timed(Op::Begin, self.inner.begin(owner, key, fresh, rules))
            .await
    }

    async fn finish(&self, owner: Owner, key: &RecordKey, end: End) -> Result<(), StateError> {
        self.timed(Op::Finish, self.inner.finish(owner, key, end))
            .await
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StateError> {
        self.timed(Op::Get, self.inner.get(key)).await
    }

    async fn resolve(
        &self,
        owner: Owner,
        key: &RecordKey,
        how: Resolution,
        now_ms: u64,
    ) -> Result<Resolved, StateError> {
        self.timed(Op::Resolve, self.inner.resolve(owner, key, how, now_ms))
            .await
    }

    async fn list(
        &self,
        state: State,
        route: Option<&str>,
        after: Option<&ListCursor>,
        limit: usize,
    ) -> Result<Listing, StateError> {
        self.timed(Op::List, self.inner.list(state, route, after, limit))
            .await
    }

    async fn sweep(&self, rules: TakeOver) -> Result<usize, StateError> {
        self.timed(Op::Sweep, self.inner.sweep(rules)).await
    }

    async fn recover(&self, owner: Owner, now_ms: u64) -> Result<usize, StateError> {
        self.timed(Op::Recover, self.inner.recover(owner, now_ms))
            .await
    }

    async fn claim_shard(&self, owner: Owner) -> Result<(), StateError> {
        self.timed(Op::ClaimShard, self.inner.claim_shard(owner))
            .await
    }

    fn is_healthy(&self) -> bool {
        self.inner.is_healthy()
    }

    fn set_up_conflict(&self) -> Option<String> {
        self.inner.set_up_conflict()
    }

    async fn check(&self) -> Result<(), StateError> {
        self.timed(Op::Check, self.inner.check()).await
    }

    fn stats(&self) -> CommitStats {
        self.inner.stats()
    }

    async fn close(&self) -> Result<(), StateError> {
        self.timed(Op::Close, self.inner.close()).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store whose every write fails as one that lost its shard.
    struct Deposed;

    #[async_trait]
    impl StateStore for Deposed {
        async fn marks(&self, _: &LeaseName) -> Result<LeaseMarks, StateError> {
            Ok(LeaseMarks::default())
        }
        async fn raise_mark(&self, o: Owner, _: &LeaseName, _: Epoch) -> Result<(), StateError> {
            Err(StateError::OwnerLost {
                ours: o,
                stored: o.generation.next(),
            })
        }
        async fn note_drained(&self, _: Owner, _: &LeaseName, _: Epoch) -> Result<(), StateError> {
            Err(StateError::Write("database away".into()))
        }
        async fn begin(
            &self,
            _: Owner,
            _: &RecordKey,
            _: &Record,
            _: TakeOver,
        ) -> Result<Begun, StateError> {
            Ok(Begun::Claimed)
        }
        async fn finish(&self, _: Owner, _: &RecordKey, _: End) -> Result<(), StateError> {
            Ok(())
        }
        async fn get(&self, _: &RecordKey) -> Result<Option<Record>, StateError> {
            Ok(None)
        }
        async fn resolve(
            &self,
            _: Owner,
            _: &RecordKey,
            _: Resolution,
            _: u64,
        ) -> Result<Resolved, StateError> {
            Ok(Resolved::Missing)
        }
        async fn list(
            &self,
            _: State,
            _: Option<&str>,
            _: Option<&ListCursor>,
            _: usize,
        ) -> Result<Listing, StateError> {
            Ok(Listing::default())
        }
        async fn sweep(&self, _: TakeOver) -> Result<usize, StateError> {
            Ok(0)
        }
        async fn recover(&self, _: Owner, _: u64) -> Result<usize, StateError> {
            Ok(0)
        }
        async fn claim_shard(&self, _: Owner) -> Result<(), StateError> {
            Ok(())
        }
        fn is_healthy(&self) -> bool {
            true
        }
        async fn check(&self) -> Result<(), StateError> {
            Ok(())
        }
        fn stats(&self) -> CommitStats {
            CommitStats::default()
        }
        async fn close(&self) -> Result<(), StateError> {
            Ok(())
        }
    }

    fn render(m: &StateMetrics) -> String {
        let mut registry = Registry::default();
        m.register(&mut registry);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).expect("encodes");
        out
    }

    fn value(text: &str, series: &str) -> String {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ').map(str::to_owned))
            .unwrap_or_else(|| panic!("no {series} in\n{text}"))
    }

    #[tokio::test]
    async fn each_call_is_timed_and_each_failure_counted_by_kind() {
        let (t, m) = Timed::wrap(Arc::new(Deposed));
        let lease = LeaseName::parse("billing").expect("valid");
        let owner = Owner::SINGLE;
        t.marks(&lease).await.expect("reads");
        t.marks(&lease).await.expect("reads");
        assert!(t.raise_mark(owner, &lease, Epoch::new(2)).await.is_err());
        assert!(t.note_drained(owner, &lease, Epoch::new(2)).await.is_err());
        let text = render(&m);
        assert_eq!(
            value(
                &text,
                "fencegate_state_duration_seconds_count{op=\"marks\"}"
            ),
            "2"
        );
        assert_eq!(
            value(
                &text,
                "fencegate_state_duration_seconds_count{op=\"raise_mark\"}"
            ),
            "1"
        );
        assert_eq!(
            value(
                &text,
                "fencegate_state_errors_total{op=\"raise_mark\",kind=\"owner_lost\"}"
            ),
            "1"
        );
        assert_eq!(
            value(
                &text,
                "fencegate_state_errors_total{op=\"note_drained\",kind=\"unavailable\"}"
            ),
            "1"
        );
        assert_eq!(
            value(
                &text,
                "fencegate_state_errors_total{op=\"marks\",kind=\"unavailable\"}"
            ),
            "0"
        );
    }
}
