"""Calls through fencegate (SPEC §3) with typed outcomes (SPEC §7) and safe retries."""

from __future__ import annotations

import email.utils
import http.client
import json as _json
import logging
import ssl
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, ClassVar, Dict, Mapping, Optional, Tuple, Type, Union
from urllib.parse import urlsplit

from .held import Lease
from .tenure import Tenure

log = logging.getLogger("fencegate_client")


# --------------------------------------------------------------------------- outcomes


@dataclass(frozen=True)
class Outcome:
    """What one `call` came to. `kind` names the class; `code` is fencegate's
    error code (the `X-Fencegate-Error` header, SPEC §7) or None when the
    destination answered. `attempts` counts the requests sent (retries included)."""

    status: int  # 0 when there was no HTTP answer
    headers: Mapping[str, str]  # lowercase names
    body: bytes
    code: Optional[str]
    attempts: int
    #: The epoch the (last) request carried; None when nothing was sent.
    epoch: Optional[int] = None

    kind: ClassVar[str] = "outcome"
    #: The worker must stop this work (its epoch is over, or its request can never pass).
    must_stop: ClassVar[bool] = False
    #: `call` retries it itself (with the same key), up to `max_attempts`.
    retried: ClassVar[bool] = False

    @property
    def details(self) -> Dict[str, Any]:
        """fencegate's JSON error body (`error`, `message`, and context such as
        `lease`, `epoch`, `high_water_mark`, `dedup_key`, `upstream_status`); {} otherwise."""
        if self.code is None:
            return {}
        try:
            d = _json.loads(self.body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return {}
        return d if isinstance(d, dict) else {}

    @property
    def message(self) -> Optional[str]:
        m = self.details.get("message")
        return m if isinstance(m, str) else None

    @property
    def request_id(self) -> Optional[str]:
        return self.headers.get("x-request-id")

    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        return _json.loads(self.body.decode("utf-8"))


@dataclass(frozen=True)
class Delivered(Outcome):
    """The destination's own answer (any status: the destination's 4xx/5xx too).
    `replayed`: the stored answer of an earlier identical request with the same
    key (`X-Fencegate-Replayed: true`): the action happened once, earlier."""

    kind: ClassVar[str] = "delivered"

    @property
    def replayed(self) -> bool:
        return self.headers.get("x-fencegate-replayed") == "true"


@dataclass(frozen=True)
class Stale(Outcome):
    """409 epoch_stale: a newer epoch exists; you are no longer the leader. Stop."""

    kind: ClassVar[str] = "stale"
    must_stop: ClassVar[bool] = True


@dataclass(frozen=True)
class Expired(Outcome):
    """409 lease_expired: the epoch expired on the store's clock. Stop; acquire again for new work."""

    kind: ClassVar[str] = "expired"
    must_stop: ClassVar[bool] = True


@dataclass(frozen=True)
class Refused(Outcome):
    """401 token_missing, 403 token_invalid / epoch_unknown / epoch_invalid /
    peer_unauthorized: a bug (wrong token, an epoch never created, a release
    epoch). Stop."""

    kind: ClassVar[str] = "refused"
    must_stop: ClassVar[bool] = True


@dataclass(frozen=True)
class Invalid(Outcome):
    """The request itself is wrong: 428 epoch_missing, 400 epoch_malformed /
    dedup_key_malformed / body_malformed, 408 body_timeout, 413 body_too_large,
    404 route_not_found, 501 upgrade_unsupported. Nothing was forwarded; fix it."""

    kind: ClassVar[str] = "invalid"


@dataclass(frozen=True)
class InFlight(Outcome):
    """409 dedup_in_flight: the same key is being forwarded right now. Retried by
    `call` (same key); returned when the attempts ran out."""

    kind: ClassVar[str] = "in_flight"
    retried: ClassVar[bool] = True


@dataclass(frozen=True)
class InDoubt(Outcome):
    """May or may not have reached the destination: 504 upstream_timeout or
    drain_aborted (this call), or 409 dedup_in_doubt (an earlier one with this
    key). Never retried: an operator resolves the key (admin API, SPEC §8)."""

    kind: ClassVar[str] = "in_doubt"


@dataclass(frozen=True)
class AlreadyDone(Outcome):
    """409 dedup_done: the key was delivered but its response was not stored (too
    large, or resolved as delivered by an operator). `upstream_status` when known."""

    kind: ClassVar[str] = "already_done"

    @property
    def upstream_status(self) -> Optional[int]:
        s = self.details.get("upstream_status")
        return s if isinstance(s, int) else None


@dataclass(frozen=True)
class KeyReused(Outcome):
    """422 dedup_key_reused: the key was used for a different request. A bug."""

    kind: ClassVar[str] = "key_reused"


@dataclass(frozen=True)
class Unavailable(Outcome):
    """503 store_unavailable / shard_unavailable / upstream_held: nothing was
    forwarded (nor recorded). Retried by
    `call` after Retry-After (same key); returned when the attempts ran out."""

    kind: ClassVar[str] = "unavailable"
    retried: ClassVar[bool] = True

    @property
    def retry_after(self) -> Optional[float]:
        return parse_retry_after(self.headers.get("retry-after"))


@dataclass(frozen=True)
class Unreachable(Outcome):
    """502 upstream_unreachable: nothing was sent to the destination. Retried by
    `call` (same key); returned when the attempts ran out."""

    kind: ClassVar[str] = "unreachable"
    retried: ClassVar[bool] = True


@dataclass(frozen=True)
class UnknownError(Outcome):
    """An X-Fencegate-Error code this client does not know (not in SPEC §7)."""

    kind: ClassVar[str] = "unknown_error"


@dataclass(frozen=True)
class NotSent(Outcome):
    """The client did not send: the tenure must stop or the lease has expired (on
    the latest estimate of the store's clock). `previous`: the last answer before
    a retry was given up for this reason, if any."""

    reason: str = ""
    previous: Optional[Outcome] = None

    kind: ClassVar[str] = "not_sent"
    must_stop: ClassVar[bool] = True


@dataclass(frozen=True)
class NoResponse(Outcome):
    """No HTTP answer from fencegate (connection refused, reset, timed out).
    `sent` is False only when the connection was never made (nothing was sent).
    Retried by `call` when nothing was sent, or when the request carried an
    Idempotency-Key (a retry is then answered from fencegate's record)."""

    error: str = ""
    sent: bool = True

    kind: ClassVar[str] = "no_response"


#: Every code of SPEC §7 and the outcome it becomes.
ERROR_CODES: Dict[str, Type[Outcome]] = {
    "epoch_malformed": Invalid,
    "dedup_key_malformed": Invalid,
    "body_malformed": Invalid,
    "token_missing": Refused,
    "token_invalid": Refused,
    "epoch_unknown": Refused,
    "epoch_invalid": Refused,
    "peer_unauthorized": Refused,
    "route_not_found": Invalid,
    "body_timeout": Invalid,
    "epoch_stale": Stale,
    "lease_expired": Expired,
    "dedup_in_flight": InFlight,
    "dedup_in_doubt": InDoubt,
    "dedup_done": AlreadyDone,
    "body_too_large": Invalid,
    "dedup_key_reused": KeyReused,
    "epoch_missing": Invalid,
    "upgrade_unsupported": Invalid,
    "upstream_unreachable": Unreachable,
    "store_unavailable": Unavailable,
    "shard_unavailable": Unavailable,
    "upstream_held": Unavailable,
    "upstream_timeout": InDoubt,
    "drain_aborted": InDoubt,
}


def parse_retry_after(value: Optional[str]) -> Optional[float]:
    """Retry-After as seconds: delta-seconds or an HTTP date (RFC 9110 §10.2.3)."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())


def parse_outcome(status: int, headers: Mapping[str, str], body: bytes, attempts: int = 1,
                  epoch: Optional[int] = None) -> Outcome:
    """The outcome of one HTTP answer from fencegate: fencegate's own (by its
    `X-Fencegate-Error` header) or the destination's."""
    h = {k.lower(): v for k, v in headers.items()}
    code = h.get("x-fencegate-error")
    if code is None:
        return Delivered(status, h, body, None, attempts, epoch)
    return ERROR_CODES.get(code, UnknownError)(status, h, body, code, attempts, epoch)


