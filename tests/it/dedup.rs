//! SPEC §6: crashes on each durable boundary, asserted at the origin. (Replay,
//! conflicts, derived keys and outcomes: `tests/inproc/dedup.rs`.)

use std::time::Duration;

use fencegate::lease::acquire::Holding;

use crate::support::*;

async fn setup() -> (S3Server, Origin, Fencegate, Holding) {
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let fg = Fencegate::start(&format!(
        "{}{}",
        s3.store_toml(200),
        route_toml("pay", "pay", &origin, ""),
    ));
    let epochs = s3.epochs().await;
    let a = acquire(&epochs, "pay", "worker-a", Duration::from_secs(60)).await;
    (s3, origin, fg, a)
}

/// kill -9 on each durable boundary, restart, retry the same key: the destination
/// sees the action at most once, and the worker learns which case it is in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_on_each_durable_boundary_is_at_most_once() {
    skip_without_python!();
    let (_s3, origin, mut fg, a) = setup().await;
    // Raise the mark first so the failpoints below hit the dedup path.
    assert_eq!(post(&fg, "/pay/warm", &a, "warm").await.status, 200);
    let cases = [
        // (failpoint, reached origin?, what a retry after restart gets)
        ("dedup_in_flight_flushed", 0, "dedup_in_doubt"),
        ("dedup_response_before_done", 1, "dedup_in_doubt"),
        ("dedup_done_flushed", 1, "replayed"),
    ];
    let mut expected_at_origin = origin.count();
    for (i, (failpoint, reached, after)) in cases.into_iter().enumerate() {
        let key = format!("crash-{i}");
        fg.kill9();
        fg.spawn(Some(failpoint)).unwrap();
        let r = try_send(keyed(&fg, "/pay/x", &a, &key, "pay 10")).await;
        assert!(
            r.is_err(),
            "{failpoint}: the process should have died mid-request, got {r:?}"
        );
        let status = fg.wait_exit();
        assert!(!status.success(), "{failpoint}: aborted");
        expected_at_origin += reached;
        assert_eq!(origin.count(), expected_at_origin, "{failpoint}");
        fg.spawn(None).unwrap();
        let retry = send(keyed(&fg, "/pay/x", &a, &key, "pay 10")).await;
        match after {
            "replayed" => {
                assert_eq!(retry.status, 200, "{failpoint}");
                assert_eq!(retry.headers["x-fencegate-replayed"], "true");
            }
            code => retry.assert_error(409, code),
        }
        assert_eq!(
            origin.count(),
            expected_at_origin,
            "{failpoint}: the retry did not reach the destination"
        );
    }
}
