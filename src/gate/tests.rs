use super::test_support::admit_if;
use super::*;
use crate::state::StateError;
use std::sync::atomic::{AtomicBool, Ordering};

async fn ok() -> Result<(), StateError> {
    Ok(())
}

/// A raise to `epoch` that persists at once and notes nothing.
async fn raise(g: &Arc<Gate>, epoch: u64, drain: Duration) -> Result<Pass, RaiseError<StateError>> {
    let e = Epoch::new(epoch);
    g.raise(e, drain, admit_if(e), ok, |_| async {}).await
}

#[tokio::test(start_paused = true)]
async fn raise_waits_for_older_passes() {
    let g = Gate::new(Epoch::new(7));
    let old = g
        .try_enter(Epoch::new(7), admit_if(Epoch::new(7)))
        .unwrap()
        .unwrap();
    let g2 = g.clone();
    let raise = tokio::spawn(async move { raise(&g2, 8, Duration::from_secs(10)).await });
    tokio::task::yield_now().await;
    // The barrier is up: new epoch-7 requests are refused while the drain runs.
    assert!(g.try_enter(Epoch::new(7), admit_if(Epoch::new(7))).is_err());
    assert!(!raise.is_finished());
    assert_eq!(g.mark(), Epoch::new(7));
    drop(old);
    let pass = raise.await.unwrap().unwrap();
    assert_eq!(pass.epoch(), Epoch::new(8));
    assert_eq!(g.mark(), Epoch::new(8));
}

#[tokio::test(start_paused = true)]
async fn drain_timeout_aborts_older_passes() {
    let g = Gate::new(Epoch::new(1));
    let old = g
        .try_enter(Epoch::new(1), admit_if(Epoch::new(1)))
        .unwrap()
        .unwrap();
    let g2 = g.clone();
    let raise = tokio::spawn(async move { raise(&g2, 2, Duration::from_millis(500)).await });
    // The holder of the old pass gives up when told to.
    old.aborted().await;
    assert!(old.is_aborted());
    assert_eq!(old.newer_epoch(), Epoch::new(2));
    drop(old);
    raise.await.unwrap().unwrap();
    assert_eq!(g.stats().drains_aborted, 1);
}

#[tokio::test(start_paused = true)]
async fn failed_persist_lowers_the_barrier_again() {
    let g = Gate::new(Epoch::new(3));
    let res = g
        .raise(
            Epoch::new(4),
            Duration::from_secs(1),
            admit_if(Epoch::new(4)),
            || async { Err(StateError::Write("disk full".into())) },
            |_| async {},
        )
        .await;
    assert!(matches!(res, Err(RaiseError::State(_))));
    assert_eq!(g.stats().barrier, Epoch::new(3));
    assert!(g
        .try_enter(Epoch::new(3), admit_if(Epoch::new(3)))
        .unwrap()
        .is_some());
}

#[tokio::test(start_paused = true)]
async fn after_a_restart_the_first_raise_waits_out_a_drain() {
    let start = tokio::time::Instant::now();
    let g = Gate::restarted(Epoch::new(4), Epoch::new(4), Duration::from_secs(3));
    // Requests at the mark need no ordering: admitted at once.
    assert!(g
        .try_enter(Epoch::new(4), admit_if(Epoch::new(4)))
        .unwrap()
        .is_some());
    let p = raise(&g, 5, Duration::from_secs(1)).await.unwrap();
    assert!(start.elapsed() >= Duration::from_secs(3));
    drop(p);
    // A fresh gate (no mark: nothing can have been forwarded) does not wait.
    let start = tokio::time::Instant::now();
    let g = Gate::restarted(Epoch::NONE, Epoch::NONE, Duration::from_secs(3));
    raise(&g, 1, Duration::from_secs(1)).await.unwrap();
    assert_eq!(start.elapsed(), Duration::ZERO);
}

/// A crash interrupted the drain to 5 (mark 5, drains completed through 4):
/// after the restart nothing at 5 is forwarded until the settle time has
/// passed, while a request at 4 is refused as stale as ever.
#[tokio::test(start_paused = true)]
async fn after_a_crash_mid_drain_the_raised_epoch_waits_out_the_drain() {
    let start = tokio::time::Instant::now();
    let g = Gate::restarted(Epoch::new(5), Epoch::new(4), Duration::from_secs(3));
    assert!(g
        .try_enter(Epoch::new(5), admit_if(Epoch::new(5)))
        .unwrap()
        .is_none());
    assert!(g.try_enter(Epoch::new(4), admit_if(Epoch::new(4))).is_err());
    let p = g
        .raise(
            Epoch::new(5),
            Duration::from_secs(1),
            admit_if(Epoch::new(5)),
            ok,
            |_| async { panic!("no drain ran") },
        )
        .await
        .unwrap();
    assert_eq!(start.elapsed(), Duration::from_secs(3));
    // Settled: the next one goes straight through.
    assert!(g
        .try_enter(Epoch::new(5), admit_if(Epoch::new(5)))
        .unwrap()
        .is_some());
    drop(p);
}

