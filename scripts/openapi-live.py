#!/usr/bin/env python3
"""A live fencegate with something in every admin listing, for scripts/openapi-test.sh.

Starts the S3 test server (scripts/s3server.py), three origins in this process
(one answers 200, one 400, one never answers), a private PostgreSQL with
`--backend postgres` (initdb on a free port, as the `postgres` user when run as
root; tests/common/postgres.rs does the same), and fencegate with an admin
token and five routes, each on its own lease:

- `billing` (direct, to the 200 origin, with `max_in_flight`, a breaker and a rate):
  `done` dedup records `order-1`..;
- `slow` (direct, to the silent origin, timeout 300 ms): `in_doubt` keys;
- `hooks` (queued, to a closed port, retries an hour apart): `pending`
  messages `msg-1`.. (the first one failed an attempt);
- `rejecting` (queued, to the 400 origin): a `failed` message;
- `notify` (queued, to the 200 origin): a `delivered` message.

The route and key names are the examples of docs/openapi.json, so that
schemathesis's example phase reaches real records. Then runs `st run` (the
arguments after `--`) against the live description once for the admin
listener (with the admin token) and once for the proxy listener's status URL,
and exits with the first non-zero status. Everything it started is stopped on
the way out.
"""
import argparse
import http.server
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

REPO = pathlib.Path(__file__).resolve().parent.parent
ADMIN_TOKEN = "openapi-test-admin-token"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Origin(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, status):
        self.answer = status

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                n = int(self.headers.get("content-length") or 0)
                self.rfile.read(n)
                if self.server.answer is None:
                    time.sleep(3600)  # never answers: the request is in doubt
                    return
                body = b'{"ok": true}'
                self.send_response(self.server.answer)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}/"


