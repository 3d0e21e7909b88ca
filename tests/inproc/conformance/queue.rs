//! The `QueueStore` conformance suite (issue 44): SPEC §11's store rules,
//! written once against `Arc<dyn QueueStore>` and run on sled and on
//! PostgreSQL, each behind the `TimedQueue` wrapper the server puts in front
//! of it (so the wrapper is shown to pass every call on as it came) and the
//! test's [`FaultQueue`], through which the last rules fault writes.

use std::sync::Arc;

use bytes::Bytes;
use fencegate::config::{StateConfig, StateKind};
use fencegate::queue::message::QueueBound;
use fencegate::queue::postgres::PgQueue;
use fencegate::queue::sled::SledQueue;
use fencegate::queue::timed::TimedQueue;
use fencegate::queue::{Accepted, Listing, Message, QueueStore, Requeued, Status};
use fencegate::state::postgres::PostgresState;
use fencegate::state::sled::SledState;
use fencegate::state::timed::Timed;
use fencegate::state::{Generation, Owner, StateError, StateStore};

use super::fault_queue::{FaultQueue, QOp};
use super::{Backend, Fault};
use crate::common::postgres::{available_or_skip, PgServer};
use crate::common::queue::{envelope, message};

/// A queue store to test, and what it runs under.
pub struct QueueSubject {
    pub backend: Backend,
    pub store: Arc<dyn QueueStore>,
    /// The fault wrapper `store` is.
    pub faults: Arc<FaultQueue>,
    /// The owner its writes are made under (a claimed shard on PostgreSQL).
    pub owner: Owner,
    /// On PostgreSQL, the state, to claim the shard again (a takeover).
    pg: Option<Arc<PostgresState>>,
    _dir: Option<tempfile::TempDir>,
}

impl QueueSubject {
    async fn new(backend: Backend) -> Option<QueueSubject> {
        match backend {
            Backend::Sled => {
                let dir = tempfile::tempdir().expect("tempdir");
                let sled = SledState::open(&dir.path().join("state")).expect("sled");
                let (_, metrics) = Timed::wrap(sled.clone() as Arc<dyn StateStore>);
                let timed =
                    TimedQueue::wrap(Arc::new(SledQueue::open(sled).expect("queue")), metrics);
                let faults = FaultQueue::new(timed);
                Some(QueueSubject {
                    backend,
                    store: faults.clone(),
                    faults,
                    owner: Owner::SINGLE,
                    pg: None,
                    _dir: Some(dir),
                })
            }
            Backend::Postgres => {
                if !available_or_skip() {
                    return None;
                }
                let pg = PostgresState::connect(&StateConfig {
                    kind: StateKind::Postgres,
                    url: Some(PgServer::shared().database()),
                    ..StateConfig::default()
                })
                .await
                .expect("connecting to the test database");
                let owner = Owner {
                    shard: 0,
                    generation: Generation::new(1),
                };
                pg.claim_shard(owner).await.expect("claiming shard 0");
                let (_, metrics) = Timed::wrap(pg.clone() as Arc<dyn StateStore>);
                let timed = TimedQueue::wrap(Arc::new(PgQueue::new(pg.clone())), metrics);
                let faults = FaultQueue::new(timed);
                Some(QueueSubject {
                    backend,
                    store: faults.clone(),
                    faults,
                    owner,
                    pg: Some(pg),
                    _dir: None,
                })
            }
        }
    }
}

pub async fn run<F, Fut>(backend: Backend, rule: F)
where
    F: FnOnce(QueueSubject) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    if let Some(s) = QueueSubject::new(backend).await {
        rule(s).await
    }
}

