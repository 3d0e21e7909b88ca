"""A queued route (SPEC §11) at a real fencegate: `call` returns its 202 as
`Queued`, `wait_delivered` polls the status URL (the TypeScript suite runs the
same list). The route `queued` has its own lease; one message of a lease is
delivered at a time, so these tests leave its queue empty."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import unittest
import urllib.request
from urllib.parse import quote

from kit import kit, wait_for

from fencegate_client import (
    ERROR_CODES,
    Delivered,
    DeliveryDropped,
    DeliveryFailed,
    DeliveryStatus,
    DeliveryStatusError,
    DeliveryTimeout,
    NotDelivered,
    Queued,
    parse_outcome,
)


def admin_drop(key: str) -> int:
    k = kit()
    req = urllib.request.Request(f"{k.info['admin']}/v1/deliveries/queued/{quote(key, safe='')}/drop",
                                 method="POST", data=b"",
                                 headers={"Authorization": f"Bearer {k.info['admin_token']}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return int(r.status)


class QueuedDelivery(unittest.TestCase):
    def test_accepted_then_delivered(self) -> None:
        k = kit()
        gate = k.gateway()
        lease = k.leases().acquire("queued", "worker", ttl_ms=30000, wait=True, wait_timeout=20)
        out = gate.call(lease, "POST", "/queued/orders", json={"order": 1}, idempotency_key="q-1", queued=True)
        self.assertIsInstance(out, Queued, out)
        assert isinstance(out, Queued)
        self.assertEqual((out.kind, out.status, out.code, out.must_stop, out.retried),
                         ("queued", 202, None, False, False))
        self.assertEqual(out.headers["x-fencegate-delivery"], "queued")
        self.assertEqual(out.dedup_key, "q-1")
        self.assertEqual(out.location, "/.fencegate/deliveries/queued/q-1")
        self.assertEqual(out.status_url, k.info["gateway"] + out.location)
        self.assertNotIn(lease.token, repr(out), "the token is not shown")
        d = out.delivery
        assert d is not None
        self.assertEqual((d.route, d.dedup_key, d.lease, d.epoch, d.status, d.location),
                         ("queued", "q-1", "queued", lease.epoch, "pending", out.location))
        self.assertIsNotNone(d.accepted_at)

        got = gate.wait_delivered(out, timeout=20)
        self.assertIsInstance(got, DeliveryStatus)
        self.assertEqual((got.status, got.attempts, got.last_status, got.last_error, got.settled),
                         ("delivered", 1, 200, None, True))
        sent = k.origin_requests("/queued/orders")
        self.assertEqual([json.loads(r["body"]) for r in sent], [{"order": 1}])
        self.assertFalse(sent[0]["token_forwarded"])

        # The same key again, once delivered: the destination's stored answer.
        again = gate.call(lease, "POST", "/queued/orders", json={"order": 1}, idempotency_key="q-1", queued=True)
        self.assertIsInstance(again, Delivered, again)
        assert isinstance(again, Delivered)
        self.assertTrue(again.replayed)
        self.assertEqual(again.json()["seq"], sent[0]["seq"])
        self.assertEqual(len(k.origin_requests("/queued/orders")), 1)
        k.leases().release(lease)

    def test_without_the_flag_and_the_status_url_by_hand(self) -> None:
        k = kit()
        gate = k.gateway()
        lease = k.leases().acquire("queued", "worker", ttl_ms=30000, wait=True, wait_timeout=20)
        # Without queued=True the 202 is a Queued too (the header says so), never Delivered.
        out = gate.call(lease, "POST", "/queued/plain", json={"n": 2}, idempotency_key="q-2/x")
        self.assertIsInstance(out, Queued, out)
        assert isinstance(out, Queued)
        self.assertEqual(out.location, "/.fencegate/deliveries/queued/q-2%2Fx")
        # The status URL with the token the message was accepted with: the URL,
        # its path (under the client's base URL), or the Lease.
        self.assertEqual(gate.wait_delivered(out.status_url, timeout=20, token=lease.token).status, "delivered")
        self.assertEqual(gate.wait_delivered(out.location, timeout=20, token=lease).status, "delivered")
        # A renewed epoch has another token: the Queued keeps the one it was accepted with.
        newer = k.leases().renew(lease)
        self.assertEqual(gate.wait_delivered(out, timeout=20).dedup_key, "q-2/x")
        with self.assertRaises(DeliveryStatusError) as e:
            gate.wait_delivered(out.status_url, timeout=20, token=newer)
        self.assertEqual((e.exception.status, e.exception.code), (403, "token_invalid"))
        with self.assertRaises(DeliveryStatusError) as e:
            gate.wait_delivered(out.status_url, timeout=20)
        self.assertEqual((e.exception.status, e.exception.code), (401, "token_missing"))
        with self.assertRaises(DeliveryStatusError) as e:
            gate.wait_delivered("/.fencegate/deliveries/queued/nothing-here", timeout=20, token=newer)
        self.assertEqual((e.exception.status, e.exception.code), (404, "delivery_not_found"))
        with self.assertRaises(TypeError):
            gate.wait_delivered(parse_outcome(200, {}, b""), timeout=1)  # type: ignore[arg-type]
        k.leases().release(newer)

    def test_held_timeout_dropped_and_failed(self) -> None:
        k = kit()
        gate = k.gateway()
        lease = k.leases().acquire("queued", "worker", ttl_ms=60000, wait=True, wait_timeout=20)
        # The head is held at the destination: still delivering when the timeout passes.
        head = gate.call(lease, "POST", "/queued/held", json={}, headers={"X-Test-Hold": "q-held"},
                         idempotency_key="q-held", queued=True)
        assert isinstance(head, Queued), head
        wait_for(lambda: k.origin_held().get("q-held"), "the head at the destination")
        t0 = time.monotonic()
        with self.assertRaises(DeliveryTimeout) as e:
            gate.wait_delivered(head, timeout=0.5)
        self.assertLess(time.monotonic() - t0, 5)
        self.assertIsInstance(e.exception, TimeoutError)
        assert e.exception.delivery is not None
        self.assertEqual((e.exception.delivery.status, e.exception.delivery.attempts), ("delivering", 1))
        # A retry of its key meanwhile: 202 again.
        again = gate.call(lease, "POST", "/queued/held", json={}, headers={"X-Test-Hold": "q-held"},
                          idempotency_key="q-held")
        self.assertIsInstance(again, Queued, again)
        assert isinstance(again, Queued) and again.delivery is not None
        self.assertEqual(again.delivery.status, "delivering")

        # Behind it, a message waits (pending); an operator drops it.
        behind = gate.call(lease, "POST", "/queued/behind", json={}, idempotency_key="q-behind", queued=True)
        assert isinstance(behind, Queued), behind
        self.assertEqual(admin_drop("q-behind"), 200)
        with self.assertRaises(NotDelivered) as nd:
            gate.wait_delivered(behind, timeout=20)
        self.assertEqual((nd.exception.status, nd.exception.delivery.attempts), ("dropped", 0))
        self.assertIn("dropped", str(nd.exception))
        out = gate.call(lease, "POST", "/queued/behind", json={}, idempotency_key="q-behind")
        self.assertEqual((type(out), out.status, out.code), (DeliveryDropped, 409, "delivery_dropped"))

        k.origin_release("q-held")
        self.assertEqual(gate.wait_delivered(head, timeout=20).status, "delivered")

        # The destination refuses it (a 4xx other than 408, 409, 425, 429): failed at once.
        bad = gate.call(lease, "POST", "/queued/bad", json={}, headers={"X-Test-Status": "400"},
                        idempotency_key="q-400", queued=True)
        assert isinstance(bad, Queued), bad
        with self.assertRaises(NotDelivered) as nd:
            gate.wait_delivered(bad, timeout=20)
        self.assertEqual((nd.exception.status, nd.exception.last_status), ("failed", 400))
        self.assertIsNotNone(nd.exception.last_error)
        out = gate.call(lease, "POST", "/queued/bad", json={}, headers={"X-Test-Status": "400"},
                        idempotency_key="q-400")
        self.assertIsInstance(out, DeliveryFailed, out)
        assert isinstance(out, DeliveryFailed)
        self.assertEqual((out.status, out.code, out.upstream_status), (409, "delivery_failed", 400))
        paths = [r["path"] for r in k.origin_requests("/queued/") if r["path"].startswith(("/queued/held",
                 "/queued/behind", "/queued/bad"))]
        self.assertEqual(paths, ["/queued/held", "/queued/bad"], "the dropped one was never sent")
        k.leases().release(lease)

    def test_queued_flag_on_a_direct_route_warns(self) -> None:
        k = kit()
        lease = k.leases().acquire("codes", "queued-flag", ttl_ms=30000, wait=True, wait_timeout=20)
        with self.assertLogs("fencegate_client", logging.WARNING) as logs:
            out = k.gateway().call(lease, "POST", "/codes/direct", json={}, queued=True)
        self.assertIsInstance(out, Delivered, out)
        self.assertIn("not queued", logs.output[0])
        k.leases().release(lease)

    def test_parsing(self) -> None:
        self.assertIs(ERROR_CODES["delivery_failed"], DeliveryFailed)
        self.assertIs(ERROR_CODES["delivery_dropped"], DeliveryDropped)
        body = json.dumps({"route": "r", "dedup_key": "k", "lease": "l", "epoch": 3, "seq": 9, "status": "pending",
                           "attempts": 0, "unknown_outcomes": 0, "accepted_at": "2026-01-02T03:04:05.678Z",
                           "updated_at": "2026-01-02T03:04:05.678Z", "next_attempt_at": None,
                           "last_status": None, "last_error": None, "location": "/.fencegate/deliveries/r/k"})
        h = {"X-Fencegate-Delivery": "queued", "Location": "/.fencegate/deliveries/r/k"}
        out = parse_outcome(202, h, body.encode())
        assert isinstance(out, Queued) and out.delivery is not None
        self.assertEqual((out.status_url, out.delivery.seq, out.delivery.accepted_at.microsecond),  # type: ignore[union-attr]
                         ("/.fencegate/deliveries/r/k", 9, 678000))
        # A 202 of the destination's own (no header), or a stored one replayed: Delivered.
        self.assertIsInstance(parse_outcome(202, {}, b"{}"), Delivered)
        self.assertIsInstance(parse_outcome(202, dict(h, **{"X-Fencegate-Replayed": "true"}), b"{}"), Delivered)
        self.assertEqual(dataclasses.replace(out, lease=None), out)


if __name__ == "__main__":
    unittest.main()
