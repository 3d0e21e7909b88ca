//! Every record the proxy can build survives encode → decode unchanged.
#![no_main]

use bytes::Bytes;
use fencegate::dedup::{codec, Record, State, StoredResponse};
use fencegate::epoch::Epoch;
use libfuzzer_sys::fuzz_target;

type Response = (u16, Vec<(String, Vec<u8>)>, Option<Vec<u8>>);

fuzz_target!(|input: (u8, [u8; 32], u64, u64, u64, Option<Response>)| {
    let (state, fingerprint, epoch, created_ms, updated_ms, response) = input;
    let record = Record {
        state: [State::InFlight, State::Done, State::InDoubt][usize::from(state % 3)],
        fingerprint,
        epoch: Epoch::new(epoch),
        created_ms,
        updated_ms,
        response: response.map(|(status, headers, body)| StoredResponse {
            status,
            headers,
            body: body.map(Bytes::from),
        }),
    };
    let raw = codec::encode(&record);
    assert_eq!(codec::decode(&raw), Some(record));
});