macro_rules! queue_conformance {
    ($(
        $(#[differs(sled = $sled:literal)])?
        $name:ident
    ),* $(,)?) => {$(
        mod $name {
            use super::run;
            use $crate::conformance::Backend;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            $(#[ignore = $sled])?
            async fn sled() {
                run(Backend::Sled, super::$name).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                run(Backend::Postgres, super::$name).await
            }
        }
    )*};
}

queue_conformance!(
    places_follow_acceptance_and_a_key_is_one_message,
    acceptances_at_once_are_each_one_message_in_distinct_places,
    a_listing_pages_in_one_order_and_filters_by_time,
    a_settled_head_lets_the_next_go_and_only_a_failed_message_keeps_its_request,
    a_retry_behind_a_newer_epoch_is_superseded,
    #[differs(sled = "sled has one owner: its writes name none")]
    a_deposed_owners_writes_fail,
    an_acceptance_whose_answer_was_lost_is_one_message,
    an_attempt_start_refused_leaves_the_message_pending,
    a_settlement_whose_answer_was_lost_has_settled,
);

/// What the store answers to `key` at `epoch`, its pass `admitted` or not.
async fn try_accept(
    s: &QueueSubject,
    key: &str,
    epoch: u64,
    admitted: bool,
) -> Result<Accepted, StateError> {
    s.store
        .accept(
            s.owner,
            message(key, epoch),
            &envelope(),
            &QueueBound::NONE,
            Arc::new(move || admitted),
        )
        .await
}

/// `key` at `epoch`, accepted as a new message.
async fn accept(s: &QueueSubject, key: &str, epoch: u64) -> Message {
    match try_accept(s, key, epoch, true).await.expect("accept") {
        Accepted::New(m) => m,
        other => panic!("{other:?}"),
    }
}

/// SPEC §11 "Accepting": places follow acceptance; the same key again is the
/// message already kept; a pass aborted before its place is taken takes none.
async fn places_follow_acceptance_and_a_key_is_one_message(s: QueueSubject) {
    let m1 = accept(&s, "m1", 1).await;
    let m2 = accept(&s, "m2", 1).await;
    assert!(m1.seq < m2.seq);
    let again = try_accept(&s, "m1", 1, true).await.unwrap();
    assert!(matches!(again, Accepted::Exists(m) if m.seq == m1.seq));
    let aborted = try_accept(&s, "m3", 1, false).await.unwrap();
    assert!(matches!(aborted, Accepted::Aborted));
    assert!(s.store.get("hook", "m3").await.unwrap().is_none());
    assert_eq!(
        s.store.head("hook").await.unwrap().map(|m| m.key),
        Some("m1".to_owned())
    );
    assert_eq!(
        s.store.leases_with_work().await.unwrap(),
        vec!["hook".to_owned()]
    );
}

/// Acceptances that arrive together (batched into one transaction where the
/// store batches): each key is one message, the same key twice is the message
/// of the first, an aborted pass takes no place, and the places are distinct
/// and follow the keys' first acceptance among those placed.
async fn acceptances_at_once_are_each_one_message_in_distinct_places(s: QueueSubject) {
    let first = accept(&s, "k0", 1).await;
    let s = Arc::new(s);
    let keys = ["k1", "k2", "k1", "k0", "k3", "k2", "k4"];
    let tries: Vec<_> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| {
            let (s, k) = (s.clone(), k.to_string());
            // The fifth (k3) was aborted before its place.
            tokio::spawn(async move { try_accept(&s, &k, 1, i != 4).await.unwrap() })
        })
        .collect();
    let mut by_key: std::collections::HashMap<String, Vec<Accepted>> = Default::default();
    for (k, t) in keys.iter().zip(tries) {
        by_key
            .entry(k.to_string())
            .or_default()
            .push(t.await.unwrap());
    }
    assert!(matches!(&by_key["k0"][..], [Accepted::Exists(m)] if m.seq == first.seq));
    assert!(matches!(&by_key["k3"][..], [Accepted::Aborted]));
    assert!(s.store.get("hook", "k3").await.unwrap().is_none());
    let mut seqs = vec![first.seq];
    for k in ["k1", "k2", "k4"] {
        let kept = s.store.get("hook", k).await.unwrap().expect("kept");
        for a in &by_key[k] {
            match a {
                Accepted::New(m) | Accepted::Exists(m) => assert_eq!(m.seq, kept.seq, "{k}"),
                other => panic!("{k}: {other:?}"),
            }
        }
        assert_eq!(
            by_key[k]
                .iter()
                .filter(|a| matches!(a, Accepted::New(_)))
                .count(),
            1,
            "{k} placed once"
        );
        seqs.push(kept.seq);
    }
    let mut sorted = seqs.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), 4, "distinct places: {seqs:?}");
    assert!(seqs[1..].iter().all(|q| *q > first.seq), "{seqs:?}");
}

