"""A lease we hold: one epoch with its token and expiry (`Lease`), and what
renews and releases it (`Renewer`: a LeaseClient). The client (lease.py) makes
Leases and Tenures; a Tenure (tenure.py) needs only this module, not the client."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Dict, Optional, Protocol

from .clock import StoreClock


@dataclass(frozen=True)
class Lease:
    """One epoch of a lease that we hold. `expires_at` is on the store's clock;
    `clock` is the estimate it is judged with (`expired()`, `seconds_left()`)."""

    name: str
    epoch: int
    token: str = field(repr=False)
    holder: str
    ttl_ms: int
    expires_at: datetime
    clock: StoreClock = field(repr=False, compare=False)
    # True when the create's answer was not a plain success (lost, a 412 after
    # an SDK retry, a 5xx) and reading the object back decided that we won.
    reconciled: bool = False

    def seconds_left(self) -> float:
        """Seconds until expiry, on the latest estimate of the store's clock."""
        return self.clock.seconds_until(self.expires_at)

    def expired(self) -> bool:
        return self.seconds_left() <= 0

    def as_json(self) -> Dict[str, Any]:
        return {"lease": self.name, "epoch": self.epoch, "token": self.token, "holder": self.holder,
                "expires_at": _iso(self.expires_at)}


def _iso(t: datetime) -> str:
    return t.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class Renewer(Protocol):
    """What a Tenure renews and releases its lease with (a LeaseClient)."""

    def renew(self, current: Lease, ttl_ms: Optional[int] = None) -> Lease: ...

    def release(self, current: Lease) -> int: ...
