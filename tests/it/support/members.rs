//! Cluster members started one by one (each its own process, config and
//! port) for the fault tests of SPEC §5, §6 and §10, and what they check at
//! the destination.

use std::time::{Duration, Instant};

use bytes::Bytes;
use fencegate::lease::acquire::Holding;

use super::dump_arrivals;
use super::{
    free_port, route_toml, state_toml, try_send, worker_req, Arrival, Fencegate, Gateway, Origin,
    Reply, S3Server,
};

/// The lease every member's routes forward: `billing`.
pub const LEASE: &str = "billing";

pub const PEER_TOKEN: &str = "test-peer-token-0123456789";

/// How large [`held_upload`]'s body is: more than loopback's socket buffers
/// hold, so the origin can hold it half read.
pub const UPLOAD: usize = 16 << 20;

/// The `[store]`, `[state]` and `[cluster]` sections of a member's config:
/// `gate` is (`gate_ttl`, `self_fence_margin`), `port` its `advertise`.
fn member_sections(
    s3: &S3Server,
    db: &str,
    id: &str,
    port: u16,
    shards: u32,
    gate: (&str, &str),
    peer_token: &str,
) -> String {
    format!(
        "{}gate_ttl = \"{}\"\nself_fence_margin = \"{}\"\n{}[cluster]\ninstance_id = \"{id}\"\nadvertise = \"http://127.0.0.1:{port}\"\nshards = {shards}\npeer_token = \"{peer_token}\"\n\n",
        s3.store_toml(200).replace("timeout_ms = 1500", "timeout_ms = 1000"),
        gate.0,
        gate.1,
        state_toml(db, ""),
    )
}

/// A cluster member's config: one route `/billing/` (fencing only, drain
/// timeout 1 s) on lease `billing`, `shards` shards.
#[allow(clippy::too_many_arguments)]
pub fn member_config(
    s3: &S3Server,
    db: &str,
    origin: &Origin,
    id: &str,
    port: u16,
    shards: u32,
    gate: (&str, &str),
    peer_token: &str,
) -> String {
    member_sections(s3, db, id, port, shards, gate, peer_token)
        + &route_toml(
            "billing",
            LEASE,
            origin,
            "timeout_ms = 20000\ndrain_timeout_ms = 1000\nderive_key = \"none\"\n",
        )
}

/// A member started as [`member_config`] says, on a free port.
pub fn start_member(
    s3: &S3Server,
    db: &str,
    origin: &Origin,
    id: &str,
    shards: u32,
    gate: (&str, &str),
) -> Fencegate {
    on_a_free_port(|port| member_config(s3, db, origin, id, port, shards, gate, PEER_TOKEN))
}

/// A member listening on a free port, its config made for that port.
fn on_a_free_port(config: impl FnOnce(u16) -> String) -> Fencegate {
    let port = free_port();
    Fencegate::start_listening(&format!("127.0.0.1:{port}"), "", &config(port), &[])
}

/// A member of a 1-shard cluster, for uploads: one route `/billing/` (fencing only, drain
/// timeout 1 s, uploads up to 64 MiB), `/keyed/` (the same lease, dedup
/// records) and `/resend/` (dedup records, `in_doubt = "resend"`) on lease
/// `billing`; `gate` is (`gate_ttl`, `self_fence_margin`).
pub fn upload_member_toml(
    s3: &S3Server,
    db: &str,
    origin: &Origin,
    id: &str,
    port: u16,
    gate: (&str, &str),
) -> String {
    let route = |name: &str, extra: &str| {
        route_toml(
            name,
            LEASE,
            origin,
            &format!(
                "timeout_ms = 60000\ndrain_timeout_ms = 1000\nmax_body_bytes = {}\n{extra}",
                4 * UPLOAD
            ),
        )
    };
    member_sections(s3, db, id, port, 1, gate, PEER_TOKEN)
        + &route("billing", "derive_key = \"none\"\n")
        + &route("keyed", "")
        + &route("resend", "in_doubt = \"resend\"\n")
}

/// A 1-shard member started as [`upload_member_toml`] says, on a free port.
pub fn start_upload_member(
    s3: &S3Server,
    db: &str,
    origin: &Origin,
    id: &str,
    gate: (&str, &str),
) -> Fencegate {
    on_a_free_port(|port| upload_member_toml(s3, db, origin, id, port, gate))
}

/// Whether `fg` serves `shard` itself right now.
pub async fn serves(fg: &Fencegate, shard: u32) -> bool {
    fg.admin_json("/v1/cluster").await["shard_map"][shard as usize]["served_here"] == true
}