/// SPEC §11 `GET /v1/deliveries` (issue 48): one order on every store (route,
/// then key, as bytes), pages that follow one another through `after` with
/// every message once, a total that counts every match whatever the page, and
/// `since`/`until` on the acceptance time.
async fn a_listing_pages_in_one_order_and_filters_by_time(s: QueueSubject) {
    let keys = ["b", "a", "C", "a-2", "é", "z"];
    for (i, k) in keys.iter().enumerate() {
        let mut m = message(k, 1);
        m.accepted_ms = 1_000 * (i as u64 + 1);
        s.store
            .accept(
                s.owner,
                m,
                &envelope(),
                &QueueBound::NONE,
                Arc::new(|| true),
            )
            .await
            .unwrap();
    }
    s.store.durable().await.unwrap();
    let mut seen = Vec::new();
    let mut after = None;
    loop {
        let l = Listing {
            route: Some("hook".into()),
            after: after.clone(),
            limit: 4,
            ..Listing::default()
        };
        let (page, total) = s.store.list(&l).await.unwrap();
        assert_eq!(total, 6);
        seen.extend(page.iter().map(|m| m.key.clone()));
        match page.last() {
            Some(m) if page.len() == 4 => after = Some((m.route.clone(), m.key.clone())),
            _ => break,
        }
    }
    let mut bytewise: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
    bytewise.sort();
    assert_eq!(seen, bytewise, "each once, by key as bytes");
    let window = Listing {
        since_ms: Some(2_000),
        until_ms: Some(5_000),
        limit: 100,
        ..Listing::default()
    };
    let (page, total) = s.store.list(&window).await.unwrap();
    let mut got: Vec<_> = page.iter().map(|m| m.key.as_str()).collect();
    got.sort();
    assert_eq!((got, total), (vec!["C", "a", "a-2"], 3));
}

/// SPEC §11: settling the head lets the next one go; a delivered or dropped
/// message's request is gone with its settlement, a failed one's is kept for
/// an operator's retry.
async fn a_settled_head_lets_the_next_go_and_only_a_failed_message_keeps_its_request(
    s: QueueSubject,
) {
    let mut m1 = accept(&s, "m1", 1).await;
    let mut m2 = accept(&s, "m2", 1).await;
    let mut m3 = accept(&s, "m3", 1).await;
    m1.status = Status::Delivered;
    s.store.settle(s.owner, &m1).await.unwrap();
    assert_eq!(
        s.store.head("hook").await.unwrap().map(|m| m.key),
        Some("m2".into())
    );
    m2.status = Status::Failed;
    s.store.settle(s.owner, &m2).await.unwrap();
    m3.status = Status::Dropped;
    s.store.settle(s.owner, &m3).await.unwrap();
    s.store.durable().await.unwrap();
    assert!(s.store.head("hook").await.unwrap().is_none());
    assert!(
        s.store.envelope("hook", "m1").await.unwrap().is_none(),
        "delivered"
    );
    assert!(
        s.store.envelope("hook", "m3").await.unwrap().is_none(),
        "dropped"
    );
    assert_eq!(
        s.store
            .envelope("hook", "m2")
            .await
            .unwrap()
            .map(|e| e.body),
        Some(Bytes::from_static(b"body")),
        "failed: kept for a retry"
    );
    if s.backend == Backend::Sled {
        let held = s
            .store
            .held_by_route()
            .map(|h| h.iter().map(|(_, h)| h.messages).sum::<u64>());
        assert_eq!(held, Some(1), "what is kept is counted");
    }
}

/// SPEC §11 "operator's actions": a failed message goes back to the end of
/// its lease's queue, unless an attempt of a newer epoch's message was started
/// — then it is superseded.
async fn a_retry_behind_a_newer_epoch_is_superseded(s: QueueSubject) {
    let mut m1 = accept(&s, "m1", 1).await;
    m1.status = Status::Failed;
    s.store.settle(s.owner, &m1).await.unwrap();
    let back = s.store.requeue(s.owner, "hook", "m1", 5).await.unwrap();
    assert!(matches!(back, Requeued::Done(_)), "{back:?}");
    let mut again = s.store.head("hook").await.unwrap().expect("m1 is back");
    again.status = Status::Failed;
    s.store.settle(s.owner, &again).await.unwrap();
    let mut m2 = accept(&s, "m2", 2).await;
    m2.status = Status::Delivering;
    m2.attempts = 1;
    s.store.start_attempt_unflushed(s.owner, &m2).await.unwrap();
    s.store.durable().await.unwrap();
    assert_eq!(s.store.sent_epoch("hook").await.unwrap(), 2);
    let superseded = s.store.requeue(s.owner, "hook", "m1", 6).await.unwrap();
    assert!(
        matches!(superseded, Requeued::Superseded(2)),
        "{superseded:?}"
    );
}

