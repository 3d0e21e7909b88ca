//! The OTLP/HTTP request body: an `ExportTraceServiceRequest` encoded as
//! protobuf by hand (opentelemetry-proto's `trace/v1/trace.proto` and
//! `collector/trace/v1/trace_service.proto`, the fields fencegate sets). Nine
//! small messages do not need a code generator; the trace test decodes the
//! result with the official Python bindings. (The `opentelemetry-proto` crate's
//! prost messages would bring prost, its derive macro and generated types for
//! every signal into a 2-core build for what is ~100 lines here; the SDK with
//! `opentelemetry-otlp` brings reqwest or tonic besides.)

use super::{Kind, SpanData, Value};

/// Wire types.
const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LEN: u8 = 2;
const FIXED32: u8 = 5;

/// `Status.code` ERROR.
const STATUS_ERROR: u64 = 2;
/// `SpanFlags`: the context's is-remote bit is known, and the parent is remote.
const FLAG_HAS_IS_REMOTE: u32 = 0x100;
const FLAG_IS_REMOTE: u32 = 0x200;

/// What every exported span shares: the process (`Resource`) and this crate as
/// the instrumentation scope.
pub(super) struct Resource {
    pub attributes: Vec<(&'static str, Value)>,
}

/// One `ExportTraceServiceRequest` holding `spans`.
pub(super) fn encode(resource: &Resource, spans: &[SpanData]) -> Vec<u8> {
    let mut scope_spans = Vec::with_capacity(64 + 160 * spans.len());
    message(&mut scope_spans, 1, |scope| {
        string(scope, 1, env!("CARGO_PKG_NAME"));
        string(scope, 2, env!("CARGO_PKG_VERSION"));
    });
    for s in spans {
        message(&mut scope_spans, 2, |b| span(b, s));
    }
    let mut resource_spans = Vec::with_capacity(scope_spans.len() + 128);
    message(&mut resource_spans, 1, |r| {
        for (k, v) in &resource.attributes {
            key_value(r, 1, k, v);
        }
    });
    field_bytes(&mut resource_spans, 2, &scope_spans);
    let mut out = Vec::with_capacity(resource_spans.len() + 8);
    field_bytes(&mut out, 1, &resource_spans);
    out
}

fn span(b: &mut Vec<u8>, s: &SpanData) {
    field_bytes(b, 1, &s.trace_id);
    field_bytes(b, 2, &s.span_id);
    if let Some(state) = &s.trace_state {
        field_bytes(b, 3, state.as_bytes());
    }
    if let Some(p) = &s.parent {
        field_bytes(b, 4, p);
    }
    string(b, 5, &s.name);
    tag(b, 6, VARINT);
    varint(
        b,
        match s.kind {
            Kind::Internal => 1,
            Kind::Server => 2,
            Kind::Client => 3,
        },
    );
    tag(b, 7, FIXED64);
    b.extend_from_slice(&s.start.to_le_bytes());
    tag(b, 8, FIXED64);
    b.extend_from_slice(&s.end.to_le_bytes());
    for (k, v) in &s.attributes {
        key_value(b, 9, k, v);
    }
    if let Some(msg) = &s.error {
        message(b, 15, |st| {
            string(st, 2, msg);
            tag(st, 3, VARINT);
            varint(st, STATUS_ERROR);
        });
    }
    let remote = if s.remote_parent { FLAG_IS_REMOTE } else { 0 };
    tag(b, 16, FIXED32);
    b.extend_from_slice(&(1 | FLAG_HAS_IS_REMOTE | remote).to_le_bytes());
}

fn key_value(b: &mut Vec<u8>, field: u32, key: &str, value: &Value) {
    message(b, field, |kv| {
        string(kv, 1, key);
        message(kv, 2, |any| match value {
            Value::Str(s) => string(any, 1, s),
            Value::Bool(v) => {
                tag(any, 2, VARINT);
                varint(any, u64::from(*v));
            }
            Value::Int(i) => {
                tag(any, 3, VARINT);
                // int64: two's complement, as protobuf encodes negative int64s.
                varint(any, *i as u64);
            }
        });
    });
}

fn tag(b: &mut Vec<u8>, field: u32, wire: u8) {
    varint(b, u64::from(field) << 3 | u64::from(wire));
}

fn varint(b: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        b.push((v as u8) | 0x80);
        v >>= 7;
    }
    b.push(v as u8);
}

fn field_bytes(b: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    tag(b, field, LEN);
    varint(b, bytes.len() as u64);
    b.extend_from_slice(bytes);
}

fn string(b: &mut Vec<u8>, field: u32, s: &str) {
    field_bytes(b, field, s.as_bytes());
}

/// An embedded message: encoded aside, then written with its length.
fn message(b: &mut Vec<u8>, field: u32, body: impl FnOnce(&mut Vec<u8>)) {
    let mut inner = Vec::new();
    body(&mut inner);
    field_bytes(b, field, &inner);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_and_tags_follow_the_wire_format() {
        let mut b = Vec::new();
        varint(&mut b, 300);
        assert_eq!(b, [0xac, 0x02]);
        b.clear();
        tag(&mut b, 16, FIXED32);
        assert_eq!(b, [0x85, 0x01]);
        b.clear();
        varint(&mut b, -1i64 as u64);
        assert_eq!(b.len(), 10);
    }

    #[test]
    fn an_empty_export_is_one_resource_with_a_scope() {
        let r = Resource {
            attributes: vec![("service.name", Value::Str("fg".into()))],
        };
        let out = encode(&r, &[]);
        // resource_spans (field 1, LEN), holding resource (1) then scope_spans (2).
        assert_eq!(out[0], 0x0a);
        assert!(out.windows(2).any(|w| w == b"fg"));
    }
}
