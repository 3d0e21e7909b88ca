//! Named abort points on durable boundaries, for the crash tests.
//!
//! When the environment variable `FENCEGATE_FAILPOINT` names a point, the process
//! aborts there — no destructors, no flush — exactly like `kill -9` at that
//! instant. Unset (always, in production) it costs one pointer comparison.

use std::sync::OnceLock;

static ARMED: OnceLock<Option<String>> = OnceLock::new();

/// Aborts the process if `name` is the armed failpoint.
pub(crate) fn hit(name: &str) {
    let armed = ARMED.get_or_init(|| {
        std::env::var("FENCEGATE_FAILPOINT")
            .ok()
            .filter(|s| !s.is_empty())
    });
    if armed.as_deref() == Some(name) {
        eprintln!("fencegate: failpoint {name} hit, aborting");
        std::process::abort();
    }
}
