//! Integration tests: a real S3-compatible server, a real fencegate process and a
//! recording origin, all on loopback. One binary, one module per SPEC section.

// Tests and benches may read the wall clock and sleep (clippy.toml bans both in
// the library, where time is injected).
#![allow(clippy::disallowed_methods)]

mod support;

mod campaign;
mod client_cert;
mod cluster;
mod cluster_script;
mod dedup;
mod defaults;
mod dir_store;
mod disk;
mod edges;
mod failover;
mod fencing;
mod guard;
mod identity;
mod kubernetes;
mod lease_cli;
mod logs;
mod monitoring;
mod one_cpu;
mod one_database;
mod ops;
mod postgres;
mod protect;
mod queued;
mod queued_cluster;
mod quickstart;
mod reload;
mod siege;
mod startup;
mod traces;
mod webhooks;
