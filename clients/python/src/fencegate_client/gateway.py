"""Calls through fencegate (SPEC §3) with typed outcomes (SPEC §7) and safe retries."""

from __future__ import annotations

import email.utils
import http.client
import json as _json
import logging
import ssl
import time
import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, Callable, ClassVar, Dict, Mapping, Optional, Tuple, Type, Union
from urllib.parse import urlsplit

from .delivery import DeliveryStatus, DeliveryStatusError, DeliveryTimeout, NotDelivered, parse_delivery
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
class Queued(Outcome):
    """202 Accepted with `X-Fencegate-Delivery: queued`: a queued route (SPEC §11)
    wrote the request durably and will deliver it (in order, with retries); the
    destination has not answered yet. `delivery`: the message's status (the
    202's JSON), `location`: its status path, `status_url`: the same under the
    client's base URL (what `wait_delivered` polls). A retry of the same key
    gets this again while the message is pending or delivering."""

    delivery: Optional[DeliveryStatus] = None
    status_url: str = ""
    #: The epoch the message was accepted with: its token is the status URL's credential.
    lease: Optional[Lease] = field(default=None, repr=False, compare=False)

    kind: ClassVar[str] = "queued"

    @property
    def dedup_key(self) -> Optional[str]:
        return self.headers.get("x-fencegate-dedup-key")

    @property
    def location(self) -> str:
        return self.headers.get("location", "")


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
class DeliveryFailed(Outcome):
    """409 delivery_failed: a queued message with this key failed for good (the
    destination refused it, or its retries ran out). `upstream_status`: the
    last attempt's status; `detail`: its error. An operator may retry it."""

    kind: ClassVar[str] = "delivery_failed"

    @property
    def upstream_status(self) -> Optional[int]:
        s = self.details.get("upstream_status")
        return s if isinstance(s, int) else None

    @property
    def detail(self) -> Optional[str]:
        d = self.details.get("detail")
        return d if isinstance(d, str) else None


@dataclass(frozen=True)
class DeliveryDropped(Outcome):
    """409 delivery_dropped: a queued message with this key was dropped by an operator."""

    kind: ClassVar[str] = "delivery_dropped"


@dataclass(frozen=True)
class KeyReused(Outcome):
    """422 dedup_key_reused: the key was used for a different request. A bug."""

    kind: ClassVar[str] = "key_reused"


