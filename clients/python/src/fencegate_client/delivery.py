"""A queued route's message as fencegate shows it (SPEC §11), and the errors of
waiting for its delivery. The client (gateway.py) sends and polls; this module
only reads what came back."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Dict, Mapping, Optional

#: A message's statuses; the last three are settled (they change no more,
#: except by an operator's retry of a failed one).
STATUSES = ("pending", "delivering", "delivered", "failed", "dropped")
SETTLED = ("delivered", "failed", "dropped")


def _time(v: Any) -> Optional[datetime]:
    """An RFC 3339 time as fencegate writes it (`2026-01-02T03:04:05.678Z`)."""
    if not isinstance(v, str):
        return None
    try:
        return datetime.fromisoformat(v[:-1] + "+00:00" if v.endswith("Z") else v)
    except ValueError:
        return None


def _int(v: Any) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _str(v: Any) -> Optional[str]:
    return v if isinstance(v, str) else None


@dataclass(frozen=True)
class DeliveryStatus:
    """One queued message: the JSON of a queued 202 and of its status URL.
    `status` is pending, delivering, delivered, failed or dropped; `attempts`
    the attempts started; `unknown_outcomes` those whose outcome was unknown
    (sent again: the destination may have seen them twice); `last_status` and
    `last_error` the last attempt's HTTP status and error; `next_attempt_at` set
    while pending. Times are on fencegate's clock (UTC)."""

    route: str
    dedup_key: str
    lease: str
    epoch: int
    seq: int
    status: str
    attempts: int = 0
    unknown_outcomes: int = 0
    accepted_at: Optional[datetime] = None
    updated_at: Optional[datetime] = None
    next_attempt_at: Optional[datetime] = None
    last_status: Optional[int] = None
    last_error: Optional[str] = None
    location: str = ""
    #: The JSON object as fencegate sent it (fields this client does not know included).
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def settled(self) -> bool:
        """Delivered, failed or dropped: it is no longer waiting to be sent."""
        return self.status in SETTLED


def parse_delivery(obj: Any) -> DeliveryStatus:
    """A DeliveryStatus from the JSON object of a queued 202 or a status URL.
    Raises ValueError when it is not one (no route, key or status)."""
    if not isinstance(obj, dict):
        raise ValueError("a delivery status is a JSON object")
    route, key, status = obj.get("route"), obj.get("dedup_key"), obj.get("status")
    if not isinstance(route, str) or not isinstance(key, str) or not isinstance(status, str):
        raise ValueError("a delivery status has route, dedup_key and status")
    return DeliveryStatus(
        route=route, dedup_key=key, lease=_str(obj.get("lease")) or "", epoch=_int(obj.get("epoch")) or 0,
        seq=_int(obj.get("seq")) or 0, status=status, attempts=_int(obj.get("attempts")) or 0,
        unknown_outcomes=_int(obj.get("unknown_outcomes")) or 0,
        accepted_at=_time(obj.get("accepted_at")), updated_at=_time(obj.get("updated_at")),
        next_attempt_at=_time(obj.get("next_attempt_at")), last_status=_int(obj.get("last_status")),
        last_error=_str(obj.get("last_error")), location=_str(obj.get("location")) or "", raw=dict(obj))


class DeliveryError(Exception):
    """`wait_delivered` did not see the message delivered (one of the three below)."""


class NotDelivered(DeliveryError):
    """The message settled without being delivered: `status` is "failed" (the
    destination refused it, or the retries ran out) or "dropped" (an operator).
    `last_status`, `last_error`: its last attempt's. An operator may retry a
    failed one (admin API); nothing will happen to it otherwise."""

    def __init__(self, delivery: DeliveryStatus) -> None:
        self.delivery = delivery
        self.status = delivery.status
        self.last_status = delivery.last_status
        self.last_error = delivery.last_error
        why = []
        if delivery.last_status is not None:
            why.append(f"last status {delivery.last_status}")
        if delivery.last_error:
            why.append(delivery.last_error)
        suffix = f" ({'; '.join(why)})" if why else ""
        super().__init__(f"message {delivery.dedup_key!r} of route {delivery.route!r}: "
                         f"{delivery.status} after {delivery.attempts} attempt(s){suffix}")


class DeliveryTimeout(DeliveryError, TimeoutError):
    """The timeout passed with the message still pending or delivering (it
    still will be delivered): `delivery` is the last status seen (None when the
    status URL never answered)."""

    def __init__(self, location: str, timeout: float, delivery: Optional[DeliveryStatus],
                 last_problem: Optional[str] = None) -> None:
        self.location, self.timeout, self.delivery = location, timeout, delivery
        seen = f"still {delivery.status}" if delivery else f"no status ({last_problem or 'no answer'})"
        super().__init__(f"{location}: not delivered within {timeout:g} s: {seen}")


class DeliveryStatusError(DeliveryError):
    """The status URL refused the query: 401 token_missing, 403 token_invalid
    (not the token the message was accepted with), 404 delivery_not_found (no
    such message, or settled longer than `[dedup] ttl` ago and swept), or
    another answer that is not a status. `status`, `code` (fencegate's
    `X-Fencegate-Error`), `details` (its JSON error body)."""

    def __init__(self, location: str, status: int, code: Optional[str], details: Dict[str, Any]) -> None:
        self.location, self.status, self.code, self.details = location, status, code, details
        msg = details.get("message")
        super().__init__(f"{location}: {status} {code or ''}".rstrip() + (f": {msg}" if isinstance(msg, str) else ""))