/// How long until `fg` serves `shard` itself (polled every 20 ms); `None`
/// after `limit`.
pub async fn wait_serves(fg: &Fencegate, shard: u32, limit: Duration) -> Option<Duration> {
    let t = Instant::now();
    while !serves(fg, shard).await {
        if t.elapsed() > limit {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Some(t.elapsed())
}

/// The generation under which `fg` sees `shard` owned (0: none).
pub async fn generation(fg: &Fencegate, shard: usize) -> u64 {
    fg.admin_json("/v1/cluster").await["shard_map"][shard]["generation"]
        .as_u64()
        .unwrap_or(0)
}

/// An [`UPLOAD`]-byte upload at `w`'s epoch through `fg`, held at the origin under
/// `name` (nothing of its body read); returns once its head has arrived.
pub async fn held_upload(
    origin: &Origin,
    fg: &Fencegate,
    w: &Holding,
    name: &str,
) -> tokio::task::JoinHandle<Result<Reply, String>> {
    let req = worker_req(&fg.url("/billing/upload"), w.epoch.get(), &w.token)
        .header("x-test-hold-body", name)
        .body(http_body_util::Full::new(Bytes::from(vec![b'u'; UPLOAD])))
        .unwrap();
    let up = tokio::spawn(try_send(req));
    let n = name.to_owned();
    origin
        .wait_until("the upload's head", |l| {
            l.iter()
                .any(|a| a.header("x-test-hold-body").as_deref() == Some(&n))
        })
        .await;
    up
}

/// Lets the held upload be read, waits until the origin is done with it, and
/// checks SPEC §5: once `later` (an e+1 request's body prefix) arrived, the
/// epoch-e upload must not have reached the destination whole.
pub async fn check_upload_after(
    origin: &Origin,
    name: &str,
    up: tokio::task::JoinHandle<Result<Reply, String>>,
    later: &str,
    t0: Instant,
) {
    origin.release(name);
    let n = name.to_owned();
    // (Polled: the origin signals arrivals, not a held body's end.)
    let deadline = Instant::now() + Duration::from_secs(20);
    while !origin
        .log()
        .iter()
        .any(|a| a.header("x-test-hold-body").as_deref() == Some(&n) && a.completed.is_some())
    {
        assert!(
            Instant::now() < deadline,
            "the upload was never read to its end"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = up.await.unwrap();
    eprintln!(
        "upload -> {:?} at {:?}",
        r.as_ref().map(|r| (r.status, r.error_code())),
        t0.elapsed()
    );
    let log = dump_arrivals(origin, t0);
    let upload = log
        .iter()
        .find(|a| a.header("x-test-hold-body").as_deref() == Some(name))
        .unwrap();
    let next = log.iter().find(|a| a.body.starts_with(later.as_bytes()));
    eprintln!(
        "upload: {} of {UPLOAD} bytes read, whole: {}; e+1 arrived: {:?}",
        upload.body_read,
        upload.body_whole,
        next.map(|n| n.arrived.saturating_duration_since(t0))
    );
    assert!(
        next.is_some(),
        "the e+1 request never arrived: nothing shown"
    );
    assert!(
        !upload.body_whole,
        "SPEC §5 broken at the destination: the epoch-e upload reached it whole ({} bytes) after an epoch e+1 request had arrived",
        upload.body_read
    );
}

/// SPEC §5's check at the destination: for requests x, y of one lease with
/// epoch(x) < epoch(y), x was complete before y arrived. The violations.
pub fn order_violations(log: &[Arrival]) -> Vec<String> {
    let mut out = Vec::new();
    for x in log {
        for y in log {
            if let (Some(ex), Some(ey)) = (x.epoch(), y.epoch()) {
                if ex < ey && x.completed.is_none_or(|c| c > y.arrived) {
                    out.push(format!(
                        "{:?} (epoch {ex}) not complete when {:?} (epoch {ey}) arrived",
                        String::from_utf8_lossy(&x.body),
                        String::from_utf8_lossy(&y.body)
                    ));
                }
            }
        }
    }
    out
}

/// When request `a:` was complete at the destination (`None`: never), and when
/// request `b:` arrived there (`None`: it did not).
pub fn a_done_b_arrived(log: &[Arrival]) -> (Option<Instant>, Option<Instant>) {
    let a_done = log
        .iter()
        .find(|x| x.body.starts_with(b"a:"))
        .unwrap()
        .completed;
    let b_arr = log
        .iter()
        .find(|x| x.body.starts_with(b"b:"))
        .map(|x| x.arrived);
    (a_done, b_arr)
}
