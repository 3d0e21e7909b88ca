#!/usr/bin/env python3
"""The recording origin of the fault campaign (tests/it/campaign): the destination
that cannot fence itself.

A threaded HTTP/1.1 server (keep-alive, so fencegate's pooled connections are
exercised) that answers every request after a small random delay, sometimes long
enough for fencegate's drain or upstream timeout to fire. It appends JSON lines to
--log, flushed one by one, so the file survives SIGSTOP and kill:

  {"ev": "arrive", "seq", "path", "req", "epoch", "key", "wid", "arrive"}
  {"ev": "done", "seq", "complete", "status", "body"}

`arrive` and `complete` are time.monotonic_ns() (CLOCK_MONOTONIC, comparable
across processes on Linux); `complete` is taken before the response is written, so
it precedes fencegate's receipt of the answer. `req` is the worker's
X-Campaign-Req header, `epoch` the forwarded X-Lease-Epoch, `key` the forwarded
Idempotency-Key, `wid` the webhook-id (a signing route's: the queued route's
attempts of one message all carry `{route}:{key}`). The response body is unique
per request; statuses are 200, 201, 202, 409 or 422 (never one of fencegate's
retryable statuses for a direct route, so every answered key is recorded `done`
and may be replayed; a queued route retries a 409 and fails a message on a
422, SPEC §11).

Delays: 60% under 10 ms, 25% 20-300 ms, 12% 0.3-0.9 s, 3% 1.0-1.5 s (past the
1 s route timeouts; a route with a 300 ms timeout sees 15% of its requests outlive
it). --slow-file names a file the nemesis may write, `UNTIL_NS MIN_MS MAX_MS`: a
request arriving before UNTIL_NS (time.monotonic_ns()) takes MIN_MS-MAX_MS
instead, so that a drain starting meanwhile finds it still executing.

Held requests (the cluster campaign's busy-shard uploads and split-brain
probes): a request with `X-Campaign-Hold: TOKEN` is logged on arrival (its head),
then its body is not read (nor the request answered) until TOKEN is a line of
--hold-file (at most 45 s), so fencegate's write of a large body blocks
meanwhile. Then the body is read as fast as it comes and one more line says how
far it got:

  {"ev": "body", "seq", "size", "read", "whole", "wrote_after"}

`wrote_after` (whole bodies larger than the in-transit bound only) is when the
origin had read `size - bound` bytes: fencegate cannot have written the last
byte before then, since at most `bound` bytes can be in transit between its write
and our read (our receive buffer, fixed at start-up so that autotuning cannot grow
it, plus the kernel's largest send buffer, plus slack for user-space buffers).
So fencegate was still writing the request at `wrote_after`. A body cut short
(fencegate aborted the forward: SPEC §5, §10.2) gets `"whole": false` and a
`done` line without status or body.

Usage: origin.py --log FILE [--seed N] [--port 0] [--slow-file FILE] [--hold-file FILE];
prints `LISTENING host:port`.
"""
import argparse
import json
import random
import secrets
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()
STATE = {"seq": 0, "rng": random.Random(0), "log": None, "slow_file": None, "hold_file": None,
         "in_transit": None}
# The receive buffer of every accepted connection (set on the listening socket, which
# also locks it: no autotuning), so that the in-transit bound stays small.
RCVBUF = 256 << 10
HOLD_MAX_S = 45


def write(rec):
    line = json.dumps(rec, separators=(",", ":")) + "\n"
    with LOCK:
        STATE["log"].write(line)
        STATE["log"].flush()


def slow_window(arrive):
    """(min, max) delay in seconds if `arrive` falls in the nemesis's slow window."""
    path = STATE["slow_file"]
    if not path:
        return None
    try:
        with open(path) as f:
            until, lo, hi = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return None
    return (lo / 1000, hi / 1000) if arrive < until else None


def sysctl_max(name):
    """The largest buffer the kernel may autotune a TCP socket's buffer to."""
    try:
        with open(f"/proc/sys/net/ipv4/{name}") as f:
            return int(f.read().split()[2])
    except (OSError, ValueError, IndexError):
        return 64 << 20  # unknown: assume a large one (then few bodies qualify)


