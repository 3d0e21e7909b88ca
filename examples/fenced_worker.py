#!/usr/bin/env python3
"""A complete fenced worker for fencegate, in Python with boto3.

It implements the lease protocol of SPEC §2 (see docs/worker-protocol.md)
and calls a destination through fencegate (SPEC §3). Nothing here depends on
fencegate's code: it is what a worker in any language has to do.

As a module:

    import boto3
    from fenced_worker import LeaseClient, Fencegate, LeaseHeld, LeaseLost

    s3 = boto3.client("s3", endpoint_url="http://127.0.0.1:9000", region_name="us-east-1")
    leases = LeaseClient(s3, bucket="leases", prefix="fencegate/", grace_ms=2000)
    tenure = leases.acquire("billing", holder="worker-1", ttl_ms=30000)   # LeaseHeld if taken
    gate = Fencegate("http://127.0.0.1:8080")
    reply = gate.call(tenure, leases.clock, "POST", "/billing/charge",
                      body=b'{"amount": 42}', idempotency_key="charge-42")
    tenure = leases.renew(tenure, ttl_ms=30000)                          # before it expires
    leases.release(tenure)

As a command (acquire, one call through fencegate, renew, release; one JSON
object on stdout, progress on stderr):

    python fenced_worker.py --endpoint http://127.0.0.1:9000 --bucket leases \\
        --lease billing --fencegate http://127.0.0.1:8080 --path /billing/charge \\
        [--body '{"amount": 42}'] [--holder worker-1] [--wait]

Exit codes: 0 done (whatever the destination answered), 3 the lease is held by
someone else (without --wait), 4 fencegate refused the call (its error code is
in the output), 1 any other error.

Requires boto3 >= 1.35 (PutObject IfNoneMatch). Credentials come from the usual
AWS chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, profile, instance role).
"""

from __future__ import annotations

import argparse
import email.utils
import hashlib
import json
import os
import re
import secrets
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

LEASE_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
EPOCH_FILE = re.compile(r"^(\d{20})\.json$")
MAX_ROUNDS = 16


def log(msg: str) -> None:
    print(f"fenced_worker: {msg}", file=sys.stderr, flush=True)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def iso(t: datetime) -> str:
    return t.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# --------------------------------------------------------------------------- clock


class StoreClock:
    """The store's clock, estimated from the `Date` header of store responses.

    `Date` has one-second resolution and is truncated: when a response arrives,
    the store's clock reads somewhere in [Date, Date + 1 s) (plus transit). Which
    end to use depends on the question, and the answer must be the safe one:

    - "has MY tenure expired?"        -> latest():   assume the store is ahead,
      so the holder stops early;
    - "has SOMEONE ELSE's expired?"   -> earliest(): assume the store is behind,
      so a contender takes over late.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._offset = None  # timedelta: Date - local arrival time (the lower end)

    def observe(self, date_header: str | None, received: datetime | None = None) -> None:
        if not date_header:
            return
        try:
            date = email.utils.parsedate_to_datetime(date_header)
        except (TypeError, ValueError):
            return
        if date.tzinfo is None:
            date = date.replace(tzinfo=timezone.utc)
        with self._lock:
            self._offset = date - (received or utcnow())

    def earliest(self) -> datetime:
        with self._lock:
            off = self._offset or timedelta(0)
        return utcnow() + off

    def latest(self) -> datetime:
        with self._lock:
            known = self._offset is not None
            off = self._offset or timedelta(0)
        return utcnow() + off + (timedelta(seconds=1) if known else timedelta(0))

    def attach(self, s3) -> None:
        """Feeds every S3 response's Date header (errors included) into the estimate."""

        def after_call(http_response=None, **_kwargs):
            if http_response is not None:
                self.observe(http_response.headers.get("date"))

        s3.meta.events.register("after-call.s3", after_call)


# --------------------------------------------------------------------------- the lease


@dataclass(frozen=True)
class EpochObject:
    """An epoch object as read back (SPEC §2)."""

    epoch: int
    kind: str  # "acquire", "release" or "invalid"
    holder: str | None
    token_sha256: str | None
    expires_at: datetime | None  # LastModified + ttl_ms, on the store's clock
    raw: bytes


@dataclass(frozen=True)
class Tenure:
    """An epoch this worker holds."""

    lease: str
    epoch: int
    token: str
    holder: str
    expires_at: datetime

    def valid(self, clock: StoreClock) -> bool:
        """SPEC §2 step 5: stop consequential work once the store's clock may have
        passed the expiry."""
        return clock.latest() < self.expires_at

    def as_json(self) -> dict:
        return {
            "lease": self.lease,
            "epoch": self.epoch,
            "token": self.token,
            "holder": self.holder,
            "expires_at": iso(self.expires_at),
        }


