"""A tenure: a held lease that renews itself and says when the work must stop."""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime
from types import TracebackType
from typing import Callable, Optional, Type

from .errors import LeaseError, LeaseLost, TenureEnded
from .held import Lease, Renewer

log = logging.getLogger("fencegate_client")


class Tenure:
    """Holds a lease: renews it in the background and signals stop BEFORE it ends.

    The stop deadline is `expires_at - margin`, with `expires_at` judged on the
    latest estimate of the store's clock (so up to ~1 s earlier still): it runs on
    the monotonic clock, comes earlier when a newer estimate says so, and moves
    later only with a successful renewal. A renewal is attempted when half of the time to
    the deadline is left, and retried (every ≤ 1 s) until the deadline. The
    signal does not depend on the renewal returning: a watchdog fires it at the
    deadline even while a renewal hangs on an unreachable store.

    `margin` is the time the work needs to notice the signal and stop what it is
    doing (including actions that do not go through fencegate). fencegate itself
    refuses the epoch from `expires_at` on (409 lease_expired) and a newer one
    after the next epoch is admitted (409 epoch_stale).

    Reasons: "deadline" (renewal did not succeed in time), "lost" (a newer epoch
    exists or ours expired: someone else holds the lease), "closed" (`close()`).
    """

    def __init__(self, client: Renewer, lease: Lease, margin_ms: int = 2000,
                 on_stop: Optional[Callable[[str], None]] = None) -> None:
        if margin_ms < 0 or margin_ms >= lease.ttl_ms:
            raise ValueError("margin_ms must be in [0, ttl_ms)")
        self._client = client
        self._cond = threading.Condition()
        self._lease = lease
        self._released = False
        self.margin_ms = margin_ms
        self._margin = margin_ms / 1000.0
        self._on_stop = on_stop
        self._stop_at = self._deadline(lease)
        self._renew_at = self._halfway(self._stop_at)
        self._reason: Optional[str] = None
        self._renewing = False  # a renewal's create is on its way to the store
        self.stopped = threading.Event()
        self.stopped_at: Optional[datetime] = None  # latest store-clock estimate at the signal
        self.renewals = 0
        self.last_error: Optional[BaseException] = None
        # A newer estimate of the store's clock may bring the deadline forward.
        self._unsubscribe = lease.clock.subscribe(self._clock_moved)
        self._watchdog = threading.Thread(target=self._watch, daemon=True, name=f"tenure-{lease.name}-watchdog")
        self._renewer = threading.Thread(target=self._renew_loop, daemon=True, name=f"tenure-{lease.name}-renew")
        self._watchdog.start()
        self._renewer.start()

    # ---- what the work reads

    @property
    def lease(self) -> Lease:
        """The current epoch (it changes at each renewal: use it for every request)."""
        with self._cond:
            return self._lease

    @property
    def name(self) -> str:
        return self._lease.name

    @property
    def must_stop(self) -> bool:
        return self.stopped.is_set() or time.monotonic() >= self._stop_deadline()

    @property
    def stop_reason(self) -> Optional[str]:
        with self._cond:
            return self._reason

    def seconds_left(self) -> float:
        """Seconds until the work must stop (≤ 0: now)."""
        if self.stopped.is_set():
            return 0.0
        return self._stop_deadline() - time.monotonic()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Waits up to `timeout` seconds for the stop signal; True once it came."""
        return self.stopped.wait(timeout)

    def check(self) -> None:
        """Raises TenureEnded if the work must stop."""
        if self.must_stop:
            raise TenureEnded(self.name, self.stop_reason or "deadline")

    def holds_at_least(self, epoch: int, timeout: float) -> Optional[Lease]:
        """This tenure's lease if it holds `epoch` or a later one, waiting up to
        `timeout` seconds for a renewal on its way: a request sent with the
        epoch before the renewal is refused as stale (409 epoch_stale) once
        fencegate has seen the renewal's epoch, before the renewal has
        returned here. None: a newer epoch that is not this tenure's, or the
        work must stop."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            while self._lease.epoch < epoch and self._renewing and self._reason is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._reason is not None or self._lease.epoch < epoch:
                return None
            return self._lease

    # ---- the end

    def close(self, release: bool = True, timeout: Optional[float] = 10.0) -> Optional[int]:
        """Stops renewing (the work must stop) and, with `release`, releases the
        current epoch so that the next worker need not wait for expiry. Returns
        the release epoch, or None. Waits up to `timeout` s for a renewal in progress."""
        self._stop("closed")
        self._renewer.join(timeout)
        if not release or self._renewer.is_alive() or self.stop_reason == "lost":
            return None
        with self._cond:
            if self._released:
                return None
            lease, self._released = self._lease, True
        if lease.expired():
            return None
        return self._client.release(lease)

    def __enter__(self) -> "Tenure":
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        try:
            self.close()
        except LeaseError as e:
            if exc is None:
                raise
            log.warning("releasing lease %s failed: %s", self.name, e)

    # ---- inside

    def _deadline(self, lease: Lease) -> float:
        return lease.clock.monotonic_deadline(lease.expires_at) - self._margin

    @staticmethod
    def _halfway(stop_at: float) -> float:
        now = time.monotonic()
        return now + max(0.0, stop_at - now) / 2

    def _stop_deadline(self) -> float:
        with self._cond:
            return self._stop_at

    def _clock_moved(self) -> None:
        with self._cond:
            if self._reason is None:
                fresh = self._deadline(self._lease)
                if fresh < self._stop_at:
                    self._stop_at = fresh
                    self._cond.notify_all()

    def _stop(self, reason: str) -> None:
        with self._cond:
            if self._reason is not None:
                return
            self._reason = reason
            self.stopped_at = self._lease.clock.latest()
            self.stopped.set()
            self._cond.notify_all()
        self._unsubscribe()
        log.info("tenure of lease %s: stop (%s)", self._lease.name, reason)
        if self._on_stop is not None:
            try:
                self._on_stop(reason)
            except Exception:  # noqa: BLE001 - a callback's failure must not kill the watchdog
                log.exception("on_stop callback failed")

    def _watch(self) -> None:
        with self._cond:
            while self._reason is None:
                left = self._stop_at - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._reason is not None:
                return
        self._stop("deadline")

    def _renew_loop(self) -> None:
        while True:
            with self._cond:
                if self._reason is not None:
                    return
                left = self._renew_at - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                current = self._lease
                self._renewing = True
            try:
                new = self._client.renew(current)
            except LeaseLost as e:
                self.last_error = e
                with self._cond:
                    self._renewing = False
                self._stop("lost")
                return
            except Exception as e:  # noqa: BLE001 - the store is unreachable or failing: retry until the deadline
                self.last_error = e
                log.info("renewing lease %s failed: %s", current.name, e)
                with self._cond:
                    self._renewing = False
                    self._cond.notify_all()
                    left = self._stop_at - time.monotonic()
                    self._renew_at = time.monotonic() + min(1.0, max(0.05, left / 4))
                continue
            stop_at = self._deadline(new)
            with self._cond:
                late = self._reason is not None
                self._renewing = False
                self._cond.notify_all()
                self._lease = new
                if not late:
                    self._stop_at = stop_at
                    self._renew_at = self._halfway(stop_at)
                    self.renewals += 1
                    self._cond.notify_all()
                else:
                    self._released = True
            if late:
                # The renewal came back after the stop: nobody works under the new
                # epoch, so free it now rather than make the next worker wait.
                try:
                    self._client.release(new)
                except Exception as e:  # noqa: BLE001
                    log.info("releasing the late renewal of %s failed: %s", new.name, e)
                return
            log.info("renewed lease %s: epoch %d", new.name, new.epoch)
