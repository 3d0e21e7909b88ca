//! Dedup records (SPEC §6, §8): claims, outcomes, resolutions, recovery,
//! listings and sweeps, as every backend must keep them.

use std::collections::BTreeSet;

use fencegate::state::{Begun, End, Record, Resolution, Resolved, State, StateStore, TakeOver};

use super::*;

/// `begin`, expecting the existing record back.
async fn exists(s: &dyn StateStore, key: &RecordKey, fresh: &Record, rules: TakeOver) -> Record {
    match s.begin(SINGLE, key, fresh, rules).await {
        Ok(Begun::Exists(r)) => r,
        other => panic!("{key:?} with {rules:?}: expected the existing record, got {other:?}"),
    }
}

async fn finish(s: &dyn StateStore, key: &RecordKey, end: End) {
    s.finish(SINGLE, key, end).await.expect("finishing a claim");
}

/// SPEC §6 ("the record is durable before the request is forwarded") and
/// `StateStore::begin`: a key without a record is claimed with the caller's
/// `in_flight` record, kept exactly as given; keys are scoped by route.
async fn a_fresh_key_is_claimed_as_given(s: Subject) {
    let k = rkey("pay", "k1");
    let fresh = claim(1, 1_000);
    let begun = s.store.begin(SINGLE, &k, &fresh, STRICT).await.unwrap();
    assert!(matches!(begun, Begun::Claimed), "{begun:?}");
    assert_eq!(get(&*s.inner, &k).await, Some(fresh.clone()));
    // The same key on another route is another record.
    let other = rkey("refund", "k1");
    claimed(&*s.store, SINGLE, &other, &claim(2, 1_001)).await;
    assert_eq!(get(&*s.store, &k).await, Some(fresh));
    assert_eq!(get(&*s.store, &other).await, Some(claim(2, 1_001)));
    assert_eq!(get(&*s.store, &rkey("pay", "k2")).await, None);
}

/// SPEC §6 ("`in_flight` → 409 `dedup_in_flight`"; `in_flight` records never
/// expire): a claimed key is answered from its record — whatever the new
/// request, the in-doubt policy or the retention — and the record is unchanged.
async fn an_in_flight_key_is_answered_from_its_record(s: Subject) {
    let k = rkey("pay", "k");
    let first = claim(1, 1_000);
    claimed(&*s.store, SINGLE, &k, &first).await;
    let forever = TakeOver {
        in_doubt: true,
        done_before_ms: u64::MAX,
    };
    for (fp, rules) in [
        (1, STRICT),
        (2, STRICT),
        (1, RESEND),
        (1, forever),
        (2, forever),
    ] {
        assert_eq!(exists(&*s.store, &k, &claim(fp, 9_000), rules).await, first);
    }
    assert_eq!(get(&*s.inner, &k).await, Some(first));
}

/// SPEC §6 ("`done` with the same request → the stored response"; "`done`
/// records expire `[dedup] ttl` after they became `done` … not after the first
/// claim"): a done record is answered from — with its response — until it has
/// been done for the whole retention, counted from its outcome; then any request
/// takes the key over with a fresh claim.
async fn a_done_record_is_answered_until_it_expires_then_taken_over(s: Subject) {
    let k = rkey("pay", "k");
    let first = claim(1, 1_000);
    claimed(&*s.store, SINGLE, &k, &first).await;
    finish(
        &*s.store,
        &k,
        done(&first, 5_000, response(201, Some(b"made"))),
    )
    .await;
    let stored = Record {
        state: State::Done,
        updated_ms: 5_000,
        response: Some(response(201, Some(b"made"))),
        ..first
    };
    assert_eq!(get(&*s.inner, &k).await, Some(stored.clone()));
    // Created at 1000, done at 5000: "done before 5000" has not expired it,
    // whatever the request or policy.
    for (fp, rules) in [(1, STRICT), (2, RESEND), (1, expired_before(5_000))] {
        assert_eq!(
            exists(&*s.store, &k, &claim(fp, 9_000), rules).await,
            stored
        );
    }
    // Done before 5001: expired; another request takes it over, as fresh.
    let next = claim(2, 9_000);
    let begun = s
        .store
        .begin(SINGLE, &k, &next, expired_before(5_001))
        .await
        .unwrap();
    assert!(matches!(begun, Begun::Claimed), "{begun:?}");
    assert_eq!(get(&*s.inner, &k).await, Some(next));
}

