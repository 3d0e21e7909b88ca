"""The lease client and the tenure on their own (the TypeScript suite runs the same list)."""

from __future__ import annotations

import json
import unittest

from kit import kit, wait_for

from fencegate_client import Delivered, LeaseHeld, LeaseLost, TenureEnded, token_sha256


class Leases(unittest.TestCase):
    def test_acquire_renew_release(self) -> None:
        k = kit()
        a, b = k.leases(), k.leases()
        a.self_test()
        first = a.acquire("basics", "worker-a", ttl_ms=30000)
        self.assertFalse(first.reconciled)
        with self.assertRaises(LeaseHeld) as held:
            b.acquire("basics", "worker-b", ttl_ms=30000)
        self.assertEqual((held.exception.epoch, held.exception.holder), (first.epoch, "worker-a"))
        second = a.renew(first)
        self.assertEqual(second.epoch, first.epoch + 1)
        self.assertNotEqual(second.token, first.token)
        obj = a.read("basics", second.epoch)
        assert obj is not None
        self.assertEqual((obj.kind, obj.holder, obj.ttl_ms), ("acquire", "worker-a", 30000))
        self.assertEqual(obj.token_sha256, token_sha256(second.token))
        with self.assertRaises(LeaseLost):
            a.renew(first)
        released = a.release(second)
        self.assertEqual(released, second.epoch + 1)
        rel = a.read("basics", released)
        assert rel is not None
        self.assertEqual(rel.kind, "release")
        # Free at once: no wait for expiry or grace.
        third = b.acquire("basics", "worker-b", ttl_ms=30000)
        self.assertEqual(third.epoch, released + 1)
        b.release(third)

    def test_tenure_renews_and_releases(self) -> None:
        k = kit()
        leases, gate = k.leases(), k.gateway()
        with leases.hold("tenure", "worker", ttl_ms=3000, margin_ms=500) as tenure:
            first = tenure.lease
            wait_for(lambda: tenure.renewals >= 2, "two renewals", timeout=10)
            self.assertFalse(tenure.must_stop)
            self.assertGreater(tenure.lease.epoch, first.epoch)
            out = gate.call(tenure, "POST", "/tenure/after-renewals", json={})
            self.assertIsInstance(out, Delivered)
            assert out.epoch is not None
            self.assertGreater(out.epoch, first.epoch, "sent with the renewed epoch")
            self.assertEqual(k.origin_requests("/tenure/after-renewals")[0]["epoch"], str(out.epoch))
            last = tenure.lease
        self.assertEqual(tenure.stop_reason, "closed")
        obj = leases.read("tenure", last.epoch + 1)
        assert obj is not None
        self.assertEqual(obj.kind, "release")
        with self.assertRaises(TenureEnded):
            tenure.check()

    def test_tenure_lost_to_a_newer_epoch(self) -> None:
        k = kit()
        leases = k.leases()
        reasons = []
        tenure = leases.hold("usurped", "worker", ttl_ms=3000, margin_ms=500, on_stop=reasons.append)
        # Someone writes the next epoch (a foreign token): the next renewal finds it.
        held = tenure.lease
        body = {"v": 1, "lease": "usurped", "epoch": held.epoch + 1, "kind": "acquire", "holder": "usurper",
                "token_sha256": token_sha256("usurper"), "ttl_ms": 30000}
        k.s3().put_object(Bucket=k.info["bucket"], Key=leases.key("usurped", held.epoch + 1),
                          Body=json.dumps(body).encode(), IfNoneMatch="*", ContentType="application/json")
        self.assertTrue(tenure.wait(10))
        self.assertEqual(tenure.stop_reason, "lost")
        self.assertEqual(reasons, ["lost"])
        self.assertIsInstance(tenure.last_error, LeaseLost)
        self.assertIsNone(tenure.close())


if __name__ == "__main__":
    unittest.main()