class LeaseHeld(Exception):
    """Someone else holds the lease."""

    def __init__(self, lease: str, obj: EpochObject):
        super().__init__(
            f"lease {lease} is held by {obj.holder!r} at epoch {obj.epoch} until {iso(obj.expires_at)}"
        )
        self.lease, self.epoch, self.holder, self.expires_at = lease, obj.epoch, obj.holder, obj.expires_at


class LeaseLost(Exception):
    """The caller no longer holds the tenure it names (renew, release, call)."""


def token_sha256(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def _encode(record: dict) -> bytes:
    return json.dumps(record, separators=(",", ":"), sort_keys=True).encode("utf-8")


def parse_epoch_object(lease: str, epoch: int, body: bytes, last_modified: datetime) -> EpochObject:
    """Interprets a stored object. Anything that does not parse, or disagrees with
    its key, is still an epoch (it makes older ones stale) but is "invalid"."""

    def invalid() -> EpochObject:
        return EpochObject(epoch, "invalid", None, None, None, body)

    try:
        rec = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return invalid()
    if not isinstance(rec, dict) or rec.get("v") != 1:
        return invalid()
    if rec.get("lease") != lease or rec.get("epoch") != epoch or not isinstance(rec.get("holder"), str):
        return invalid()
    if rec.get("kind") == "release":
        return EpochObject(epoch, "release", rec["holder"], None, None, body)
    if rec.get("kind") != "acquire":
        return invalid()
    tok, ttl = rec.get("token_sha256"), rec.get("ttl_ms")
    if not (isinstance(tok, str) and re.fullmatch(r"[0-9a-f]{64}", tok)):
        return invalid()
    if not (isinstance(ttl, int) and not isinstance(ttl, bool) and ttl >= 0):
        return invalid()
    return EpochObject(epoch, "acquire", rec["holder"], tok, last_modified + timedelta(milliseconds=ttl), body)


class LeaseClient:
    """SPEC §2 on an S3-compatible store: acquire, renew, release, status."""

    def __init__(self, s3, bucket: str, prefix: str = "fencegate/", grace_ms: int = 2000):
        if prefix and not prefix.endswith("/"):
            raise ValueError("prefix must be empty or end with '/'")
        self.s3, self.bucket, self.prefix = s3, bucket, prefix
        self.grace = timedelta(milliseconds=grace_ms)
        self.clock = StoreClock()
        self.clock.attach(s3)

    # ---- layout

    def key(self, lease: str, epoch: int) -> str:
        return f"{self.prefix}{lease}/{epoch:020d}.json"

    @staticmethod
    def _check_name(lease: str) -> None:
        if not LEASE_NAME.match(lease):
            raise ValueError(f"invalid lease name {lease!r}: must match [a-z0-9][a-z0-9._-]{{0,62}}")

    # ---- the store self-test

    def self_test(self) -> None:
        """Refuses a store that ignores If-None-Match (some S3-compatible servers
        do, silently): creates one probe object twice; the second must fail."""
        key = f"{self.prefix}.probe/{secrets.token_hex(8)}.json"
        kw = {"Bucket": self.bucket, "Key": key, "Body": b'{"probe":true}', "IfNoneMatch": "*",
              "ContentType": "application/json"}
        self.s3.put_object(**kw)
        try:
            self.s3.put_object(**kw)
            rejected = False
        except ClientError as e:
            rejected = _status(e) in (409, 412)
            if not rejected:
                raise
        finally:
            try:
                self.s3.delete_object(Bucket=self.bucket, Key=key)
            except (ClientError, BotoCoreError):
                pass
        if not rejected:
            raise RuntimeError(
                f"bucket {self.bucket} ignores conditional writes (a second PutObject with "
                "If-None-Match: * succeeded): fencing is impossible on this store")

    # ---- reads

    def latest_epoch(self, lease: str) -> int:
        """Step 1: the greatest epoch listed under {prefix}{lease}/ (0 = none)."""
        lp = f"{self.prefix}{lease}/"
        latest, token = 0, None
        while True:
            kw = {"Bucket": self.bucket, "Prefix": lp}
            if token:
                kw["ContinuationToken"] = token
            out = self.s3.list_objects_v2(**kw)
            for o in out.get("Contents", []):
                m = EPOCH_FILE.match(o["Key"][len(lp):])
                if m and int(m.group(1)) > 0:
                    latest = max(latest, int(m.group(1)))
            if not out.get("IsTruncated"):
                return latest
            token = out.get("NextContinuationToken")

    def read(self, lease: str, epoch: int) -> EpochObject | None:
        try:
            out = self.s3.get_object(Bucket=self.bucket, Key=self.key(lease, epoch))
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404") or _status(e) == 404:
                return None
            raise
        return parse_epoch_object(lease, epoch, out["Body"].read(), out["LastModified"])

    def status(self, lease: str) -> tuple[int, EpochObject | None]:
        self._check_name(lease)
        latest = self.latest_epoch(lease)
        return latest, (self.read(lease, latest) if latest else None)

    def is_free(self, obj: EpochObject | None) -> bool:
        """Step 2: no epoch, a release, an invalid object, or an acquire expired by
        more than grace — judged on the EARLIEST the store's clock may read."""
        if obj is None or obj.kind != "acquire":
            return True
        return self.clock.earliest() > obj.expires_at + self.grace

    # ---- step 3: the conditional create, with uncertain results read back

    def _create_decided(self, lease: str, epoch: int, body: bytes, ours) -> tuple[bool, EpochObject]:
        """Creates epoch `epoch` with If-None-Match: *. Returns (won, object).

        Whatever the PUT said, the object is read back: a 412 may be our own first
        attempt answered late (SDK retries do this), a timeout or 5xx may or may not
        have been applied, and a success needs LastModified for the expiry."""
        key = self.key(lease, epoch)
        for attempt in range(MAX_ROUNDS):
            if attempt:
                time.sleep(min(0.02 * 2**attempt, 1.0))
            try:
                self.s3.put_object(
                    Bucket=self.bucket, Key=key, Body=body, IfNoneMatch="*",
                    ContentType="application/json",
                )
            except ClientError as e:
                status, code = _status(e), e.response.get("Error", {}).get("Code")
                conflict = status == 412 or code in ("PreconditionFailed", "ConditionalRequestConflict")
                uncertain = status is None or status >= 500 or status in (408, 429)
                if not (conflict or uncertain):
                    raise  # refused: credentials, bucket, bad request
                log(f"create {key}: {code or status} ({'exists' if conflict else 'uncertain'}); reading back")
            except BotoCoreError as e:  # timeout, connection reset: the uncertain result
                log(f"create {key}: {e}; reading back")
            try:
                obj = self.read(lease, epoch)
            except (ClientError, BotoCoreError) as e:
                log(f"read-back of {key} failed: {e}; retrying")
                continue
            if obj is None:
                continue  # the create did not happen: the same conditional PUT is safe
            return ours(obj), obj
        raise RuntimeError(f"could not create {key} after {MAX_ROUNDS} attempts")

    # ---- the operations

    def acquire(self, lease: str, holder: str, ttl_ms: int = 30000, wait: bool = False,
                current: Tenure | None = None) -> Tenure:
        """Acquires `lease` if free (or, with `current`, renews it). Raises LeaseHeld
        (unless wait=True, which waits for expiry + grace with bounded backoff) or
        LeaseLost (renewing a tenure no longer ours)."""
        self._check_name(lease)
        backoff = 0.1
        lost_races = 0
        while True:
            latest, obj = self.status(lease)
            if current is not None:
                mine = (obj is not None and obj.kind == "acquire" and latest == current.epoch
                        and secrets.compare_digest(obj.token_sha256, token_sha256(current.token)))
                if not mine:
                    raise LeaseLost(f"lease {lease}: epoch {current.epoch} is no longer the latest ({latest})")
                if not current.valid(self.clock):
                    raise LeaseLost(f"lease {lease}: epoch {current.epoch} has expired")
            elif not self.is_free(obj):
                if not wait:
                    raise LeaseHeld(lease, obj)
                free_at = obj.expires_at + self.grace
                pause = max(0.05, min(backoff, (free_at - self.clock.earliest()).total_seconds()))
                log(f"lease {lease} held by {obj.holder!r} at epoch {latest} until {iso(obj.expires_at)}; "
                    f"waiting {int(pause * 1000)} ms")
                time.sleep(pause)
                backoff = min(backoff * 2, 2.0)
                continue
            token = secrets.token_hex(32)  # 256 bits
            digest = token_sha256(token)
            body = _encode({
                "v": 1, "lease": lease, "epoch": latest + 1, "kind": "acquire",
                "holder": holder, "token_sha256": digest, "ttl_ms": int(ttl_ms),
            })
            won, got = self._create_decided(
                lease, latest + 1, body,
                lambda o: o.kind == "acquire" and secrets.compare_digest(o.token_sha256, digest))
            if won:
                return Tenure(lease, latest + 1, token, holder, got.expires_at)
            # Losing a race is never permission to work: look again.
            lost_races += 1
            if lost_races >= MAX_ROUNDS:
                raise RuntimeError(f"lease {lease}: lost {lost_races} races in a row")

    def renew(self, tenure: Tenure, ttl_ms: int = 30000) -> Tenure:
        """Step 4: acquire epoch L+1 while holding L (a fresh token)."""
        return self.acquire(tenure.lease, tenure.holder, ttl_ms, current=tenure)

    def release(self, tenure: Tenure) -> int:
        """Step 4: create epoch L+1 with kind "release". Returns that epoch."""
        latest, obj = self.status(tenure.lease)
        if not (obj is not None and obj.kind == "acquire" and latest == tenure.epoch
                and secrets.compare_digest(obj.token_sha256, token_sha256(tenure.token))):
            raise LeaseLost(f"lease {tenure.lease}: epoch {tenure.epoch} is no longer the latest ({latest})")
        body = _encode({"v": 1, "lease": tenure.lease, "epoch": tenure.epoch + 1,
                        "kind": "release", "holder": tenure.holder})
        won, _ = self._create_decided(tenure.lease, tenure.epoch + 1, body, lambda o: o.raw == body)
        if not won:
            raise LeaseLost(f"lease {tenure.lease}: epoch {tenure.epoch + 1} was created by someone else")
        return tenure.epoch + 1


def _status(e: ClientError) -> int | None:
    return e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")


# --------------------------------------------------------------------------- fencegate


@dataclass
class Reply:
    status: int
    headers: dict
    body: bytes

    @property
    def fencegate_error(self) -> str | None:
        """Set when fencegate itself refused the call (SPEC §7), not the destination."""
        return self.headers.get("x-fencegate-error")

    @property
    def replayed(self) -> bool:
        return self.headers.get("x-fencegate-replayed") == "true"


class Fencegate:
    """Calls a destination through fencegate (SPEC §3)."""

    def __init__(self, base_url: str, timeout: float = 30.0):
        self.base_url, self.timeout = base_url.rstrip("/"), timeout

    def call(self, tenure: Tenure, clock: StoreClock, method: str, path: str, body: bytes = b"",
             idempotency_key: str | None = None, headers: dict | None = None) -> Reply:
        """Sends one request carrying the tenure's epoch and token. Reuse the same
        idempotency key when retrying the same action; a new action needs a new key."""
        if not tenure.valid(clock):
            # SPEC §2 step 5: fencegate would refuse it too (lease_expired), but a
            # worker must not even try consequential work past its expiry.
            raise LeaseLost(f"lease {tenure.lease}: epoch {tenure.epoch} has expired; not sending")
        h = {"Content-Type": "application/json", **(headers or {})}
        h["X-Lease-Epoch"] = str(tenure.epoch)
        h["X-Lease-Token"] = tenure.token
        if idempotency_key is not None:
            h["Idempotency-Key"] = idempotency_key
        req = urllib.request.Request(self.base_url + path, data=body, headers=h, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return Reply(r.status, {k.lower(): v for k, v in r.headers.items()}, r.read())
        except urllib.error.HTTPError as e:
            return Reply(e.code, {k.lower(): v for k, v in e.headers.items()}, e.read())


# --------------------------------------------------------------------------- command line


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
    gate = Fencegate(args.fencegate)
    out: dict = {"lease": args.lease, "holder": args.holder}
    tenure = None
    try:
        leases.self_test()
        started = time.monotonic()
        tenure = leases.acquire(args.lease, args.holder, args.ttl_ms, wait=args.wait)
        out["acquired"] = {**tenure.as_json(), "elapsed_ms": int((time.monotonic() - started) * 1000)}
        log(f"acquired {args.lease} epoch {tenure.epoch}")

        key = args.idempotency_key or str(uuid.uuid4())
        reply = gate.call(tenure, leases.clock, args.method, args.path, args.body.encode("utf-8"), key)
        out["call"] = {
            "status": reply.status,
            "error": reply.fencegate_error,
            "replayed": reply.replayed,
            "idempotency_key": key,
            "body": reply.body.decode("utf-8", "replace"),
        }
        log(f"{args.method} {args.path} -> {reply.status} {reply.fencegate_error or ''}".rstrip())

        if not args.no_release:
            tenure = leases.renew(tenure, args.ttl_ms)
            out["renewed"] = tenure.as_json()
            out["released"] = {"epoch": leases.release(tenure)}
            tenure = None
        print(json.dumps(out))
        return 4 if reply.fencegate_error else 0
    except LeaseHeld as e:
        out["held"] = {"epoch": e.epoch, "holder": e.holder, "expires_at": iso(e.expires_at)}
        print(json.dumps(out))
        log(str(e))
        return 3
    except LeaseLost as e:
        out["lost"] = str(e)
        print(json.dumps(out))
        log(str(e))
        return 3
    except (ClientError, BotoCoreError, RuntimeError, ValueError, OSError) as e:
        out["error"] = str(e)
        if tenure is not None and not args.no_release:
            # Stop working and let the next worker in without waiting for expiry.
            try:
                out["released"] = {"epoch": leases.release(tenure)}
            except (LeaseLost, ClientError, BotoCoreError, RuntimeError) as e2:
                log(f"release after error failed: {e2}")
        print(json.dumps(out))
        log(f"error: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