/// SPEC §6 ("`in_doubt` → the route's `in_doubt` policy: `reject` … or
/// `resend`"; `in_doubt` records never expire) and `Record::taken_over_by`: an
/// in-doubt key is answered from under `reject`, and under `resend` only for the
/// same request (fingerprint), which takes it over keeping the first claim's
/// creation time.
async fn an_in_doubt_key_is_resent_only_for_the_same_request(s: Subject) {
    let k = rkey("pay", "k");
    let first = claim(1, 1_000);
    claimed(&*s.store, SINGLE, &k, &first).await;
    finish(&*s.store, &k, in_doubt(&first, 2_000)).await;
    let doubt = Record {
        state: State::InDoubt,
        updated_ms: 2_000,
        ..first.clone()
    };
    assert_eq!(get(&*s.inner, &k).await, Some(doubt.clone()));
    let forever = TakeOver {
        in_doubt: false,
        done_before_ms: u64::MAX,
    };
    assert_eq!(exists(&*s.store, &k, &claim(1, 9_000), STRICT).await, doubt);
    assert_eq!(
        exists(&*s.store, &k, &claim(1, 9_000), forever).await,
        doubt
    );
    // Another request under `resend`: answered from (422 at the gateway).
    let mut other = claim(2, 9_000);
    other.epoch = first.epoch;
    assert_eq!(exists(&*s.store, &k, &other, RESEND).await, doubt);
    // The same request, at a newer epoch: resent.
    let resend = Record {
        epoch: Epoch::new(40),
        ..claim(1, 9_000)
    };
    let begun = s.store.begin(SINGLE, &k, &resend, RESEND).await.unwrap();
    assert!(matches!(begun, Begun::Claimed), "{begun:?}");
    assert_eq!(
        get(&*s.inner, &k).await,
        Some(Record {
            created_ms: 1_000,
            ..resend
        })
    );
}

/// SPEC §6 (a `done` record's retention starts when it became done, "not after
/// the first claim") and `Record::taken_over_by` ("keeping its creation time"):
/// the outcome of a resend — written from the resend's own claim, as `Dedup`
/// writes it — keeps the first claim's creation time (so the key keeps its place
/// in the oldest-first listing), and its retention runs from that outcome.
async fn a_resends_outcome_keeps_the_first_claims_creation_time(s: Subject) {
    let (a, b) = (rkey("pay", "answered"), rkey("pay", "again-in-doubt"));
    for k in [&a, &b] {
        let first = claim(1, 1_000);
        claimed(&*s.store, SINGLE, k, &first).await;
        finish(&*s.store, k, in_doubt(&first, 2_000)).await;
        let begun = s
            .store
            .begin(SINGLE, k, &claim(1, 50_000), RESEND)
            .await
            .unwrap();
        assert!(matches!(begun, Begun::Claimed), "{begun:?}");
    }
    let resent = claim(1, 50_000);
    finish(
        &*s.store,
        &a,
        done(&resent, 60_000, response(200, Some(b"ok"))),
    )
    .await;
    finish(&*s.store, &b, in_doubt(&resent, 55_000)).await;
    let times = |r: Option<Record>| r.map(|r| (r.state, r.created_ms, r.updated_ms));
    assert_eq!(
        times(get(&*s.inner, &a).await),
        Some((State::Done, 1_000, 60_000))
    );
    assert_eq!(
        times(get(&*s.inner, &b).await),
        Some((State::InDoubt, 1_000, 55_000))
    );
    // Kept a whole retention from the resend's answer.
    assert_eq!(s.store.sweep(expired_before(60_000)).await.unwrap(), 0);
    assert_eq!(s.store.sweep(expired_before(60_001)).await.unwrap(), 1);
    assert_eq!(get(&*s.inner, &a).await, None);
}

/// SPEC §6 ("an upstream answer → `done`"; `done` "keeps the response's status
/// and headers, and its body when it is at most `max_replay_bytes`"): the
/// outcome keeps status, headers (in order, any bytes) and the body or its
/// absence; the claim's request, epoch and fingerprint stay.
async fn an_answer_is_kept_with_its_response(s: Subject) {
    for (key, body) in [
        ("with-body", Some(&b"made \x00\xff"[..])),
        ("no-body", None),
    ] {
        let k = rkey("pay", key);
        let c = claim(3, 1_000);
        claimed(&*s.store, SINGLE, &k, &c).await;
        finish(&*s.store, &k, done(&c, 1_500, response(422, body))).await;
        assert_eq!(
            get(&*s.inner, &k).await,
            Some(Record {
                state: State::Done,
                updated_ms: 1_500,
                response: Some(response(422, body)),
                ..c
            }),
            "{key}"
        );
    }
}

