//! W3C Trace Context (`traceparent`, `tracestate`): read from a worker or a
//! relaying peer, written to the upstream or the owner.

use http::header::{HeaderMap, HeaderName, HeaderValue};

/// `traceparent`.
pub(crate) const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
/// `tracestate`: vendors' entries, passed on unchanged with a valid `traceparent`.
pub(crate) const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// The `tracestate` kept at most (W3C: "at least 512 characters" must be passed
/// on); a longer one is dropped rather than cut in the middle of an entry.
const MAX_TRACESTATE: usize = 512;

/// A parent span from a `traceparent` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TraceParent {
    pub trace_id: [u8; 16],
    pub parent_id: [u8; 8],
    /// The `sampled` flag: the caller records this trace.
    pub sampled: bool,
}

impl TraceParent {
    /// The request's parent: exactly one valid `traceparent`, else `None` (the
    /// request starts a new trace).
    pub(crate) fn from_headers(headers: &HeaderMap) -> Option<TraceParent> {
        let mut all = headers.get_all(&TRACEPARENT).iter();
        match (all.next(), all.next()) {
            (Some(v), None) => parse(v.as_bytes()),
            _ => None,
        }
    }
}

/// Parses a `traceparent` value: version `00` exactly, or a later version (not
/// `ff`) read as `00` when its first 55 characters are (W3C §3.2.4). Lowercase
/// hex only; an all-zero trace or parent id is invalid.
pub(crate) fn parse(v: &[u8]) -> Option<TraceParent> {
    if v.len() < 55 || v[2] != b'-' || v[35] != b'-' || v[52] != b'-' {
        return None;
    }
    let version = hex_byte(&v[0..2])?;
    match version {
        0 if v.len() == 55 => {}
        0 | 0xff => return None,
        _ if v.len() == 55 || v[55] == b'-' => {}
        _ => return None,
    }
    let mut trace_id = [0u8; 16];
    for (i, b) in trace_id.iter_mut().enumerate() {
        *b = hex_byte(&v[3 + 2 * i..5 + 2 * i])?;
    }
    let mut parent_id = [0u8; 8];
    for (i, b) in parent_id.iter_mut().enumerate() {
        *b = hex_byte(&v[36 + 2 * i..38 + 2 * i])?;
    }
    let flags = hex_byte(&v[53..55])?;
    if trace_id == [0; 16] || parent_id == [0; 8] {
        return None;
    }
    Some(TraceParent {
        trace_id,
        parent_id,
        sampled: flags & 1 == 1,
    })
}

fn hex_byte(two: &[u8]) -> Option<u8> {
    fn nibble(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        }
    }
    Some(nibble(two[0])? << 4 | nibble(two[1])?)
}

/// The `traceparent` naming `span_id` of `trace_id` as the parent, sampled.
pub(crate) fn traceparent(trace_id: &[u8; 16], span_id: &[u8; 8]) -> HeaderValue {
    let mut out = [0u8; 55];
    out[..3].copy_from_slice(b"00-");
    let _ = hex::encode_to_slice(trace_id, &mut out[3..35]);
    out[35] = b'-';
    let _ = hex::encode_to_slice(span_id, &mut out[36..52]);
    out[52..].copy_from_slice(b"-01");
    // Hex digits and dashes: always a valid header value.
    HeaderValue::from_bytes(&out).unwrap_or(HeaderValue::from_static(""))
}

/// The request's `tracestate` (several headers joined with `,`), when it has one
/// of at most 512 bytes.
pub(crate) fn tracestate(headers: &HeaderMap) -> Option<HeaderValue> {
    let mut all = headers.get_all(&TRACESTATE).iter();
    let first = all.next()?;
    let mut joined = first.as_bytes().to_vec();
    for v in all {
        joined.push(b',');
        joined.extend_from_slice(v.as_bytes());
    }
    if joined.is_empty() || joined.len() > MAX_TRACESTATE {
        return None;
    }
    // W3C trace context: printable ASCII (and OWS tabs), at most 32 `key=value`
    // members. Anything else is dropped, not passed on: it would reach the
    // upstream unchecked and, exported as a protobuf string, make a collector
    // refuse the whole batch (every other request's spans with it).
    let printable = joined
        .iter()
        .all(|&b| b == b'\t' || (0x20..0x7f).contains(&b));
    let members: Vec<&[u8]> = joined
        .split(|&b| b == b',')
        .filter(|m| m.iter().any(|&b| b != b' ' && b != b'\t'))
        .collect();
    if !printable
        || members.len() > MAX_TRACESTATE_MEMBERS
        || members.iter().any(|m| !m.contains(&b'='))
    {
        return None;
    }
    HeaderValue::from_bytes(&joined).ok()
}

/// W3C trace context's bound on `tracestate` list members.
const MAX_TRACESTATE_MEMBERS: usize = 32;

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_is_read() {
        let p = parse(GOOD.as_bytes()).unwrap();
        assert_eq!(hex::encode(p.trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(hex::encode(p.parent_id), "00f067aa0ba902b7");
        assert!(p.sampled);
        assert!(
            !parse(GOOD.replace("-01", "-00").as_bytes())
                .unwrap()
                .sampled
        );
        // A later version: its first 55 characters, read as version 00.
        assert!(parse(format!("cc{}-what-comes-next", &GOOD[2..]).as_bytes()).is_some());
        let tp = traceparent(&p.trace_id, &p.parent_id);
        assert_eq!(tp, GOOD);
    }

    #[test]
    fn a_malformed_traceparent_is_none() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
        ] {
            assert_eq!(parse(bad.as_bytes()), None, "{bad:?}");
        }
        let mut two = HeaderMap::new();
        two.append(TRACEPARENT, HeaderValue::from_static(GOOD));
        two.append(TRACEPARENT, HeaderValue::from_static(GOOD));
        assert_eq!(TraceParent::from_headers(&two), None, "repeated");
    }

    #[test]
    fn tracestate_is_joined_and_bounded() {
        let mut h = HeaderMap::new();
        assert_eq!(tracestate(&h), None);
        h.append(TRACESTATE, HeaderValue::from_static("a=1"));
        h.append(TRACESTATE, HeaderValue::from_static("b=2"));
        assert_eq!(tracestate(&h).unwrap(), "a=1,b=2");
        h.insert(TRACESTATE, HeaderValue::from_str(&"x".repeat(513)).unwrap());
        assert_eq!(tracestate(&h), None);
        // Not ASCII, too many members, a member without `=`: dropped.
        h.insert(TRACESTATE, HeaderValue::from_bytes(b"v=caf\xe9").unwrap());
        assert_eq!(tracestate(&h), None);
        let many = (0..33)
            .map(|i| format!("k{i}=v"))
            .collect::<Vec<_>>()
            .join(",");
        h.insert(TRACESTATE, HeaderValue::from_str(&many).unwrap());
        assert_eq!(tracestate(&h), None);
        h.insert(TRACESTATE, HeaderValue::from_static("a=1,bogus"));
        assert_eq!(tracestate(&h), None);
        h.insert(TRACESTATE, HeaderValue::from_static("a=1, b=2 ,"));
        assert_eq!(tracestate(&h).unwrap(), "a=1, b=2 ,");
    }
}