def in_transit_bound(listener):
    """Bytes that can be between fencegate's write and our read (module doc)."""
    rcvbuf = listener.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    return rcvbuf + sysctl_max("tcp_wmem") + (4 << 20)


def released(token):
    path = STATE["hold_file"]
    try:
        with open(path) as f:
            return token in f.read().split()
    except (OSError, TypeError):
        return False


def held_body(rfile, length, hold):
    """Waits for the release of hold `hold`, then reads the body: (read, wrote_after)."""
    end = time.monotonic() + HOLD_MAX_S
    while not released(hold) and time.monotonic() < end:
        time.sleep(0.05)
    bound, read, wrote_after = STATE["in_transit"], 0, None
    while read < length:
        try:
            chunk = rfile.read1(min(1 << 20, length - read))
        except OSError:
            chunk = b""  # fencegate reset the connection: cut short
        if not chunk:
            break
        read += len(chunk)
        if wrote_after is None and length > bound and read >= length - bound:
            wrote_after = time.monotonic_ns()
    return read, (wrote_after if read == length else None)


def draw(arrive):
    """(seq, delay in seconds, status) for one request."""
    slow = slow_window(arrive)
    with LOCK:
        STATE["seq"] += 1
        rng = STATE["rng"]
        x = rng.random()
        if x < 0.60:
            delay = rng.uniform(0, 0.01)
        elif x < 0.85:
            delay = rng.uniform(0.02, 0.3)
        elif x < 0.97:
            delay = rng.uniform(0.3, 0.9)
        else:
            delay = rng.uniform(1.0, 1.5)  # past the route's timeout
        if slow:
            delay = rng.uniform(*slow)
        status = rng.choices([200, 201, 202, 409, 422], [80, 8, 4, 5, 3])[0]
        return STATE["seq"], delay, status


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        arrive = time.monotonic_ns()
        seq, delay, status = draw(arrive)
        h = self.headers
        write({"ev": "arrive", "seq": seq, "path": self.path, "req": h.get("x-campaign-req"),
               "epoch": h.get("x-lease-epoch"), "key": h.get("idempotency-key"),
               "wid": h.get("webhook-id"), "arrive": arrive})
        length = int(h.get("content-length") or 0)
        hold = h.get("x-campaign-hold")
        if hold is not None:
            read, wrote_after = held_body(self.rfile, length, hold)
            write({"ev": "body", "seq": seq, "size": length, "read": read,
                   "whole": read == length, "wrote_after": wrote_after})
            if read < length:
                write({"ev": "done", "seq": seq, "complete": time.monotonic_ns(),
                       "status": None, "body": None})
                self.close_connection = True
                return
            delay = 0
        else:
            self.rfile.read(length)
        time.sleep(delay)
        body = json.dumps({"seq": seq, "req": h.get("x-campaign-req"),
                           "nonce": secrets.token_hex(8)}).encode()
        write({"ev": "done", "seq": seq, "complete": time.monotonic_ns(), "status": status,
               "body": body.decode("latin-1")})
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.send_header("x-origin-seq", str(seq))
        self.end_headers()
        self.wfile.write(body)

    do_PUT = do_POST
    do_GET = do_POST  # the workers' polls (--polls)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256

    def server_bind(self):
        # Before listen(): accepted connections inherit it (and its lock).
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        super().server_bind()

    def handle_error(self, request, client_address):
        pass  # fencegate gave up on an answer (timeout, drain abort, kill): expected


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--slow-file")
    p.add_argument("--hold-file")
    args = p.parse_args()
    STATE["slow_file"] = args.slow_file
    STATE["hold_file"] = args.hold_file
    STATE["rng"] = random.Random(args.seed)
    STATE["log"] = open(args.log, "a", encoding="utf-8")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    srv = Server(("127.0.0.1", args.port), Handler)
    STATE["in_transit"] = in_transit_bound(srv.socket)
    host, port = srv.server_address[:2]
    print(f"LISTENING {host}:{port}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
