//! The binary record codec of the sled backend: versioned, length-prefixed,
//! bounds-checked on decode (proptested and fuzzed: `tests/fuzz`).

use bytes::Bytes;

use super::record::{Record, State, StoredResponse};
use crate::epoch::Epoch;

const VERSION: u8 = 1;

pub fn encode(r: &Record) -> Vec<u8> {
    let mut out = Vec::with_capacity(
        64 + r
            .response
            .as_ref()
            .map_or(0, |s| s.body.as_ref().map_or(0, Bytes::len)),
    );
    out.push(VERSION);
    out.push(match r.state {
        State::InFlight => 0,
        State::Done => 1,
        State::InDoubt => 2,
    });
    out.extend_from_slice(&r.fingerprint);
    out.extend_from_slice(&r.epoch.get().to_be_bytes());
    out.extend_from_slice(&r.created_ms.to_be_bytes());
    out.extend_from_slice(&r.updated_ms.to_be_bytes());
    match &r.response {
        None => out.push(0),
        Some(s) => {
            out.push(1);
            out.extend_from_slice(&s.status.to_be_bytes());
            out.extend_from_slice(&(s.headers.len() as u32).to_be_bytes());
            for (n, v) in &s.headers {
                out.extend_from_slice(&(n.len() as u32).to_be_bytes());
                out.extend_from_slice(n.as_bytes());
                out.extend_from_slice(&(v.len() as u32).to_be_bytes());
                out.extend_from_slice(v);
            }
            match &s.body {
                None => out.push(0),
                Some(b) => {
                    out.push(1);
                    out.extend_from_slice(&(b.len() as u32).to_be_bytes());
                    out.extend_from_slice(b);
                }
            }
        }
    }
    out
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2)
            .and_then(|b| b.try_into().ok())
            .map(u16::from_be_bytes)
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_be_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_be_bytes)
    }
}

pub fn decode(raw: &[u8]) -> Option<Record> {
    let mut r = Reader(raw);
    if r.u8()? != VERSION {
        return None;
    }
    let state = match r.u8()? {
        0 => State::InFlight,
        1 => State::Done,
        2 => State::InDoubt,
        _ => return None,
    };
    let fingerprint: [u8; 32] = r.take(32)?.try_into().ok()?;
    let epoch = Epoch::new(r.u64()?);
    let created_ms = r.u64()?;
    let updated_ms = r.u64()?;
    let response = match r.u8()? {
        0 => None,
        1 => {
            let status = r.u16()?;
            let n = r.u32()? as usize;
            let mut headers = Vec::with_capacity(n.min(128));
            for _ in 0..n {
                let nl = r.u32()? as usize;
                let name = std::str::from_utf8(r.take(nl)?).ok()?.to_owned();
                let vl = r.u32()? as usize;
                headers.push((name, r.take(vl)?.to_vec()));
            }
            let body = match r.u8()? {
                0 => None,
                1 => {
                    let bl = r.u32()? as usize;
                    Some(Bytes::copy_from_slice(r.take(bl)?))
                }
                _ => return None,
            };
            Some(StoredResponse {
                status,
                headers,
                body,
            })
        }
        _ => return None,
    };
    if !r.0.is_empty() {
        return None;
    }
    Some(Record {
        state,
        fingerprint,
        epoch,
        created_ms,
        updated_ms,
        response,
    })
}
