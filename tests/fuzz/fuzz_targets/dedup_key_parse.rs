//! `Idempotency-Key` (SPEC §3, §6): 1–255 visible ASCII characters, kept byte
//! for byte; everything else refused; nothing panics.
#![no_main]

use fencegate::dedup::DedupKey;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let valid = (1..=255).contains(&data.len()) && data.iter().all(|b| (0x21..=0x7e).contains(b));
    match DedupKey::parse(data) {
        Ok(k) => {
            assert!(valid, "accepted {data:?}");
            assert_eq!(k.as_str().as_bytes(), data);
        }
        Err(why) => {
            assert!(!valid, "refused {data:?}: {why}");
            assert!(!why.is_empty());
        }
    }
});
