"""Typed outcomes for the SPEC §7 codes, each provoked at a real fencegate (the
TypeScript suite runs the same list)."""

from __future__ import annotations

import dataclasses
import re
import socket
import unittest
from datetime import timedelta
from typing import Dict, List, Tuple
from urllib.parse import urlsplit

from kit import REPO, Background, kit, wait_for

from fencegate_client import (
    ERROR_CODES,
    AlreadyDone,
    Delivered,
    Expired,
    InDoubt,
    InFlight,
    Invalid,
    KeyReused,
    NotSent,
    Outcome,
    Refused,
    Stale,
    Unavailable,
    Unreachable,
    parse_outcome,
)


def spec_codes() -> Dict[str, int]:
    """code -> status, from SPEC.md §7's table."""
    text = (REPO / "SPEC.md").read_text()
    section = text.split("## 7. Errors", 1)[1].split("\n## ", 1)[0]
    codes: Dict[str, int] = {}
    for line in section.splitlines():
        m = re.match(r"\|\s*(\d{3})\s*\|(.*?)\|", line)
        if m:
            for code in re.findall(r"`([a-z_]+)`", m.group(2)):
                codes[code] = int(m.group(1))
    return codes


def raw(head: str, body: bytes = b"", shut: bool = False) -> Outcome:
    """Sends one hand-made request to fencegate; parses its answer like `call` does.
    `shut`: half-close after sending (a body that breaks off)."""
    u = urlsplit(kit().info["gateway"])
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall((head + "Connection: close\n").replace("\n", "\r\n").encode() + b"\r\n" + body)
        if shut:
            s.shutdown(socket.SHUT_WR)
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head_bytes, payload = data.split(b"\r\n\r\n", 1)
    lines = head_bytes.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return parse_outcome(int(lines[0].split()[1]), headers, payload)


