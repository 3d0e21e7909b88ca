//! The embedded `dir` store: conditional create is atomic under contention, and a
//! fencegate on it fences like on S3.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fencegate::clock::SystemClock;
use fencegate::lease::dir::DirStore;
use fencegate::lease::{CreateOutcome, Epochs, LeaseStore};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_contenders_twenty_rounds_one_winner_each() {
    let tmp = tempfile::tempdir().unwrap();
    let store: Arc<dyn LeaseStore> =
        Arc::new(DirStore::open(tmp.path(), Arc::new(SystemClock)).unwrap());
    for round in 1..=20u64 {
        let key = format!("fencegate/race/{round:020}.json");
        let barrier = Arc::new(tokio::sync::Barrier::new(50));
        let mut tasks = Vec::new();
        for c in 0..50 {
            let (store, key, barrier) = (store.clone(), key.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                let out = store
                    .create_if_absent(&key, Bytes::from(format!("contender {c}")))
                    .await
                    .unwrap();
                (c, out)
            }));
        }
        let mut winners = Vec::new();
        for t in tasks {
            let (c, out) = t.await.unwrap();
            if out == CreateOutcome::Created {
                winners.push(c);
            }
        }
        assert_eq!(winners.len(), 1, "round {round}: winners {winners:?}");
        let stored = store.get(&key).await.unwrap().unwrap();
        assert_eq!(
            stored.body,
            Bytes::from(format!("contender {}", winners[0]))
        );
    }
    // No temp files are left behind.
    let leftovers: Vec<_> = std::fs::read_dir(tmp.path().join("fencegate/race"))
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencegate_on_the_dir_store_refuses_the_late_worker() {
    let origin = Origin::start().await;
    let leases = tempfile::tempdir().unwrap();
    let store_toml = format!(
        "[store]\nkind = \"dir\"\npath = \"{}\"\nrefresh_interval_ms = 100\ngrace_ms = 200\n",
        leases.path().display()
    );
    let fg = Fencegate::start(&format!(
        "{store_toml}{}",
        route_toml("jobs", "jobs", &origin, "")
    ));
    let epochs = Epochs::new(
        Arc::new(DirStore::open(leases.path(), Arc::new(SystemClock)).unwrap()),
        "fencegate/",
    );
    let a = acquire(&epochs, "jobs", "a", Duration::from_millis(800)).await;
    assert_eq!(post(&fg, "/jobs/run", &a, "a").await.status, 200);
    let b = acquire(&epochs, "jobs", "b", Duration::from_secs(30)).await;
    assert_eq!(post(&fg, "/jobs/run", &b, "b").await.status, 200);
    post(&fg, "/jobs/run", &a, "a-late")
        .await
        .assert_error(409, "epoch_stale");
    assert_eq!(origin.count(), 2);
}
