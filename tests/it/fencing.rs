//! SPEC §4: the durable mark across kill -9. (The late worker, expiry, forged
//! epochs, the drain and an unreachable store: `tests/inproc/fencing.rs`.)

use std::time::Duration;

use crate::support::*;

const LEASE: &str = "billing";

fn bodies(o: &Origin) -> Vec<String> {
    o.log()
        .iter()
        .map(|a| String::from_utf8_lossy(&a.body).into_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mark_survives_kill_9_and_does_not_depend_on_old_objects() {
    skip_without_python!();
    let (_s3, origin, mut fg, epochs) = billing_route(200, "").await;
    let a = acquire(&epochs, LEASE, "worker-a", Duration::from_secs(30)).await;
    assert_eq!(post(&fg, "/billing/x", &a, "a1").await.status, 200);
    let b = force_next_epoch(&epochs, LEASE, "worker-b", Duration::from_secs(30)).await;
    assert_eq!(post(&fg, "/billing/x", &b, "b1").await.status, 200);
    fg.restart(); // kill -9, start on the same data directory
    post(&fg, "/billing/x", &a, "a-after-crash")
        .await
        .assert_error(409, "epoch_stale");
    // Garbage collection deletes every epoch object; a zombie re-creates A's epoch
    // with its own token. The durable mark still refuses it.
    let lease = fencegate::epoch::LeaseName::parse(LEASE).unwrap();
    for e in [a.epoch, b.epoch] {
        epochs
            .store()
            .delete(&fencegate::epoch::object_key(PREFIX, &lease, e))
            .await
            .unwrap();
    }
    let zombie_token = "zombie-token";
    let rec = fencegate::epoch::EpochRecord::acquire(
        &lease,
        a.epoch,
        "zombie",
        zombie_token.as_bytes(),
        Duration::from_secs(30),
    );
    put_raw(&epochs, LEASE, a.epoch.get(), &rec.to_json()).await;
    fg.restart();
    let r = send(
        worker_req(&fg.url("/billing/x"), a.epoch.get(), zombie_token)
            .body(body("zombie"))
            .unwrap(),
    )
    .await;
    r.assert_error(409, "epoch_stale");
    assert_eq!(r.json()["high_water_mark"], b.epoch.get());
    assert_eq!(bodies(&origin), vec!["a1", "b1"]);
}
