//! Faults (issue 26; SPEC §6 and the durability notes of `src/state/mod.rs`):
//! every write the state store takes, refused before it reaches the backend,
//! applied with its answer lost, or slowed — on sled and on PostgreSQL.
//!
//! A refused call must change nothing (checked through the inner store); a call
//! whose answer was lost must have done exactly what the same call answered
//! would have (checked against a clean run of it on keys of its own), and
//! reading back must tell the caller which; nothing may panic, and the store
//! works on afterwards.

use std::time::Duration;

use fencegate::state::{Begun, End, Resolution, Resolved, State, StateError, StateStore};

use super::*;

/// One write the store may be asked for. Each run of it has keys, a lease and
/// a shard of its own, named by a tag.
#[derive(Debug, Clone, Copy)]
enum Call {
    RaiseMark,
    NoteDrained,
    Claim,
    Resend,
    TakeOverExpired,
    FinishDone,
    FinishInDoubt,
    FinishDelete,
    Delivered,
    NotDelivered,
    Recover,
    Sweep,
    ClaimShard,
}

impl Call {
    const ALL: [Call; 13] = [
        Call::RaiseMark,
        Call::NoteDrained,
        Call::Claim,
        Call::Resend,
        Call::TakeOverExpired,
        Call::FinishDone,
        Call::FinishInDoubt,
        Call::FinishDelete,
        Call::Delivered,
        Call::NotDelivered,
        Call::Recover,
        Call::Sweep,
        Call::ClaimShard,
    ];

    fn op(self) -> Op {
        match self {
            Call::RaiseMark => Op::RaiseMark,
            Call::NoteDrained => Op::NoteDrained,
            Call::Claim | Call::Resend | Call::TakeOverExpired => Op::Begin,
            Call::FinishDone | Call::FinishInDoubt | Call::FinishDelete => Op::Finish,
            Call::Delivered | Call::NotDelivered => Op::Resolve,
            Call::Recover => Op::Recover,
            Call::Sweep => Op::Sweep,
            Call::ClaimShard => Op::ClaimShard,
        }
    }

    /// The state the call starts from, on `run`'s keys.
    async fn prepare(self, s: &dyn StateStore, run: &Run) {
        let (k, c) = (&run.key, claim(1, 1_000));
        match self {
            Call::RaiseMark => s
                .raise_mark(SINGLE, &run.lease, Epoch::new(3))
                .await
                .unwrap(),
            Call::NoteDrained => {
                s.raise_mark(SINGLE, &run.lease, Epoch::new(7))
                    .await
                    .unwrap();
                s.note_drained(SINGLE, &run.lease, Epoch::new(2))
                    .await
                    .unwrap();
            }
            Call::Claim => {}
            Call::FinishDone | Call::FinishInDoubt | Call::FinishDelete => {
                claimed(s, SINGLE, k, &c).await
            }
            Call::Resend | Call::Delivered | Call::NotDelivered => {
                claimed(s, SINGLE, k, &c).await;
                s.finish(SINGLE, k, in_doubt(&c, 1_100)).await.unwrap();
            }
            Call::TakeOverExpired => {
                claimed(s, SINGLE, k, &c).await;
                s.finish(SINGLE, k, done(&c, 1_100, response(200, None)))
                    .await
                    .unwrap();
            }
            Call::Recover => claimed(s, SINGLE, k, &c).await,
            // Done long before every other record of these tests.
            Call::Sweep => {
                claimed(s, SINGLE, k, &claim(1, 10)).await;
                s.finish(SINGLE, k, done(&claim(1, 10), 100, response(200, None)))
                    .await
                    .unwrap();
            }
            Call::ClaimShard => s.claim_shard(run.owner(1)).await.unwrap(),
        }
    }

