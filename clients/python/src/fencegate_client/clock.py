"""The lease store's clock, estimated from the `Date` header of its responses (SPEC §2)."""

from __future__ import annotations

import email.utils
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, List, Optional

ONE_SECOND = timedelta(seconds=1)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class StoreClock:
    """The store's clock, estimated from the `Date` header of store responses.

    `Date` has one-second resolution and is truncated: when a response arrives,
    the store's clock reads somewhere in [Date, Date + 1 s) (plus transit). Which
    end to use depends on the question, and the answer must be the safe one:

    - "has MY tenure expired?"        -> latest():   the holder stops early;
    - "has SOMEONE ELSE's expired?"   -> earliest(): a contender takes over late.

    Before any response has been seen, the local clock stands in (offset 0).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._offset: Optional[timedelta] = None  # Date - local arrival time
        self._listeners: List[Callable[[], None]] = []

    @property
    def known(self) -> bool:
        with self._lock:
            return self._offset is not None

    def observe(self, date_header: Optional[str], received: Optional[datetime] = None) -> None:
        """Feeds one response's `Date` header, received at `received` (default: now)."""
        if not date_header:
            return
        try:
            date = email.utils.parsedate_to_datetime(date_header)
        except (TypeError, ValueError, IndexError):
            return
        if date is None:
            return
        if date.tzinfo is None:
            date = date.replace(tzinfo=timezone.utc)
        with self._lock:
            offset = date - (received or utcnow())
            changed, self._offset = offset != self._offset, offset
            listeners = list(self._listeners) if changed else []
        for fn in listeners:
            fn()

    def subscribe(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Calls `fn` whenever the estimate changes; returns the unsubscribe function."""
        with self._lock:
            self._listeners.append(fn)

        def unsubscribe() -> None:
            with self._lock:
                if fn in self._listeners:
                    self._listeners.remove(fn)

        return unsubscribe

    def earliest(self) -> datetime:
        """The earliest the store's clock may read now."""
        with self._lock:
            off = self._offset or timedelta(0)
        return utcnow() + off

    def latest(self) -> datetime:
        """The latest the store's clock may read now (Date + 1 s resolution)."""
        with self._lock:
            off = self._offset
        return utcnow() + (off + ONE_SECOND if off is not None else timedelta(0))

    def seconds_until(self, store_time: datetime) -> float:
        """Seconds from now until the store's clock may first read `store_time`
        (on the latest estimate, the safe side for a holder)."""
        return (store_time - self.latest()).total_seconds()

    def monotonic_deadline(self, store_time: datetime) -> float:
        """`time.monotonic()` value at which the store's clock may first read
        `store_time` (latest estimate): immune to later local clock steps."""
        return time.monotonic() + self.seconds_until(store_time)

    def attach(self, s3: Any) -> None:
        """Feeds every response of a boto3 S3 client (errors included) into the estimate."""

        def after_call(http_response: Any = None, **_kwargs: Any) -> None:
            if http_response is not None:
                self.observe(http_response.headers.get("date"))

        s3.meta.events.register("after-call.s3", after_call)
