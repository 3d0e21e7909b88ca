//! fencegate: an HTTP gateway that fences stale leaders in front of destinations
//! that cannot fence themselves. The contract is SPEC.md; this is the map.
//!
//! - [`epoch`] — lease names, epochs, tokens and the epoch object (SPEC §2).
//! - [`lease`] — the lease store trait with `s3` and `dir` backends, the worker's
//!   acquire/renew/release algorithm, and the store self-test.
//! - [`admission`] — the pure admission decision (SPEC §4).
//! - [`gate`] — per-lease high-water mark, in-flight tracking and the drain (§4–§5).
//! - [`fence`] — everything kept for one lease: gate, known epochs; how fences are
//!   kept current (`fence/refresh.rs`) and the running ones (`fence/registry.rs`).
//! - [`state`] — marks and dedup records behind one trait; `sled` (group commit,
//!   witness) is the embedded backend, `postgres` the shared one (with the
//!   set-up record: one database, one set-up); shard owner rows and membership
//!   are a trait of their own (`ownership`).
//! - [`dedup`] — dedup keys, records, replay (SPEC §6).
//! - [`forward`] — the request mapped to the upstream and header hygiene (SPEC §3);
//!   the pooled client over rustls is `forward/client.rs`, a route's TLS client
//!   certificate `forward/client_auth.rs`, Standard Webhooks signing
//!   `forward/sign.rs`.
//! - [`headers`] — the header names fencegate reads and adds (SPEC §3, §10.2).
//! - [`cutoff`] — upstream connections an abort cuts at once (SPEC §5);
//!   [`streaming`] — bodies streamed both ways while the lease's pass is held
//!   (§5–§6).
//! - [`protect`] — protecting the destination: a route's in-flight limit, its
//!   rate, its hold on a `Retry-After`, its circuit breaker (refusals before
//!   forwarding).
//! - [`queue`] — queued delivery (SPEC §11): a message and its states, the
//!   route rules, the stores behind one trait (sled, PostgreSQL), the
//!   deliverer that follows this instance's tenures, operator edits, pauses
//!   and bulk jobs.
//! - [`proxy`] — the request path tying the above together, in named phases
//!   its module doc lists in order (parse the claim, place or relay, admit,
//!   protect, claim the key, forward, record); [`access`] — its access log
//!   line and request id.
//! - [`error`] — every fencegate-made response, mapped to SPEC §7 in one place.
//! - [`live`] — what a reload (SIGHUP) replaces: routes, admin token, TLS;
//!   `routes` — the configured routes and their index, below everything
//!   that reads them (the proxy, the queue, the server).
//! - [`budget`] — the descriptor budget: what the process may hold open,
//!   split at start-up (SPEC §9 "Limits").
//! - [`shared`] — the one value built at start-up and handed to the proxy, the
//!   admin API and the metrics collector.
//! - [`server`], [`admin`], [`metrics`] — listeners (idle HTTP/1 connections are
//!   parked: `server/park.rs`), the admin API, Prometheus.
//! - [`telemetry`] — traces: W3C trace context in and on, a span per request
//!   and its steps, OTLP/HTTP export through a bounded queue (`[telemetry]`).
//! - [`set_up`] — what a gate object says of the set-up that wrote it, its seal,
//!   and when a contender may believe it (§10).
//! - [`cluster`] — several instances: a shard as held and seen (`shard`),
//!   the prefix's anchor (`anchor`), exclusion between set-ups on a prefix
//!   (`exclusion`), the keeper's rounds (`keeper`), a tenure (`tenure`), the
//!   forwarding window (`window`), relaying to the owner (`peer`); and
//!   [`cluster::guard`], the instance guard — the one-shard case (§10.1). [`process`] — which process wrote a gate object, and whether it
//!   is gone.
//! - [`clock`] — time, injected (the monotonic side is tokio's clock);
//!   [`entropy`] — randomness, from one place.
//! - [`lock_order`] — the one-mutex-at-a-time rule, checked in debug builds.
//! - [`config`], [`clock`], [`cli`], [`demo`], [`failpoint`] — the rest.

#![forbid(unsafe_code)]
// Lints as memory (issue 26): what is `pub` is the library's surface, and every
// item of it says what it is for; a lock is never held across an await; no
// `unwrap` outside tests.
#![warn(missing_docs, unreachable_pub, clippy::await_holding_lock)]
#![cfg_attr(not(test), warn(clippy::unwrap_used))]

pub(crate) mod access;
pub mod admin;
pub mod admission;
pub mod budget;
pub mod cli;
pub mod clock;
pub mod cluster;
pub mod config;
pub(crate) mod cutoff;
pub mod dedup;
pub(crate) mod demo;
pub mod entropy;
pub mod epoch;
pub(crate) mod error;
pub(crate) mod failpoint;
pub(crate) mod fence;
pub mod forward;
pub mod gate;
pub mod headers;
pub mod lease;
pub(crate) mod live;
pub(crate) mod lock_order;
pub mod metrics;
pub mod process;
pub mod protect;
pub(crate) mod proxy;
pub mod queue;
pub(crate) mod routes;
pub mod server;
pub mod set_up;
pub(crate) mod shared;
pub mod state;
pub mod streaming;
pub(crate) mod telemetry;