@dataclass(frozen=True)
class Unavailable(Outcome):
    """503 store_unavailable / shard_unavailable / upstream_held / queue_full: nothing was
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
    "dedup_key_missing": Invalid,
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
    "delivery_failed": DeliveryFailed,
    "delivery_dropped": DeliveryDropped,
    "delivery_not_found": Invalid,
    "body_too_large": Invalid,
    "dedup_key_reused": KeyReused,
    "epoch_missing": Invalid,
    "upgrade_unsupported": Invalid,
    "upstream_unreachable": Unreachable,
    "store_unavailable": Unavailable,
    "shard_unavailable": Unavailable,
    "upstream_held": Unavailable,
    "queue_full": Unavailable,
    "route_changed": Unavailable,
    "request_malformed": Invalid,
    "uri_too_long": Invalid,
    "headers_too_large": Invalid,
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
    `X-Fencegate-Error` header, or a queued route's 202 by `X-Fencegate-Delivery:
    queued`) or the destination's."""
    h = {k.lower(): v for k, v in headers.items()}
    code = h.get("x-fencegate-error")
    if (code is None and status == 202 and h.get("x-fencegate-delivery", "").strip().lower() == "queued"
            and h.get("x-fencegate-replayed") != "true"):
        try:
            delivery: Optional[DeliveryStatus] = parse_delivery(_json.loads(body.decode("utf-8")))
        except (UnicodeDecodeError, ValueError):
            delivery = None
        return Queued(status, h, body, None, attempts, epoch, delivery, h.get("location", ""))
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
    safe: 503 store_unavailable / shard_unavailable / upstream_held / queue_full (after
    Retry-After), 502
    upstream_unreachable, 409 dedup_in_flight, and no answer at all (when nothing
    was sent, or when the request carried a key). Everything else is returned.
    """

    def __init__(self, base_url: str, timeout: float = 30.0, max_attempts: int = 5,
                 backoff: float = 0.2, max_retry_wait: float = 30.0,
                 ssl_context: Optional[ssl.SSLContext] = None, follow_owner: bool = True) -> None:
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"base_url {base_url!r}: want http(s)://host[:port][/path]")
        self._https = u.scheme == "https"
        self._host = u.hostname
        self._port = u.port or (443 if self._https else 80)
        self._base_path = u.path.rstrip("/")
        self._origin = f"{u.scheme}://{u.netloc.rsplit('@', 1)[-1]}"
        self.timeout, self.max_attempts = timeout, max_attempts
        self.backoff, self.max_retry_wait = backoff, max_retry_wait
        self._ssl = ssl_context
        # SPEC §10.2: per lease, the owner a cluster named in its last answer
        # (X-Fencegate-Owner): (https, host, port). The path stays the base's.
        self.follow_owner = follow_owner
        self._owners: Dict[str, Tuple[bool, str, int]] = {}

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
             on_retry: Optional[Callable[[Outcome, float], None]] = None, queued: bool = False) -> Outcome:
        """Sends `method path` (a path under one of fencegate's routes, with its
        query) carrying the holder's current epoch and token.

        `idempotency_key`: one key per *action*; pass the same key to retry the
        same action later (another process, after a crash). None (the default):
        a fresh key for this call, kept by its own retries. NO_KEY: none sent.
        `on_retry(outcome, delay_seconds)` is called before each retry.

        A queued route's `202` (`X-Fencegate-Delivery: queued`, SPEC §11) is
        returned as `Queued` — with or without `queued` — never as `Delivered`:
        the destination has not answered yet. Pass it to `wait_delivered`.
        `queued=True` says the route is meant to be queued: an answer that shows
        it is not (the destination's own, fresh) is still returned as
        `Delivered`, and logged as a warning.
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
            outcome = self._accepted(
                self._send_once(method, path, data, h, timeout or self.timeout, attempt, lease.epoch,
                                lease.name), lease)
            renewed = self._renewed_past(holder, lease, outcome)
            if renewed is not None:
                # Refused at admission (nothing was forwarded) because this
                # tenure's own renewal reached fencegate first: the same request
                # again, at the renewed epoch.
                h["X-Lease-Epoch"] = str(renewed.epoch)
                h["X-Lease-Token"] = renewed.token
                outcome = self._accepted(
                    self._send_once(method, path, data, h, timeout or self.timeout, attempt, renewed.epoch,
                                    lease.name),
                    renewed)
            if attempt == attempts or not self._retry(outcome, key is not None):
                if queued and isinstance(outcome, Delivered) and not outcome.replayed:
                    log.warning("%s %s: answered by the destination, not queued: the route is direct "
                                "(queued=True expected X-Fencegate-Delivery: queued)", method, path)
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

    def wait_delivered(self, target: Union[Queued, str], timeout: float = 60.0, *,
                       token: Union[str, Lease, None] = None, max_interval: float = 2.0) -> DeliveryStatus:
        """Polls a queued message's status URL until it is delivered, and returns
        its status. `target`: a `Queued` outcome, or its status URL (absolute, or
        a path such as `/.fencegate/deliveries/{route}/{key}`, taken under this
        client's base URL). `token`: the lease token (or the `Lease`) the message
        was accepted with — a `Queued` carries its own; a renewed epoch's token is
        refused (403). None on a route with `require_token = false`.

        Raises `NotDelivered` when it settles failed or dropped (`status`,
        `last_status`, `last_error`), `DeliveryTimeout` (a `TimeoutError`) when
        `timeout` seconds pass first, `DeliveryStatusError` when the status URL
        refuses the query (401, 403, 404 delivery_not_found). No answer or a 5xx
        is polled again. Polls every 0.1 s at first, doubling up to `max_interval`.
        """
        if isinstance(target, Queued):
            url = target.status_url or target.location
            if token is None and target.lease is not None:
                token = target.lease.token
        elif isinstance(target, str):
            url = target
        else:
            raise TypeError(f"wait_delivered: want a Queued outcome or a status URL, got {type(target).__name__}")
        if not url:
            raise ValueError("wait_delivered: no status URL (a Queued without Location)")
        if url.startswith("/"):
            url = self._origin + self._base_path + url
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"wait_delivered: {url!r} is not an http(s) URL or an absolute path")
        target_path = u.path + (f"?{u.query}" if u.query else "")
        headers = {"Accept": "application/json"}
        secret = token.token if isinstance(token, Lease) else token
        if secret is not None:
            headers["X-Lease-Token"] = secret
        deadline = time.monotonic() + timeout
        interval = min(0.1, max_interval)
        seen: Optional[DeliveryStatus] = None
        problem: Optional[str] = None
        while True:
            left = deadline - time.monotonic()
            try:
                status, hdrs, payload = self._exchange(
                    u.scheme == "https", u.hostname, u.port or (443 if u.scheme == "https" else 80), "GET",
                    target_path, None, headers, min(self.timeout, max(left, 0.5)))
            except _NotConnected as e:
                problem = f"connect: {e.cause}"
            except (OSError, http.client.HTTPException) as e:
                problem = f"{type(e).__name__}: {e}"
            else:
                if status == 200:
                    try:
                        seen = parse_delivery(_json.loads(payload.decode("utf-8")))
                    except (UnicodeDecodeError, ValueError) as e:
                        raise DeliveryStatusError(url, status, None, {"message": f"not a delivery status: {e}"})
                    if seen.status == "delivered":
                        return seen
                    if seen.status in ("failed", "dropped"):
                        raise NotDelivered(seen)
                elif 400 <= status < 500 and status not in (408, 429):
                    out = parse_outcome(status, hdrs, payload)
                    raise DeliveryStatusError(url, status, out.code, out.details)
                else:
                    problem = f"HTTP {status} {hdrs.get('x-fencegate-error', '')}".rstrip()
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeliveryTimeout(url, timeout, seen, problem)
            time.sleep(min(interval, left))
            interval = min(interval * 2, max_interval)

    # ---- inside

    def _accepted(self, outcome: Outcome, lease: Lease) -> Outcome:
        """A Queued outcome with its status URL under this client's base URL and
        the epoch it was accepted with (the status URL's token)."""
        if not isinstance(outcome, Queued):
            return outcome
        return replace(outcome, lease=lease,
                       status_url=self._origin + self._base_path + outcome.location if outcome.location else "")

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

    def _exchange(self, https: bool, host: str, port: int, method: str, target: str, data: Optional[bytes],
                  headers: Mapping[str, str], timeout: float,
                  ) -> Tuple[int, Dict[str, str], bytes]:
        """One request on its own connection: (status, lowercase headers, body).
        Raises OSError / HTTPException; a connect() that failed (nothing was
        sent) as `_NotConnected`."""
        if https:
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                host, port, timeout=timeout, context=self._ssl)
        else:
            conn = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            try:
                conn.connect()
            except OSError as e:
                raise _NotConnected(e) from e
            conn.request(method, target, body=data, headers=dict(headers))
            resp = conn.getresponse()
            payload = resp.read()
            hdrs: Dict[str, str] = {}
            for k, v in resp.getheaders():
                k = k.lower()
                hdrs[k] = f"{hdrs[k]}, {v}" if k in hdrs else v
            return resp.status, hdrs, payload
        finally:
            conn.close()

    def _send_once(self, method: str, path: str, data: Optional[bytes], headers: Dict[str, str],
                   timeout: float, attempt: int, epoch: int, lease: str) -> Outcome:
        hinted = self._owners.get(lease) if self.follow_owner else None
        https, host, port = hinted or (self._https, self._host, self._port)
        try:
            status, hdrs, payload = self._exchange(https, host, port, method,
                                                   self._base_path + path, data, headers, timeout)
        except _NotConnected as e:
            if hinted is not None:
                # The named owner cannot be reached: the base URL again (its
                # member relays the request to whoever owns the lease now).
                self._owners.pop(lease, None)
            return NoResponse(0, {}, b"", None, attempt, None, error=f"connect: {e.cause}", sent=False)
        except (OSError, http.client.HTTPException) as e:
            return NoResponse(0, {}, b"", None, attempt, epoch, error=f"{type(e).__name__}: {e}", sent=True)
        self._note_owner(lease, hdrs.get("x-fencegate-owner"))
        return parse_outcome(status, hdrs, payload, attempt, epoch)

    def _note_owner(self, lease: str, owner: Optional[str]) -> None:
        """Keeps the owner a cluster named (SPEC §10.2) for the lease's next
        request; anything that is not an http(s) URL is ignored."""
        if not owner or not self.follow_owner:
            return
        u = urlsplit(owner)
        if u.scheme not in ("http", "https") or not u.hostname:
            return
        https = u.scheme == "https"
        self._owners[lease] = (https, u.hostname, u.port or (443 if https else 80))


class _NotConnected(OSError):
    """The connection was never made: nothing was sent."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(str(cause))
        self.cause = cause
