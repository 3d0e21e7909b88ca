//! The request headers fencegate itself reads or adds, in one place: a worker's
//! lease claim, dedup key and request id (SPEC §3), the forwarding hop it appends
//! (§3), and the headers a cluster instance relays a request with (§10.2).
//!
//! Typed names: looking a header up by `&str` parses and validates the name
//! again on every request.

use http::header::HeaderName;

/// The worker's lease token: read, checked against the epoch's object, and never
/// forwarded (SPEC §3).
pub const LEASE_TOKEN: &str = "x-lease-token";
/// The worker's epoch: read, and forwarded as it came (SPEC §3).
pub const LEASE_EPOCH: &str = "x-lease-epoch";

/// [`LEASE_TOKEN`] as a header name, for lookups and removal.
pub(crate) const LEASE_TOKEN_NAME: HeaderName = HeaderName::from_static(LEASE_TOKEN);
/// [`LEASE_EPOCH`] as a header name.
pub(crate) const LEASE_EPOCH_NAME: HeaderName = HeaderName::from_static(LEASE_EPOCH);
/// The worker's dedup key (SPEC §3, §6), when it chose one.
pub const IDEMPOTENCY_KEY_NAME: HeaderName = HeaderName::from_static("idempotency-key");
/// The request id, sent upstream and echoed to the worker (`access`).
pub(crate) const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// SPEC §10.2: on an answer of a cluster member, the `advertise` URL of the
/// member that owns the lease's shard now — a worker (or a load balancer) may
/// send the lease's next request there and skip the relay.
pub(crate) const OWNER: HeaderName = HeaderName::from_static("x-fencegate-owner");

/// The operator page's session cookie (the admin listener sets it; the proxy
/// strips it from what it forwards: browsers scope cookies by host,
/// not port).
pub(crate) const ADMIN_SESSION_COOKIE: &str = "fencegate_admin";

/// The client hop fencegate appends to (SPEC §3), with `Forwarded`.
pub(crate) const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// SPEC §10.2: the instance that relayed a request to its shard's owner, and the
/// cluster's shared secret proving it. Neither is ever sent upstream.
pub const PEER_NAME: HeaderName = HeaderName::from_static("x-fencegate-peer");
/// The cluster's shared secret on a relayed request ([`PEER_NAME`]).
pub(crate) const PEER_TOKEN_NAME: HeaderName = HeaderName::from_static("x-fencegate-peer-token");
