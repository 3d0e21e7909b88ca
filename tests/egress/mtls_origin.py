"""An https destination that demands a TLS client certificate (Python's ssl,
CERT_REQUIRED), for tests/it/client_cert.rs.

    python mtls_origin.py CERT KEY CLIENT_CA LOG

Prints {"port": N} once listening on 127.0.0.1. Appends one JSON line per event
to LOG: {"event": "request", "client_cn": ..., "path": ...} for each request it
answers (200, the client certificate's common name in the JSON body), and
{"event": "handshake_failed", "error": ...} for each connection whose handshake
it refused (no certificate, or one its CA did not issue).
"""
import json
import os
import ssl
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CERT, KEY, CA, LOG = sys.argv[1:5]
LOCK = threading.Lock()


def record(**event):
    with LOCK, open(LOG, "a") as f:
        f.write(json.dumps(event) + "\n")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        subject = dict(x[0] for x in self.connection.getpeercert()["subject"])
        cn = subject.get("commonName")
        record(event="request", client_cn=cn, path=self.path)
        # x-test-hold-until: PATH — answered only once PATH exists (a request
        # kept in flight while the test reloads fencegate).
        hold = self.headers.get("x-test-hold-until")
        while hold and not os.path.exists(hold):
            time.sleep(0.02)
        data = json.dumps({"client_cn": cn}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def finish_request(self, request, client_address):
        # The handshake runs in the connection's thread: a refused one is
        # recorded, and the listener goes on.
        try:
            tls = CTX.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as e:
            record(event="handshake_failed", error=str(e))
            return
        super().finish_request(tls, client_address)


CTX = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
CTX.load_cert_chain(CERT, KEY)
CTX.load_verify_locations(CA)
CTX.verify_mode = ssl.CERT_REQUIRED

if __name__ == "__main__":
    server = Server(("127.0.0.1", 0), Handler)
    print(json.dumps({"port": server.server_address[1]}), flush=True)
    server.serve_forever()