    /// The call itself; what it answered, as text.
    async fn call(self, s: &dyn StateStore, run: &Run) -> Result<String, StateError> {
        let (k, c) = (&run.key, claim(1, 1_000));
        let shown = |b: Begun| format!("{b:?}");
        match self {
            Call::RaiseMark => s
                .raise_mark(SINGLE, &run.lease, Epoch::new(7))
                .await
                .map(|()| "ok".into()),
            Call::NoteDrained => s
                .note_drained(SINGLE, &run.lease, Epoch::new(5))
                .await
                .map(|()| "ok".into()),
            Call::Claim => s.begin(SINGLE, k, &c, STRICT).await.map(shown),
            Call::Resend => s
                .begin(SINGLE, k, &claim(1, 5_000), RESEND)
                .await
                .map(shown),
            Call::TakeOverExpired => s
                .begin(SINGLE, k, &claim(2, 5_000), expired_before(2_000))
                .await
                .map(shown),
            Call::FinishDone => s
                .finish(SINGLE, k, done(&c, 1_500, response(201, Some(b"made"))))
                .await
                .map(|()| "ok".into()),
            Call::FinishInDoubt => s
                .finish(SINGLE, k, in_doubt(&c, 1_500))
                .await
                .map(|()| "ok".into()),
            Call::FinishDelete => s.finish(SINGLE, k, End::Delete).await.map(|()| "ok".into()),
            Call::Delivered => s
                .resolve(SINGLE, k, Resolution::Delivered, 1_500)
                .await
                .map(|r| format!("{r:?}")),
            Call::NotDelivered => s
                .resolve(SINGLE, k, Resolution::NotDelivered, 1_500)
                .await
                .map(|r| format!("{r:?}")),
            Call::Recover => s
                .recover(SINGLE, 1_500)
                .await
                .map(|n| format!("{n} recovered")),
            Call::Sweep => s
                .sweep(expired_before(200))
                .await
                .map(|n| format!("{n} swept")),
            Call::ClaimShard => s.claim_shard(run.owner(2)).await.map(|()| "ok".into()),
        }
    }

    /// What the call may change on `run`'s keys, as text without the tag: the
    /// record, the marks, and for a shard claim whether the older generation
    /// is refused (probed with a write of its own lease, after the rest is read).
    async fn observe(self, s: &dyn StateStore, run: &Run) -> String {
        let mut out = format!(
            "record: {:?}\nmarks: {:?}\n",
            get(s, &run.key).await,
            s.marks(&run.lease).await.unwrap()
        );
        if let Call::ClaimShard = self {
            let probe = match s.raise_mark(run.owner(1), &run.probe, Epoch::new(1)).await {
                Err(StateError::OwnerLost { stored, .. }) => format!("lost to {stored}"),
                other => format!("{other:?}"),
            };
            out += &format!("generation 1 writes: {probe}\n");
        }
        out
    }
}

/// The keys of one run of a [`Call`].
struct Run {
    key: RecordKey,
    lease: LeaseName,
    /// A lease only a shard claim's probe writes.
    probe: LeaseName,
    shard: u32,
}

impl Run {
    fn new(call: Call, n: u32, what: &str) -> Run {
        let tag = format!("{call:?}-{what}").to_lowercase();
        Run {
            key: rkey("pay", &tag),
            lease: lease(&tag),
            probe: lease(&format!("{tag}-probe")),
            shard: 100 + n,
        }
    }

    fn owner(&self, generation: u64) -> Owner {
        owner(self.shard, generation)
    }
}

/// How many records are in each state: what a refused call must not change
/// beyond its own keys either.
async fn totals(s: &dyn StateStore) -> String {
    let mut out = String::new();
    for st in [State::InFlight, State::Done, State::InDoubt] {
        let n = s.list(st, None, None, 0).await.unwrap().total;
        out += &format!("{}: {n} ", st.as_str());
    }
    out
}

