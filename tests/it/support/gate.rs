//! Gate objects as someone else writes them: the gate leases' epochs under
//! `{prefix}.gate/`, the next one forged, a holder's renewal awaited; and the
//! single instance whose guard they are.

use std::time::{Duration, Instant};

use bytes::Bytes;
use fencegate::epoch::{Epoch, LeaseName};
use fencegate::lease::{CreateOutcome, Epochs};

use super::{route_toml, Origin, S3Server, PREFIX};

/// The gate leases' epochs (`{prefix}.gate/`).
pub async fn gates(s3: &S3Server) -> Epochs {
    Epochs::new(s3.store().await, format!("{PREFIX}.gate/"))
}

/// Creates `body` as the next gate object of `shard` (retrying if the holder's
/// renewal wins the number first); returns the epoch written.
pub async fn forge_next(gates: &Epochs, shard: u32, body: impl Fn(u64) -> Vec<u8>) -> u64 {
    let name = LeaseName::parse(&format!("{shard:04}")).unwrap();
    for _ in 0..20 {
        let latest = gates.latest_after(&name, Epoch::NONE).await.unwrap();
        let next = latest.get() + 1;
        let out = gates
            .create(&name, Epoch::new(next), Bytes::from(body(next)))
            .await
            .unwrap();
        if out == CreateOutcome::Created {
            return next;
        }
    }
    panic!("could not forge a gate object");
}

/// Waits until the latest gate epoch of `shard` moves past what it is now (its
/// owner just renewed), and returns the new one.
pub async fn next_renewal(gates: &Epochs, shard: u32) -> u64 {
    let name = LeaseName::parse(&format!("{shard:04}")).unwrap();
    let now = gates.latest_after(&name, Epoch::NONE).await.unwrap();
    let since = Instant::now();
    loop {
        let l = gates.latest_after(&name, Epoch::NONE).await.unwrap();
        if l > now {
            return l.get();
        }
        assert!(
            since.elapsed() < Duration::from_secs(90),
            "no new gate object on shard {shard} after {now:?} in 90 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A single instance's config: gate lease 6 s, margin 1 s (forwards until 5 s
/// after each renewal, renewed every 2 s).
pub fn single_config(s3: &S3Server, origin: &Origin) -> String {
    format!(
        "{}gate_ttl = \"6s\"\nself_fence_margin = \"1s\"\n{}",
        s3.store_toml(200),
        route_toml("billing", "billing", origin, "timeout_ms = 20000\n")
    )
}
