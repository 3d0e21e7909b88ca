"""The errors of the lease protocol, and the one a tenure raises when the work must stop."""

from __future__ import annotations

from datetime import datetime
from typing import Optional


class LeaseError(Exception):
    """The store refused an operation (credentials, bucket, a store that cannot
    fence), or the protocol gave up after MAX_ROUNDS attempts."""


class LeaseHeld(LeaseError):
    """Someone else holds the lease (a live acquire that is not ours)."""

    def __init__(self, lease: str, epoch: int, holder: Optional[str], expires_at: Optional[datetime]):
        self.lease, self.epoch, self.holder, self.expires_at = lease, epoch, holder, expires_at
        until = expires_at.isoformat() if expires_at else "?"
        super().__init__(f"lease {lease} is held by {holder!r} at epoch {epoch} until {until}")


class LeaseLost(LeaseError):
    """The lease is no longer ours: a newer epoch exists, or ours expired."""


class TenureEnded(LeaseError):
    """The work must stop: the tenure ended (`reason`: "deadline", "lost" or "closed")."""

    def __init__(self, lease: str, reason: str):
        self.lease, self.reason = lease, reason
        super().__init__(f"tenure of lease {lease} ended ({reason}): stop the work")
