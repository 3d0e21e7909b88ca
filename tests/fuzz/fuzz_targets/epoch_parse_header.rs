//! `X-Lease-Epoch` (SPEC §3, §7): exactly a plain decimal u64 in its one
//! spelling — no sign, no spaces, no leading zero, nothing but ASCII digits — is
//! accepted, and nothing panics.
#![no_main]

use fencegate::epoch::Epoch;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let got = Epoch::parse_header(data);
    // The reference: at most 20 ASCII digits, no leading zero unless the digit
    // is the whole header ("0"), that std parses as a u64.
    let reference = std::str::from_utf8(data)
        .ok()
        .filter(|s| !s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit()))
        .filter(|s| s.len() == 1 || !s.starts_with('0'))
        .and_then(|s| s.parse::<u64>().ok());
    assert_eq!(got.map(Epoch::get), reference, "{data:?}");
    if let Some(e) = got {
        // Its own rendering parses back to the same epoch.
        assert_eq!(Epoch::parse_header(e.get().to_string().as_bytes()), Some(e));
    }
});
