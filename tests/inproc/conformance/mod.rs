//! The `StateStore` conformance suite (issue 26): one set of behaviour tests,
//! written once against `Arc<dyn StateStore>`, run on every backend — as slatedb
//! runs one suite on each object store.
//!
//! Each rule is an `async fn RULE(s: Subject)`, declared with [`conformance!`]
//! as four tests, `RULE::sled`, `RULE::postgres`, `RULE::faulty_sled` and
//! `RULE::faulty_postgres`: sled in a temporary directory, a fresh database on the test run's PostgreSQL
//! ([`PgServer::shared`]; skipped, saying why, only when PostgreSQL is not
//! installed and `FENCEGATE_TEST_REQUIRE_POSTGRES` is unset), and each of them
//! behind the fault-injecting [`FaultState`] with latency on every call. The
//! tests of `faults.rs` add errors and unknown outcomes through that wrapper and
//! check what they left by reading the inner store.
//!
//! Every test's doc names the rule it checks and where SPEC (or the trait's
//! documentation in `src/state/mod.rs`) states it. Where the backends disagree
//! on a rule, the test states the rule and is ignored on the backend that breaks
//! it, with the exact difference as the reason (`cargo test -- --ignored` shows
//! it failing there).
//!
//! - `records.rs`: claims, outcomes, resolutions, recovery, listings, sweeps.
//! - `marks.rs`: marks and drained notes, owner generations, durability across
//!   a close and reopen, readiness and membership.
//! - `faults.rs`: errors, unknown outcomes and latency.
//! - `queue.rs`: the `QueueStore` suite (SPEC §11), through `TimedQueue` and
//!   the fault-injecting `FaultQueue` (`fault_queue.rs`).

mod fault_queue;
mod fault_state;
mod faults;
mod marks;
mod queue;
mod records;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fencegate::config::{StateConfig, StateKind};
use fencegate::epoch::{Epoch, LeaseName};
use fencegate::state::postgres::PostgresState;
use fencegate::state::sled::SledState;
use fencegate::state::{
    End, Generation, ListCursor, Owner, Record, RecordKey, RequestLine, State, StateError,
    StateStore, StoredResponse, TakeOver,
};

pub use fault_state::{Fault, FaultState, Op, Rule};

use crate::common::postgres::{available_or_skip, PgServer};

/// The latency the faulty variants add before and after every call.
pub const LATENCY: Duration = Duration::from_millis(1);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sled,
    Postgres,
}

/// Where a backend keeps its state, to open it again.
enum Place {
    Sled(tempfile::TempDir),
    Postgres(String),
}

/// The store a conformance test runs on.
pub struct Subject {
    pub backend: Backend,
    /// What the test calls: the backend, or [`FaultState`] in front of it.
    pub store: Arc<dyn StateStore>,
    /// The backend itself: what a faulted call left, read past the faults.
    pub inner: Arc<dyn StateStore>,
    /// The fault wrapper, in the faulty variants.
    faults: Option<Arc<FaultState>>,
    place: Place,
}

impl Subject {
    /// A fresh, empty store; `None` (after saying why) when the backend cannot
    /// run here.
    pub async fn new(backend: Backend, faulty: bool) -> Option<Subject> {
        let place = match backend {
            Backend::Sled => Place::Sled(tempfile::tempdir().expect("tempdir")),
            Backend::Postgres => {
                if !available_or_skip() {
                    return None;
                }
                Place::Postgres(PgServer::shared().database())
            }
        };
        Some(Subject::open(backend, place, faulty).await)
    }

    async fn open(backend: Backend, place: Place, faulty: bool) -> Subject {
        let inner: Arc<dyn StateStore> = match &place {
            Place::Sled(dir) => open_sled(dir.path()).await,
            Place::Postgres(url) => PostgresState::connect(&StateConfig {
                kind: StateKind::Postgres,
                url: Some(url.clone()),
                ..StateConfig::default()
            })
            .await
            .expect("connecting to the test database"),
        };
        let faults = faulty.then(|| {
            let f = FaultState::new(inner.clone());
            f.add(Rule::any(Fault::Latency(LATENCY)));
            f
        });
        let store = match &faults {
            Some(f) => f.clone() as Arc<dyn StateStore>,
            None => inner.clone(),
        };
        Subject {
            backend,
            store,
            inner,
            faults,
            place,
        }
    }