class Outcomes(unittest.TestCase):
    def test_every_spec_code_has_an_outcome(self) -> None:
        codes = spec_codes()
        self.assertGreaterEqual(len(codes), 24)
        self.assertEqual(sorted(codes), sorted(ERROR_CODES))
        for code, status in codes.items():
            out = parse_outcome(status, {"X-Fencegate-Error": code}, b'{"error":"%s"}' % code.encode())
            self.assertIs(type(out), ERROR_CODES[code])
            self.assertEqual(out.code, code)

    def test_stale_expired_refused(self) -> None:
        k = kit()
        leases, gate = k.leases(), k.gateway()
        lease = leases.acquire("codes", "worker", ttl_ms=30000)
        newer = leases.renew(lease)
        self.assertIsInstance(gate.call(newer, "POST", "/codes/a", json={}), Delivered)
        out = gate.call(lease, "POST", "/codes/a", json={})
        self.assertIsInstance(out, Stale)
        self.assertEqual((out.status, out.code, out.details.get("lease")), (409, "epoch_stale", "codes"))
        out = gate.call(dataclasses.replace(newer, token="0" * 64), "POST", "/codes/a", json={})
        self.assertIsInstance(out, Refused)
        self.assertEqual((out.status, out.code), (403, "token_invalid"))
        self.assertTrue(out.must_stop)
        out = gate.call(dataclasses.replace(newer, epoch=newer.epoch + 10), "POST", "/codes/a", json={})
        self.assertEqual((type(out), out.status, out.code), (Refused, 403, "epoch_unknown"))
        released = leases.release(newer)
        out = gate.call(dataclasses.replace(newer, epoch=released), "POST", "/codes/a", json={})
        self.assertEqual((type(out), out.status, out.code), (Refused, 403, "epoch_invalid"))

        short = leases.acquire("expiry", "worker", ttl_ms=1500)
        # Past its end on the earliest estimate of the store's clock: over for
        # fencegate too. The client itself refuses to send it...
        wait_for(lambda: short.clock.earliest() > short.expires_at + timedelta(milliseconds=100),
                 "the lease's end", timeout=10)
        out = gate.call(short, "POST", "/expiry/a", json={})
        self.assertIsInstance(out, NotSent)
        self.assertTrue(out.must_stop)
        # ...and a worker whose idea of the expiry is wrong is refused by fencegate.
        wrong = dataclasses.replace(short, expires_at=short.expires_at + timedelta(hours=1))
        out = gate.call(wrong, "POST", "/expiry/a", json={})
        self.assertIsInstance(out, Expired)
        self.assertEqual((out.status, out.code), (409, "lease_expired"))
        self.assertEqual(k.origin_requests("/expiry/"), [])

    def test_invalid_requests(self) -> None:
        k = kit()
        gate = k.gateway()
        lease = k.leases().acquire("tiny", "worker", ttl_ms=30000)
        out = gate.call(lease, "POST", "/nowhere/a", json={})
        self.assertEqual((type(out), out.status, out.code), (Invalid, 404, "route_not_found"))
        out = gate.call(lease, "POST", "/tiny/a", body=b"x" * 100)
        self.assertEqual((type(out), out.status, out.code), (Invalid, 413, "body_too_large"))
        self.assertEqual(out.details.get("limit_bytes"), 64)
        # What `call` cannot send (it always sets a valid epoch, token and key),
        # sent by hand and parsed by the same code.
        e, t = lease.epoch, lease.token
        cases: List[Tuple[str, bytes, bool, int, str]] = [  # head, body, half-close, status, code
            ("POST /tiny/a HTTP/1.1\nHost: x\nContent-Length: 0\n", b"", False, 428, "epoch_missing"),
            ("POST /tiny/a HTTP/1.1\nHost: x\nX-Lease-Epoch: +1\nContent-Length: 0\n", b"", False, 400,
             "epoch_malformed"),
            (f"POST /tiny/a HTTP/1.1\nHost: x\nX-Lease-Epoch: {e}\nContent-Length: 0\n", b"", False, 401,
             "token_missing"),
            (f"POST /tiny/a HTTP/1.1\nHost: x\nX-Lease-Epoch: {e}\nX-Lease-Token: {t}\nIdempotency-Key: a b\n"
             "Content-Length: 0\n", b"", False, 400, "dedup_key_malformed"),
            (f"GET /tiny/a HTTP/1.1\nHost: x\nX-Lease-Epoch: {e}\nX-Lease-Token: {t}\nConnection: Upgrade\n"
             "Upgrade: websocket\n", b"", False, 501, "upgrade_unsupported"),
            (f"POST /tiny/a HTTP/1.1\nHost: x\nX-Lease-Epoch: {e}\nX-Lease-Token: {t}\nContent-Length: 10\n",
             b"abc", True, 400, "body_malformed"),
        ]
        for head, body, shut, status, code in cases:
            out = raw(head, body, shut)
            want = Refused if code == "token_missing" else Invalid
            self.assertEqual((type(out), out.status, out.code), (want, status, code), head)
        self.assertEqual(k.origin_requests("/tiny/a"), [])
        k.leases().release(lease)

    def test_refused_by_hand(self) -> None:
        lease = kit().leases().acquire("slow", "hand", ttl_ms=30000)
        out = raw(f"POST /slow/a HTTP/1.1\nHost: x\nX-Lease-Epoch: {lease.epoch}\nX-Lease-Token: {lease.token}\n"
                  "X-Fencegate-Peer: someone\nContent-Length: 0\n")
        self.assertEqual((type(out), out.status, out.code), (Refused, 403, "peer_unauthorized"))
        # The body does not come within the route's timeout (800 ms).
        out = raw(f"POST /slow/a HTTP/1.1\nHost: x\nX-Lease-Epoch: {lease.epoch}\nX-Lease-Token: {lease.token}\n"
                  "Content-Length: 10\n", b"abc", shut=False)
        self.assertEqual((type(out), out.status, out.code), (Invalid, 408, "body_timeout"))
        kit().leases().release(lease)

    def test_dedup_outcomes(self) -> None:
        k = kit()
        gate = k.gateway()
        lease = k.leases().acquire("inflight", "worker", ttl_ms=30000)
        # dedup_key_reused: one key, two different requests.
        self.assertIsInstance(gate.call(lease, "POST", "/inflight/k", json={"a": 1}, idempotency_key="reused"),
                              Delivered)
        out = gate.call(lease, "POST", "/inflight/k", json={"a": 2}, idempotency_key="reused")
        self.assertEqual((type(out), out.status, out.code), (KeyReused, 422, "dedup_key_reused"))
        # dedup_in_flight: the first is still at the destination. With one attempt
        # it is returned; with more, `call` retries until the record answers.
        hold = {"X-Test-Hold": "inflight-a"}
        first = Background(lambda: gate.call(lease, "POST", "/inflight/a", json={}, headers=hold,
                                             idempotency_key="inflight-a"))
        wait_for(lambda: k.origin_held().get("inflight-a"), "the first request at the origin")
        out = gate.call(lease, "POST", "/inflight/a", json={}, headers=hold, idempotency_key="inflight-a",
                        max_attempts=1)
        self.assertEqual((type(out), out.status, out.code), (InFlight, 409, "dedup_in_flight"))
        seen: List[Outcome] = []

        def release_first(o: Outcome, delay: float) -> None:
            seen.append(o)
            k.origin_release("inflight-a")

        out = gate.call(lease, "POST", "/inflight/a", json={}, headers=hold, idempotency_key="inflight-a",
                        max_attempts=50, on_retry=release_first)
        self.assertIsInstance(seen[0], InFlight)
        self.assertIsInstance(out, Delivered, out)
        self.assertTrue(out.replayed)
        original = first.result()
        self.assertIsInstance(original, Delivered)
        self.assertFalse(original.replayed)
        self.assertEqual(out.body, original.body)
        self.assertEqual(len(k.origin_requests("/inflight/a")), 1)
        k.leases().release(lease)

        # dedup_done: delivered, the answer too large to keep (max_replay_bytes 16).
        tiny = k.leases().acquire("tiny", "worker", ttl_ms=30000, wait=True, wait_timeout=20)
        big = {"X-Test-Size": "100"}
        out = gate.call(tiny, "POST", "/tiny/big", json={}, headers=big, idempotency_key="big")
        self.assertEqual((type(out), len(out.body)), (Delivered, 100))
        out = gate.call(tiny, "POST", "/tiny/big", json={}, headers=big, idempotency_key="big")
        self.assertIsInstance(out, AlreadyDone)
        self.assertEqual((out.status, out.code, out.upstream_status), (409, "dedup_done", 200))
        self.assertEqual(len(k.origin_requests("/tiny/big")), 1)
        k.leases().release(tiny)

    def test_in_doubt_outcomes(self) -> None:
        k = kit()
        gate = k.gateway()
        # upstream_timeout (route timeout 800 ms), then dedup_in_doubt: never retried.
        lease = k.leases().acquire("slow", "worker", ttl_ms=30000, wait=True, wait_timeout=20)
        hold = {"X-Test-Hold": "slow-a"}
        out = gate.call(lease, "POST", "/slow/a", json={}, headers=hold, idempotency_key="slow-a")
        self.assertEqual((type(out), out.status, out.code, out.attempts), (InDoubt, 504, "upstream_timeout", 1))
        out = gate.call(lease, "POST", "/slow/a", json={}, headers=hold, idempotency_key="slow-a")
        self.assertEqual((type(out), out.status, out.code, out.attempts), (InDoubt, 409, "dedup_in_doubt", 1))
        k.origin_release("slow-a")
        self.assertEqual(len(k.origin_requests("/slow/a")), 1)
        k.leases().release(lease)

        # drain_aborted: an epoch-1 request still at the destination when epoch 2's
        # first request arrives; the drain (300 ms) gives up on it.
        old = k.leases().acquire("drain", "worker", ttl_ms=30000)
        first = Background(lambda: gate.call(old, "POST", "/drain/a", json={},
                                             headers={"X-Test-Hold": "drain-a"}, idempotency_key="drain-a"))
        wait_for(lambda: k.origin_held().get("drain-a"), "the epoch-1 request at the origin")
        new = k.leases().renew(old)
        out = gate.call(new, "POST", "/drain/b", json={}, idempotency_key="drain-b")
        self.assertIsInstance(out, Delivered)
        aborted = first.result()
        self.assertEqual((type(aborted), aborted.status, aborted.code, aborted.attempts),
                         (InDoubt, 504, "drain_aborted", 1))
        # Its key is now in doubt: the same request again is not forwarded.
        out = gate.call(new, "POST", "/drain/a", json={}, idempotency_key="drain-a")
        self.assertEqual((type(out), out.status, out.code), (InDoubt, 409, "dedup_in_doubt"))
        k.origin_release("drain-a")
        self.assertEqual([r["path"] for r in k.origin_requests("/drain/")], ["/drain/a", "/drain/b"])
        k.leases().release(new)

    def test_retried_outcomes(self) -> None:
        k = kit()
        gate = k.gateway()
        # upstream_unreachable: nothing was sent; retried with the same key.
        dead = k.leases().acquire("dead", "worker", ttl_ms=30000)
        seen: List[Tuple[Outcome, float]] = []
        out = gate.call(dead, "POST", "/dead/a", json={}, max_attempts=3,
                        on_retry=lambda o, d: seen.append((o, d)))
        self.assertEqual((type(out), out.status, out.code, out.attempts), (Unreachable, 502, "upstream_unreachable", 3))
        self.assertEqual([type(o) for o, _ in seen], [Unreachable, Unreachable])

        # store_unavailable: fencegate cannot reach the store to judge a new epoch;
        # `call` waits Retry-After and retries, and the store is back by then.
        k.relay_mode("gate", "blackhole")
        try:
            lease = k.leases().acquire("store", "worker", ttl_ms=30000)
            seen.clear()

            def store_back(o: Outcome, delay: float) -> None:
                seen.append((o, delay))
                k.relay_mode("gate", "pass")

            out = gate.call(lease, "POST", "/store/a", json={}, on_retry=store_back)
        finally:
            k.relay_mode("gate", "pass")
        self.assertEqual(len(seen), 1)
        first, delay = seen[0]
        self.assertIsInstance(first, Unavailable)
        assert isinstance(first, Unavailable)
        self.assertEqual((first.status, first.code, first.retry_after), (503, "store_unavailable", 1.0))
        self.assertEqual(delay, 1.0, "waited Retry-After")
        self.assertIsInstance(out, Delivered, out)
        self.assertEqual(out.attempts, 2)
        self.assertEqual(len(k.origin_requests("/store/")), 1)
        k.leases().release(lease)
        k.leases().release(dead)


if __name__ == "__main__":
    unittest.main()