/// SPEC §6 ("a timeout or reset after sending → `in_doubt`"; "no byte sent →
/// deleted"; retryable statuses "delete the record instead"): an unknown outcome
/// leaves the key in doubt as of then; a deleted claim frees the key for the
/// next request.
async fn an_unknown_outcome_is_in_doubt_and_a_deleted_claim_frees_the_key(s: Subject) {
    let (doubt, free) = (rkey("pay", "doubt"), rkey("pay", "free"));
    let c = claim(1, 1_000);
    claimed(&*s.store, SINGLE, &doubt, &c).await;
    claimed(&*s.store, SINGLE, &free, &c).await;
    finish(&*s.store, &doubt, in_doubt(&c, 1_700)).await;
    s.store.finish(SINGLE, &free, End::Delete).await.unwrap();
    assert_eq!(
        get(&*s.inner, &doubt).await,
        Some(Record {
            state: State::InDoubt,
            updated_ms: 1_700,
            ..c
        })
    );
    assert_eq!(get(&*s.inner, &free).await, None);
    claimed(&*s.store, SINGLE, &free, &claim(2, 2_000)).await;
}

/// `StateStore::finish` ("Ends a claimed key") and the PostgreSQL backend's
/// rule that "an outcome is written only over the caller's own `in_flight`
/// record": finishing a key that is not in flight — absent, done, in doubt —
/// fails and changes nothing.
async fn an_outcome_is_written_only_over_an_in_flight_record(s: Subject) {
    let c = claim(1, 1_000);
    let (absent, finished, doubt) = (
        rkey("pay", "absent"),
        rkey("pay", "done"),
        rkey("pay", "doubt"),
    );
    claimed(&*s.store, SINGLE, &finished, &c).await;
    finish(
        &*s.store,
        &finished,
        done(&c, 1_100, response(200, Some(b"first"))),
    )
    .await;
    claimed(&*s.store, SINGLE, &doubt, &c).await;
    finish(&*s.store, &doubt, in_doubt(&c, 1_100)).await;
    let keys = [absent.clone(), finished.clone(), doubt.clone()];
    let before = snapshot(&*s.inner, &keys, &[]).await;
    let mut wrong = Vec::new();
    for k in &keys {
        for end in [
            done(&c, 2_000, response(500, Some(b"second"))),
            in_doubt(&c, 2_000),
            End::Delete,
        ] {
            let what = format!("{}: {end:?}", k.key);
            if let Ok(()) = s.store.finish(SINGLE, k, end).await {
                wrong.push(what);
            }
        }
    }
    assert_eq!(snapshot(&*s.inner, &keys, &[]).await, before);
    assert!(
        wrong.is_empty(),
        "finished a record not in flight: {wrong:#?}"
    );
}

/// `StateStore::begin` ("Atomic: two concurrent claims of one key never both
/// succeed"), SPEC §6: of concurrent claims of a new key, and of concurrent
/// resends of one in-doubt key, exactly one is claimed; the others are answered
/// from its record.
async fn of_concurrent_claims_of_a_key_exactly_one_wins(s: Subject) {
    let k = rkey("pay", "contended");
    let tasks: Vec<_> = (0..8u8)
        .map(|i| {
            let (store, k) = (s.store.clone(), k.clone());
            tokio::spawn(
                async move { (i, store.begin(SINGLE, &k, &claim(i, 1_000), STRICT).await) },
            )
        })
        .collect();
    let mut winners = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            (i, Ok(Begun::Claimed)) => winners.push(i),
            (_, Ok(Begun::Exists(r))) => assert_eq!(r.state, State::InFlight),
            (i, Err(e)) => panic!("claim {i}: {e}"),
        }
    }
    assert_eq!(winners.len(), 1, "claimed by {winners:?}");
    assert_eq!(get(&*s.inner, &k).await, Some(claim(winners[0], 1_000)));
    // Resends of the same in-doubt request.
    finish(&*s.store, &k, in_doubt(&claim(winners[0], 1_000), 2_000)).await;
    let tasks: Vec<_> = (0..8u64)
        .map(|i| {
            let (store, k) = (s.store.clone(), k.clone());
            let mut fresh = claim(winners[0], 3_000 + i);
            fresh.epoch = Epoch::new(100 + i);
            tokio::spawn(
                async move { (fresh.clone(), store.begin(SINGLE, &k, &fresh, RESEND).await) },
            )
        })
        .collect();
    let mut resent = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            (fresh, Ok(Begun::Claimed)) => resent.push(fresh),
            (_, Ok(Begun::Exists(_))) => {}
            (_, Err(e)) => panic!("resend: {e}"),
        }
    }
    assert_eq!(resent.len(), 1, "resent by {resent:?}");
    assert_eq!(
        get(&*s.inner, &k).await.map(|r| r.epoch),
        Some(resent[0].epoch)
    );
}