    /// The fault wrapper; only the faulty variants have one.
    pub fn faults(&self) -> Option<&FaultState> {
        self.faults.as_deref()
    }

    /// Closes the store and opens what it kept again: sled's directory, or a new
    /// connection pool on the same database. (The wrapper starts again with its
    /// standing latency only.)
    pub async fn reopen(self) -> Subject {
        let Subject {
            backend,
            store,
            inner,
            faults,
            place,
        } = self;
        store.close().await.expect("closing the store");
        drop((store, inner));
        let faulty = faults.is_some();
        drop(faults);
        Subject::open(backend, place, faulty).await
    }
}

/// Opens sled in `dir` once an earlier handle has let go of the directory's lock
/// (sled's own flusher keeps it for up to its flush interval after the last
/// handle is dropped; a restarted process never waits).
async fn open_sled(dir: &Path) -> Arc<dyn StateStore> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match SledState::open(dir) {
            Ok(s) => return s,
            Err(StateError::Open { detail, .. })
                if detail.contains("another fencegate process") && Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(e) => panic!("opening sled: {e}"),
        }
    }
}

/// Runs `rule` on a fresh store of `backend` (behind [`FaultState`] if
/// `faulty`), unless the backend cannot run here.
pub async fn run<F, Fut>(backend: Backend, faulty: bool, rule: F)
where
    F: FnOnce(Subject) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    if let Some(s) = Subject::new(backend, faulty).await {
        rule(s).await
    }
}

/// The fault wrapper of a faulty subject.
pub fn faults(s: &Subject) -> &FaultState {
    s.faults().expect("a subject behind the fault wrapper")
}

