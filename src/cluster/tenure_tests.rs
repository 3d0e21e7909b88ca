//! A tenure's start and stop on their own ([`Tenures`]), on paused time, with
//! the in-memory lease store and database of `keeper_tests`: what a tenure
//! starts (the work's consent, the state's claim, the fences) and how it
//! stops (every lease and the work held to the deadline given, the stopped
//! tenure counted until its requests have ended). Which shard, when, and
//! under which generation is the cluster's (`keeper_tests`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::{advance, Instant};

use super::keeper_tests::{settle, World};
use super::shard::Shard;
use super::tenure::Tenures;
use super::TenureWork;
use crate::epoch::LeaseName;
use crate::state::{Generation, Owner, StateStore};

/// The queue as a tenure sees it: refuses a start while `refuse` is set, and
/// records what it is told.
#[derive(Default)]
struct Work {
    refuse: Mutex<Option<String>>,
    started: Mutex<Vec<Vec<LeaseName>>>,
    stops: Mutex<Vec<(u32, Instant)>>,
}

impl TenureWork for Work {
    fn check(
        &self,
        _: &[LeaseName],
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), String>> + Send + '_>> {
        let refuse = self.refuse.lock().unwrap().clone();
        Box::pin(async move { refuse.map_or(Ok(()), Err) })
    }
    fn started(&self, leases: &[LeaseName]) {
        self.started.lock().unwrap().push(leases.to_vec());
    }
    fn stop(
        &self,
        shard: u32,
        deadline: Instant,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
        self.stops.lock().unwrap().push((shard, deadline));
        Box::pin(async {})
    }
}

const DRAIN: Duration = Duration::from_millis(100);

fn billing() -> LeaseName {
    LeaseName::parse("billing").unwrap()
}

/// The tenures of a member whose one shard holds lease `billing` (drain
/// timeout 100 ms), followed by `work`.
fn tenures(w: &World, work: Arc<Work>) -> (Tenures, Shard) {
    let db = w.db();
    let state: Arc<dyn StateStore> = db;
    let epochs = crate::lease::Epochs::new(w.store(), "p/");
    let fences = crate::fence::Fences::new(epochs, state.clone(), Duration::from_secs(1));
    let dedup = Arc::new(crate::dedup::Dedup::new(
        state.clone(),
        w.clock.clone(),
        Duration::from_secs(60),
    ));
    let t = Tenures::new(fences, state, dedup);
    t.follow(work);
    (t, Shard::new(vec![(billing(), DRAIN)]))
}

const FIRST: Owner = Owner {
    shard: 0,
    generation: Generation::FIRST,
};

/// A tenure starts only if the work that follows it agrees: refused, the
/// shard is not claimed and no fence runs; agreed, the state is claimed under
/// the tenure's generation and every lease's fence runs under its owner.
#[tokio::test(start_paused = true)]
async fn a_tenure_starts_only_if_its_work_agrees() {
    let w = World::new();
    let work = Arc::new(Work::default());
    let (t, g) = tenures(&w, work.clone());
    *work.refuse.lock().unwrap() = Some("the queue is not ready".into());
    assert_eq!(
        t.start(&g, FIRST).await,
        Err("the queue is not ready".into())
    );
    assert!(w.tables.lock().unwrap().owners.is_empty(), "not claimed");
    assert!(t.fences.get(&billing()).is_none(), "no fence started");
    *work.refuse.lock().unwrap() = None;
    t.start(&g, FIRST).await.unwrap();
    assert_eq!(w.tables.lock().unwrap().owners[&0].generation, 1, "claimed");
    let fence = t.fences.get(&billing()).expect("its fence runs");
    assert_eq!(fence.owner(), FIRST);
    assert!(work.started.lock().unwrap().is_empty(), "not served yet");
    t.started(&g);
    assert_eq!(*work.started.lock().unwrap(), vec![vec![billing()]]);
}

/// A stopped tenure: nothing served from the stop on; what is in flight runs
/// until the deadline given and is aborted then, the work's attempts held to
/// the same deadline; the shard counts the tenure as stopping until its
/// requests have ended. Stopping a shard not served does nothing.
#[tokio::test(start_paused = true)]
async fn a_stopped_tenure_holds_its_requests_and_work_to_the_deadline() {
    let w = World::new();
    let work = Arc::new(Work::default());
    let (t, g) = tenures(&w, work.clone());
    t.start(&g, FIRST).await.unwrap();
    g.serve(FIRST.generation);
    let pass = w.admit_to(&t.fences).await;
    let aborted: Arc<Mutex<Option<Instant>>> = Arc::default();
    let request = {
        let aborted = aborted.clone();
        tokio::spawn(async move {
            pass.aborted().await;
            *aborted.lock().unwrap() = Some(Instant::now());
        })
    };
    let deadline = Instant::now() + Duration::from_secs(3);
    assert!(t.stop(0, &g, deadline, "test"));
    assert_eq!(g.serving(), None, "nothing served from the stop on");
    assert!(!t.stop(0, &g, deadline, "test"), "already stopped");
    settle().await;
    assert_eq!(*work.stops.lock().unwrap(), vec![(0, deadline)]);
    assert_eq!(*g.stopping.borrow(), 1, "its request is in flight");
    advance(deadline - Instant::now() - Duration::from_millis(1)).await;
    settle().await;
    assert_eq!(
        *aborted.lock().unwrap(),
        None,
        "aborted before the deadline"
    );
    advance(Duration::from_millis(1)).await;
    settle().await;
    assert_eq!(*aborted.lock().unwrap(), Some(deadline));
    request.await.unwrap(); // the request ends: its pass is dropped
    settle().await;
    assert_eq!(*g.stopping.borrow(), 0, "the stopped tenure has ended");
}

/// A handover's stop: each lease is held to its own drain timeout's
/// deadline, the work to the longest of them.
#[tokio::test(start_paused = true)]
async fn a_handovers_leases_drain_for_their_own_timeout_and_the_work_the_longest() {
    let w = World::new();
    let work = Arc::new(Work::default());
    let (t, g) = tenures(&w, work.clone());
    t.start(&g, FIRST).await.unwrap();
    g.serve(FIRST.generation);
    let now = Instant::now();
    let drained = t.stop_leases(&g, FIRST, |drain| now + drain);
    let stopped = drained.join_all().await;
    assert_eq!(stopped, vec![true, true], "the lease's fence, and the work");
    assert_eq!(*work.stops.lock().unwrap(), vec![(0, now + DRAIN)]);
    assert!(t.fences.get(&billing()).is_none(), "the fence is closed");
}
