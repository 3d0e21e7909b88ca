"""Leases on an S3 lease store: acquire, renew, release (SPEC §2, docs/worker-protocol.md)."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Dict, Optional, Tuple

from botocore.exceptions import BotoCoreError, ClientError

from .clock import StoreClock
from .errors import LeaseError, LeaseHeld, LeaseLost
from .held import Lease
from .tenure import Tenure

log = logging.getLogger("fencegate_client")

LEASE_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
EPOCH_FILE = re.compile(r"^(\d{20})\.json$")
MAX_ROUNDS = 16


def token_sha256(token: str) -> str:
    """Lowercase hex SHA-256 of the token's bytes as sent in X-Lease-Token."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class EpochObject:
    """An epoch object as read from the store (SPEC §2)."""

    epoch: int
    kind: str  # "acquire", "release" or "invalid"
    holder: Optional[str]
    token_sha256: Optional[str]
    ttl_ms: Optional[int]
    last_modified: datetime
    raw: bytes = field(repr=False)

    @property
    def expires_at(self) -> Optional[datetime]:
        """LastModified + ttl_ms, on the store's clock (acquires only)."""
        if self.kind != "acquire" or self.ttl_ms is None:
            return None
        return self.last_modified + timedelta(milliseconds=self.ttl_ms)


def parse_epoch_object(lease: str, epoch: int, raw: bytes, last_modified: datetime) -> EpochObject:
    """SPEC §2: an object that does not parse or disagrees with its key is still an
    epoch, of kind "invalid" (it admits nothing and frees the lease)."""
    if last_modified.tzinfo is None:
        last_modified = last_modified.replace(tzinfo=timezone.utc)
    invalid = EpochObject(epoch, "invalid", None, None, None, last_modified, raw)
    try:
        o = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return invalid
    if not isinstance(o, dict) or not _is_int(o.get("v"), 1) or o.get("lease") != lease \
            or not _is_int(o.get("epoch"), epoch):
        return invalid
    holder = o.get("holder") if isinstance(o.get("holder"), str) else None
    if o.get("kind") == "release":
        return EpochObject(epoch, "release", holder, None, None, last_modified, raw)
    if o.get("kind") != "acquire":
        return invalid
    digest, ttl = o.get("token_sha256"), o.get("ttl_ms")
    if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
        return invalid
    if not (isinstance(ttl, int) and not isinstance(ttl, bool) and ttl > 0):
        return invalid
    return EpochObject(epoch, "acquire", holder, digest, ttl, last_modified, raw)


def _is_int(v: Any, want: Optional[int] = None) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and (want is None or v == want)


def _status(e: ClientError) -> Optional[int]:
    return e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")


