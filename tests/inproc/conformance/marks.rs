//! Marks and drained notes (SPEC §4, §5), owner generations (SPEC §10), what
//! survives a close and reopen, readiness and membership.

use fencegate::state::{Begun, Generation, LeaseMarks, Resolution, StateError, TakeOver};

use super::*;

fn marks(mark: u64, drained: u64) -> LeaseMarks {
    LeaseMarks {
        mark: Epoch::new(mark),
        drained: Epoch::new(drained),
    }
}

/// `StateStore::marks` ("zero when none"): a lease never raised has mark and
/// drained-through epoch zero.
async fn a_lease_never_raised_has_no_marks(s: Subject) {
    assert_eq!(s.store.marks(&lease("never")).await.unwrap(), marks(0, 0));
}

/// SPEC §4 ("A request above the mark raises the mark, durably"; the mark is a
/// high-water mark): a mark only rises — a lower or equal raise leaves it — and
/// each lease has its own.
async fn a_mark_only_rises(s: Subject) {
    let (a, b) = (lease("a"), lease("b"));
    for (epoch, expect) in [(5, 5), (3, 5), (5, 5), (9, 9), (1, 9)] {
        s.store
            .raise_mark(SINGLE, &a, Epoch::new(epoch))
            .await
            .unwrap();
        assert_eq!(
            s.inner.marks(&a).await.unwrap().mark,
            Epoch::new(expect),
            "after {epoch}"
        );
    }
    assert_eq!(s.store.marks(&b).await.unwrap(), marks(0, 0));
    s.store.raise_mark(SINGLE, &b, Epoch::new(2)).await.unwrap();
    assert_eq!(s.store.marks(&a).await.unwrap().mark, Epoch::new(9));
    assert_eq!(s.store.marks(&b).await.unwrap().mark, Epoch::new(2));
}

/// SPEC §5 ("A drain interrupted by a crash is not forgotten") and `LeaseMarks`
/// ("never above `mark`"): the drained-through epoch only rises, and is reported
/// no higher than the mark.
async fn a_drained_note_only_rises_and_never_shows_above_the_mark(s: Subject) {
    let l = lease("l");
    s.store.raise_mark(SINGLE, &l, Epoch::new(5)).await.unwrap();
    for (noted, expect) in [
        (3, marks(5, 3)),
        (2, marks(5, 3)),
        (5, marks(5, 5)),
        (8, marks(5, 5)),
    ] {
        s.store
            .note_drained(SINGLE, &l, Epoch::new(noted))
            .await
            .unwrap();
        assert_eq!(
            s.inner.marks(&l).await.unwrap(),
            expect,
            "after noting {noted}"
        );
    }
    // A drained note is about its own lease only.
    assert_eq!(s.store.marks(&lease("other")).await.unwrap(), marks(0, 0));
}

