/** The lease client and the tenure on their own (the Python suite runs the same list). */

import assert from "node:assert/strict";
import { PutObjectCommand } from "@aws-sdk/client-s3";
import { describe, test } from "node:test";

import { LeaseHeld, LeaseLost, TenureEnded, tokenSha256, type StopReason } from "fencegate-client";

import { kit, settle, waitFor } from "./kit";

describe("leases", () => {
  test("acquire renew release", async () => {
    const k = await kit();
    const [a, b] = [k.leases(), k.leases()];
    await a.selfTest();
    const first = await a.acquire("basics", { holder: "worker-a", ttlMs: 30000 });
    assert.equal(first.reconciled, false);
    const held = await settle(b.acquire("basics", { holder: "worker-b", ttlMs: 30000 }));
    assert.ok(held instanceof LeaseHeld);
    assert.deepEqual([held.epoch, held.holder], [first.epoch, "worker-a"]);
    const second = await a.renew(first);
    assert.equal(second.epoch, first.epoch + 1);
    assert.notEqual(second.token, first.token);
    const obj = await a.read("basics", second.epoch);
    assert.deepEqual([obj?.kind, obj?.holder, obj?.ttlMs], ["acquire", "worker-a", 30000]);
    assert.equal(obj?.tokenSha256, tokenSha256(second.token));
    assert.ok((await settle(a.renew(first))) instanceof LeaseLost);
    const released = await a.release(second);
    assert.equal(released, second.epoch + 1);
    assert.equal((await a.read("basics", released))?.kind, "release");
    // Free at once: no wait for expiry or grace.
    const third = await b.acquire("basics", { holder: "worker-b", ttlMs: 30000 });
    assert.equal(third.epoch, released + 1);
    await b.release(third);
  });

  test("tenure renews and releases", async () => {
    const k = await kit();
    const leases = k.leases();
    const gate = k.gateway();
    const tenure = await leases.hold("tenure", { holder: "worker", ttlMs: 3000, marginMs: 500, wait: true, waitTimeoutMs: 20000 });
    const first = tenure.lease;
    await waitFor(() => tenure.renewals >= 2, "two renewals");
    assert.equal(tenure.mustStop, false);
    assert.ok(tenure.lease.epoch > first.epoch);
    const out = await gate.call(tenure, "POST", "/tenure/after-renewals", { json: {} });
    assert.equal(out.kind, "delivered");
    assert.ok((out.epoch ?? 0) > first.epoch, "sent with the renewed epoch");
    assert.equal((await k.originRequests("/tenure/after-renewals"))[0].epoch, String(out.epoch));
    const last = tenure.lease;
    const released = await tenure.close();
    assert.equal(released, last.epoch + 1);
    assert.equal(tenure.stopReason, "closed");
    assert.equal((await leases.read("tenure", last.epoch + 1))?.kind, "release");
    assert.throws(() => tenure.check(), TenureEnded);
  });

  test("tenure lost to a newer epoch", async () => {
    const k = await kit();
    const leases = k.leases();
    const reasons: StopReason[] = [];
    const tenure = await leases.hold("usurped", { holder: "worker", ttlMs: 3000, marginMs: 500, onStop: (r) => reasons.push(r) });
    // Someone writes the next epoch (a foreign token): the next renewal finds it.
    const held = tenure.lease;
    const body = {
      v: 1, lease: "usurped", epoch: held.epoch + 1, kind: "acquire", holder: "usurper",
      token_sha256: tokenSha256("usurper"), ttl_ms: 30000,
    };
    await k.s3().send(new PutObjectCommand({
      Bucket: k.info.bucket, Key: leases.key("usurped", held.epoch + 1), Body: JSON.stringify(body),
      IfNoneMatch: "*", ContentType: "application/json",
    }));
    assert.equal(await tenure.wait(10000), true);
    assert.equal(tenure.stopReason, "lost");
    assert.deepEqual(reasons, ["lost"]);
    assert.ok(tenure.lastError instanceof LeaseLost);
    assert.equal(await tenure.close(), undefined);
  });
});