/// SPEC §10.2, §11: once a newer owner holds the shard, every queue write of
/// the deposed one fails (`owner_lost`) and changes nothing.
async fn a_deposed_owners_writes_fail(s: QueueSubject) {
    let m1 = accept(&s, "m1", 1).await;
    let pg = s.pg.clone().expect("PostgreSQL");
    pg.claim_shard(Owner {
        shard: 0,
        generation: Generation::new(2),
    })
    .await
    .unwrap();
    let mut started = m1.clone();
    started.status = Status::Delivering;
    let r = s.store.start_attempt_unflushed(s.owner, &started).await;
    assert!(matches!(r, Err(StateError::OwnerLost { .. })), "{r:?}");
    let r = try_accept(&s, "m2", 1, true).await;
    assert!(matches!(r, Err(StateError::OwnerLost { .. })), "{r:?}");
    assert_eq!(
        s.store
            .head("hook")
            .await
            .unwrap()
            .map(|m| (m.key, m.status)),
        Some(("m1".into(), Status::Pending))
    );
}

/// SPEC §11, "durable boundaries": an acceptance applied whose answer was lost
/// (a COMMIT acknowledged to no one) leaves one message, found by the worker's
/// retry of its key.
async fn an_acceptance_whose_answer_was_lost_is_one_message(s: QueueSubject) {
    s.faults.once(QOp::Accept, Fault::Unknown);
    let lost = try_accept(&s, "m1", 1, true).await;
    assert!(lost.is_err());
    s.store.durable().await.unwrap();
    let again = try_accept(&s, "m1", 1, true).await.unwrap();
    assert!(matches!(again, Accepted::Exists(_)), "{again:?}");
    let (listed, total) = s
        .store
        .list(&Listing {
            route: Some("hook".into()),
            limit: 10,
            ..Listing::default()
        })
        .await
        .unwrap();
    assert_eq!((listed.len(), total), (1, 1));
}

/// SPEC §11: an attempt whose start could not be written is not sent — the
/// message stays pending, and no epoch counts as sent.
async fn an_attempt_start_refused_leaves_the_message_pending(s: QueueSubject) {
    let m1 = accept(&s, "m1", 3).await;
    let mut started = m1.clone();
    started.status = Status::Delivering;
    started.attempts = 1;
    s.faults.once(QOp::Attempt, Fault::Fail);
    assert!(s
        .store
        .start_attempt_unflushed(s.owner, &started)
        .await
        .is_err());
    s.store.durable().await.unwrap();
    let now = s.store.get("hook", "m1").await.unwrap().expect("kept");
    assert_eq!((now.status, now.attempts), (Status::Pending, 0));
    assert_eq!(s.store.sent_epoch("hook").await.unwrap(), 0);
}

/// SPEC §11: a settlement applied whose answer was lost has settled: the next
/// message is the head, and the delivered one's request is gone.
async fn a_settlement_whose_answer_was_lost_has_settled(s: QueueSubject) {
    let mut m1 = accept(&s, "m1", 1).await;
    accept(&s, "m2", 1).await;
    m1.status = Status::Delivered;
    s.faults.once(QOp::Settle, Fault::Unknown);
    assert!(s.store.settle(s.owner, &m1).await.is_err());
    s.store.durable().await.unwrap();
    assert_eq!(
        s.store.get("hook", "m1").await.unwrap().map(|m| m.status),
        Some(Status::Delivered)
    );
    assert_eq!(
        s.store.head("hook").await.unwrap().map(|m| m.key),
        Some("m2".into())
    );
    assert!(s.store.envelope("hook", "m1").await.unwrap().is_none());
}
