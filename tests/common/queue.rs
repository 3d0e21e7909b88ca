//! A queued message and its request as the queue-store tests make them (the
//! conformance suite in `tests/inproc`, the PostgreSQL store's own tests in
//! `tests/it`): route and lease `hook`, a plain-text body.

use bytes::Bytes;
use fencegate::queue::{Envelope, Message, Status};

/// A pending message of `key` at `epoch` (its place is the store's to give).
pub fn message(key: &str, epoch: u64) -> Message {
    Message {
        route: "hook".into(),
        key: key.into(),
        lease: "hook".into(),
        epoch,
        seq: 0,
        fingerprint: String::new(),
        method: "POST".into(),
        path: "/hook/x".into(),
        token_sha256: None,
        status: Status::Pending,
        attempts: 0,
        unknown_outcomes: 0,
        accepted_ms: 1,
        updated_ms: 1,
        next_attempt_ms: 1,
        last_status: None,
        last_error: None,
        answer: None,
    }
}

/// Its request: `POST x`, `text/plain`, the body `body`.
pub fn envelope() -> Envelope {
    Envelope {
        method: "POST".into(),
        rest: "x".into(),
        query: None,
        headers: vec![("content-type".into(), b"text/plain".to_vec())],
        body: Bytes::from_static(b"body"),
    }
}