/// SPEC §6 ("`in_flight` records found at start-up → `in_doubt`") and
/// `StateStore::recover`: every `in_flight` record becomes `in_doubt` as of the
/// recovery (its creation kept), `done` and `in_doubt` ones are untouched, and
/// the count says how many changed.
async fn recovery_turns_in_flight_records_in_doubt(s: Subject) {
    let keys: Vec<_> = ["a", "b", "done", "doubt"]
        .iter()
        .map(|k| rkey("pay", k))
        .collect();
    let c = claim(1, 1_000);
    for k in &keys {
        claimed(&*s.store, SINGLE, k, &c).await;
    }
    finish(
        &*s.store,
        &keys[2],
        done(&c, 1_100, response(200, Some(b"x"))),
    )
    .await;
    finish(&*s.store, &keys[3], in_doubt(&c, 1_200)).await;
    let untouched = [
        get(&*s.inner, &keys[2]).await,
        get(&*s.inner, &keys[3]).await,
    ];
    assert_eq!(s.store.recover(SINGLE, 7_000).await.unwrap(), 2);
    for k in &keys[..2] {
        assert_eq!(
            get(&*s.inner, k).await,
            Some(Record {
                state: State::InDoubt,
                updated_ms: 7_000,
                ..c.clone()
            })
        );
    }
    assert_eq!(
        [
            get(&*s.inner, &keys[2]).await,
            get(&*s.inner, &keys[3]).await
        ],
        untouched
    );
    assert_eq!(s.store.recover(SINGLE, 8_000).await.unwrap(), 0);
}

/// SPEC §10.2 (a successor "turns the old owner's `in_flight` records into
/// `in_doubt`") and `StateStore::recover` ("every `in_flight` record of
/// `owner`'s shard"): a takeover's recovery changes its own shard only; another
/// shard's requests are still in flight at their owner.
async fn recovery_after_a_takeover_changes_that_shard_only(s: Subject) {
    let (mine, theirs) = (rkey("pay", "shard-1"), rkey("pay", "shard-2"));
    let (old, other, new) = (owner(1, 1), owner(2, 1), owner(1, 2));
    s.store.claim_shard(old).await.unwrap();
    s.store.claim_shard(other).await.unwrap();
    let c = claim(1, 1_000);
    s.store.begin(old, &mine, &c, STRICT).await.unwrap();
    s.store.begin(other, &theirs, &c, STRICT).await.unwrap();
    s.store.claim_shard(new).await.unwrap();
    assert_eq!(s.store.recover(new, 5_000).await.unwrap(), 1);
    assert_eq!(
        get(&*s.inner, &mine).await.map(|r| r.state),
        Some(State::InDoubt)
    );
    assert_eq!(get(&*s.inner, &theirs).await, Some(c));
}