/// Issue 26 (errors before the call): every write refused before it reaches the
/// store fails with a `Write` error and leaves the store as it was — its
/// record, its marks, its shard's generation, and every count; the same call
/// then goes through.
async fn a_refused_write_changes_nothing(s: Subject) {
    let f = faults(&s);
    let mut wrong = Vec::new();
    for (n, call) in Call::ALL.into_iter().enumerate() {
        let run = Run::new(call, n as u32, "refused");
        call.prepare(&*s.store, &run).await;
        let before = (totals(&*s.inner).await, call.observe(&*s.inner, &run).await);
        f.add(Rule::new(call.op(), Fault::Fail).once());
        match call.call(&*s.store, &run).await {
            Err(StateError::Write(m)) if m.starts_with("injected") => {}
            other => wrong.push(format!("{call:?} answered {other:?}")),
        }
        let after = (totals(&*s.inner).await, call.observe(&*s.inner, &run).await);
        if after != before {
            wrong.push(format!(
                "{call:?} changed the store:\n{before:?}\n{after:?}"
            ));
        }
        // Not refused any more: it goes through.
        if let Err(e) = call.call(&*s.store, &run).await {
            wrong.push(format!("{call:?} after the refusal: {e}"));
        }
    }
    assert_eq!(f.fired(), Call::ALL.len());
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    s.store.check().await.unwrap();
}

/// Issue 26 (unknown outcomes): a write applied whose answer is lost leaves the
/// store exactly as the same write answered does (compared on keys of its own),
/// so reading back tells the caller what happened.
async fn a_write_whose_answer_is_lost_did_what_it_would_have(s: Subject) {
    let f = faults(&s);
    let mut wrong = Vec::new();
    for (n, call) in Call::ALL.into_iter().enumerate() {
        let lost = Run::new(call, 2 * n as u32, "lost");
        call.prepare(&*s.store, &lost).await;
        f.add(Rule::new(call.op(), Fault::Unknown).once());
        if call.call(&*s.store, &lost).await.is_ok() {
            wrong.push(format!("{call:?}: the lost answer was not an error"));
        }
        let after_lost = call.observe(&*s.inner, &lost).await;
        let clean = Run::new(call, 2 * n as u32 + 1, "clean");
        call.prepare(&*s.store, &clean).await;
        if let Err(e) = call.call(&*s.store, &clean).await {
            wrong.push(format!("{call:?} answered: {e}"));
        }
        let after_clean = call.observe(&*s.inner, &clean).await;
        if after_lost != after_clean {
            wrong.push(format!(
                "{call:?}:\nlost answer: {after_lost}\nanswered: {after_clean}"
            ));
        }
    }
    assert_eq!(f.fired(), Call::ALL.len());
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    s.store.check().await.unwrap();
}

/// Issue 26 and SPEC §6 (a claim is "durable before the request is
/// forwarded"): after a claim whose answer was lost, asking again is answered
/// from the request's own claim (at the gateway: 409 `dedup_in_flight`, never a
/// second forward); reading the record back finds the caller's own claim —
/// same fingerprint, same creation time — so the caller may go on as claimed.
async fn a_claim_whose_answer_was_lost_is_found_by_reading_back(s: Subject) {
    let f = faults(&s);
    let k = rkey("pay", "k");
    let c = claim(1, 1_000);
    f.add(Rule::new(Op::Begin, Fault::Unknown).once());
    assert!(s.store.begin(SINGLE, &k, &c, STRICT).await.is_err());
    match s.store.begin(SINGLE, &k, &c, RESEND).await {
        Ok(Begun::Exists(r)) => assert_eq!(r, c),
        other => panic!("asking again: {other:?}"),
    }
    assert_eq!(get(&*s.store, &k).await, Some(c.clone()));
    s.store
        .finish(SINGLE, &k, done(&c, 1_200, response(200, Some(b"ok"))))
        .await
        .unwrap();
    assert_eq!(get(&*s.store, &k).await.map(|r| r.state), Some(State::Done));
}