def _encode(obj: Dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode("utf-8")


class LeaseClient:
    """The lease protocol of SPEC §2 on an S3 (or S3-compatible) lease store.

    `s3` is a boto3 S3 client (boto3 >= 1.35 for IfNoneMatch); this client
    registers an event hook on it that feeds every response's `Date` header into
    `self.clock`. `prefix` and `grace_ms` must match fencegate's `[store]`.
    """

    def __init__(self, s3: Any, bucket: str, prefix: str = "fencegate/", grace_ms: int = 2000,
                 clock: Optional[StoreClock] = None, max_rounds: int = MAX_ROUNDS) -> None:
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"prefix {prefix!r} must be empty or end in '/'")
        self.s3, self.bucket, self.prefix = s3, bucket, prefix
        self.grace = timedelta(milliseconds=grace_ms)
        self.max_rounds = max_rounds
        self.clock = clock or StoreClock()
        self.clock.attach(s3)

    # ---- layout

    def key(self, lease: str, epoch: int) -> str:
        return f"{self.prefix}{lease}/{epoch:020d}.json"

    @staticmethod
    def check_name(lease: str) -> None:
        if not LEASE_NAME.match(lease):
            raise ValueError(f"invalid lease name {lease!r}: must match [a-z0-9][a-z0-9._-]{{0,62}}")

    # ---- the store self-test (docs/worker-protocol.md §8)

    def self_test(self) -> None:
        """Raises LeaseError on a store that ignores If-None-Match: creates one
        probe object twice under `{prefix}.probe/`; the second must be refused."""
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
            raise LeaseError(
                f"bucket {self.bucket} ignores conditional writes (a second PutObject with "
                "If-None-Match: * succeeded): fencing is impossible on this store")

    # ---- reads

    def latest_epoch(self, lease: str, after: int = 0) -> int:
        """The greatest epoch listed under {prefix}{lease}/ (0: none)."""
        lp = f"{self.prefix}{lease}/"
        latest, token = 0, None
        while True:
            kw: Dict[str, Any] = {"Bucket": self.bucket, "Prefix": lp}
            if token:
                kw["ContinuationToken"] = token
            elif after:
                kw["StartAfter"] = self.key(lease, after)
            out = self.s3.list_objects_v2(**kw)
            for o in out.get("Contents", []):
                m = EPOCH_FILE.match(o["Key"][len(lp):])
                if m and int(m.group(1)) > 0:
                    latest = max(latest, int(m.group(1)))
            if not out.get("IsTruncated"):
                return latest
            token = out.get("NextContinuationToken")

    def read(self, lease: str, epoch: int) -> Optional[EpochObject]:
        """The epoch object, or None when it does not exist."""
        try:
            out = self.s3.get_object(Bucket=self.bucket, Key=self.key(lease, epoch))
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404") or _status(e) == 404:
                return None
            raise
        return parse_epoch_object(lease, epoch, out["Body"].read(), out["LastModified"])

    def status(self, lease: str) -> Tuple[int, Optional[EpochObject]]:
        """(latest epoch, its object): 0 and None when the lease has no epoch."""
        self.check_name(lease)
        latest = self.latest_epoch(lease)
        return latest, (self.read(lease, latest) if latest else None)

    def is_free(self, obj: Optional[EpochObject]) -> bool:
        """No epoch, a release, an invalid object, or an acquire expired by more
        than grace — judged on the EARLIEST the store's clock may read."""
        if obj is None or obj.kind != "acquire" or obj.expires_at is None:
            return True
        return self.clock.earliest() > obj.expires_at + self.grace

    # ---- the conditional create, uncertain results decided by reading back

    def _create_decided(self, lease: str, epoch: int, body: bytes,
                        ours: Callable[[EpochObject], bool]) -> Tuple[bool, EpochObject, bool]:
        """Creates `epoch` with If-None-Match: *. Returns (won, object, reconciled).

        Whatever the PUT said, the object is read back: a 412 may be our own first
        attempt answered late (SDK retries do this), a timeout or 5xx may or may
        not have been applied, and a success needs LastModified for the expiry."""
        key = self.key(lease, epoch)
        uncertain = False
        put = True
        for attempt in range(self.max_rounds):
            if attempt:
                time.sleep(min(0.02 * 2 ** attempt, 1.0))
            if put:
                try:
                    self.s3.put_object(Bucket=self.bucket, Key=key, Body=body, IfNoneMatch="*",
                                       ContentType="application/json")
                except ClientError as e:
                    status, code = _status(e), e.response.get("Error", {}).get("Code")
                    conflict = status == 412 or code in ("PreconditionFailed", "ConditionalRequestConflict")
                    unknown = status is None or status >= 500 or status in (408, 429)
                    if not (conflict or unknown):
                        raise LeaseError(f"create {key} refused: {code or status}: {e}") from e
                    uncertain = True
                    log.info("create %s: %s (%s); reading back", key, code or status,
                             "exists" if conflict else "uncertain")
                except BotoCoreError as e:  # timeout, connection reset: the uncertain result
                    uncertain = True
                    log.info("create %s: %s; reading back", key, e)
            try:
                obj = self.read(lease, epoch)
            except (ClientError, BotoCoreError) as e:
                log.info("read-back of %s failed: %s; reading again", key, e)
                put = False  # retry the GET, do not guess
                continue
            if obj is None:
                put = True  # the create did not happen: the same conditional PUT is safe
                continue
            return ours(obj), obj, uncertain
        raise LeaseError(f"could not decide the create of {key} after {self.max_rounds} attempts")

    # ---- the operations

    def acquire(self, lease: str, holder: str, ttl_ms: int = 30000, wait: bool = False,
                wait_timeout: Optional[float] = None) -> Lease:
        """Acquires `lease` if it is free. Raises LeaseHeld when someone else holds
        it — with wait=True, only after waiting `wait_timeout` seconds (None:
        forever) for its expiry + grace."""
        return self._acquire(lease, holder, ttl_ms, wait, wait_timeout, current=None)

    def renew(self, current: Lease, ttl_ms: Optional[int] = None) -> Lease:
        """Acquires epoch L+1 while holding L (a fresh token). Raises LeaseLost when
        L is no longer the latest epoch, not ours, or expired."""
        return self._acquire(current.name, current.holder, ttl_ms or current.ttl_ms, False, None, current)

    def release(self, current: Lease) -> int:
        """Creates epoch L+1 of kind "release": the lease is free at once. Returns
        that epoch. Send nothing with `current` afterwards."""
        latest, obj = self.status(current.name)
        if not self._mine(obj, latest, current):
            raise LeaseLost(f"lease {current.name}: epoch {current.epoch} is no longer the latest ({latest})")
        body = _encode({"v": 1, "lease": current.name, "epoch": current.epoch + 1,
                        "kind": "release", "holder": current.holder})
        won, _, _ = self._create_decided(current.name, current.epoch + 1, body, lambda o: o.raw == body)
        if not won:
            raise LeaseLost(f"lease {current.name}: epoch {current.epoch + 1} was created by someone else")
        return current.epoch + 1

    def hold(self, lease: str, holder: str, ttl_ms: int = 30000, margin_ms: int = 2000,
             wait: bool = False, wait_timeout: Optional[float] = None,
             on_stop: Optional[Callable[[str], None]] = None) -> Tenure:
        """Acquires `lease` and returns a started Tenure: it renews itself in the
        background and signals stop `margin_ms` before the lease could end."""
        if margin_ms < 0 or margin_ms >= ttl_ms:
            raise ValueError("margin_ms must be in [0, ttl_ms)")
        return Tenure(self, self.acquire(lease, holder, ttl_ms, wait, wait_timeout), margin_ms, on_stop)

    @staticmethod
    def _mine(obj: Optional[EpochObject], latest: int, current: Lease) -> bool:
        return (obj is not None and obj.kind == "acquire" and latest == current.epoch
                and obj.token_sha256 is not None
                and secrets.compare_digest(obj.token_sha256, token_sha256(current.token)))

    def _acquire(self, lease: str, holder: str, ttl_ms: int, wait: bool, wait_timeout: Optional[float],
                 current: Optional[Lease]) -> Lease:
        self.check_name(lease)
        if ttl_ms <= 0:
            raise ValueError("ttl_ms must be positive")
        give_up = None if wait_timeout is None else time.monotonic() + wait_timeout
        backoff = 0.1
        lost_races = 0
        while True:
            latest, obj = self.status(lease)
            if current is not None:
                if not self._mine(obj, latest, current):
                    raise LeaseLost(f"lease {lease}: epoch {current.epoch} is no longer the latest ({latest})")
                if current.expired():
                    raise LeaseLost(f"lease {lease}: epoch {current.epoch} has expired")
            elif not self.is_free(obj):
                assert obj is not None and obj.expires_at is not None
                held = LeaseHeld(lease, latest, obj.holder, obj.expires_at)
                if not wait or (give_up is not None and time.monotonic() >= give_up):
                    raise held
                free_in = (obj.expires_at + self.grace - self.clock.earliest()).total_seconds()
                pause = max(0.05, min(backoff, free_in + 0.05))
                if give_up is not None:
                    pause = max(0.0, min(pause, give_up - time.monotonic()))
                log.info("%s; waiting %d ms", held, int(pause * 1000))
                time.sleep(pause)
                backoff = min(backoff * 2, 2.0)
                continue
            token = secrets.token_hex(32)  # 256 bits
            digest = token_sha256(token)
            body = _encode({"v": 1, "lease": lease, "epoch": latest + 1, "kind": "acquire",
                            "holder": holder, "token_sha256": digest, "ttl_ms": int(ttl_ms)})
            won, got, uncertain = self._create_decided(
                lease, latest + 1, body,
                lambda o: o.kind == "acquire" and o.token_sha256 is not None
                and secrets.compare_digest(o.token_sha256, digest))
            if won:
                assert got.expires_at is not None
                return Lease(lease, latest + 1, token, holder, int(ttl_ms), got.expires_at, self.clock,
                             reconciled=uncertain)
            if current is not None:
                raise LeaseLost(f"lease {lease}: epoch {latest + 1} was created by someone else")
            # Losing a race is never permission to work: look again.
            log.info("lease %s: epoch %d was won by someone else; looking again", lease, latest + 1)
            lost_races += 1
            if lost_races >= self.max_rounds:
                raise LeaseError(f"lease {lease}: lost {lost_races} races in a row")