/// SPEC §8 ("delivered → `done` without a stored body") and §6 (its retention
/// counts from the operator's `delivered`): the record becomes done as of the
/// resolution, without a response, keeping its request; the same request is
/// answered from it for a whole retention from then.
async fn delivered_makes_an_in_doubt_key_done_as_of_the_resolution(s: Subject) {
    let k = rkey("pay", "k");
    let c = claim(1, 1_000);
    claimed(&*s.store, SINGLE, &k, &c).await;
    finish(&*s.store, &k, in_doubt(&c, 2_000)).await;
    let r = s
        .store
        .resolve(SINGLE, &k, Resolution::Delivered, 90_000)
        .await
        .unwrap();
    assert_eq!(r, Resolved::Done);
    let resolved = Record {
        state: State::Done,
        updated_ms: 90_000,
        response: None,
        ..c
    };
    assert_eq!(get(&*s.inner, &k).await, Some(resolved.clone()));
    assert_eq!(
        exists(&*s.store, &k, &claim(1, 90_001), expired_before(90_000)).await,
        resolved
    );
    assert_eq!(s.store.sweep(expired_before(90_000)).await.unwrap(), 0);
    assert_eq!(s.store.sweep(expired_before(90_001)).await.unwrap(), 1);
}

/// SPEC §8 ("not delivered → deleted"): the key is free again.
async fn not_delivered_deletes_an_in_doubt_key(s: Subject) {
    let k = rkey("pay", "k");
    let c = claim(1, 1_000);
    claimed(&*s.store, SINGLE, &k, &c).await;
    finish(&*s.store, &k, in_doubt(&c, 2_000)).await;
    let r = s
        .store
        .resolve(SINGLE, &k, Resolution::NotDelivered, 3_000)
        .await
        .unwrap();
    assert_eq!(r, Resolved::Deleted);
    assert_eq!(get(&*s.inner, &k).await, None);
    claimed(&*s.store, SINGLE, &k, &claim(1, 4_000)).await;
}

/// SPEC §8 ("an operator resolves an in-doubt key") and `Resolved`: only an
/// in-doubt key is resolvable; a missing one is `Missing`, any other is
/// `NotInDoubt` with its state, and neither changes.
async fn only_an_in_doubt_key_is_resolvable(s: Subject) {
    let c = claim(1, 1_000);
    let (flying, finished, absent) = (
        rkey("pay", "flying"),
        rkey("pay", "done"),
        rkey("pay", "absent"),
    );
    claimed(&*s.store, SINGLE, &flying, &c).await;
    claimed(&*s.store, SINGLE, &finished, &c).await;
    finish(
        &*s.store,
        &finished,
        done(&c, 1_100, response(200, Some(b"x"))),
    )
    .await;
    let keys = [flying.clone(), finished.clone(), absent.clone()];
    let before = snapshot(&*s.inner, &keys, &[]).await;
    for how in [Resolution::Delivered, Resolution::NotDelivered] {
        let r = |k| s.store.resolve(SINGLE, k, how, 5_000);
        assert_eq!(
            r(&flying).await.unwrap(),
            Resolved::NotInDoubt(State::InFlight)
        );
        assert_eq!(
            r(&finished).await.unwrap(),
            Resolved::NotInDoubt(State::Done)
        );
        assert_eq!(r(&absent).await.unwrap(), Resolved::Missing);
    }
    assert_eq!(snapshot(&*s.inner, &keys, &[]).await, before);
}

/// SPEC §8 and §6: an operator's resolution and a resend of the same in-doubt
/// key race; exactly one of them wins (the resolution finds the key in flight,
/// or the resend finds it resolved).
async fn a_resolution_and_a_resend_never_both_win(s: Subject) {
    for round in 0..8u64 {
        let k = rkey("pay", &format!("race-{round}"));
        let c = claim(1, 1_000);
        claimed(&*s.store, SINGLE, &k, &c).await;
        finish(&*s.store, &k, in_doubt(&c, 2_000)).await;
        let how = if round % 2 == 0 {
            Resolution::Delivered
        } else {
            Resolution::NotDelivered
        };
        let (st, k2) = (s.store.clone(), k.clone());
        let resolve = tokio::spawn(async move { st.resolve(SINGLE, &k2, how, 3_000).await });
        let resend = s
            .store
            .begin(SINGLE, &k, &claim(1, 3_000), RESEND)
            .await
            .unwrap();
        let resolved = resolve.await.unwrap().unwrap();
        let now = get(&*s.inner, &k).await.map(|r| r.state);
        match (&resend, resolved) {
            (Begun::Claimed, Resolved::NotInDoubt(State::InFlight)) => {
                assert_eq!(now, Some(State::InFlight))
            }
            (Begun::Exists(r), Resolved::Done) => {
                assert_eq!((r.state, now), (State::Done, Some(State::Done)))
            }
            // Not delivered first: the resend finds the key free and claims it.
            (Begun::Claimed, Resolved::Deleted) => assert_eq!(now, Some(State::InFlight)),
            other => panic!("round {round}: {other:?}, now {now:?}"),
        }
    }
}