/// Declares each rule — an `async fn RULE(s: Subject)` of the calling module —
/// as four tests (see the module docs), in a module named after it.
/// `#[differs(sled = "…")]` or `#[differs(postgres = "…")]` ignores the rule on
/// that backend (and its faulty variant), giving the exact difference as the
/// reason.
macro_rules! conformance {
    ($(
        $(#[differs(sled = $sled:literal)])?
        $(#[differs(postgres = $pg:literal)])?
        $name:ident
    ),* $(,)?) => {$(
        mod $name {
            use $crate::conformance::{run, Backend};

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            $(#[ignore = $sled])?
            async fn sled() {
                run(Backend::Sled, false, super::$name).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            $(#[ignore = $pg])?
            async fn postgres() {
                run(Backend::Postgres, false, super::$name).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            $(#[ignore = $sled])?
            async fn faulty_sled() {
                run(Backend::Sled, true, super::$name).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            $(#[ignore = $pg])?
            async fn faulty_postgres() {
                run(Backend::Postgres, true, super::$name).await
            }
        }
    )*};
}
pub(crate) use conformance;

/// Declares each fault rule — an `async fn RULE(s: Subject)` that adds faults
/// through [`faults`] — as two tests, `RULE::sled` and `RULE::postgres`, both
/// behind [`FaultState`] (the rule's faults come before the standing latency).
macro_rules! under_faults {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            use $crate::conformance::{run, Backend};

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sled() {
                run(Backend::Sled, true, super::$name).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                run(Backend::Postgres, true, super::$name).await
            }
        }
    )*};
}
pub(crate) use under_faults;

// ---------------------------------------------------------------------------
// What the tests write.

/// A single instance's owner (SPEC §10.1).
pub const SINGLE: Owner = Owner::SINGLE;

/// A cluster's owner of `shard` under `generation` (SPEC §10.2).
pub fn owner(shard: u32, generation: u64) -> Owner {
    Owner {
        shard,
        generation: Generation::new(generation),
    }
}

pub fn rkey(route: &str, key: &str) -> RecordKey {
    RecordKey {
        route: route.into(),
        key: key.into(),
    }
}

pub fn lease(name: &str) -> LeaseName {
    LeaseName::parse(name).expect("a lease name")
}

/// A claim as `Dedup::begin` makes it: `in_flight`, created and updated `at`.
pub fn claim(fp: u8, at: u64) -> Record {
    Record {
        state: State::InFlight,
        fingerprint: [fp; 32],
        epoch: Epoch::new(u64::from(fp) + 1),
        created_ms: at,
        updated_ms: at,
        response: None,
        request: Some(RequestLine::new("POST", &format!("/pay/{fp}?secret=x"))),
    }
}

pub fn response(status: u16, body: Option<&'static [u8]>) -> StoredResponse {
    StoredResponse {
        status,
        headers: vec![
            ("content-type".into(), b"text/plain".to_vec()),
            ("x-origin".into(), vec![0xff, 0x00, b'a']),
        ],
        body: body.map(bytes::Bytes::from_static),
    }
}

/// The outcome `Dedup::finish` writes for a claim `claimed` answered `at`: the
/// ticket's record (the claim it made) with the outcome.
pub fn done(claimed: &Record, at: u64, resp: StoredResponse) -> End {
    End::Done(Record {
        state: State::Done,
        updated_ms: at,
        response: Some(resp),
        ..claimed.clone()
    })
}

/// `Dedup::finish`'s unknown outcome for a claim `claimed`, `at`.
pub fn in_doubt(claimed: &Record, at: u64) -> End {
    End::InDoubt(Record {
        state: State::InDoubt,
        updated_ms: at,
        ..claimed.clone()
    })
}

/// Claims never take anything over.
pub const STRICT: TakeOver = TakeOver {
    in_doubt: false,
    done_before_ms: 0,
};

/// `in_doubt = "resend"`, nothing expired.
pub const RESEND: TakeOver = TakeOver {
    in_doubt: true,
    done_before_ms: 0,
};

/// `done` records that became done before `ms` have expired.
pub fn expired_before(ms: u64) -> TakeOver {
    TakeOver {
        in_doubt: false,
        done_before_ms: ms,
    }
}

/// Claims `key` on `s` and checks it was claimed.
pub async fn claimed(s: &dyn StateStore, o: Owner, key: &RecordKey, fresh: &Record) {
    match s.begin(o, key, fresh, STRICT).await {
        Ok(fencegate::state::Begun::Claimed) => {}
        other => panic!("claiming {key:?}: {other:?}"),
    }
}

/// The record of `key`, read from `s`.
pub async fn get(s: &dyn StateStore, key: &RecordKey) -> Option<Record> {
    s.get(key).await.expect("reading a record")
}

/// Everything the store keeps about `keys` and `leases`, and how many records
/// are in each state, as text to compare before and after a call.
pub async fn snapshot(s: &dyn StateStore, keys: &[RecordKey], leases: &[LeaseName]) -> String {
    let mut out = String::new();
    for k in keys {
        out += &format!("{}/{}: {:?}\n", k.route, k.key, get(s, k).await);
    }
    for l in leases {
        out += &format!("{l:?}: {:?}\n", s.marks(l).await.expect("marks"));
    }
    for st in [State::InFlight, State::Done, State::InDoubt] {
        let n = s.list(st, None, None, 0).await.expect("list").total;
        out += &format!("{}: {n}\n", st.as_str());
    }
    out
}

/// Every record in `state` (on `route`), page by page of `page`, following the
/// cursor as the admin API does.
pub async fn list_all(
    s: &dyn StateStore,
    state: State,
    route: Option<&str>,
    page: usize,
) -> Vec<RecordKey> {
    let mut out = Vec::new();
    let mut after: Option<ListCursor> = None;
    loop {
        let l = s
            .list(state, route, after.as_ref(), page)
            .await
            .expect("list");
        let Some((k, r)) = l.records.last() else {
            return out;
        };
        after = Some(ListCursor {
            created_ms: r.created_ms,
            key: k.clone(),
        });
        let n = l.records.len();
        out.extend(l.records.into_iter().map(|(k, _)| k));
        if n < page {
            return out;
        }
    }
}
