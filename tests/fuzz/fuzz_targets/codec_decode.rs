//! The dedup record codec on arbitrary bytes (a damaged or foreign sled value):
//! decoding never panics or over-allocates, and whatever decodes is canonical —
//! encoding it again gives back exactly the input.
#![no_main]

use fencegate::dedup::codec;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(record) = codec::decode(data) {
        assert_eq!(codec::encode(&record), data);
    }
});
