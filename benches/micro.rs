//! Micro benches (criterion) of the request path's pieces: the epoch header, the
//! admission decision, the gate's pass, dedup key derivation, a group commit, and
//! the per-request bookkeeping (metrics, the upstream request).
//!
//! ```text
//! cargo bench --bench micro                # all
//! cargo bench --bench micro -- gate        # a filter
//! ```
//! Under `cargo test --all-targets` criterion runs each once, as a test.

// Tests and benches may read the wall clock and sleep (clippy.toml bans both in
// the library, where time is injected).
#![allow(clippy::disallowed_methods)]

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant, SystemTime};

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};

use fencegate::admission::{self, Admit, Claim, Facts};
use fencegate::dedup::{self, DedupKey};
use fencegate::epoch::{Epoch, EpochObject, LeaseName, TokenHash};
use fencegate::gate::Gate;

const TOKEN: &str = "3f1c9a6b2e7d4f80a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718";

fn epoch_header(c: &mut Criterion) {
    c.bench_function("epoch/parse_header", |b| {
        b.iter(|| Epoch::parse_header(black_box(b"1234567")))
    });
}

fn admission_decide(c: &mut Criterion) {
    let lease = LeaseName::parse("billing").expect("lease name");
    let object = EpochObject::Acquire {
        holder: "worker-1".into(),
        token: TokenHash::of(TOKEN.as_bytes()),
        expires_at: SystemTime::now() + Duration::from_secs(3600),
    };
    let now = SystemTime::now();
    c.bench_function("admission/decide (admit at mark, token checked)", |b| {
        b.iter(|| {
            admission::decide(
                black_box(Claim {
                    epoch: Epoch::new(7),
                    token: Some(TOKEN.as_bytes()),
                }),
                Facts {
                    lease: &lease,
                    high_water_mark: Epoch::new(7),
                    latest_known: Epoch::new(7),
                    object: Some(&object),
                    store_now: now,
                    require_token: true,
                    token_verified: false,
                },
            )
        })
    });
}

fn at_mark(_: Epoch) -> Result<Admit, admission::Refusal> {
    Ok(Admit::AtMark)
}

fn gate(c: &mut Criterion) {
    let g = Gate::new(Epoch::new(7));
    c.bench_function("gate/try_enter+drop, uncontended", |b| {
        b.iter(|| {
            let pass = g.try_enter(black_box(Epoch::new(7)), at_mark);
            drop(black_box(pass));
        })
    });
    let mut group = c.benchmark_group("gate");
    group.throughput(Throughput::Elements(8));
    group.bench_function("try_enter+drop, 8 threads (time per 8 pairs)", |b| {
        b.iter_custom(|iters| {
            let g = Gate::new(Epoch::new(7));
            let barrier = Arc::new(Barrier::new(9));
            let threads: Vec<_> = (0..8)
                .map(|_| {
                    let (g, barrier) = (g.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        barrier.wait();
                        for _ in 0..iters {
                            let pass = g.try_enter(black_box(Epoch::new(7)), at_mark);
                            drop(black_box(pass));
                        }
                    })
                })
                .collect();
            barrier.wait();
            let t = Instant::now();
            for th in threads {
                th.join().expect("gate thread");
            }
            t.elapsed()
        })
    });
    group.finish();
}

fn dedup_key(c: &mut Criterion) {
    let body = vec![0x5au8; 1024];
    let mut group = c.benchmark_group("dedup");
    group.throughput(Throughput::Bytes(1024));
    group.bench_function("DedupKey::derive, 1 KiB body", |b| {
        b.iter(|| DedupKey::derive("billing", "POST", "/billing/charges?x=1", black_box(&body)))
    });
    group.bench_function("fingerprint, 1 KiB body", |b| {
        b.iter(|| dedup::fingerprint("POST", "/billing/charges?x=1", black_box(&body)))
    });
    group.finish();
}

fn group_commit(c: &mut Criterion) {
    let dir = tempfile::Builder::new()
        .prefix("micro-durable-")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .expect("temp dir");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    use fencegate::state::StateStore;
    let durable = fencegate::state::sled::SledState::open(dir.path()).expect("durable");
    let mut n = 0u64;
    let before = durable.stats();
    let mut group = c.benchmark_group("durable");
    group.sample_size(20);
    group.throughput(Throughput::Elements(64));
    group.bench_function("group commit: 64 inserts + 64 concurrent commit()", |b| {
        b.iter(|| {
            rt.block_on(async {
                let tasks: Vec<_> = (0..64)
                    .map(|_| {
                        n += 1;
                        let d = durable.clone();
                        let key = fencegate::state::RecordKey {
                            route: "micro".into(),
                            key: n.to_string(),
                        };
                        let rec = fencegate::state::Record {
                            state: fencegate::state::State::Done,
                            fingerprint: [0; 32],
                            epoch: Epoch::new(1),
                            created_ms: n,
                            updated_ms: n,
                            response: None,
                            request: None,
                        };
                        tokio::spawn(async move {
                            d.put_record(&key, &rec).expect("insert");
                            d.commit().await.expect("commit");
                        })
                    })
                    .collect();
                for t in tasks {
                    t.await.expect("commit task");
                }
            })
        })
    });
    group.finish();
    let after = durable.stats();
    let (rec, bat) = (
        after.records - before.records,
        after.batches - before.batches,
    );
    if bat > 0 {
        eprintln!(
            "durable: {rec} commits in {bat} flushes ({:.1} per flush)",
            rec as f64 / bat as f64
        );
    }
    rt.block_on(durable.close()).expect("close");
}

fn bookkeeping(c: &mut Criterion) {
    let m = fencegate::metrics::Metrics::new();
    c.bench_function("metrics/request (forwarded)", |b| {
        b.iter(|| m.request(black_box("billing"), "forwarded", ""))
    });
    let target = fencegate::forward::Target::new(
        "/billing/",
        "http://127.0.0.1:9/v1/",
        "Idempotency-Key",
        vec![],
    )
    .expect("target");
    let req = http::Request::builder()
        .method("POST")
        .uri("/billing/charges")
        .header("host", "fencegate.local")
        .header("content-type", "application/json")
        .header("x-lease-epoch", "7")
        .header("x-lease-token", TOKEN)
        .body(())
        .expect("request");
    let (parts, _) = req.into_parts();
    let body = bytes::Bytes::from_static(&[b'x'; 100]);
    let hop =
        fencegate::forward::ClientHop::new("127.0.0.1:40000".parse().expect("client hop"), "http");
    c.bench_function("forward/build_request", |b| {
        b.iter_batched(
            || (parts.clone(), body.clone()),
            |(parts, body)| {
                fencegate::forward::build_request(&target, parts, body.into(), &hop, "fg-0123")
            },
            BatchSize::SmallInput,
        )
    });
    c.bench_function("dedup/DedupKey::fresh", |b| b.iter(DedupKey::fresh));
}

criterion_group!(
    benches,
    epoch_header,
    admission_decide,
    gate,
    dedup_key,
    group_commit,
    bookkeeping
);
criterion_main!(benches);