/// SPEC §10.2 ("Every state write of an owner is conditioned on its gate
/// epoch") and `StateStore::claim_shard` ("a write of an older generation
/// fails"): once a newer generation claimed the shard, every write of the older
/// one fails with `OwnerLost` and changes nothing (a drained note, which may
/// be lost anyway, and a recovery may succeed but must not write); the other
/// shard keeps its owner, and the newer generation writes.
async fn a_superseded_generation_writes_nothing(s: Subject) {
    let (old, new, elsewhere) = (owner(1, 1), owner(1, 2), owner(2, 1));
    let l = lease("billing");
    s.store.claim_shard(old).await.unwrap();
    s.store.claim_shard(elsewhere).await.unwrap();
    s.store.raise_mark(old, &l, Epoch::new(5)).await.unwrap();
    s.store.note_drained(old, &l, Epoch::new(4)).await.unwrap();
    let keys: Vec<_> = ["flying", "doubtful", "finished", "fresh"]
        .iter()
        .map(|k| rkey("pay", k))
        .collect();
    let c = claim(1, 1_000);
    for k in &keys[..3] {
        assert!(matches!(
            s.store.begin(old, k, &c, STRICT).await,
            Ok(Begun::Claimed)
        ));
    }
    s.store
        .finish(old, &keys[1], in_doubt(&c, 1_100))
        .await
        .unwrap();
    s.store
        .finish(old, &keys[2], done(&c, 1_100, response(200, Some(b"x"))))
        .await
        .unwrap();

    s.store.claim_shard(new).await.unwrap();
    let before = snapshot(&*s.inner, &keys, std::slice::from_ref(&l)).await;
    let mut wrong = Vec::new();
    let mut check = |what: &str, r: Result<String, StateError>| match r {
        Err(StateError::OwnerLost { ours, stored })
            if ours == old && stored == Generation::new(2) => {}
        other => wrong.push(format!("{what}: {other:?}")),
    };
    check(
        "claim_shard",
        s.store.claim_shard(old).await.map(|()| "ok".into()),
    );
    check(
        "raise_mark",
        s.store
            .raise_mark(old, &l, Epoch::new(9))
            .await
            .map(|()| "ok".into()),
    );
    check(
        "begin of a new key",
        s.store
            .begin(old, &keys[3], &claim(2, 2_000), STRICT)
            .await
            .map(|b| format!("{b:?}")),
    );
    let resend_or_expired = TakeOver {
        in_doubt: true,
        done_before_ms: u64::MAX,
    };
    for k in &keys[1..3] {
        check(
            &format!("begin taking over {}", k.key),
            s.store
                .begin(old, k, &c, resend_or_expired)
                .await
                .map(|b| format!("{b:?}")),
        );
    }
    for end in [
        done(&c, 2_000, response(200, None)),
        in_doubt(&c, 2_000),
        End::Delete,
    ] {
        let what = format!("finish {end:?}");
        check(
            &what,
            s.store
                .finish(old, &keys[0], end)
                .await
                .map(|()| "ok".into()),
        );
    }
    for how in [Resolution::Delivered, Resolution::NotDelivered] {
        check(
            &format!("resolve {how:?}"),
            s.store
                .resolve(old, &keys[1], how, 2_000)
                .await
                .map(|r| format!("{r:?}")),
        );
    }
    let _ = s.store.note_drained(old, &l, Epoch::new(5)).await;
    let _ = s.store.recover(old, 2_000).await;
    assert_eq!(
        snapshot(&*s.inner, &keys, std::slice::from_ref(&l)).await,
        before
    );
    assert!(
        wrong.is_empty(),
        "the superseded generation's writes:\n{}",
        wrong.join("\n")
    );

    // The other shard keeps its owner; the new generation writes.
    let other = lease("other");
    s.store
        .raise_mark(elsewhere, &other, Epoch::new(3))
        .await
        .unwrap();
    s.store.raise_mark(new, &l, Epoch::new(9)).await.unwrap();
    assert_eq!(s.inner.marks(&l).await.unwrap().mark, Epoch::new(9));
    assert!(matches!(
        s.store.begin(new, &keys[3], &claim(2, 2_000), STRICT).await,
        Ok(Begun::Claimed)
    ));
    s.store
        .finish(
            new,
            &keys[3],
            done(&claim(2, 2_000), 2_100, response(201, None)),
        )
        .await
        .unwrap();
    assert_eq!(
        s.store
            .resolve(new, &keys[1], Resolution::Delivered, 3_000)
            .await
            .unwrap(),
        fencegate::state::Resolved::Done
    );
}

