//! A dedup record as the PostgreSQL backend stores it: the state's code and
//! the columns a record is read back from (by the one-row statements and by
//! the claim batch, which returns a conflicting key's record).

use bytes::Bytes;
use tokio_postgres::Row;

use super::schema::epoch_from_sql;
use crate::epoch::Epoch;
use crate::state::{Record, RequestLine, State, StoredResponse};

pub(super) fn state_code(s: State) -> i16 {
    match s {
        State::InFlight => 0,
        State::Done => 1,
        State::InDoubt => 2,
    }
}

fn state_of(code: i16) -> Option<State> {
    match code {
        0 => Some(State::InFlight),
        1 => Some(State::Done),
        2 => Some(State::InDoubt),
        _ => None,
    }
}

pub(super) const RECORD_COLUMNS: &str =
    "state, fingerprint, epoch, created_ms, updated_ms, status, header_names, header_values, body, method, path, headers";

pub(super) fn record_of(row: &Row) -> Option<Record> {
    record_at(row, 0)
}

/// The record in [`RECORD_COLUMNS`] from column `at` on (`None` when its state
/// is NULL: no record).
pub(super) fn record_at(row: &Row, at: usize) -> Option<Record> {
    let state = state_of(row.get::<_, Option<i16>>(at)?)?;
    let fingerprint: Vec<u8> = row.get(at + 1);
    let status: Option<i16> = row.get(at + 5);
    let names: Option<Vec<String>> = row.get(at + 6);
    let values: Option<Vec<Vec<u8>>> = row.get(at + 7);
    let body: Option<Vec<u8>> = row.get(at + 8);
    let method: Option<String> = row.get(at + 9);
    let path: Option<String> = row.get(at + 10);
    let packed: Option<Vec<u8>> = row.get(at + 11);
    // Since schema 5 the headers are one column; older records keep two arrays.
    let headers = match packed {
        Some(raw) => crate::state::codec::decode_headers(&raw)?,
        None => names
            .unwrap_or_default()
            .into_iter()
            .zip(values.unwrap_or_default())
            .collect(),
    };
    Some(Record {
        state,
        fingerprint: fingerprint.try_into().ok()?,
        epoch: Epoch::new(epoch_from_sql(row.get(at + 2))),
        created_ms: u64::try_from(row.get::<_, i64>(at + 3)).ok()?,
        updated_ms: u64::try_from(row.get::<_, i64>(at + 4)).ok()?,
        response: status.map(|s| StoredResponse {
            status: u16::try_from(s).unwrap_or(0),
            headers,
            body: body.map(Bytes::from),
        }),
        request: method
            .zip(path)
            .map(|(method, path)| RequestLine { method, path }),
    })
}
