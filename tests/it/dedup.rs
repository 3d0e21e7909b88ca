//! SPEC §6: crashes on each durable boundary, asserted at the origin, with the
//! state in sled and in PostgreSQL. (Replay, conflicts, derived keys and outcomes:
//! `tests/inproc/dedup.rs`.)

use std::time::Duration;

use fencegate::lease::acquire::Holding;

use crate::support::*;

async fn setup(backend: Backend) -> (S3Server, Origin, Fencegate, Holding) {
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let fg = Fencegate::start(&format!(
        "{}{}{}",
        s3.store_toml(200),
        backend.state_toml(),
        route_toml("pay", "pay", &origin, ""),
    ));
    let epochs = s3.epochs().await;
    let a = acquire(&epochs, "pay", "worker-a", Duration::from_secs(60)).await;
    (s3, origin, fg, a)
}

/// How fencegate dies in one case of [`crash_on_each_durable_boundary`].
#[derive(Debug, Clone, Copy)]
enum Crash {
    /// The process aborts at this failpoint, mid-request.
    At(&'static str),
    /// kill -9 while the origin holds the request (no failpoint: the `in_flight`
    /// record is durable on every backend by then).
    WhileAtOrigin,
}

/// kill -9 on each durable boundary, restart, retry the same key: the destination
/// sees the action at most once, and the worker learns which case it is in.
async fn crash_on_each_durable_boundary(backend: Backend) {
    let (_s3, origin, mut fg, a) = setup(backend).await;
    // Raise the mark first so the failpoints below hit the dedup path.
    assert_eq!(post(&fg, "/pay/warm", &a, "warm").await.status, 200);
    // (how it dies, reached origin?, what a retry after restart gets). Every
    // backend passes `dedup_in_flight_flushed` once the claim is durable (sled's
    // group commit, PostgreSQL's commit of the claiming statement).
    let mut cases = vec![
        (Crash::At("dedup_in_flight_flushed"), 0, "dedup_in_doubt"),
        (Crash::WhileAtOrigin, 1, "dedup_in_doubt"),
        (Crash::At("dedup_response_before_done"), 1, "dedup_in_doubt"),
        (Crash::At("dedup_done_flushed"), 1, "replayed"),
    ];
    if matches!(backend, Backend::Postgres) {
        // The batched path's own boundaries (issue 27): a batch's statement
        // has returned (committed), its requests not yet answered.
        cases.push((Crash::At("pg_claim_batch_answered"), 0, "dedup_in_doubt"));
        cases.push((Crash::At("pg_outcome_batch_answered"), 1, "replayed"));
    }
    let mut expected_at_origin = origin.count();
    for (i, (crash, reached, after)) in cases.into_iter().enumerate() {
        let key = format!("crash-{i}");
        fg.kill9();
        match crash {
            Crash::At(failpoint) => {
                fg.spawn(Some(failpoint)).unwrap();
                let r = try_send(keyed(&fg, "/pay/x", &a, &key, "pay 10")).await;
                assert!(
                    r.is_err(),
                    "{crash:?}: the process should have died mid-request, got {r:?}"
                );
                let status = fg.wait_exit();
                assert!(!status.success(), "{crash:?}: aborted");
            }
            Crash::WhileAtOrigin => {
                fg.spawn(None).unwrap();
                let mut req = keyed(&fg, "/pay/x", &a, &key, "pay 10");
                req.headers_mut()
                    .insert("x-test-hold", key.parse().unwrap());
                let pending = tokio::spawn(try_send(req));
                origin.wait_for(expected_at_origin + 1).await;
                fg.kill9();
                let r = pending.await.unwrap();
                assert!(r.is_err(), "{crash:?}: killed mid-request, got {r:?}");
                origin.release(&key);
            }
        }
        expected_at_origin += reached;
        assert_eq!(origin.count(), expected_at_origin, "{crash:?}");
        fg.spawn(None).unwrap();
        let retry = send(keyed(&fg, "/pay/x", &a, &key, "pay 10")).await;
        match after {
            "replayed" => {
                assert_eq!(retry.status, 200, "{crash:?}");
                assert_eq!(retry.headers["x-fencegate-replayed"], "true");
            }
            code => retry.assert_error(409, code),
        }
        assert_eq!(
            origin.count(),
            expected_at_origin,
            "{crash:?}: the retry did not reach the destination"
        );
    }
}

mod crash_on_each_durable_boundary_is_at_most_once {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sled() {
        skip_without_python!();
        crash_on_each_durable_boundary(Backend::Sled).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres() {
        skip_without_python!();
        if !postgres::available_or_skip() {
            return;
        }
        crash_on_each_durable_boundary(Backend::Postgres).await;
    }
}
