//! Integration tests: a real S3-compatible server, a real fencegate process and a
//! recording origin, all on loopback. One binary, one module per SPEC section.

mod support;

mod dedup;
mod dir_store;
mod errors;
mod fencing;
mod hygiene;
