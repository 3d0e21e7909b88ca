#!/usr/bin/env python3
"""An OTLP/HTTP trace receiver for the trace tests (tests/it/support/otlp.rs).

Decodes each POST /v1/traces with the official OpenTelemetry protobuf bindings
(the `opentelemetry-proto` package, pinned in scripts/requirements-test.txt) and
appends one JSON line per span to --out; each raw body goes to --raw (the tests
look for secrets in the bytes as sent). Prints {"port": N} on stdout once
listening. Anything that is not a valid ExportTraceServiceRequest sent as
application/x-protobuf is answered 400 and logged to --out as {"error": ...}.

--hang: read each request and never answer (a collector that is stuck).
"""
import argparse
import http.server
import json
import sys
import threading

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

LOCK = threading.Lock()


def value(v: common_pb2.AnyValue):
    kind = v.WhichOneof("value")
    return None if kind is None else getattr(v, kind)


def attributes(kvs):
    return {kv.key: value(kv.value) for kv in kvs}


def spans_of(req):
    for rs in req.resource_spans:
        resource = attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                yield {
                    "trace_id": s.trace_id.hex(),
                    "span_id": s.span_id.hex(),
                    "parent_span_id": s.parent_span_id.hex(),
                    "trace_state": s.trace_state,
                    "name": s.name,
                    "kind": trace_pb2.Span.SpanKind.Name(s.kind),
                    "start": s.start_time_unix_nano,
                    "end": s.end_time_unix_nano,
                    "attributes": attributes(s.attributes),
                    "status_code": s.status.code,
                    "status_message": s.status.message,
                    "flags": s.flags,
                    "resource": resource,
                    "scope": ss.scope.name,
                }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--raw", required=True)
    ap.add_argument("--hang", action="store_true")
    args = ap.parse_args()
    stuck = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            if args.hang:
                stuck.wait()
                return
            lines = []
            try:
                if self.path != "/v1/traces":
                    raise ValueError(f"path {self.path}")
                ctype = self.headers.get("content-type")
                if ctype != "application/x-protobuf":
                    raise ValueError(f"content-type {ctype}")
                req = trace_service_pb2.ExportTraceServiceRequest()
                req.ParseFromString(body)
                lines = [json.dumps(s) for s in spans_of(req)]
                status = 200
            except Exception as e:  # noqa: BLE001 - reported to the test
                lines = [json.dumps({"error": str(e)})]
                status = 400
            with LOCK:
                with open(args.raw, "ab") as f:
                    f.write(body)
                with open(args.out, "a") as f:
                    for line in lines:
                        f.write(line + "\n")
            answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(status)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(json.dumps({"port": server.server_address[1]}), flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
