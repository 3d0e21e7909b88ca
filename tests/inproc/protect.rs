//! What the circuit breaker counts (SPEC §7 `upstream_held`, §9 `breaker`): an
//! exchange that timed out is the upstream's failure; a 4xx answer is not.

use std::time::Duration;

use crate::support::*;

/// `failures = 1`: a 404 from the origin leaves the breaker closed (the next
/// request is forwarded); a request the origin does not answer within the
/// route's timeout (504 `upstream_timeout`) opens it, and the next request is
/// refused `breaker_open` without reaching the origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_opens_the_breaker_and_a_4xx_does_not() {
    let (origin, fg) = billing_route(
        200,
        "timeout_ms = 300\nbreaker = { failures = 1, cool_down = \"10m\" }",
    )
    .await;
    let a = acquire(&fg.epochs, "billing", "worker-a", Duration::from_secs(30)).await;
    let url = fg.url("/billing/x");
    let r = send(
        worker_req(&url, a.epoch.get(), &a.token)
            .header("x-test-status", "404")
            .body(body("x"))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 404);
    assert_eq!(
        post(&fg, "/billing/x", &a, "still closed").await.status,
        200
    );

    let r = send(
        worker_req(&url, a.epoch.get(), &a.token)
            .header("x-test-hold", "never")
            .body(body("slow"))
            .unwrap(),
    )
    .await;
    r.assert_error(504, "upstream_timeout");
    let refused = send(keyed(&fg, "/billing/x", &a, "after", "x")).await;
    refused.assert_error(503, "upstream_held");
    assert_eq!(refused.json()["detail"], "breaker_open");
    assert_eq!(origin.count(), 3, "the refused request reached nothing");
    let view = fg.admin_json("/v1/routes").await;
    assert_eq!(view["routes"][0]["breaker"]["state"], "open", "{view}");
    origin.release("never");
}
