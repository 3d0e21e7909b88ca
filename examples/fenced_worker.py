#!/usr/bin/env python3
"""A fenced worker for fencegate, on the Python client package (clients/python).

The protocol itself (SPEC §2 leases, SPEC §3 calls, SPEC §7 outcomes) lives in
`fencegate_client` (`pip install ./clients/python`); this script is an example
of using it: it runs the store self-test, acquires a lease, makes one call
through fencegate, renews, and releases, printing one JSON object on stdout
(progress on stderr).

    python fenced_worker.py --endpoint http://127.0.0.1:9000 --bucket leases \\
        --lease billing --fencegate http://127.0.0.1:8080 --path /billing/charge \\
        [--body '{"amount": 42}'] [--holder worker-1] [--wait]

Exit codes: 0 done (whatever the destination answered), 3 the lease is held by
someone else (without --wait) or was lost, 4 fencegate refused the call (its
error code is in the output), 1 any other error.

Requires boto3 >= 1.35. Credentials come from the usual AWS chain. Run from a
checkout, it uses the package's source there (clients/python/src); elsewhere,
`pip install` the package.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
import uuid
from datetime import datetime, timezone

# In a checkout, the package's source next door comes first (an installed copy may be older).
_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients", "python", "src")
if os.path.isdir(os.path.join(_SRC, "fencegate_client")):
    sys.path.insert(0, _SRC)

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from fencegate_client import GatewayClient, LeaseClient, LeaseError, LeaseHeld, LeaseLost


def iso(t: datetime | None) -> str | None:
    return t.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z") if t else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="A fenced worker: acquire, call through fencegate, renew, release.")
    p.add_argument("--endpoint", help="S3-compatible endpoint URL (default: AWS)")
    p.add_argument("--bucket", required=True)
    p.add_argument("--prefix", default="fencegate/")
    p.add_argument("--region", default="us-east-1")
    p.add_argument("--no-path-style", action="store_true", help="virtual-hosted bucket addressing")
    p.add_argument("--lease", required=True)
    p.add_argument("--holder", default=f"{socket.gethostname()}-{os.getpid()}")
    p.add_argument("--ttl-ms", type=int, default=30000)
    p.add_argument("--grace-ms", type=int, default=2000)
    p.add_argument("--wait", action="store_true", help="wait while another worker holds the lease")
    p.add_argument("--fencegate", required=True, help="fencegate's base URL, e.g. http://127.0.0.1:8080")
    p.add_argument("--path", required=True, help="a path under one of fencegate's routes")
    p.add_argument("--method", default="POST")
    p.add_argument("--body", default='{"hello": "from the python worker"}')
    p.add_argument("--idempotency-key", help="default: a fresh UUID")
    p.add_argument("--no-release", action="store_true", help="keep the lease (skip renew and release)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="fenced_worker: %(message)s", stream=sys.stderr)
    logging.getLogger("fencegate_client").setLevel(logging.INFO)  # retries, read-backs, waits

    s3 = boto3.client(
        "s3", endpoint_url=args.endpoint, region_name=args.region,
        config=Config(
            s3={"addressing_style": "virtual" if args.no_path_style else "path"},
            connect_timeout=2, read_timeout=5,
            retries={"mode": "standard", "max_attempts": 3},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )
    leases = LeaseClient(s3, args.bucket, args.prefix, args.grace_ms)
    gate = GatewayClient(args.fencegate)
    out: dict = {"lease": args.lease, "holder": args.holder}
    lease = None
    try:
        leases.self_test()
        started = time.monotonic()
        lease = leases.acquire(args.lease, args.holder, args.ttl_ms, wait=args.wait)
        out["acquired"] = {**lease.as_json(), "elapsed_ms": int((time.monotonic() - started) * 1000)}

        key = args.idempotency_key or str(uuid.uuid4())
        reply = gate.call(lease, args.method, args.path, args.body.encode("utf-8"),
                          idempotency_key=key, headers={"Content-Type": "application/json"})
        out["call"] = {
            "status": reply.status,
            "outcome": reply.kind,
            "error": reply.code,
            "replayed": bool(reply.headers.get("x-fencegate-replayed") == "true"),
            "idempotency_key": key,
            "body": reply.text(),
        }
        if not args.no_release and not reply.must_stop:
            lease = leases.renew(lease, args.ttl_ms)
            out["renewed"] = lease.as_json()
            out["released"] = {"epoch": leases.release(lease)}
            lease = None
        print(json.dumps(out))
        return 4 if reply.code else 0
    except LeaseHeld as e:
        out["held"] = {"epoch": e.epoch, "holder": e.holder, "expires_at": iso(e.expires_at)}
        print(json.dumps(out))
        return 3
    except LeaseLost as e:
        out["lost"] = str(e)
        print(json.dumps(out))
        return 3
    except (ClientError, BotoCoreError, LeaseError, ValueError, OSError) as e:
        out["error"] = str(e)
        if lease is not None and not args.no_release:
            try:  # stop working and let the next worker in without waiting for expiry
                out["released"] = {"epoch": leases.release(lease)}
            except (LeaseError, ClientError, BotoCoreError) as e2:
                logging.warning("release after error failed: %s", e2)
        print(json.dumps(out))
        return 1


if __name__ == "__main__":
    sys.exit(main())