/// SPEC §8 (`GET /v1/dedup?state=…[&route=R][&limit=N]`, "oldest first") and
/// `StateStore::list`: records of one state, by creation time, then route and
/// key (bytewise); `total` counts every match, past the page too; `limit = 0`
/// counts only.
async fn listings_are_oldest_first_and_count_every_match(s: Subject) {
    // (route, key, created): ties on time order by route, then key.
    let doubts = [
        ("pay", "b", 3_000),
        ("pay", "a", 3_000),
        ("alpha", "z", 3_000),
        ("pay", "B", 3_000),
        ("pay", "old", 1_000),
        ("refund", "a", 2_000),
        ("pay", "a-b", 3_000),
        ("pay", "a_b", 3_000),
    ];
    for (route, key, at) in doubts {
        let c = claim(1, at);
        claimed(&*s.store, SINGLE, &rkey(route, key), &c).await;
        finish(&*s.store, &rkey(route, key), in_doubt(&c, 9_000)).await;
    }
    // Other states are not listed as in doubt.
    claimed(&*s.store, SINGLE, &rkey("pay", "flying"), &claim(1, 500)).await;
    let mut expect: Vec<_> = doubts.iter().map(|(r, k, at)| (*at, rkey(r, k))).collect();
    expect.sort();
    let expect: Vec<_> = expect.into_iter().map(|(_, k)| k).collect();
    let l = s.store.list(State::InDoubt, None, None, 100).await.unwrap();
    assert_eq!(l.total, 8);
    let got: Vec<_> = l.records.iter().map(|(k, _)| k.clone()).collect();
    assert_eq!(got, expect);
    assert!(l.records.iter().all(|(_, r)| r.state == State::InDoubt));
    // A page: the oldest, and the count of all.
    let l = s.store.list(State::InDoubt, None, None, 3).await.unwrap();
    assert_eq!((l.records.len(), l.total), (3, 8));
    assert_eq!(
        l.records.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>(),
        expect[..3]
    );
    // One route.
    let l = s
        .store
        .list(State::InDoubt, Some("pay"), None, 100)
        .await
        .unwrap();
    let on_pay: Vec<_> = expect
        .iter()
        .filter(|k| k.route == "pay")
        .cloned()
        .collect();
    assert_eq!(
        (
            l.records.into_iter().map(|(k, _)| k).collect::<Vec<_>>(),
            l.total
        ),
        (on_pay, 6)
    );
    // Counting only.
    let l = s
        .store
        .list(State::InDoubt, Some("refund"), None, 0)
        .await
        .unwrap();
    assert_eq!((l.records.len(), l.total), (0, 1));
    let l = s.store.list(State::InFlight, None, None, 10).await.unwrap();
    assert_eq!((l.records.len(), l.total), (1, 1));
    assert_eq!(
        s.store
            .list(State::Done, None, None, 10)
            .await
            .unwrap()
            .total,
        0
    );
}

/// SPEC §8 ("`after` is the `next` of the previous page") and `ListCursor` ("a
/// page can follow one whose last record was resolved meanwhile"): following
/// the cursor visits every record once, in order, at any page size — also when
/// the record a cursor names is resolved between pages.
async fn pagination_visits_every_record_once(s: Subject) {
    let mut all = Vec::new();
    for i in 0..11u64 {
        let k = rkey(
            if i % 3 == 0 { "a" } else { "b" },
            &format!("k{:02}", 10 - i),
        );
        let c = claim(1, 1_000 + (i / 2) * 10);
        claimed(&*s.store, SINGLE, &k, &c).await;
        finish(&*s.store, &k, in_doubt(&c, 5_000)).await;
        all.push((c.created_ms, k));
    }
    all.sort();
    let all: Vec<_> = all.into_iter().map(|(_, k)| k).collect();
    for page in [1, 2, 3, 10, 11, 12] {
        assert_eq!(
            list_all(&*s.store, State::InDoubt, None, page).await,
            all,
            "page {page}"
        );
    }
    let on_a: Vec<_> = all.iter().filter(|k| k.route == "a").cloned().collect();
    assert_eq!(
        list_all(&*s.store, State::InDoubt, Some("a"), 2).await,
        on_a
    );
    // The cursor's record is resolved before the next page is asked for.
    let first = s.store.list(State::InDoubt, None, None, 4).await.unwrap();
    let (k, r) = first.records.last().unwrap().clone();
    s.store
        .resolve(SINGLE, &k, Resolution::NotDelivered, 6_000)
        .await
        .unwrap();
    let cursor = ListCursor {
        created_ms: r.created_ms,
        key: k,
    };
    let rest = s
        .store
        .list(State::InDoubt, None, Some(&cursor), 100)
        .await
        .unwrap();
    assert_eq!(
        rest.records.into_iter().map(|(k, _)| k).collect::<Vec<_>>(),
        all[4..]
    );
    assert_eq!(rest.total, 10);
}