# --------------------------------------------------------------------------- the client


class _NoKey:
    def __repr__(self) -> str:
        return "NO_KEY"


#: Pass as `idempotency_key` to send no Idempotency-Key (fencegate then derives
#: one per its route's `derive_key`, or records nothing for GET/HEAD/OPTIONS/TRACE).
NO_KEY: Any = _NoKey()

_RESERVED = {"x-lease-epoch", "x-lease-token", "idempotency-key"}


def _check_key(key: str) -> None:
    if not (1 <= len(key) <= 255) or not all(0x21 <= ord(c) <= 0x7E for c in key):
        raise ValueError("Idempotency-Key must be 1-255 visible ASCII characters (SPEC §3)")


class GatewayClient:
    """Sends requests through fencegate with the epoch and token of a Lease or a
    Tenure (SPEC §3) and returns typed outcomes (SPEC §7).

    Retries — always with the same Idempotency-Key, at most `max_attempts`
    requests per call, never past the tenure's stop — only what SPEC says is
    safe: 503 store_unavailable / shard_unavailable / upstream_held (after
    Retry-After), 502
    upstream_unreachable, 409 dedup_in_flight, and no answer at all (when nothing
    was sent, or when the request carried a key). Everything else is returned.
    """

    def __init__(self, base_url: str, timeout: float = 30.0, max_attempts: int = 5,
                 backoff: float = 0.2, max_retry_wait: float = 30.0,
                 ssl_context: Optional[ssl.SSLContext] = None) -> None:
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"base_url {base_url!r}: want http(s)://host[:port][/path]")
        self._https = u.scheme == "https"
        self._host = u.hostname
        self._port = u.port or (443 if self._https else 80)
        self._base_path = u.path.rstrip("/")
        self.timeout, self.max_attempts = timeout, max_attempts
        self.backoff, self.max_retry_wait = backoff, max_retry_wait
        self._ssl = ssl_context

    @staticmethod
    def _renewed_past(holder: Union[Tenure, Lease], sent: Lease, outcome: Outcome) -> Optional[Lease]:
        """The tenure's renewed lease when `outcome` is a 409 epoch_stale whose
        newer epoch is the tenure's own renewal (it holds it now, or once its
        renewal on the way returns); None otherwise."""
        if not isinstance(outcome, Stale) or not isinstance(holder, Tenure):
            return None
        latest = outcome.details.get("latest_epoch")
        if not isinstance(latest, int) or latest <= sent.epoch:
            return None
        return holder.holds_at_least(latest, holder.seconds_left())

    def call(self, holder: Union[Tenure, Lease], method: str, path: str,
             body: Union[bytes, str, None] = None, *, json: Any = None,
             idempotency_key: Any = None, headers: Optional[Mapping[str, str]] = None,
             timeout: Optional[float] = None, max_attempts: Optional[int] = None,
             on_retry: Optional[Callable[[Outcome, float], None]] = None) -> Outcome:
        """Sends `method path` (a path under one of fencegate's routes, with its
        query) carrying the holder's current epoch and token.

        `idempotency_key`: one key per *action*; pass the same key to retry the
        same action later (another process, after a crash). None (the default):
        a fresh key for this call, kept by its own retries. NO_KEY: none sent.
        `on_retry(outcome, delay_seconds)` is called before each retry.
        """
        if idempotency_key is None:
            key: Optional[str] = f"fgc-{uuid.uuid4().hex}"
        elif idempotency_key is NO_KEY:
            key = None
        else:
            key = str(idempotency_key)
            _check_key(key)
        if json is not None:
            if body is not None:
                raise ValueError("pass body or json, not both")
            body = _json.dumps(json).encode("utf-8")
        data = body.encode("utf-8") if isinstance(body, str) else body
        base_headers = {k: v for k, v in (headers or {}).items() if k.lower() not in _RESERVED}
        if json is not None and not any(k.lower() == "content-type" for k in base_headers):
            base_headers["Content-Type"] = "application/json"
        attempts = max_attempts or self.max_attempts
        previous: Optional[Outcome] = None
        for attempt in range(1, attempts + 1):
            lease, why = self._current(holder)
            if lease is None:
                return NotSent(0, {}, b"", None, attempt - 1, reason=why, previous=previous)
            h = dict(base_headers)
            h["X-Lease-Epoch"] = str(lease.epoch)
            h["X-Lease-Token"] = lease.token
            if key is not None:
                h["Idempotency-Key"] = key
            outcome = self._send_once(method, path, data, h, timeout or self.timeout, attempt, lease.epoch)
            renewed = self._renewed_past(holder, lease, outcome)
            if renewed is not None:
                # Refused at admission (nothing was forwarded) because this
                # tenure's own renewal reached fencegate first: the same request
                # again, at the renewed epoch.
                h["X-Lease-Epoch"] = str(renewed.epoch)
                h["X-Lease-Token"] = renewed.token
                outcome = self._send_once(method, path, data, h, timeout or self.timeout, attempt, renewed.epoch)
            if attempt == attempts or not self._retry(outcome, key is not None):
                return outcome
            delay = self._delay(outcome, attempt)
            if delay > self.max_retry_wait:
                return outcome
            if isinstance(holder, Tenure) and holder.seconds_left() <= delay:
                return outcome  # the work must stop before the retry could be sent
            if isinstance(holder, Lease) and holder.seconds_left() <= delay:
                return outcome
            log.info("%s %s: %s%s; retrying in %.2f s with the same key", method, path, outcome.kind,
                     f" ({outcome.code})" if outcome.code else "", delay)
            if on_retry is not None:
                on_retry(outcome, delay)
            if isinstance(holder, Tenure):
                if holder.wait(delay):
                    return NotSent(0, {}, b"", None, attempt,
                                   reason=f"tenure ended ({holder.stop_reason})", previous=outcome)
            else:
                time.sleep(delay)
            previous = outcome
        raise AssertionError("unreachable")  # pragma: no cover

    # ---- inside

    @staticmethod
    def _current(holder: Union[Tenure, Lease]) -> Tuple[Optional[Lease], str]:
        if isinstance(holder, Tenure):
            if holder.must_stop:
                return None, f"tenure ended ({holder.stop_reason or 'deadline'})"
            return holder.lease, ""
        if holder.expired():
            return None, f"epoch {holder.epoch} of lease {holder.name} has expired on the store's clock"
        return holder, ""

    @staticmethod
    def _retry(outcome: Outcome, keyed: bool) -> bool:
        if isinstance(outcome, NoResponse):
            return not outcome.sent or keyed
        # dedup_in_flight: a key (ours, or one derived from this same request) is
        # being forwarded; the same request again is answered from its record.
        return outcome.retried

    def _delay(self, outcome: Outcome, attempt: int) -> float:
        backoff: float = min(self.backoff * float(2 ** (attempt - 1)), 5.0)
        if isinstance(outcome, Unavailable):
            ra = outcome.retry_after
            return ra if ra is not None else max(1.0, backoff)
        return backoff

    def _send_once(self, method: str, path: str, data: Optional[bytes], headers: Dict[str, str],
                   timeout: float, attempt: int, epoch: int) -> Outcome:
        if self._https:
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                self._host, self._port, timeout=timeout, context=self._ssl)
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout)
        try:
            try:
                conn.connect()
            except OSError as e:
                return NoResponse(0, {}, b"", None, attempt, None, error=f"connect: {e}", sent=False)
            try:
                conn.request(method, self._base_path + path, body=data, headers=headers)
                resp = conn.getresponse()
                payload = resp.read()
            except (OSError, http.client.HTTPException) as e:
                return NoResponse(0, {}, b"", None, attempt, epoch, error=f"{type(e).__name__}: {e}", sent=True)
            hdrs: Dict[str, str] = {}
            for k, v in resp.getheaders():
                k = k.lower()
                hdrs[k] = f"{hdrs[k]}, {v}" if k in hdrs else v
            return parse_outcome(resp.status, hdrs, payload, attempt, epoch)
        finally:
            conn.close()
