"""The real parts under test (clients/testkit/testkit.py), started once per test run."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, TypeVar

import boto3
from botocore.config import Config

from fencegate_client import GatewayClient, LeaseClient

REPO = Path(__file__).resolve().parents[3]
TESTKIT = REPO / "clients" / "testkit" / "testkit.py"
T = TypeVar("T")


class Kit:
    def __init__(self) -> None:
        python = os.environ.get("FENCEGATE_TEST_PYTHON", sys.executable)
        self.proc = subprocess.Popen([python, str(TESTKIT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            raise RuntimeError("the testkit did not start (see its stderr)")
        self.info: Dict[str, Any] = json.loads(line)
        atexit.register(self.stop)

    def stop(self) -> None:
        if self.proc.poll() is None:
            if self.proc.stdin:
                self.proc.stdin.close()  # the testkit stops what it started
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.proc.stdout:
            self.proc.stdout.close()

    # ---- the control API

    def control(self, method: str, path: str) -> Any:
        req = urllib.request.Request(self.info["control"] + path, method=method,
                                     data=b"" if method == "POST" else None)
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.load(r)

    def origin_requests(self, path: str) -> List[Dict[str, Any]]:
        return self.control("GET", f"/origin/requests?path={path}")

    def origin_held(self) -> Dict[str, int]:
        return self.control("GET", "/origin/held")

    def origin_release(self, tag: str) -> None:
        self.control("POST", f"/origin/release?tag={tag}")

    def relay(self, name: str) -> Dict[str, Any]:
        return self.control("GET", f"/relay/{name}")

    def relay_mode(self, name: str, mode: str) -> None:
        self.control("POST", f"/relay/{name}/mode?mode={mode}")

    def relay_arm(self, name: str, match: str, conditional: bool = False, hold: bool = False,
                  drop: bool = False) -> None:
        q = f"match={match}&conditional={int(conditional)}&hold={int(hold)}&drop={int(drop)}"
        self.control("POST", f"/relay/{name}/arm?{q}")

    def relay_release(self, name: str) -> None:
        self.control("POST", f"/relay/{name}/release")

    # ---- clients

    def s3(self, via_relay: bool = False) -> Any:
        return boto3.client(
            "s3", endpoint_url=self.info["s3_relay" if via_relay else "s3"], region_name="us-east-1",
            aws_access_key_id="test", aws_secret_access_key="test",
            config=Config(s3={"addressing_style": "path"}, connect_timeout=1, read_timeout=2,
                          retries={"mode": "standard", "max_attempts": 2},
                          request_checksum_calculation="when_required",
                          response_checksum_validation="when_required"))

    def leases(self, via_relay: bool = False) -> LeaseClient:
        return LeaseClient(self.s3(via_relay), self.info["bucket"], self.info["prefix"],
                           grace_ms=self.info["grace_ms"])

    def gateway(self, via_relay: bool = False, **kw: Any) -> GatewayClient:
        return GatewayClient(self.info["gateway_relay" if via_relay else "gateway"], **kw)


_kit: Optional[Kit] = None
_lock = threading.Lock()


def kit() -> Kit:
    global _kit
    with _lock:
        if _kit is None:
            _kit = Kit()
        return _kit


def wait_for(cond: Callable[[], T], what: str, timeout: float = 10.0) -> T:
    """Polls `cond` until it returns something truthy; fails after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


class Background(threading.Thread):
    """Runs `fn` in a thread; `result()` joins and returns its value or raises."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.value: Any = None
        self.error: Optional[BaseException] = None
        self.start()

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as e:  # noqa: BLE001
            self.error = e

    def result(self, timeout: float = 30.0) -> Any:
        self.join(timeout)
        if self.is_alive():
            raise AssertionError("background call did not finish")
        if self.error is not None:
            return self.error
        return self.value
