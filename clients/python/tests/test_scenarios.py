"""The four scenarios of issue 31, against the S3 test server, fencegate and a
recording origin (the TypeScript suite runs the same list)."""

from __future__ import annotations

import json
import threading
import time
import unittest
from datetime import timedelta

from kit import Background, kit, wait_for

from fencegate_client import (
    Delivered,
    LeaseHeld,
    NoResponse,
    NotSent,
    Stale,
    Tenure,
    token_sha256,
)


class Scenarios(unittest.TestCase):
    def test_1_late_worker_refused_at_destination(self) -> None:
        k = kit()
        leases = k.leases()
        # 5 s, not 2: the store's clock has whole seconds, so a 2 s epoch could
        # end ~1 s after it was won, and on a loaded machine the client then
        # refused to send A's request at all (NotSent) before the relay saw it.
        a = leases.acquire("late", "worker-a", ttl_ms=5000)
        # Worker A's request leaves while its epoch is valid, then stalls on the way
        # (the relay holds it) past A's lease.
        k.relay_arm("gw", "/late/", hold=True)
        late = Background(lambda: k.gateway(via_relay=True).call(
            a, "POST", "/late/charges", json={"worker": "a"}, idempotency_key="late-a"))

        def held() -> bool:
            if not late.is_alive():
                self.fail(f"A's request ended before it was held: {late.result()!r}")
            return bool(k.relay("gw")["held"] == 1)

        wait_for(held, "A's request held on the way")
        # Worker B waits for A's expiry + grace, wins the next epoch, gets through.
        b = leases.acquire("late", "worker-b", ttl_ms=10000, wait=True, wait_timeout=20)
        self.assertEqual(b.epoch, a.epoch + 1)
        out_b = k.gateway().call(b, "POST", "/late/charges", json={"worker": "b"}, idempotency_key="late-b")
        self.assertIsInstance(out_b, Delivered, out_b)
        # A's request arrives: refused at fencegate, never at the destination.
        k.relay_release("gw")
        out_a = late.result()
        self.assertIsInstance(out_a, Stale, out_a)
        self.assertEqual((out_a.status, out_a.code, out_a.kind), (409, "epoch_stale", "stale"))
        self.assertTrue(out_a.must_stop)
        self.assertEqual(out_a.attempts, 1)
        got = k.origin_requests("/late/")
        self.assertEqual([(r["epoch"], json.loads(r["body"])) for r in got], [(str(b.epoch), {"worker": "b"})])
        self.assertFalse(got[0]["token_forwarded"])
        leases.release(b)

    def test_2a_lost_create_response_reconciled_won(self) -> None:
        k = kit()
        leases = k.leases(via_relay=True)
        # The conditional PUT reaches S3 and is applied; its answer is lost.
        dropped = k.relay("s3")["dropped"]
        k.relay_arm("s3", "/lost-won/", conditional=True, drop=True)
        lease = leases.acquire("lost-won", "worker", ttl_ms=30000)
        self.assertEqual(k.relay("s3")["dropped"], dropped + 1)
        self.assertEqual(lease.epoch, 1)
        self.assertTrue(lease.reconciled, "decided by reading back, not by the PUT's answer")
        obj = k.leases().read("lost-won", 1)
        assert obj is not None
        self.assertEqual(obj.token_sha256, token_sha256(lease.token))
        self.assertEqual(lease.expires_at, obj.expires_at)
        self.assertEqual(k.leases().latest_epoch("lost-won"), 1)
        leases.release(lease)

    def test_2b_lost_create_response_reconciled_another_won(self) -> None:
        k = kit()
        leases = k.leases(via_relay=True)
        # Our conditional PUT is held on the way; a rival creates the same epoch
        # first; ours then gets 412, and that answer is lost too.
        dropped = k.relay("s3")["dropped"]
        k.relay_arm("s3", "/lost-other/", conditional=True, hold=True, drop=True)
        ours = Background(lambda: leases.acquire("lost-other", "worker", ttl_ms=30000))
        wait_for(lambda: k.relay("s3")["held"] == 1, "our create held on the way")
        rival = k.leases().acquire("lost-other", "rival", ttl_ms=30000)
        self.assertEqual(rival.epoch, 1)
        k.relay_release("s3")
        got = ours.result()
        self.assertIsInstance(got, LeaseHeld, got)
        self.assertEqual((got.epoch, got.holder), (1, "rival"))
        self.assertEqual(k.relay("s3")["dropped"], dropped + 1)
        self.assertEqual(k.leases().latest_epoch("lost-other"), 1, "losing is never permission to work")
        k.leases().release(rival)

    def test_3_retry_after_uncertain_result_answered_from_record(self) -> None:
        k = kit()
        lease = k.leases().acquire("replay", "worker", ttl_ms=30000)
        # The request goes through; fencegate's answer is lost on the way back.
        dropped = k.relay("gw")["dropped"]
        k.relay_arm("gw", "/replay/", drop=True)
        retries = []
        out = k.gateway(via_relay=True).call(lease, "POST", "/replay/charges", json={"amount": 42},
                                             idempotency_key="charge-42",
                                             on_retry=lambda o, d: retries.append(o))
        self.assertEqual(k.relay("gw")["dropped"], dropped + 1)
        self.assertEqual(len(retries), 1)
        self.assertIsInstance(retries[0], NoResponse)
        self.assertTrue(retries[0].sent)
        self.assertIsInstance(out, Delivered, out)
        self.assertTrue(out.replayed, "the retry was answered from the record")
        self.assertEqual(out.attempts, 2)
        self.assertEqual(out.json()["seq"], k.origin_requests("/replay/")[0]["seq"])
        # The same key again, later (another process, after a crash): the same answer.
        again = k.gateway().call(lease, "POST", "/replay/charges", json={"amount": 42},
                                 idempotency_key="charge-42")
        self.assertIsInstance(again, Delivered)
        self.assertTrue(again.replayed)
        self.assertEqual(again.body, out.body)
        # And after a renewal: "the same request" is method, path and body, not the epoch.
        renewed = k.leases().renew(lease)
        again = k.gateway().call(renewed, "POST", "/replay/charges", json={"amount": 42},
                                 idempotency_key="charge-42")
        self.assertIsInstance(again, Delivered)
        self.assertTrue(again.replayed)
        self.assertEqual((again.body, again.epoch), (out.body, renewed.epoch))
        got = k.origin_requests("/replay/")
        self.assertEqual(len(got), 1, "the origin received it once")
        self.assertEqual(got[0]["idempotency_key"], "charge-42")
        k.leases().release(renewed)

    def test_4b_a_call_overtaken_by_its_own_renewal_is_sent_again(self) -> None:
        # The tenure's renewal has created epoch 2 at the store and not yet
        # returned; fencegate has admitted epoch 2 (another request carried
        # it). A call with epoch 1 is refused as stale — by this tenure's own
        # renewal, not a new leader: the call waits for the renewal and sends
        # the request again at epoch 2, once.
        k = kit()
        leases = k.leases()
        created, go_on = threading.Event(), threading.Event()
        renewed: list = []

        class SlowRenewal:
            def renew(self, current):  # type: ignore[no-untyped-def]
                new = leases.renew(current)
                renewed.append(new)
                created.set()
                go_on.wait(20)
                return new

            def release(self, current):  # type: ignore[no-untyped-def]
                return leases.release(current)

        first = leases.acquire("overtaken", "worker", ttl_ms=8000)
        tenure = Tenure(SlowRenewal(), first, margin_ms=1000)  # type: ignore[arg-type]
        gate = k.gateway()
        try:
            wait_for(created.is_set, "the renewal created epoch 2", timeout=15)
            out2 = gate.call(renewed[0], "POST", "/overtaken/x", json={"n": "epoch 2"})
            self.assertIsInstance(out2, Delivered, out2)
            real_send = gate._send_once
            refused = []

            def send_once(*a, **kw):  # type: ignore[no-untyped-def]
                out = real_send(*a, **kw)
                if isinstance(out, Stale):
                    refused.append(out)
                    go_on.set()  # the renewal returns only after the refusal
                return out

            gate._send_once = send_once  # type: ignore[method-assign]
            out = gate.call(tenure, "POST", "/overtaken/x", json={"n": "epoch 1 then 2"})
            self.assertIsInstance(out, Delivered, out)
            self.assertEqual(len(refused), 1, refused)
            self.assertEqual(refused[0].details.get("latest_epoch"), renewed[0].epoch)
            got = k.origin_requests("/overtaken/")
            self.assertEqual([(r["epoch"], json.loads(r["body"])) for r in got],
                             [(str(renewed[0].epoch), {"n": "epoch 2"}),
                              (str(renewed[0].epoch), {"n": "epoch 1 then 2"})])
        finally:
            go_on.set()
            tenure.close(release=False, timeout=0)

    def test_4_renewal_missing_deadline_stops_work(self) -> None:
        k = kit()
        leases = k.leases(via_relay=True)
        gate = k.gateway()
        margin_ms = 1000
        tenure = leases.hold("renew", "worker", ttl_ms=8000, margin_ms=margin_ms)
        try:
            outcomes = []

            def work() -> None:
                n = 0
                while not tenure.must_stop:
                    n += 1
                    outcomes.append(gate.call(tenure, "POST", "/renew/work", json={"n": n}))
                    tenure.wait(0.05)  # the work's own pace; returns at once on stop

            worker = Background(work)
            wait_for(lambda: tenure.renewals >= 1 or tenure.must_stop, "a first renewal", timeout=15)
            self.assertEqual(tenure.renewals, 1, f"no renewal; stopped: {tenure.stop_reason}, last error: {tenure.last_error!r}")
            renewed = tenure.lease
            # The store becomes unreachable: renewals hang and fail.
            k.relay_mode("s3", "blackhole")
            self.assertTrue(tenure.wait(15), "the tenure signalled stop")
            stopped_at = tenure.stopped_at
            assert stopped_at is not None
            worker.result()
            self.assertEqual(tenure.stop_reason, "deadline")
            # The signal came `margin` before the epoch's end (latest estimate of
            # the store's clock; 100 ms for the watchdog thread to wake up).
            last = tenure.lease
            self.assertEqual(last.epoch, renewed.epoch)
            before_end = last.expires_at - stopped_at
            self.assertGreaterEqual(before_end, timedelta(milliseconds=margin_ms - 100), before_end)
            self.assertLess(before_end, timedelta(milliseconds=margin_ms + 1500), "not long before the deadline")
            self.assertFalse(last.expired(), "stopped before the lease ended")
            # Every call made while the tenure ran went through; none after the
            # stop (a call the work began as the stop landed — it looked at
            # `must_stop` just before — is not sent, and says why).
            self.assertTrue(outcomes)
            delivered = [o for o in outcomes if isinstance(o, Delivered)]
            for o in outcomes:
                if not isinstance(o, Delivered):
                    self.assertIsInstance(o, NotSent, o)
                    self.assertTrue(o.must_stop, o)
            self.assertLessEqual(len(outcomes) - len(delivered), 1, outcomes)
            after = gate.call(tenure, "POST", "/renew/work", json={"n": "late"})
            self.assertIsInstance(after, NotSent)
            self.assertTrue(after.must_stop)
            got = k.origin_requests("/renew/")
            self.assertEqual(len(got), len(delivered))
            self.assertLessEqual(max(int(r["epoch"]) for r in got), last.epoch)
        finally:
            k.relay_mode("s3", "pass")
            tenure.close(release=False, timeout=0)


if __name__ == "__main__":
    unittest.main()
