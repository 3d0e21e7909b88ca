//! Randomness, in one place (clippy.toml bans `rand::thread_rng` and
//! `rand::random` elsewhere): tokens, request-id prefixes and temporary names
//! come from here, so a test that needs them fixed has one place to look.

use rand::RngCore;

/// Fills `buf` from the thread's CSPRNG (tokens: SPEC §2's fresh random token).
pub fn fill(buf: &mut [u8]) {
    #[allow(clippy::disallowed_methods)]
    rand::thread_rng().fill_bytes(buf);
}

/// A random `u64` (names and ids that only need to differ).
pub fn u64() -> u64 {
    #[allow(clippy::disallowed_methods)]
    rand::thread_rng().next_u64()
}
