/**
 * A queued route (SPEC §11) at a real fencegate: `call` returns its 202 as a
 * `queued` outcome, `waitDelivered` polls the status URL (the Python suite runs
 * the same list). The route `queued` has its own lease; one message of a lease
 * is delivered at a time, so these tests leave its queue empty.
 */

import assert from "node:assert/strict";
import { describe, test } from "node:test";

import {
  DeliveryStatusError, DeliveryTimeout, ERROR_CODES, NotDelivered, parseOutcome,
  type DeliveryStatus, type Outcome, type Queued,
} from "fencegate-client";

import { kit, waitFor } from "./kit";

async function adminDrop(key: string): Promise<number> {
  const k = await kit();
  const res = await fetch(`${k.info.admin}/v1/deliveries/queued/${encodeURIComponent(key)}/drop`, {
    method: "POST", headers: { Authorization: `Bearer ${k.info.admin_token}` },
  });
  await res.arrayBuffer();
  return res.status;
}

function asQueued(o: Outcome): Queued {
  assert.equal(o.kind, "queued", JSON.stringify(o));
  return o as Queued;
}

async function rejects<E extends Error>(p: Promise<unknown>, cls: new (...a: never[]) => E): Promise<E> {
  try {
    await p;
  } catch (e) {
    assert.ok(e instanceof cls, `${String(e)} is not a ${cls.name}`);
    return e as E;
  }
  assert.fail(`no ${cls.name}`);
}

