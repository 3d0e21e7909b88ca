//! Integration tests: a real S3-compatible server, a real fencegate process and a
//! recording origin, all on loopback. One binary, one module per SPEC section.

mod support;

mod campaign;
mod corpus;
mod dedup;
mod dir_store;
mod disk;
mod edges;
mod errors;
mod fencing;
mod hygiene;
mod lease_cli;
mod ops;
