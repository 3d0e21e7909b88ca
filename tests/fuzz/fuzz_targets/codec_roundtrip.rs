//! Every record the proxy can build survives encode → decode unchanged.
#![no_main]

use bytes::Bytes;
use fencegate::dedup::{codec, Record, RequestLine, State, StoredResponse};
use fencegate::epoch::Epoch;
use libfuzzer_sys::fuzz_target;

type Response = (u16, Vec<(String, Vec<u8>)>, Option<Vec<u8>>);
type Input = (u8, [u8; 32], u64, u64, u64, Option<Response>, Option<(String, String)>);

fuzz_target!(|input: Input| {
    let (state, fingerprint, epoch, created_ms, updated_ms, response, request) = input;
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
        request: request.map(|(m, p)| RequestLine::new(&m, &p)),
    };
    let raw = codec::encode(&record);
    assert_eq!(codec::decode(&raw), Some(record));
});
