//! The binary record codec of the sled backend: versioned, length-prefixed,
//! bounds-checked on decode (proptested and fuzzed: `tests/fuzz`).
//!
//! Version 2 appends the request's method and path to version 1's layout; a
//! record without them is still written as version 1, so records written
//! before them decode unchanged and `encode(decode(raw)) == raw` for both.

use bytes::Bytes;

use super::record::{Record, RequestLine, State, StoredResponse};
use crate::epoch::Epoch;

const V1: u8 = 1;
/// Version 1, then the method and the path (each a u16 length and UTF-8).
const V2: u8 = 2;

/// A record's bytes as the embedded backend stores them (the newest version).
pub fn encode(r: &Record) -> Vec<u8> {
    let mut out = Vec::with_capacity(
        64 + r
            .response
            .as_ref()
            .map_or(0, |s| s.body.as_ref().map_or(0, Bytes::len)),
    );
    out.push(if r.request.is_some() { V2 } else { V1 });
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
            put_headers(&mut out, &s.headers);
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
    if let Some(q) = &r.request {
        for part in [&q.method, &q.path] {
            // RequestLine::new bounds both far below u16::MAX.
            let n = part.len().min(usize::from(u16::MAX));
            out.extend_from_slice(&(n as u16).to_be_bytes());
            out.extend_from_slice(&part.as_bytes()[..n]);
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
    /// A known version and the state.
    fn head(&mut self) -> Option<(u8, State)> {
        let version = self.u8().filter(|v| matches!(*v, V1 | V2))?;
        let state = match self.u8()? {
            0 => State::InFlight,
            1 => State::Done,
            2 => State::InDoubt,
            _ => return None,
        };
        Some((version, state))
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
    fn headers(&mut self) -> Option<Vec<(String, Vec<u8>)>> {
        let n = self.u32()? as usize;
        let mut headers = Vec::with_capacity(n.min(128));
        for _ in 0..n {
            let nl = self.u32()? as usize;
            let name = std::str::from_utf8(self.take(nl)?).ok()?.to_owned();
            let vl = self.u32()? as usize;
            headers.push((name, self.take(vl)?.to_vec()));
        }
        Some(headers)
    }
}

/// Response headers as a count (u32) and each name and value with a u32 length:
/// the record layout's header part, which the PostgreSQL backend also stores as
/// one `bytea` (a column per record, so that a batch of outcomes is one array).
fn put_headers(out: &mut Vec<u8>, headers: &[(String, Vec<u8>)]) {
    out.extend_from_slice(&(headers.len() as u32).to_be_bytes());
    for (n, v) in headers {
        out.extend_from_slice(&(n.len() as u32).to_be_bytes());
        out.extend_from_slice(n.as_bytes());
        out.extend_from_slice(&(v.len() as u32).to_be_bytes());
        out.extend_from_slice(v);
    }
}

/// [`put_headers`] alone.
pub fn encode_headers(headers: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(
        4 + headers
            .iter()
            .map(|(n, v)| 8 + n.len() + v.len())
            .sum::<usize>(),
    );
    put_headers(&mut out, headers);
    out
}

/// The inverse of [`encode_headers`]; `None` unless the bytes are exactly that.
pub fn decode_headers(raw: &[u8]) -> Option<Vec<(String, Vec<u8>)>> {
    let mut r = Reader(raw);
    let headers = r.headers()?;
    r.0.is_empty().then_some(headers)
}

/// A record's state and creation time without decoding the rest (listings scan
/// every record and decode only the ones they keep).
pub fn peek(raw: &[u8]) -> Option<(State, u64)> {
    let mut r = Reader(raw);
    let (_, state) = r.head()?;
    r.take(32 + 8)?;
    Some((state, r.u64()?))
}

/// Reads a record of any version; `None` when the bytes are not one.
pub fn decode(raw: &[u8]) -> Option<Record> {
    let mut r = Reader(raw);
    let (version, state) = r.head()?;
    let fingerprint: [u8; 32] = r.take(32)?.try_into().ok()?;
    let epoch = Epoch::new(r.u64()?);
    let created_ms = r.u64()?;
    let updated_ms = r.u64()?;
    let response = match r.u8()? {
        0 => None,
        1 => {
            let status = r.u16()?;
            let headers = r.headers()?;
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
    let request = if version == V2 {
        let mut text = || -> Option<String> {
            let n = usize::from(r.u16()?);
            Some(std::str::from_utf8(r.take(n)?).ok()?.to_owned())
        };
        let method = text()?;
        let path = text()?;
        Some(RequestLine { method, path })
    } else {
        None
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
        request,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A version 1 record (written before records kept the request) as it
    /// sits on disk: it must still decode, and re-encode byte for byte.
    #[test]
    fn version_1_records_still_decode() {
        let mut v1 = vec![V1, 2];
        v1.extend_from_slice(&[9; 32]);
        v1.extend_from_slice(&7u64.to_be_bytes());
        v1.extend_from_slice(&1000u64.to_be_bytes());
        v1.extend_from_slice(&2000u64.to_be_bytes());
        v1.push(0);
        let r = decode(&v1).expect("a version 1 record decodes");
        assert_eq!(
            (r.state, r.epoch.get(), r.created_ms, r.updated_ms),
            (State::InDoubt, 7, 1000, 2000)
        );
        assert_eq!(r.request, None);
        assert_eq!(encode(&r), v1);
        assert_eq!(peek(&v1), Some((State::InDoubt, 1000)));
        let with = Record {
            request: Some(RequestLine::new("POST", "/pay/x?secret=1")),
            ..r
        };
        let v2 = encode(&with);
        assert_eq!(v2[0], V2);
        assert_eq!(decode(&v2), Some(with.clone()));
        assert_eq!(with.request.map(|q| q.path), Some("/pay/x".to_owned()));
        assert_eq!(peek(&v2), Some((State::InDoubt, 1000)));
        // Cut anywhere in the request part: refused, never misread.
        for n in v1.len()..v2.len() {
            assert_eq!(decode(&v2[..n]), None, "{n}");
        }
    }
}
