"""A webhook receiver for tests/it/webhooks.rs: records every arrival and checks
it with the `standardwebhooks` PyPI package (the reference Python library), as
a receiver would, against each secret it is given.

    python origin.py   (secrets: env FG_ORIGIN_SECRETS, "NAME=whsec_... NAME=...")

Prints {"port": N} once listening on 127.0.0.1 (a free port). Every request
but GET /_log is an arrival: recorded with its headers, body, which secrets
verify it, and whether the library rejects the same delivery with its body
changed by one byte, and ten minutes late (its clock moved; tolerance is five
minutes). Answers 200 when some secret verifies it, else 401; a request with
`x-test-fail-first: STATUS` gets STATUS the first time its webhook-id arrives
(a destination that fails once: the worker retries); with
`x-test-delay-first: MS` the first arrival of an id is answered only after MS
milliseconds (one that outlasts fencegate's timeout: the outcome in doubt).
GET /_log answers the arrivals as JSON.
"""
import base64
import datetime as real_datetime
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import standardwebhooks.webhooks as swh

SECRETS = dict(p.split("=", 1) for p in os.environ.get("FG_ORIGIN_SECRETS", "").split())
LOCK = threading.Lock()
ARRIVALS = []
SEEN_IDS = set()


class Late(real_datetime.datetime):
    """The library's clock, ten minutes ahead."""

    @classmethod
    def now(cls, tz=None):
        return real_datetime.datetime.now(tz) + real_datetime.timedelta(minutes=10)


def attempt(secret, body, headers, late=False):
    if late:
        swh.datetime = Late
    try:
        swh.Webhook(secret).verify(body, headers, json_parse=False)
        return None
    except Exception as e:  # the library's WebhookVerificationError, or a parse error
        return f"{type(e).__name__}: {e}"
    finally:
        swh.datetime = real_datetime.datetime


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def answer(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/_log":
            with LOCK:
                return self.answer(200, ARRIVALS)
        self.arrive()

    def do_POST(self):
        self.arrive()

    def arrive(self):
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length)
        headers = {k.lower(): v for k, v in self.headers.items()}
        verified, errors, good = {}, {}, None
        # The lock also keeps the clock swap of one arrival from another's check.
        with LOCK:
            for name, secret in SECRETS.items():
                err = attempt(secret, body, headers)
                verified[name] = err is None
                if err is None:
                    good = good or secret
                else:
                    errors[name] = err
            entry = {
                "path": self.path,
                "headers": headers,
                "body_b64": base64.b64encode(body).decode(),
                "verified": verified,
                "errors": errors,
            }
            if good is not None:
                entry["tampered_rejected"] = attempt(good, body + b" ", headers) is not None
                stale = attempt(good, body, headers, late=True)
                entry["stale_rejected"] = stale is not None
                entry["stale_error"] = stale
            ARRIVALS.append(entry)
            wid = headers.get("webhook-id")
            first = wid not in SEEN_IDS
            SEEN_IDS.add(wid)
        fail = self.headers.get("x-test-fail-first")
        if fail and first:
            return self.answer(int(fail), {"failed_once": wid})
        delay = self.headers.get("x-test-delay-first")
        if delay and first:
            time.sleep(int(delay) / 1000)
            try:
                return self.answer(200, {"late": wid})
            except OSError:
                return  # fencegate gave up on it and closed the connection
        self.answer(200 if good is not None else 401, {"verified": verified})


def main():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(json.dumps({"port": server.server_address[1]}), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