class Postgres:
    """A private PostgreSQL server (as tests/common/postgres.rs)."""

    def __init__(self):
        self.bin = self.bindir()
        # Its own directory: the postgres user cannot enter `root` (0700).
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="fencegate-openapi-pg-"))
        self.user = None
        if os.geteuid() == 0:
            import pwd

            pw = pwd.getpwnam("postgres")
            self.user = (pw.pw_uid, pw.pw_gid)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        data = self.dir / "data"
        self.run("initdb", "-D", str(data), "-A", "trust", "-U", "fg", "--no-sync", "-E", "UTF8")
        self.port = free_port()
        self.proc = self.popen(
            "postgres", "-D", str(data), "-p", str(self.port), "-k", str(self.dir),
            "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off",
        )
        deadline = time.time() + 30
        while subprocess.run([str(self.bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "fg"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode != 0:
            if time.time() > deadline or self.proc.poll() is not None:
                raise SystemExit("openapi-live: postgres did not start")
            time.sleep(0.1)
        subprocess.run([str(self.bin / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "fg",
                        "-d", "postgres", "-qc", "CREATE DATABASE openapi"], check=True)
        self.url = f"host=127.0.0.1 port={self.port} user=fg dbname=openapi sslmode=disable connect_timeout=5"

    @staticmethod
    def bindir():
        try:
            d = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True).stdout.strip()
            cands = [pathlib.Path(d)] if d else []
        except FileNotFoundError:
            cands = []
        cands += sorted(pathlib.Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
        for c in cands:
            if (c / "initdb").is_file() and (c / "postgres").is_file():
                return c
        raise SystemExit("openapi-live: no PostgreSQL server binaries (bash scripts/setup-postgres.sh)")

    def kw(self):
        kw = {"env": {**os.environ, "LC_ALL": "C"}}
        kw["env"].pop("PGDATA", None)
        if self.user:
            kw["user"], kw["group"] = self.user
            kw["extra_groups"] = []
        return kw

    def run(self, name, *args):
        subprocess.run([str(self.bin / name), *args], check=True, stdout=subprocess.DEVNULL, **self.kw())

    def popen(self, name, *args):
        return subprocess.Popen([str(self.bin / name), *args], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, **self.kw())

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def call(method, url, body=None, headers=None):
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--backend", choices=["sled", "postgres"], required=True)
    ap.add_argument("--serve", action="store_true",
                    help="set everything up, print the addresses and the tokens, and wait (to try the API by hand)")
    ap.add_argument("st", nargs=argparse.REMAINDER, help="-- then st's arguments")
    a = ap.parse_args()
    # SIGTERM (a timeout, or ending --serve) stops what this started, too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    st_args = a.st[1:] if a.st[:1] == ["--"] else a.st

    root = pathlib.Path(tempfile.mkdtemp(prefix="fencegate-openapi-"))
    procs = []
    pg = None
    keep = bool(os.environ.get("FENCEGATE_OPENAPI_KEEP"))
    try:
        s3 = subprocess.Popen([sys.executable, str(REPO / "scripts/s3server.py"), "--port", "0",
                               "--bucket", "leases", "--conn-timeout", "5"],
                              stdout=subprocess.PIPE, text=True)
        procs.append(s3)
        s3_addr = s3.stdout.readline().strip().removeprefix("LISTENING ")
        if a.backend == "postgres":
            pg = Postgres()
        ok, reject, silent = Origin(200), Origin(400), Origin(None)
        down = f"http://127.0.0.1:{free_port()}/"

        def route(name, upstream, extra=""):
            return (f'[[route]]\nname = "{name}"\npath_prefix = "/{name}/"\nupstream = "{upstream}"\n'
                    f'lease = "{name}"\n{extra}\n')

        queued = 'delivery = "queued"\nretry = { schedule = ["1h"] }\n'
        config = root / "fencegate.toml"
        config.write_text(
            f'[server]\nlisten = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\n'
            f'data_dir = "{root / "state"}"\nadmin_token = "{ADMIN_TOKEN}"\nshutdown_timeout_ms = 1000\n\n'
            f'[store]\nkind = "s3"\nbucket = "leases"\nprefix = "fencegate/"\nendpoint = "http://{s3_addr}"\n'
            f'region = "us-east-1"\nforce_path_style = true\nrefresh_interval_ms = 200\ntimeout_ms = 1500\n\n'
            + (f'[state]\nkind = "postgres"\nurl = "{pg.url}"\n\n' if pg else "")
            + route("billing", ok.url, 'timeout_ms = 3000\nmax_in_flight = 8\n'
                    'breaker = { failures = 5, window = "10s", cool_down = "5s" }\n'
                    'rate = "10000/s"\n')
            + route("slow", silent.url, "timeout_ms = 300\n")
            + route("hooks", down, queued + "timeout_ms = 1000\n")
            + route("rejecting", reject.url, queued + "timeout_ms = 3000\n")
            + route("notify", ok.url, queued + "timeout_ms = 3000\n")
        )
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
        log = open(root / "fencegate.log", "w")
        fg = subprocess.Popen([a.bin, "serve", "--config", str(config)], stdout=subprocess.PIPE,
                              stderr=log, text=True, env=env)
        procs.append(fg)
        line = fg.stdout.readline()
        if not line:
            fg.wait()
            sys.stderr.write((root / "fencegate.log").read_text())
            raise SystemExit(f"openapi-live: fencegate did not start (exit {fg.returncode})")
        listening = json.loads(line)
        proxy, admin = f"http://{listening['proxy']}", f"http://{listening['admin']}"
        print(f"openapi-live ({a.backend}): proxy {proxy}, admin {admin}", flush=True)

        tokens = {}
        for lease in ["billing", "slow", "hooks", "rejecting", "notify"]:
            out = subprocess.run([a.bin, "lease", "acquire", "--config", str(config), "--lease", lease,
                                  "--holder", "openapi-test", "--ttl-ms", "3600000", "--format", "json"],
                                 capture_output=True, text=True, env=env, check=True).stdout
            h = json.loads(out)
            tokens[lease] = (h["epoch"], h["token"])

        def send(route, key, body):
            epoch, token = tokens[route]
            return call("POST", f"{proxy}/{route}/{key}", body.encode(),
                        {"X-Lease-Epoch": str(epoch), "X-Lease-Token": token,
                         "Idempotency-Key": key, "Content-Type": "application/json"})

        want = {("billing", 200), ("slow", 504), ("hooks", 202), ("rejecting", 202), ("notify", 202)}
        for route_name, status in sorted(want):
            n = 3 if route_name in ("billing", "slow", "hooks") else 1
            prefix = {"billing": "order", "slow": "charge", "hooks": "msg"}.get(route_name, route_name)
            for i in range(1, n + 1):
                got, body = send(route_name, f"{prefix}-{i}", json.dumps({"n": i}))
                if got != status:
                    raise SystemExit(f"openapi-live: {route_name} {prefix}-{i}: {got} {body!r}, wanted {status}")
        auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        deadline = time.time() + 30
        for route_name, key, status in [("rejecting", "rejecting-1", "failed"), ("notify", "notify-1", "delivered"),
                                         ("hooks", "msg-1", "pending")]:
            while True:
                got, body = call("GET", f"{admin}/v1/deliveries/{route_name}/{key}", headers=auth)
                m = json.loads(body)
                if got == 200 and m["status"] == status and m["attempts"] >= 1:
                    break
                if time.time() > deadline:
                    raise SystemExit(f"openapi-live: {route_name}/{key} is {body!r}, not {status}")
                time.sleep(0.1)
        got, body = call("GET", f"{admin}/v1/dedup?state=in_doubt", headers=auth)
        assert got == 200 and json.loads(body)["total"] == 3, body

        if a.serve:
            print(json.dumps({"admin": admin, "proxy": proxy, "admin_token": ADMIN_TOKEN,
                              "lease_tokens": {k: t for k, (_, t) in tokens.items()}}), flush=True)
            fg.wait()
            return fg.returncode
        rc = 0
        st = str(pathlib.Path(sys.executable).parent / "st")
        runs = [
            ("admin listener", admin, ["--exclude-tag", "proxy", "-H", f"Authorization: Bearer {ADMIN_TOKEN}"]),
            # The token `hooks`'s messages were accepted with: the example
            # message's status is readable.
            ("proxy listener", proxy, ["--include-tag", "proxy", "-H", f"X-Lease-Token: {tokens['hooks'][1]}"]),
        ]
        for what, target, only in runs:
            cmd = [st, "run", f"{admin}/v1/openapi.json", "--url", target, *only, *st_args]
            print(f"openapi-live ({a.backend}, {what}): st run ... {' '.join(only[:2])} {' '.join(st_args)}",
                  flush=True)
            t0 = time.time()
            # In the scratch directory: st keeps a cache where it runs.
            r = subprocess.run(cmd, cwd=root)
            print(f"openapi-live ({a.backend}, {what}): exit {r.returncode} in {time.time() - t0:.0f} s",
                  flush=True)
            rc = rc or r.returncode
            if fg.poll() is not None:
                print(f"openapi-live: fencegate exited ({fg.returncode})", flush=True)
                rc = rc or 1
        if rc:
            keep = True
            print(f"openapi-live: fencegate's log is kept: {root / 'fencegate.log'}", flush=True)
        return rc
    except BaseException:
        keep = True
        print(f"openapi-live: its files are kept: {root}", file=sys.stderr, flush=True)
        raise
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        if pg:
            pg.stop()
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
