#!/usr/bin/env python3
"""The real parts the client packages are tested against, started once per suite.

Starts, on free loopback ports:

- the S3 test server (scripts/s3server.py, with the bucket `leases`);
- three TCP fault relays: `s3` (a client -> S3), `gate` (fencegate -> S3) and
  `gw` (a client -> fencegate). A relay passes bytes through; it can be armed to
  hold the next matching request before forwarding it, and/or to drop its
  response (the request is applied, the client's connection is reset when the
  first byte of the final response comes back), or set to blackhole (connections
  are accepted and never answered);
- a recording origin (the destination): it records every request (method, path,
  X-Lease-Epoch, Idempotency-Key, whether X-Lease-Token reached it, body) and
  answers 200 with JSON `{"seq": N, ...}`. Request headers steer it:
  `X-Test-Hold: TAG` holds the answer until the tag is released,
  `X-Test-Status: N` answers with status N, `X-Test-Size: N` answers N bytes;
- fencegate (`$FENCEGATE_BIN`, default <repo>/target/debug/fencegate) on the S3
  store through the `gate` relay, with the routes in ROUTES (`queued` is a
  queued route, SPEC §11) and the admin token ADMIN_TOKEN.

Prints one JSON line on stdout when everything is up (the addresses, see
`info`), then serves a control API over HTTP (JSON) until stdin closes or it gets
SIGTERM, and then stops what it started:

    GET  /info
    GET  /origin/requests[?path=PREFIX]    what the origin received, in order
    GET  /origin/held                      tags being held right now
    POST /origin/release?tag=TAG           answer the requests held under TAG
    GET  /relay/NAME                       {"mode", "armed", "held", "dropped", "matched"}
    POST /relay/NAME/mode?mode=pass|blackhole
    POST /relay/NAME/arm?match=TEXT[&conditional=1][&hold=1][&drop=1]
         one-shot: the next request whose request line contains TEXT (and, with
         conditional=1, that has If-None-Match) is held and/or has its response dropped
    POST /relay/NAME/release               forward the held request

Run with the S3 server's venv python (scripts/setup-s3server.sh prints it); the
testkit itself needs only the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUCKET = "leases"
PREFIX = "fencegate/"
GRACE_MS = 500
ADMIN_TOKEN = "testkit-admin-token"  # the admin API's (drop a queued message)

# Each route is `/{name}/` -> the origin's `/{name}/`, protected by lease `{name}`,
# with these extra keys. The tests of both languages use the same names.
ROUTES = {
    "late": {},
    "replay": {},
    "renew": {},
    "overtaken": {},
    "tenure": {},
    "codes": {},
    "inflight": {},
    "expiry": {},
    "tiny": {"max_body_bytes": 64, "max_replay_bytes": 16},
    "slow": {"timeout_ms": 800},
    "drain": {"timeout_ms": 10000, "drain_timeout_ms": 300},
    "dead": {"upstream": "DEAD"},
    "store": {},
    # SPEC §11: answered 202, delivered afterwards (a single instance on sled: the
    # testkit's default state). Its own lease, as a lease's routes are all queued or all direct.
    "queued": {"delivery": '"queued"'},
}


def log(msg: str) -> None:
    print(f"testkit: {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- relay


class Relay:
    """A TCP relay with faults. Each connection carries one request (the relay
    adds `Connection: close` to it), whose request line is inspected."""

    def __init__(self, name: str, upstream: tuple[str, int]):
        self.name = name
        self.upstream = upstream
        self.lock = threading.Condition()
        self.mode = "pass"
        self.armed: dict | None = None
        self.held = 0
        self.dropped = 0
        self.matched = 0
        self.release_gen = 0
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name=f"relay-{name}").start()

    def state(self) -> dict:
        with self.lock:
            return {"mode": self.mode, "armed": self.armed, "held": self.held,
                    "dropped": self.dropped, "matched": self.matched}

    def set_mode(self, mode: str) -> None:
        if mode not in ("pass", "blackhole"):
            raise ValueError(f"mode {mode!r}")
        with self.lock:
            self.mode = mode
            self.lock.notify_all()

    def arm(self, match: str, conditional: bool, hold: bool, drop: bool) -> None:
        with self.lock:
            self.armed = {"match": match, "conditional": conditional, "hold": hold, "drop": drop}

    def release(self) -> None:
        with self.lock:
            self.release_gen += 1
            self.lock.notify_all()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            self._serve_inner(client)
        except OSError:
            pass
        finally:
            try:
                client.close()
            except OSError:
                pass

    def _blackhole(self, client: socket.socket) -> None:
        """Reads and discards until the client gives up or the mode changes; the
        held request is never forwarded."""
        client.settimeout(0.1)
        while True:
            with self.lock:
                if self.mode != "blackhole":
                    return
            try:
                if not client.recv(65536):
                    return
            except socket.timeout:
                continue

    def _serve_inner(self, client: socket.socket) -> None:
        with self.lock:
            mode = self.mode
        if mode == "blackhole":
            return self._blackhole(client)
        # Read the first request's head (and whatever body came with it).
        buf = b""
        client.settimeout(30)
        while b"\r\n\r\n" not in buf:
            chunk = client.recv(65536)
            if not chunk:
                return
            buf += chunk
            if len(buf) > 1 << 20:
                break
        raw_head, rest = buf.split(b"\r\n\r\n", 1)
        head = raw_head.decode("latin-1")
        # One request per connection, so that each one is inspected: the upstream
        # is asked to close after its answer (clients keep connections alive).
        lines = [h for h in head.split("\r\n") if not h.lower().startswith("connection:")]
        buf = ("\r\n".join(lines + ["Connection: close"]) + "\r\n\r\n").encode("latin-1") + rest
        request_line = head.split("\r\n", 1)[0]
        conditional = any(h.lower().startswith("if-none-match:") for h in head.split("\r\n")[1:])
        hold = drop = False
        with self.lock:
            if self.mode == "blackhole":
                mode = "blackhole"
            a = self.armed
            if a and a["match"] in request_line and (conditional or not a["conditional"]):
                self.armed = None
                self.matched += 1
                hold, drop = a["hold"], a["drop"]
                log(f"relay {self.name}: {request_line!r} matched (hold={hold}, drop={drop})")
            if hold:
                self.held += 1
                gen = self.release_gen
                self.lock.notify_all()
                deadline = time.monotonic() + 60
                while self.release_gen == gen and time.monotonic() < deadline:
                    self.lock.wait(deadline - time.monotonic())
                self.held -= 1
        if mode == "blackhole":
            return self._blackhole(client)
        up = socket.create_connection(self.upstream, timeout=30)
        try:
            up.sendall(buf)
            self._pipe(client, up, drop)
        finally:
            up.close()

    def _pipe(self, client: socket.socket, up: socket.socket, drop: bool) -> None:
        client.setblocking(True)
        up.setblocking(True)
        pending = b""  # the upstream's answer while looking for its final status line
        socks = [client, up]
        while True:
            with self.lock:
                if self.mode == "blackhole":
                    # Cut: nothing more goes either way.
                    return self._reset(client)
            r, _, _ = select.select(socks, [], [], 0.2)
            for s in r:
                data = s.recv(65536)
                if not data:
                    if s is up and drop:
                        return self._dropped(client)
                    return
                if s is client:
                    up.sendall(data)
                    continue
                if not drop:
                    client.sendall(data)
                    continue
                pending += data
                # Interim 1xx answers (100 Continue) pass; the final one is dropped.
                while pending.startswith(b"HTTP/1.") and len(pending) >= 12:
                    if pending[9:10] == b"1" and b"\r\n\r\n" in pending:
                        interim, pending = pending.split(b"\r\n\r\n", 1)
                        client.sendall(interim + b"\r\n\r\n")
                        continue
                    if pending[9:10] != b"1":
                        return self._dropped(client)
                    break

    def _dropped(self, client: socket.socket) -> None:
        with self.lock:
            self.dropped += 1
            self.lock.notify_all()
        log(f"relay {self.name}: response dropped, client connection reset")
        self._reset(client)

    @staticmethod
    def _reset(client: socket.socket) -> None:
        # SO_LINGER 0: close sends RST, the client sees a reset, not a clean end.
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


# --------------------------------------------------------------------------- origin


class Quiet(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # a peer that went away: not news
        pass



class Origin:
    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.requests: list[dict] = []
        self.released: set[str] = set()
        self.holding: dict[str, int] = {}
        origin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _handle(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    body = self._read_chunked()
                with origin.lock:
                    seq = len(origin.requests) + 1
                    rec = {
                        "seq": seq,
                        "method": self.command,
                        "path": self.path,
                        "epoch": self.headers.get("X-Lease-Epoch"),
                        "idempotency_key": self.headers.get("Idempotency-Key"),
                        "token_forwarded": self.headers.get("X-Lease-Token") is not None,
                        "body": body.decode("utf-8", "replace"),
                        "completed": False,
                    }
                    origin.requests.append(rec)
                    origin.lock.notify_all()
                tag = self.headers.get("X-Test-Hold")
                if tag:
                    with origin.lock:
                        origin.holding[tag] = origin.holding.get(tag, 0) + 1
                        origin.lock.notify_all()
                        deadline = time.monotonic() + 60
                        while tag not in origin.released and time.monotonic() < deadline:
                            origin.lock.wait(deadline - time.monotonic())
                        origin.holding[tag] -= 1
                        if not origin.holding[tag]:
                            del origin.holding[tag]
                status = int(self.headers.get("X-Test-Status") or 200)
                size = self.headers.get("X-Test-Size")
                if size:
                    out = b"x" * int(size)
                else:
                    out = json.dumps({"seq": seq, "method": self.command, "path": self.path,
                                      "epoch": rec["epoch"]}).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(out)))
                    self.end_headers()
                    self.wfile.write(out)
                    self.wfile.flush()
                except OSError:
                    self.close_connection = True  # fencegate gave up on it (a timeout, a drain)
                finally:
                    with origin.lock:
                        rec["completed"] = True

            def _read_chunked(self) -> bytes:
                out = b""
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        self.rfile.readline()
                        return out
                    out += self.rfile.read(size)
                    self.rfile.readline()

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle

        self.server = Quiet(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True, name="origin").start()

    def release(self, tag: str) -> None:
        with self.lock:
            self.released.add(tag)
            self.lock.notify_all()


# --------------------------------------------------------------------------- control


def serve_control(kit: dict) -> ThreadingHTTPServer:
    relays: dict[str, Relay] = kit["relays"]
    origin: Origin = kit["origin"]

    class Control(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _reply(self, status: int, obj) -> None:
            out = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def _route(self, method: str) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            if n:
                self.rfile.read(n)
            u = urlparse(self.path)
            q = {k: v[-1] for k, v in parse_qs(u.query).items()}
            parts = [p for p in u.path.split("/") if p]
            try:
                if method == "GET" and parts == ["info"]:
                    return self._reply(200, kit["info"])
                if method == "GET" and parts == ["origin", "requests"]:
                    with origin.lock:
                        reqs = [dict(r) for r in origin.requests
                                if r["path"].startswith(q.get("path", ""))]
                    return self._reply(200, reqs)
                if method == "GET" and parts == ["origin", "held"]:
                    with origin.lock:
                        return self._reply(200, dict(origin.holding))
                if method == "POST" and parts == ["origin", "release"]:
                    origin.release(q["tag"])
                    return self._reply(200, {})
                if len(parts) >= 2 and parts[0] == "relay" and parts[1] in relays:
                    relay = relays[parts[1]]
                    rest = parts[2:]
                    if method == "GET" and not rest:
                        return self._reply(200, relay.state())
                    if method == "POST" and rest == ["mode"]:
                        relay.set_mode(q["mode"])
                        return self._reply(200, relay.state())
                    if method == "POST" and rest == ["arm"]:
                        relay.arm(q["match"], q.get("conditional") == "1",
                                  q.get("hold") == "1", q.get("drop") == "1")
                        return self._reply(200, relay.state())
                    if method == "POST" and rest == ["release"]:
                        relay.release()
                        return self._reply(200, relay.state())
                return self._reply(404, {"error": f"no {method} {u.path}"})
            except (KeyError, ValueError) as e:
                return self._reply(400, {"error": str(e)})

        def do_GET(self):
            self._route("GET")

        def do_POST(self):
            self._route("POST")

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Control)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True, name="control").start()
    return srv


# --------------------------------------------------------------------------- main


def start_s3(python: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [python, os.path.join(REPO, "scripts", "s3server.py"), "--port", "0", "--bucket", BUCKET,
         "--conn-timeout", "10"],
        stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline().strip()
    if not line.startswith("LISTENING "):
        proc.kill()
        sys.exit(f"testkit: the S3 server did not start ({line!r})")
    return proc, int(line.rsplit(":", 1)[1])


def start_fencegate(binary: str, tmp: str, s3_port: int, origin_port: int) -> tuple[subprocess.Popen, dict]:
    routes = []
    for name, extra in ROUTES.items():
        extra = dict(extra)
        upstream = extra.pop("upstream", None)
        if upstream == "DEAD":
            upstream = f"http://127.0.0.1:{free_port()}/{name}/"  # nothing listens there
        else:
            upstream = f"http://127.0.0.1:{origin_port}/{name}/"
        lines = [f'name = "{name}"', f'path_prefix = "/{name}/"', f'upstream = "{upstream}"',
                 f'lease = "{name}"'] + [f"{k} = {v}" for k, v in extra.items()]
        routes.append("[[route]]\n" + "\n".join(lines) + "\n")
    config = f"""[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
data_dir = "state"
shutdown_timeout_ms = 1000
admin_token = "{ADMIN_TOKEN}"

[store]
kind = "s3"
bucket = "{BUCKET}"
prefix = "{PREFIX}"
endpoint = "http://127.0.0.1:{s3_port}"
region = "us-east-1"
force_path_style = true
refresh_interval_ms = 200
timeout_ms = 1000
grace_ms = {GRACE_MS}

""" + "\n".join(routes)
    path = os.path.join(tmp, "fencegate.toml")
    with open(path, "w") as f:
        f.write(config)
    env = dict(os.environ, AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test",
               AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE="/dev/null",
               AWS_SHARED_CREDENTIALS_FILE="/dev/null", RUST_LOG=os.environ.get("RUST_LOG", "warn"))
    errlog = open(os.path.join(tmp, "fencegate.log"), "w")
    proc = subprocess.Popen([binary, "serve", "--config", path], stdout=subprocess.PIPE,
                            stderr=errlog, stdin=subprocess.DEVNULL, text=True, env=env)
    line = proc.stdout.readline().strip()
    try:
        listening = json.loads(line)
    except ValueError:
        proc.kill()
        errlog.close()
        with open(os.path.join(tmp, "fencegate.log")) as f:
            sys.exit(f"testkit: fencegate did not start ({line!r}):\n{f.read()[-4000:]}")
    return proc, listening


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--s3-python", default=os.environ.get("FENCEGATE_TEST_PYTHON", sys.executable),
                   help="a python with moto (scripts/setup-s3server.sh prints it)")
    p.add_argument("--fencegate", default=os.environ.get(
        "FENCEGATE_BIN", os.path.join(os.environ.get("CARGO_TARGET_DIR") or os.path.join(REPO, "target"),
                                      "debug", "fencegate")))
    args = p.parse_args()
    if not os.access(args.fencegate, os.X_OK):
        sys.exit(f"testkit: no fencegate binary at {args.fencegate} (set FENCEGATE_BIN)")

    children: list[subprocess.Popen] = []
    tmp = tempfile.mkdtemp(prefix="fencegate-clients-")

    def stop(*_):
        for c in reversed(children):
            if c.poll() is None:
                c.terminate()
        for c in reversed(children):
            try:
                c.wait(timeout=5)
            except subprocess.TimeoutExpired:
                c.kill()
        if os.environ.get("TESTKIT_KEEP") != "1":
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    s3, s3_port = start_s3(args.s3_python)
    children.append(s3)
    relays = {
        "s3": Relay("s3", ("127.0.0.1", s3_port)),
        "gate": Relay("gate", ("127.0.0.1", s3_port)),
    }
    origin = Origin()
    fg, listening = start_fencegate(args.fencegate, tmp, relays["gate"].port, origin.port)
    children.append(fg)
    proxy_host, proxy_port = listening["proxy"].rsplit(":", 1)
    relays["gw"] = Relay("gw", (proxy_host, int(proxy_port)))

    # Ready: fencegate answers /readyz.
    import urllib.request
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(f"http://{listening['admin']}/readyz", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline or fg.poll() is not None:
            log("fencegate not ready; its log follows")
            with open(os.path.join(tmp, "fencegate.log")) as f:
                sys.stderr.write(f.read()[-4000:])
            stop()
        time.sleep(0.05)

    kit = {"relays": relays, "origin": origin}
    control = serve_control(kit)
    kit["info"] = {
        "control": f"http://127.0.0.1:{control.server_address[1]}",
        "s3": f"http://127.0.0.1:{s3_port}",
        "s3_relay": f"http://127.0.0.1:{relays['s3'].port}",
        "gateway": f"http://{listening['proxy']}",
        "gateway_relay": f"http://127.0.0.1:{relays['gw'].port}",
        "admin": f"http://{listening['admin']}",
        "admin_token": ADMIN_TOKEN,
        "bucket": BUCKET,
        "prefix": PREFIX,
        "grace_ms": GRACE_MS,
        "routes": sorted(ROUTES),
        "fencegate_log": os.path.join(tmp, "fencegate.log"),
    }
    print(json.dumps(kit["info"]), flush=True)
    # Until the test suite goes away (stdin closes) or a signal.
    try:
        while sys.stdin.read(4096):
            pass
    except (OSError, ValueError):
        pass
    stop()


if __name__ == "__main__":
    main()