/// SPEC §6 ("`done` records expire `[dedup] ttl` … after they became `done`";
/// "`in_flight` and `in_doubt` never do") and `StateStore::sweep`: a sweep
/// removes exactly the done records that became done before the cut-off —
/// however old their claim — and says how many.
async fn a_sweep_removes_only_expired_done_records(s: Subject) {
    let at = |ms| claim(1, ms);
    let keys: Vec<_> = [
        "old-done",
        "late-done",
        "new-done",
        "old-flying",
        "old-doubt",
    ]
    .iter()
    .map(|k| rkey("pay", k))
    .collect();
    for (k, c) in keys.iter().zip([at(0), at(0), at(9_000), at(0), at(0)]) {
        claimed(&*s.store, SINGLE, k, &c).await;
    }
    finish(&*s.store, &keys[0], done(&at(0), 100, response(200, None))).await;
    // Claimed at 0, done only at 10 000.
    finish(
        &*s.store,
        &keys[1],
        done(&at(0), 10_000, response(200, Some(b"x"))),
    )
    .await;
    finish(
        &*s.store,
        &keys[2],
        done(&at(9_000), 9_500, response(200, None)),
    )
    .await;
    finish(&*s.store, &keys[4], in_doubt(&at(0), 1)).await;
    assert_eq!(s.store.sweep(expired_before(100)).await.unwrap(), 0);
    assert_eq!(s.store.sweep(expired_before(10_000)).await.unwrap(), 2);
    let left: BTreeSet<_> = {
        let mut v = BTreeSet::new();
        for k in &keys {
            if get(&*s.inner, k).await.is_some() {
                v.insert(k.key.clone());
            }
        }
        v
    };
    assert_eq!(
        left,
        ["late-done", "old-flying", "old-doubt"]
            .map(String::from)
            .into()
    );
    assert_eq!(s.store.sweep(expired_before(u64::MAX)).await.unwrap(), 1);
    assert_eq!(
        s.store
            .list(State::Done, None, None, 0)
            .await
            .unwrap()
            .total,
        0
    );
    assert_eq!(
        s.store
            .list(State::InFlight, None, None, 0)
            .await
            .unwrap()
            .total,
        1
    );
    assert_eq!(
        s.store
            .list(State::InDoubt, None, None, 0)
            .await
            .unwrap()
            .total,
        1
    );
}

conformance! {
    a_fresh_key_is_claimed_as_given,
    an_in_flight_key_is_answered_from_its_record,
    a_done_record_is_answered_until_it_expires_then_taken_over,
    an_in_doubt_key_is_resent_only_for_the_same_request,
    a_resends_outcome_keeps_the_first_claims_creation_time,
    an_answer_is_kept_with_its_response,
    an_unknown_outcome_is_in_doubt_and_a_deleted_claim_frees_the_key,
    an_outcome_is_written_only_over_an_in_flight_record,
    of_concurrent_claims_of_a_key_exactly_one_wins,
    recovery_turns_in_flight_records_in_doubt,
    #[differs(sled = "sled keeps no shard with a record: recover() turns the in_flight records of every shard in doubt")]
    recovery_after_a_takeover_changes_that_shard_only,
    delivered_makes_an_in_doubt_key_done_as_of_the_resolution,
    not_delivered_deletes_an_in_doubt_key,
    only_an_in_doubt_key_is_resolvable,
    a_resolution_and_a_resend_never_both_win,
    listings_are_oldest_first_and_count_every_match,
    pagination_visits_every_record_once,
    a_sweep_removes_only_expired_done_records,
}