/// A request whose outcome is unknown keeps the drain waiting until the
/// drain's timeout, which then ends it (its worker was answered long ago).
#[tokio::test(start_paused = true)]
async fn a_lingering_request_holds_the_drain_until_its_timeout() {
    let g = Gate::new(Epoch::new(1));
    let old = g
        .try_enter(Epoch::new(1), admit_if(Epoch::new(1)))
        .unwrap()
        .unwrap();
    old.linger();
    assert_eq!((g.stats().in_flight, g.stats().in_doubt), (0, 1));
    let start = tokio::time::Instant::now();
    let drained = std::sync::atomic::AtomicU64::new(0);
    let p = g
        .raise(
            Epoch::new(2),
            Duration::from_millis(700),
            admit_if(Epoch::new(2)),
            ok,
            |e| {
                drained.store(e.get(), Ordering::SeqCst);
                async {}
            },
        )
        .await
        .unwrap();
    assert_eq!(start.elapsed(), Duration::from_millis(700));
    assert_eq!(drained.load(Ordering::SeqCst), 2);
    let st = g.stats();
    assert_eq!((st.drains_aborted, st.in_doubt, st.in_flight), (1, 0, 1));
    drop(p);
}

/// The raiser's claim is decided again when the drain completes: an epoch
/// that expired (or was superseded) while it waited is refused, not forwarded,
/// and the mark stays raised.
#[tokio::test(start_paused = true)]
async fn a_raise_is_decided_again_when_its_drain_completes() {
    let g = Gate::new(Epoch::new(1));
    let old = g
        .try_enter(Epoch::new(1), admit_if(Epoch::new(1)))
        .unwrap()
        .unwrap();
    let expired = Arc::new(AtomicBool::new(false));
    let g2 = g.clone();
    let exp = expired.clone();
    let raise = tokio::spawn(async move {
        let e2 = Epoch::new(2);
        g2.raise(
            e2,
            Duration::from_secs(10),
            move |mark| {
                if exp.load(Ordering::SeqCst) {
                    Err(Refusal::Expired {
                        lease: crate::epoch::LeaseName::parse("l").unwrap(),
                        epoch: e2,
                        expired_at: std::time::SystemTime::UNIX_EPOCH,
                    })
                } else {
                    admit_if(e2)(mark)
                }
            },
            ok,
            |_| async {},
        )
        .await
    });
    tokio::task::yield_now().await;
    expired.store(true, Ordering::SeqCst);
    drop(old);
    let res = raise.await.unwrap();
    assert!(matches!(
        res,
        Err(RaiseError::Denied(Denied::Refused(Refusal::Expired { .. })))
    ));
    let st = g.stats();
    assert_eq!(
        (st.mark, st.barrier, st.in_flight),
        (Epoch::new(2), Epoch::new(2), 0)
    );
}

/// Closing admits nothing more, lets a raise waiting in a drain give up, and
/// aborts what is still in flight after the drain timeout.
#[tokio::test(start_paused = true)]
async fn closing_refuses_new_requests_and_aborts_the_rest_after_the_timeout() {
    let g = Gate::new(Epoch::new(1));
    let old = g
        .try_enter(Epoch::new(1), admit_if(Epoch::new(1)))
        .unwrap()
        .unwrap();
    let g2 = g.clone();
    let raise = tokio::spawn(async move { raise(&g2, 2, Duration::from_secs(60)).await });
    tokio::task::yield_now().await;
    let start = tokio::time::Instant::now();
    let g3 = g.clone();
    let closing = tokio::spawn(async move { g3.close(Duration::from_secs(2)).await });
    assert!(matches!(
        raise.await.unwrap(),
        Err(RaiseError::Denied(Denied::Closed))
    ));
    assert!(matches!(
        g.try_enter(Epoch::new(1), admit_if(Epoch::new(1))),
        Err(Denied::Closed)
    ));
    old.aborted().await;
    assert_eq!(start.elapsed(), Duration::from_secs(2));
    drop(old);
    closing.await.unwrap();
    assert_eq!(g.stats().in_flight, 0);
}

#[tokio::test(start_paused = true)]
async fn concurrent_raisers_to_one_epoch_both_pass() {
    let g = Gate::new(Epoch::new(1));
    let raiser = || {
        let g = g.clone();
        tokio::spawn(async move { raise(&g, 5, Duration::from_secs(1)).await })
    };
    let (a, b) = (raiser(), raiser());
    let (pa, pb) = (a.await.unwrap().unwrap(), b.await.unwrap().unwrap());
    assert_eq!(g.stats().in_flight, 2);
    assert_eq!(g.stats().raises, 1);
    assert_eq!(g.stats().drains_started, 0);
    drop((pa, pb));
    assert_eq!(g.stats().in_flight, 0);
}
