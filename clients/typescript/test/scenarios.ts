/**
 * The four scenarios of issue 31, against the S3 test server, fencegate and a
 * recording origin (the Python suite runs the same list).
 */

import assert from "node:assert/strict";
import { describe, test } from "node:test";

import { LeaseHeld, Tenure, isExpired, tokenSha256, type Lease, type Outcome } from "fencegate-client";

import { kit, settle, waitFor } from "./kit";

describe("scenarios", () => {
  test("1 late worker refused at destination", async () => {
    const k = await kit();
    const leases = k.leases();
    // 5 s, not 2: the store's clock has whole seconds, so a 2 s epoch could end
    // ~1 s after it was won, and on a loaded machine the client refused to send
    // A's request at all before the relay saw it (the Python twin failed so).
    const a = await leases.acquire("late", { holder: "worker-a", ttlMs: 5000 });
    // Worker A's request leaves while its epoch is valid, then stalls on the way
    // (the relay holds it) past A's lease.
    await k.relayArm("gw", "/late/", { hold: true });
    const late = k.gateway(true).call(a, "POST", "/late/charges", { json: { worker: "a" }, idempotencyKey: "late-a" });
    await waitFor(async () => (await k.relay("gw")).held === 1, "A's request held on the way");
    // Worker B waits for A's expiry + grace, wins the next epoch, gets through.
    const b = await leases.acquire("late", { holder: "worker-b", ttlMs: 10000, wait: true, waitTimeoutMs: 20000 });
    assert.equal(b.epoch, a.epoch + 1);
    const outB = await k.gateway().call(b, "POST", "/late/charges", { json: { worker: "b" }, idempotencyKey: "late-b" });
    assert.equal(outB.kind, "delivered");
    // A's request arrives: refused at fencegate, never at the destination.
    await k.relayRelease("gw");
    const outA = await late;
    assert.deepEqual([outA.kind, outA.status, outA.code, outA.mustStop, outA.attempts], ["stale", 409, "epoch_stale", true, 1]);
    const got = await k.originRequests("/late/");
    assert.deepEqual(got.map((r) => [r.epoch, JSON.parse(r.body)]), [[String(b.epoch), { worker: "b" }]]);
    assert.equal(got[0].token_forwarded, false);
    await leases.release(b);
  });

  test("2a lost create response reconciled: won", async () => {
    const k = await kit();
    const leases = k.leases(true);
    // The conditional PUT reaches S3 and is applied; its answer is lost.
    const dropped = (await k.relay("s3")).dropped;
    await k.relayArm("s3", "/lost-won/", { conditional: true, drop: true });
    const lease = await leases.acquire("lost-won", { holder: "worker", ttlMs: 30000 });
    assert.equal((await k.relay("s3")).dropped, dropped + 1);
    assert.equal(lease.epoch, 1);
    assert.equal(lease.reconciled, true, "decided by reading back, not by the PUT's answer");
    const obj = await k.leases().read("lost-won", 1);
    assert.equal(obj?.tokenSha256, tokenSha256(lease.token));
    assert.equal(lease.expiresAt.getTime(), obj?.expiresAt?.getTime());
    assert.equal(await k.leases().latestEpoch("lost-won"), 1);
    await leases.release(lease);
  });

  test("2b lost create response reconciled: another won", async () => {
    const k = await kit();
    const leases = k.leases(true);
    // Our conditional PUT is held on the way; a rival creates the same epoch
    // first; ours then gets 412, and that answer is lost too.
    const dropped = (await k.relay("s3")).dropped;
    await k.relayArm("s3", "/lost-other/", { conditional: true, hold: true, drop: true });
    const ours = settle(leases.acquire("lost-other", { holder: "worker", ttlMs: 30000 }));
    await waitFor(async () => (await k.relay("s3")).held === 1, "our create held on the way");
    const rival = await k.leases().acquire("lost-other", { holder: "rival", ttlMs: 30000 });
    assert.equal(rival.epoch, 1);
    await k.relayRelease("s3");
    const got = await ours;
    assert.ok(got instanceof LeaseHeld, String(got));
    assert.deepEqual([got.epoch, got.holder], [1, "rival"]);
    assert.equal((await k.relay("s3")).dropped, dropped + 1);
    assert.equal(await k.leases().latestEpoch("lost-other"), 1, "losing is never permission to work");
    await k.leases().release(rival);
  });

  test("3 retry after uncertain result answered from record", async () => {
    const k = await kit();
    const lease = await k.leases().acquire("replay", { holder: "worker", ttlMs: 30000 });
    // The request goes through; fencegate's answer is lost on the way back.
    const dropped = (await k.relay("gw")).dropped;
    await k.relayArm("gw", "/replay/", { drop: true });
    const retries: Outcome[] = [];
    const out = await k.gateway(true).call(lease, "POST", "/replay/charges", {
      json: { amount: 42 }, idempotencyKey: "charge-42", onRetry: (o) => retries.push(o),
    });
    assert.equal((await k.relay("gw")).dropped, dropped + 1);
    assert.equal(retries.length, 1);
    assert.equal(retries[0].kind, "no_response");
    assert.equal(retries[0].kind === "no_response" && retries[0].sent, true);
    assert.equal(out.kind, "delivered");
    assert.equal(out.kind === "delivered" && out.replayed, true, "the retry was answered from the record");
    assert.equal(out.attempts, 2);
    const got = await k.originRequests("/replay/");
    assert.equal((out.json() as { seq: number }).seq, got[0].seq);
    // The same key again, later (another process, after a crash): the same answer.
    const again = await k.gateway().call(lease, "POST", "/replay/charges", { json: { amount: 42 }, idempotencyKey: "charge-42" });
    assert.equal(again.kind === "delivered" && again.replayed, true);
    assert.deepEqual(again.body, out.body);
    // And after a renewal: "the same request" is method, path and body, not the epoch.
    const renewed = await k.leases().renew(lease);
    const third = await k.gateway().call(renewed, "POST", "/replay/charges", { json: { amount: 42 }, idempotencyKey: "charge-42" });
    assert.equal(third.kind === "delivered" && third.replayed, true);
    assert.deepEqual([third.body, third.epoch], [out.body, renewed.epoch]);
    const after = await k.originRequests("/replay/");
    assert.equal(after.length, 1, "the origin received it once");
    assert.equal(after[0].idempotency_key, "charge-42");
    await k.leases().release(renewed);
  });

  test("4b a call overtaken by its own renewal is sent again", async () => {
    // The tenure's renewal has created epoch 2 at the store and not yet
    // returned; fencegate has admitted epoch 2 (another request carried it). A
    // call with epoch 1 is refused as stale — by this tenure's own renewal, not
    // a new leader: the call waits for the renewal and sends the request again
    // at epoch 2, once.
    const k = await kit();
    const leases = k.leases();
    let created: Lease | undefined;
    let goOn: () => void = () => undefined;
    const returned = new Promise<void>((resolve) => {
      goOn = resolve;
    });
    const slowRenewal = {
      renew: async (current: Lease, ttlMs?: number) => {
        const next = await leases.renew(current, ttlMs);
        created = next;
        await returned;
        return next;
      },
      release: (current: Lease) => leases.release(current),
    };
    const first = await leases.acquire("overtaken", { holder: "worker", ttlMs: 8000 });
    const tenure = new Tenure(slowRenewal, first, { marginMs: 1000 });
    const refused: (string | null)[] = [];
    const gate = k.gateway(false, {
      fetch: async (input, init) => {
        const res = await fetch(input, init);
        if (res.status === 409) {
          refused.push(res.headers.get("x-fencegate-error"));
          goOn(); // the renewal returns only after the refusal
        }
        return res;
      },
    });
    try {
      await waitFor(() => created !== undefined, "the renewal created epoch 2", 15000);
      const renewed = created as Lease;
      const out2 = await gate.call(renewed, "POST", "/overtaken/x", { json: { n: "epoch 2" } });
      assert.equal(out2.kind, "delivered", JSON.stringify(out2));
      const out = await gate.call(tenure, "POST", "/overtaken/x", { json: { n: "epoch 1 then 2" } });
      assert.equal(out.kind, "delivered", JSON.stringify(out));
      assert.deepEqual(refused, ["epoch_stale"]);
      const got = await k.originRequests("/overtaken/");
      assert.deepEqual(got.map((r) => [r.epoch, JSON.parse(r.body)]), [
        [String(renewed.epoch), { n: "epoch 2" }],
        [String(renewed.epoch), { n: "epoch 1 then 2" }],
      ]);
    } finally {
      goOn();
      await tenure.close({ release: false, timeoutMs: 0 });
    }
  });

  test("4 renewal missing deadline stops work", async () => {
    const k = await kit();
    const leases = k.leases(true);
    const gate = k.gateway();
    const marginMs = 1000;
    const tenure = await leases.hold("renew", { holder: "worker", ttlMs: 8000, marginMs });
    try {
      const outcomes: Outcome[] = [];
      const work = (async () => {
        for (let n = 1; !tenure.mustStop; n++) {
          outcomes.push(await gate.call(tenure, "POST", "/renew/work", { json: { n } }));
          await tenure.wait(50); // the work's own pace; returns at once on stop
        }
      })();
      await waitFor(() => tenure.renewals >= 1 || tenure.mustStop, "a first renewal", 15000);
      assert.equal(tenure.renewals, 1, `no renewal; stopped: ${tenure.stopReason}, last error: ${String(tenure.lastError)}`);
      const renewed = tenure.lease;
      // The store becomes unreachable: renewals hang and fail.
      await k.relayMode("s3", "blackhole");
      assert.equal(await tenure.wait(15000), true, "the tenure signalled stop");
      const stoppedAt = tenure.stoppedAt as Date;
      await work;
      assert.equal(tenure.stopReason, "deadline");
      assert.ok(tenure.signal.aborted);
      // The signal came `margin` before the epoch's end (latest estimate of the
      // store's clock; 100 ms for the timer to fire).
      const last = tenure.lease;
      assert.equal(last.epoch, renewed.epoch);
      const beforeEnd = last.expiresAt.getTime() - stoppedAt.getTime();
      assert.ok(beforeEnd >= marginMs - 100, `${beforeEnd} ms before the end`);
      assert.ok(beforeEnd < marginMs + 1500, `not long before the deadline (${beforeEnd} ms)`);
      assert.equal(isExpired(last), false, "stopped before the lease ended");
      // Every call made while the tenure ran went through; none after the stop.
      assert.ok(outcomes.length > 0);
      for (const o of outcomes) assert.equal(o.kind, "delivered", JSON.stringify(o));
      const after = await gate.call(tenure, "POST", "/renew/work", { json: { n: "late" } });
      assert.equal(after.kind, "not_sent");
      assert.equal(after.mustStop, true);
      const got = await k.originRequests("/renew/");
      assert.equal(got.length, outcomes.length);
      assert.ok(Math.max(...got.map((r) => Number(r.epoch))) <= last.epoch);
    } finally {
      await k.relayMode("s3", "pass");
      await tenure.close({ release: false, timeoutMs: 0 });
    }
  });
});
