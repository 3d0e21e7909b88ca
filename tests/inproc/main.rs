//! In-process tests: fencegate's `server::build_with_store` + `App::run` in the test
//! process, on the `dir` store with a manual clock, and a recording origin. No
//! Python, no S3 server, no child processes: plain `cargo test` runs them. What
//! needs S3, the CLI, a crash, a signal or the campaign stays in `tests/it`.
//! `conformance` is the `StateStore` suite: one set of rules run on sled, on
//! PostgreSQL, and on each behind a fault-injecting wrapper.

// Tests may read the wall clock and sleep (clippy.toml bans both in the library).
#![allow(clippy::disallowed_methods)]

#[path = "../common/mod.rs"]
mod common;
mod support;

mod conformance;
mod corpus;
mod dedup;
mod edges;
mod errors;
mod fencing;
mod harness;
mod hygiene;
mod operator;
mod parking;
mod protect;
mod streaming;
mod upstream_conn;
