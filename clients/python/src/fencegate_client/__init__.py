"""fencegate's worker client: leases on an S3 lease store (SPEC §2) and calls
through fencegate (SPEC §3) with typed outcomes (SPEC §7).

    import boto3
    from fencegate_client import LeaseClient, GatewayClient

    leases = LeaseClient(boto3.client("s3"), bucket="leases", grace_ms=2000)
    gate = GatewayClient("http://127.0.0.1:8080")
    with leases.hold("billing", holder="worker-1", ttl_ms=30000, margin_ms=2000) as tenure:
        outcome = gate.call(tenure, "POST", "/billing/charges", json={"amount": 5},
                            idempotency_key="charge-42")
        if outcome.must_stop: ...

A queued route (SPEC §11) answers `Queued`; `gate.wait_delivered(outcome)` polls
its status URL until it is delivered (or raises NotDelivered / DeliveryTimeout).
"""

from .clock import StoreClock
from .delivery import (
    DeliveryError,
    DeliveryStatus,
    DeliveryStatusError,
    DeliveryTimeout,
    NotDelivered,
    parse_delivery,
)
from .errors import LeaseError, LeaseHeld, LeaseLost, TenureEnded
from .gateway import (
    ERROR_CODES,
    NO_KEY,
    AlreadyDone,
    Delivered,
    DeliveryDropped,
    DeliveryFailed,
    Expired,
    GatewayClient,
    InDoubt,
    InFlight,
    Invalid,
    KeyReused,
    NoResponse,
    NotSent,
    Outcome,
    Queued,
    Refused,
    Stale,
    Unavailable,
    UnknownError,
    Unreachable,
    parse_outcome,
    parse_retry_after,
)
from .held import Lease
from .lease import EpochObject, LeaseClient, parse_epoch_object, token_sha256
from .tenure import Tenure

__version__ = "0.1.0"

__all__ = [
    "AlreadyDone", "Delivered", "DeliveryDropped", "DeliveryError", "DeliveryFailed", "DeliveryStatus",
    "DeliveryStatusError", "DeliveryTimeout", "ERROR_CODES", "EpochObject", "Expired", "GatewayClient",
    "InDoubt", "InFlight", "Invalid", "KeyReused", "Lease", "LeaseClient", "LeaseError", "LeaseHeld",
    "LeaseLost", "NO_KEY", "NoResponse", "NotDelivered", "NotSent", "Outcome", "Queued", "Refused", "Stale",
    "StoreClock", "Tenure", "TenureEnded", "Unavailable", "UnknownError", "Unreachable", "parse_delivery",
    "parse_epoch_object", "parse_outcome", "parse_retry_after", "token_sha256",
]