/// SPEC §10.1 ("One instance": one shard, one generation) and `Owner::SINGLE`:
/// a single instance writes without claiming; claiming its shard, or any
/// shard's current generation, again is harmless; an older one is refused.
async fn a_single_instance_writes_without_claiming_and_claims_are_idempotent(s: Subject) {
    let l = lease("l");
    s.store.raise_mark(SINGLE, &l, Epoch::new(2)).await.unwrap();
    claimed(&*s.store, SINGLE, &rkey("pay", "k"), &claim(1, 1_000)).await;
    s.store.claim_shard(SINGLE).await.unwrap();
    s.store.claim_shard(SINGLE).await.unwrap();
    s.store.raise_mark(SINGLE, &l, Epoch::new(3)).await.unwrap();
    s.store.claim_shard(owner(4, 7)).await.unwrap();
    s.store.claim_shard(owner(4, 7)).await.unwrap();
    s.store.claim_shard(owner(4, 8)).await.unwrap();
    let r = s.store.claim_shard(owner(4, 7)).await;
    assert!(
        matches!(r, Err(StateError::OwnerLost { stored, .. }) if stored == Generation::new(8)),
        "{r:?}"
    );
    assert_eq!(s.store.marks(&l).await.unwrap().mark, Epoch::new(3));
}

/// `src/state/mod.rs` (what a backend makes durable: a raised mark and a claim
/// before the call returns, a `done` record before it returns; `close` "makes
/// everything durable"): after a close, a new handle — sled's directory opened
/// again, a new connection pool — finds the marks, the drained note, every
/// record as written and the shard's generation, which still refuses an older
/// writer.
async fn what_was_written_survives_a_close_and_reopen(s: Subject) {
    let l = lease("l");
    let gen = owner(3, 6);
    s.store.claim_shard(gen).await.unwrap();
    s.store.raise_mark(SINGLE, &l, Epoch::new(7)).await.unwrap();
    s.store
        .note_drained(SINGLE, &l, Epoch::new(6))
        .await
        .unwrap();
    let keys: Vec<_> = ["flying", "done", "doubt"]
        .iter()
        .map(|k| rkey("pay", k))
        .collect();
    let c = claim(1, 1_000);
    for k in &keys {
        claimed(&*s.store, SINGLE, k, &c).await;
    }
    s.store
        .finish(
            SINGLE,
            &keys[1],
            done(&c, 1_100, response(201, Some(b"kept"))),
        )
        .await
        .unwrap();
    s.store
        .finish(SINGLE, &keys[2], in_doubt(&c, 1_200))
        .await
        .unwrap();
    let before = snapshot(&*s.inner, &keys, std::slice::from_ref(&l)).await;
    assert!(
        before.contains("in_flight: 1\ndone: 1\nin_doubt: 1"),
        "{before}"
    );
    let s = s.reopen().await;
    assert_eq!(
        snapshot(&*s.inner, &keys, std::slice::from_ref(&l)).await,
        before
    );
    assert_eq!(s.inner.marks(&l).await.unwrap(), marks(7, 6));
    let r = s.store.raise_mark(owner(3, 5), &l, Epoch::new(8)).await;
    assert!(
        matches!(r, Err(StateError::OwnerLost { stored, .. }) if stored == Generation::new(6)),
        "{r:?}"
    );
    // And the store writes on.
    s.store.raise_mark(gen, &l, Epoch::new(8)).await.unwrap();
    assert_eq!(s.store.recover(SINGLE, 5_000).await.unwrap(), 1);
    s.store.close().await.unwrap();
}

/// `StateStore::check` (readiness: "the backend can take a write now") and
/// `is_healthy`: a working store is ready and healthy. (Membership is the
/// cluster's `OwnershipStore`, tested with the cluster.)
async fn a_working_store_is_ready(s: Subject) {
    s.store
        .raise_mark(SINGLE, &lease("l"), Epoch::new(1))
        .await
        .unwrap();
    s.store.check().await.unwrap();
    assert!(s.store.is_healthy());
}

conformance! {
    a_lease_never_raised_has_no_marks,
    a_mark_only_rises,
    a_drained_note_only_rises_and_never_shows_above_the_mark,
    a_superseded_generation_writes_nothing,
    a_single_instance_writes_without_claiming_and_claims_are_idempotent,
    what_was_written_survives_a_close_and_reopen,
    a_working_store_is_ready,
}