describe("queued delivery", () => {
  test("accepted then delivered", async () => {
    const k = await kit();
    const gate = k.gateway();
    const lease = await k.leases().acquire("queued", { holder: "worker", ttlMs: 30000, wait: true, waitTimeoutMs: 20000 });
    const out = asQueued(await gate.call(lease, "POST", "/queued/orders", { json: { order: 1 }, idempotencyKey: "q-1", queued: true }));
    assert.deepEqual([out.status, out.code, out.mustStop, out.retried], [202, null, false, false]);
    assert.equal(out.headers["x-fencegate-delivery"], "queued");
    assert.equal(out.dedupKey, "q-1");
    assert.equal(out.location, "/.fencegate/deliveries/queued/q-1");
    assert.equal(out.statusUrl, k.info.gateway + out.location);
    assert.ok(!JSON.stringify(out).includes(lease.token), "the token is not on the outcome");
    const d = out.delivery as DeliveryStatus;
    assert.deepEqual([d.route, d.dedupKey, d.lease, d.epoch, d.status, d.location, d.settled],
      ["queued", "q-1", "queued", lease.epoch, "pending", out.location, false]);
    assert.ok(d.acceptedAt instanceof Date);

    const got = await gate.waitDelivered(out, { timeoutMs: 20000 });
    assert.deepEqual([got.status, got.attempts, got.lastStatus, got.lastError, got.settled], ["delivered", 1, 200, null, true]);
    const sent = await k.originRequests("/queued/orders");
    assert.deepEqual(sent.map((r) => JSON.parse(r.body)), [{ order: 1 }]);
    assert.equal(sent[0].token_forwarded, false);

    // The same key again, once delivered: the destination's stored answer.
    const again = await gate.call(lease, "POST", "/queued/orders", { json: { order: 1 }, idempotencyKey: "q-1", queued: true });
    assert.equal(again.kind === "delivered" && again.replayed, true, JSON.stringify(again));
    assert.equal((again.json() as { seq: number }).seq, sent[0].seq);
    assert.equal((await k.originRequests("/queued/orders")).length, 1);
    await k.leases().release(lease);
  });

  test("without the flag, and the status URL by hand", async () => {
    const k = await kit();
    const gate = k.gateway();
    const lease = await k.leases().acquire("queued", { holder: "worker", ttlMs: 30000, wait: true, waitTimeoutMs: 20000 });
    // Without `queued: true` the 202 is a queued outcome too (the header says so), never delivered.
    const out = asQueued(await gate.call(lease, "POST", "/queued/plain", { json: { n: 2 }, idempotencyKey: "q-2/x" }));
    assert.equal(out.location, "/.fencegate/deliveries/queued/q-2%2Fx");
    // The token the message was accepted with: the URL, its path (under the client's base URL), or the Lease.
    assert.equal((await gate.waitDelivered(out.statusUrl, { timeoutMs: 20000, token: lease.token })).status, "delivered");
    assert.equal((await gate.waitDelivered(out.location, { timeoutMs: 20000, token: lease })).status, "delivered");
    // A renewed epoch has another token: the outcome keeps the one it was accepted with.
    const newer = await k.leases().renew(lease);
    assert.equal((await gate.waitDelivered(out, { timeoutMs: 20000 })).dedupKey, "q-2/x");
    let e = await rejects(gate.waitDelivered(out.statusUrl, { timeoutMs: 20000, token: newer }), DeliveryStatusError);
    assert.deepEqual([e.status, e.code], [403, "token_invalid"]);
    e = await rejects(gate.waitDelivered(out.statusUrl, { timeoutMs: 20000 }), DeliveryStatusError);
    assert.deepEqual([e.status, e.code], [401, "token_missing"]);
    e = await rejects(gate.waitDelivered("/.fencegate/deliveries/queued/nothing-here", { timeoutMs: 20000, token: newer }), DeliveryStatusError);
    assert.deepEqual([e.status, e.code], [404, "delivery_not_found"]);
    await rejects(gate.waitDelivered(parseOutcome(200, {}, new Uint8Array()) as unknown as Queued), TypeError);
    await k.leases().release(newer);
  });

  test("held, timeout, dropped and failed", async () => {
    const k = await kit();
    const gate = k.gateway();
    const lease = await k.leases().acquire("queued", { holder: "worker", ttlMs: 60000, wait: true, waitTimeoutMs: 20000 });
    // The head is held at the destination: still delivering when the timeout passes.
    const hold = { "X-Test-Hold": "q-held" };
    const head = asQueued(await gate.call(lease, "POST", "/queued/held", { json: {}, headers: hold, idempotencyKey: "q-held", queued: true }));
    await waitFor(async () => (await k.originHeld())["q-held"], "the head at the destination");
    const t0 = performance.now();
    const timedOut = await rejects(gate.waitDelivered(head, { timeoutMs: 500 }), DeliveryTimeout);
    assert.ok(performance.now() - t0 < 5000);
    assert.deepEqual([timedOut.delivery?.status, timedOut.delivery?.attempts], ["delivering", 1]);
    // A retry of its key meanwhile: 202 again.
    const again = asQueued(await gate.call(lease, "POST", "/queued/held", { json: {}, headers: hold, idempotencyKey: "q-held" }));
    assert.equal(again.delivery?.status, "delivering");

    // Behind it, a message waits (pending); an operator drops it.
    const behind = asQueued(await gate.call(lease, "POST", "/queued/behind", { json: {}, idempotencyKey: "q-behind", queued: true }));
    assert.equal(await adminDrop("q-behind"), 200);
    let nd = await rejects(gate.waitDelivered(behind, { timeoutMs: 20000 }), NotDelivered);
    assert.deepEqual([nd.status, nd.delivery.attempts], ["dropped", 0]);
    assert.match(nd.message, /dropped/);
    let out = await gate.call(lease, "POST", "/queued/behind", { json: {}, idempotencyKey: "q-behind" });
    assert.deepEqual([out.kind, out.status, out.code], ["delivery_dropped", 409, "delivery_dropped"]);

    await k.originRelease("q-held");
    assert.equal((await gate.waitDelivered(head, { timeoutMs: 20000 })).status, "delivered");

    // The destination refuses it (a 4xx other than 408, 409, 425, 429): failed at once.
    const bad400 = { "X-Test-Status": "400" };
    const bad = asQueued(await gate.call(lease, "POST", "/queued/bad", { json: {}, headers: bad400, idempotencyKey: "q-400", queued: true }));
    nd = await rejects(gate.waitDelivered(bad, { timeoutMs: 20000 }), NotDelivered);
    assert.deepEqual([nd.status, nd.lastStatus], ["failed", 400]);
    assert.notEqual(nd.lastError, null);
    out = await gate.call(lease, "POST", "/queued/bad", { json: {}, headers: bad400, idempotencyKey: "q-400" });
    assert.deepEqual([out.kind, out.status, out.code, out.kind === "delivery_failed" && out.upstreamStatus], ["delivery_failed", 409, "delivery_failed", 400]);
    const paths = (await k.originRequests("/queued/")).map((r) => r.path)
      .filter((p) => ["/queued/held", "/queued/behind", "/queued/bad"].some((x) => p.startsWith(x)));
    assert.deepEqual(paths, ["/queued/held", "/queued/bad"], "the dropped one was never sent");
    await k.leases().release(lease);
  });

  test("the queued flag on a direct route warns", async () => {
    const k = await kit();
    const lease = await k.leases().acquire("codes", { holder: "queued-flag", ttlMs: 30000, wait: true, waitTimeoutMs: 20000 });
    const warned = new Promise<Error & { code?: string }>((resolve) => process.once("warning", resolve));
    const out = await k.gateway().call(lease, "POST", "/codes/direct", { json: {}, queued: true });
    assert.equal(out.kind, "delivered");
    const w = await warned;
    assert.equal(w.code, "FENCEGATE_NOT_QUEUED");
    assert.match(w.message, /not queued/);
    await k.leases().release(lease);
  });

  test("parsing", () => {
    assert.equal(ERROR_CODES.delivery_failed, "delivery_failed");
    assert.equal(ERROR_CODES.delivery_dropped, "delivery_dropped");
    const body = new TextEncoder().encode(JSON.stringify({
      route: "r", dedup_key: "k", lease: "l", epoch: 3, seq: 9, status: "pending", attempts: 0, unknown_outcomes: 0,
      accepted_at: "2026-01-02T03:04:05.678Z", updated_at: "2026-01-02T03:04:05.678Z", next_attempt_at: null,
      last_status: null, last_error: null, location: "/.fencegate/deliveries/r/k",
    }));
    const h = { "X-Fencegate-Delivery": "queued", Location: "/.fencegate/deliveries/r/k" };
    const out = asQueued(parseOutcome(202, h, body));
    assert.deepEqual([out.statusUrl, out.delivery?.seq, out.delivery?.acceptedAt?.getTime()],
      ["/.fencegate/deliveries/r/k", 9, Date.parse("2026-01-02T03:04:05.678Z")]);
    // A 202 of the destination's own (no header), or a stored one replayed: delivered.
    assert.equal(parseOutcome(202, {}, new Uint8Array()).kind, "delivered");
    assert.equal(parseOutcome(202, { ...h, "X-Fencegate-Replayed": "true" }, new Uint8Array()).kind, "delivered");
  });
});
