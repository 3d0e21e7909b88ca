//! Loopback ports for listeners whose address a test must know before the
//! listener exists: a member's `advertise`, PostgreSQL's `-p`, a quickstart's
//! config.
//!
//! A port found with `bind(0)` and released is an ephemeral port: the kernel may
//! give it to the next `bind(0)` or outgoing connection of any process before the
//! listener it was meant for binds it (a CI run failed that way: a relay started
//! between the pick and fencegate's start took the member's port). These come
//! from below the kernel's ephemeral range instead, which it never hands out by
//! itself; a counter keeps them distinct within a test binary, a start derived
//! from the process id keeps binaries apart, and a bind check skips a port some
//! other program listens on.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};

/// Lowest port handed out (below it are well-known and registered services).
const FIRST: u32 = 10_000;

/// A loopback port nothing listens on, not handed out before by this process,
/// and outside the kernel's ephemeral range.
pub fn free_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let end = ephemeral_start().max(FIRST + 1_000);
    let span = end - FIRST;
    let start = std::process::id().wrapping_mul(7_919) % span;
    for _ in 0..span {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = FIRST + (start + n) % span;
        if let Ok(port) = u16::try_from(port) {
            if TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return port;
            }
        }
    }
    panic!("no free loopback port below {end}");
}

/// The first port of the kernel's ephemeral range (Linux's default when it
/// cannot be read).
fn ephemeral_start() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}
