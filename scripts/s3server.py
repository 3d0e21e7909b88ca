#!/usr/bin/env python3
"""Single-threaded S3-compatible test server (moto), for fencegate's tests.

Stock `moto_server` serves each request on its own thread and checks
`If-None-Match: *` without a lock, so two concurrent conditional PUTs can both
succeed. Here one thread serves one request at a time, so conditional writes
are atomic. Werkzeug closes every connection after its response.

Usage: s3server.py [--host H] [--port 0] [--bucket NAME]... [--conn-timeout S] [--verbose]
Binds first, then prints exactly one line `LISTENING <host>:<port>` to stdout,
then serves until killed. State lives in memory only. Requests must be SigV4
signed (unsigned object requests get 403), with any access key, region
us-east-1, path-style addressing (http://host:port/bucket/key).
Moto quirk: a PUT sent with Content-Type application/x-www-form-urlencoded
stores an empty body (the form parser eats it); use any other type.
"""
import argparse
import os
import sys

from werkzeug.serving import make_server
from werkzeug.test import Client

from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)


class Handler(MotoRequestHandler):
    verbose = False  # per-request access lines only with --verbose; errors always go to stderr
    timeout = None  # socket timeout per connection (StreamRequestHandler applies it)

    def log_request(self, code="-", size="-"):
        if self.verbose:
            super().log_request(code, size)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--bucket", action="append", default=[], help="create at start; repeatable")
    p.add_argument("--verbose", action="store_true", help="log every request to stderr")
    p.add_argument("--conn-timeout", type=float, default=30.0,
                   help="drop a connection idle this many seconds mid-request (0 = never), "
                        "so one stuck client cannot wedge this single-threaded server")
    args = p.parse_args()

    app = DomainDispatcherApplication(create_backend_app)
    Handler.verbose = args.verbose
    Handler.timeout = args.conn_timeout or None
    srv = make_server(args.host, args.port, app, threaded=False, processes=1,
                      request_handler=Handler)
    host, port = srv.socket.getsockname()[:2]
    os.environ["MOTO_PORT"] = str(port)  # moto builds some self-URLs from it

    # Buckets are made in-process through the same WSGI app, before serving,
    # so they exist by the time a client can read the LISTENING line.
    client = Client(app)
    for name in args.bucket:
        r = client.put(f"/{name}", headers={"Host": f"{host}:{port}"})
        if r.status_code != 200:
            sys.exit(f"s3server: creating bucket {name!r} failed: {r.status} {r.get_data(as_text=True)}")

    print(f"LISTENING {host}:{port}", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