/// Issue 26 and SPEC §6, §8: after an outcome or a resolution whose answer was
/// lost, reading back shows it applied, and repeating it changes nothing
/// further (an outcome is written only over an in-flight record; a resolution
/// only of an in-doubt key).
async fn a_lost_outcome_or_resolution_is_applied_once(s: Subject) {
    let f = faults(&s);
    let (answered, resolved) = (rkey("pay", "answered"), rkey("pay", "resolved"));
    let c = claim(1, 1_000);
    claimed(&*s.store, SINGLE, &answered, &c).await;
    claimed(&*s.store, SINGLE, &resolved, &c).await;
    s.store
        .finish(SINGLE, &resolved, in_doubt(&c, 1_100))
        .await
        .unwrap();

    f.add(Rule::new(Op::Finish, Fault::Unknown).once());
    let end = || done(&c, 1_200, response(201, Some(b"first")));
    assert!(s.store.finish(SINGLE, &answered, end()).await.is_err());
    let read = get(&*s.store, &answered).await;
    assert_eq!(
        read.as_ref().map(|r| (r.state, r.updated_ms)),
        Some((State::Done, 1_200))
    );
    let again = s
        .store
        .finish(SINGLE, &answered, done(&c, 1_300, response(500, None)))
        .await;
    assert_eq!(
        get(&*s.inner, &answered).await,
        read,
        "repeating the outcome: {again:?}"
    );

    f.add(Rule::new(Op::Resolve, Fault::Unknown).once());
    assert!(s
        .store
        .resolve(SINGLE, &resolved, Resolution::Delivered, 2_000)
        .await
        .is_err());
    let read = get(&*s.store, &resolved).await;
    assert_eq!(
        read.as_ref().map(|r| (r.state, r.updated_ms)),
        Some((State::Done, 2_000))
    );
    assert_eq!(
        s.store
            .resolve(SINGLE, &resolved, Resolution::NotDelivered, 3_000)
            .await
            .unwrap(),
        Resolved::NotInDoubt(State::Done)
    );
    assert_eq!(get(&*s.inner, &resolved).await, read);
}

/// Issue 26 (errors on reads): a refused read is an error, never a wrong
/// answer (an empty mark, a missing record), and the next read answers.
async fn a_refused_read_is_an_error_not_an_answer(s: Subject) {
    let f = faults(&s);
    let (l, k) = (lease("l"), rkey("pay", "k"));
    s.store.raise_mark(SINGLE, &l, Epoch::new(4)).await.unwrap();
    claimed(&*s.store, SINGLE, &k, &claim(1, 1_000)).await;
    for op in [Op::Marks, Op::Get, Op::List, Op::Check] {
        f.add(Rule::new(op, Fault::Fail).once());
    }
    assert!(s.store.marks(&l).await.is_err());
    assert!(s.store.get(&k).await.is_err());
    assert!(s.store.list(State::InFlight, None, None, 10).await.is_err());
    assert!(s.store.check().await.is_err());
    assert_eq!(s.store.marks(&l).await.unwrap().mark, Epoch::new(4));
    assert_eq!(get(&*s.store, &k).await, Some(claim(1, 1_000)));
    assert_eq!(
        s.store
            .list(State::InFlight, None, None, 10)
            .await
            .unwrap()
            .total,
        1
    );
    s.store.check().await.unwrap();
}

/// `StateStore::begin` ("two concurrent claims of one key never both
/// succeed") under latency: the claim that reaches the store first wins, not the
/// one sent first; the slowed one is answered from the winner's record.
async fn a_slowed_claim_loses_to_the_one_that_reaches_the_store_first(s: Subject) {
    let f = faults(&s);
    let k = rkey("pay", "k");
    f.add(
        Rule::new(Op::Begin, Fault::Latency(Duration::from_millis(100)))
            .key("pay/k")
            .once(),
    );
    let (store, k2) = (s.store.clone(), k.clone());
    let slow =
        tokio::spawn(async move { store.begin(SINGLE, &k2, &claim(1, 1_000), STRICT).await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    claimed(&*s.store, SINGLE, &k, &claim(2, 1_001)).await;
    match slow.await.unwrap() {
        Ok(Begun::Exists(r)) => assert_eq!(r, claim(2, 1_001)),
        other => panic!("the slowed claim: {other:?}"),
    }
    assert_eq!(f.calls(Op::Begin), 2);
}

under_faults! {
    a_refused_write_changes_nothing,
    a_write_whose_answer_is_lost_did_what_it_would_have,
    a_claim_whose_answer_was_lost_is_found_by_reading_back,
    a_lost_outcome_or_resolution_is_applied_once,
    a_refused_read_is_an_error_not_an_answer,
    a_slowed_claim_loses_to_the_one_that_reaches_the_store_first,
}
