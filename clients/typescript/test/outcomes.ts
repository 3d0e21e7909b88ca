/**
 * Typed outcomes for the SPEC §7 codes, each provoked at a real fencegate (the
 * Python suite runs the same list).
 */

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { connect } from "node:net";
import * as path from "node:path";
import { describe, test } from "node:test";

import { ERROR_CODES, parseOutcome, type Lease, type Outcome } from "fencegate-client";

import { REPO, kit, settle, waitFor } from "./kit";

/** code -> status, from SPEC.md §7's table. */
function specCodes(): Map<string, number> {
  const text = readFileSync(path.join(REPO, "SPEC.md"), "utf8");
  const section = text.split("## 7. Errors")[1].split("\n## ")[0];
  const codes = new Map<string, number>();
  for (const line of section.split("\n")) {
    const m = /^\|\s*(\d{3})\s*\|(.*?)\|/.exec(line);
    if (!m) continue;
    for (const c of m[2].matchAll(/`([a-z_]+)`/g)) codes.set(c[1], Number(m[1]));
  }
  return codes;
}

/** Sends one hand-made request to fencegate; parses its answer like `call` does. `shut`: half-close (a body that breaks off). */
async function raw(head: string, body = "", shut = false): Promise<Outcome> {
  const k = await kit();
  const u = new URL(k.info.gateway);
  const data = await new Promise<Buffer>((resolve, reject) => {
    const chunks: Buffer[] = [];
    const s = connect(Number(u.port), u.hostname, () => {
      s.write((head + "Connection: close\n").replace(/\n/g, "\r\n") + "\r\n" + body);
      if (shut) s.end();
    });
    s.on("data", (c: Buffer) => chunks.push(c));
    s.on("end", () => resolve(Buffer.concat(chunks)));
    s.on("error", reject);
  });
  const split = data.indexOf("\r\n\r\n");
  const lines = data.subarray(0, split).toString("latin1").split("\r\n");
  const headers: Record<string, string> = {};
  for (const l of lines.slice(1)) {
    const i = l.indexOf(": ");
    headers[l.slice(0, i)] = l.slice(i + 2);
  }
  return parseOutcome(Number(lines[0].split(" ")[1]), headers, new Uint8Array(data.subarray(split + 4)));
}

const brief = (o: Outcome) => [o.kind, o.status, o.code];

describe("outcomes", () => {
  test("every spec code has an outcome", () => {
    const codes = specCodes();
    assert.ok(codes.size >= 24);
    assert.deepEqual([...codes.keys()].sort(), Object.keys(ERROR_CODES).sort());
    for (const [code, status] of codes) {
      const out = parseOutcome(status, { "X-Fencegate-Error": code }, new TextEncoder().encode(`{"error":"${code}"}`));
      assert.equal(out.kind, ERROR_CODES[code]);
      assert.equal(out.code, code);
    }
  });

  test("stale expired refused", async () => {
    const k = await kit();
    const leases = k.leases();
    const gate = k.gateway();
    const lease = await leases.acquire("codes", { holder: "worker", ttlMs: 30000 });
    const newer = await leases.renew(lease);
    assert.equal((await gate.call(newer, "POST", "/codes/a", { json: {} })).kind, "delivered");
    let out = await gate.call(lease, "POST", "/codes/a", { json: {} });
    assert.deepEqual([...brief(out), out.details.lease], ["stale", 409, "epoch_stale", "codes"]);
    out = await gate.call({ ...newer, token: "0".repeat(64) }, "POST", "/codes/a", { json: {} });
    assert.deepEqual(brief(out), ["refused", 403, "token_invalid"]);
    assert.equal(out.mustStop, true);
    out = await gate.call({ ...newer, epoch: newer.epoch + 10 }, "POST", "/codes/a", { json: {} });
    assert.deepEqual(brief(out), ["refused", 403, "epoch_unknown"]);
    const released = await leases.release(newer);
    out = await gate.call({ ...newer, epoch: released }, "POST", "/codes/a", { json: {} });
    assert.deepEqual(brief(out), ["refused", 403, "epoch_invalid"]);

    const short = await leases.acquire("expiry", { holder: "worker", ttlMs: 1500 });
    // Past its end on the earliest estimate of the store's clock: over for
    // fencegate too. The client itself refuses to send it...
    await waitFor(() => short.clock.earliest() > short.expiresAt.getTime() + 100, "the lease's end");
    out = await gate.call(short, "POST", "/expiry/a", { json: {} });
    assert.equal(out.kind, "not_sent");
    assert.equal(out.mustStop, true);
    // ...and a worker whose idea of the expiry is wrong is refused by fencegate.
    const wrong: Lease = { ...short, expiresAt: new Date(short.expiresAt.getTime() + 3600_000) };
    out = await gate.call(wrong, "POST", "/expiry/a", { json: {} });
    assert.deepEqual(brief(out), ["expired", 409, "lease_expired"]);
    assert.deepEqual(await k.originRequests("/expiry/"), []);
  });

  test("invalid requests", async () => {
    const k = await kit();
    const gate = k.gateway();
    const lease = await k.leases().acquire("tiny", { holder: "worker", ttlMs: 30000, wait: true, waitTimeoutMs: 20000 });
    let out = await gate.call(lease, "POST", "/nowhere/a", { json: {} });
    assert.deepEqual(brief(out), ["invalid", 404, "route_not_found"]);
    out = await gate.call(lease, "POST", "/tiny/a", { body: "x".repeat(100) });
    assert.deepEqual(brief(out), ["invalid", 413, "body_too_large"]);
    assert.equal(out.details.limit_bytes, 64);
    // What `call` cannot send (it always sets a valid epoch, token and key),
    // sent by hand and parsed by the same code.
    const [e, t] = [lease.epoch, lease.token];
    const cases: [string, string, boolean, number, string][] = [
      ["POST /tiny/a HTTP/1.1\nHost: x\nContent-Length: 0\n", "", false, 428, "epoch_missing"],
      ["POST /tiny/a HTTP/1.1\nHost: x\nX-Lease-Epoch: +1\nContent-Length: 0\n", "", false, 400, "epoch_malformed"],
      [`POST /tiny/a HTTP/1.1\nHost: x\nX-Lease-Epoch: ${e}\nContent-Length: 0\n`, "", false, 401, "token_missing"],
      [`POST /tiny/a HTTP/1.1\nHost: x\nX-Lease-Epoch: ${e}\nX-Lease-Token: ${t}\nIdempotency-Key: a b\nContent-Length: 0\n`,
        "", false, 400, "dedup_key_malformed"],
      [`GET /tiny/a HTTP/1.1\nHost: x\nX-Lease-Epoch: ${e}\nX-Lease-Token: ${t}\nConnection: Upgrade\nUpgrade: websocket\n`,
        "", false, 501, "upgrade_unsupported"],
      [`POST /tiny/a HTTP/1.1\nHost: x\nX-Lease-Epoch: ${e}\nX-Lease-Token: ${t}\nContent-Length: 10\n`, "abc", true, 400,
        "body_malformed"],
    ];
    for (const [head, body, shut, status, code] of cases) {
      out = await raw(head, body, shut);
      assert.deepEqual(brief(out), [code === "token_missing" ? "refused" : "invalid", status, code], head);
    }
    assert.deepEqual(await k.originRequests("/tiny/a"), []);
    await k.leases().release(lease);
  });

  test("refused by hand", async () => {
    const k = await kit();
    const lease = await k.leases().acquire("slow", { holder: "hand", ttlMs: 30000, wait: true, waitTimeoutMs: 20000 });
    const base = `POST /slow/a HTTP/1.1\nHost: x\nX-Lease-Epoch: ${lease.epoch}\nX-Lease-Token: ${lease.token}\n`;
    let out = await raw(base + "X-Fencegate-Peer: someone\nContent-Length: 0\n");
    assert.deepEqual(brief(out), ["refused", 403, "peer_unauthorized"]);
    // The body does not come within the route's timeout (800 ms).
    out = await raw(base + "Content-Length: 10\n", "abc");
    assert.deepEqual(brief(out), ["invalid", 408, "body_timeout"]);
    await k.leases().release(lease);
  });

  test("dedup outcomes", async () => {
    const k = await kit();
    const gate = k.gateway();
    const lease = await k.leases().acquire("inflight", { holder: "worker", ttlMs: 30000, wait: true, waitTimeoutMs: 20000 });
    // dedup_key_reused: one key, two different requests.
    let out = await gate.call(lease, "POST", "/inflight/k", { json: { a: 1 }, idempotencyKey: "reused" });
    assert.equal(out.kind, "delivered");
    out = await gate.call(lease, "POST", "/inflight/k", { json: { a: 2 }, idempotencyKey: "reused" });
    assert.deepEqual(brief(out), ["key_reused", 422, "dedup_key_reused"]);
    // dedup_in_flight: the first is still at the destination. With one attempt
    // it is returned; with more, `call` retries until the record answers.
    const hold = { "X-Test-Hold": "inflight-a" };
    const first = gate.call(lease, "POST", "/inflight/a", { json: {}, headers: hold, idempotencyKey: "inflight-a" });
    await waitFor(async () => (await k.originHeld())["inflight-a"], "the first request at the origin");
    out = await gate.call(lease, "POST", "/inflight/a", { json: {}, headers: hold, idempotencyKey: "inflight-a", maxAttempts: 1 });
    assert.deepEqual(brief(out), ["in_flight", 409, "dedup_in_flight"]);
    const seen: Outcome[] = [];
    out = await gate.call(lease, "POST", "/inflight/a", {
      json: {}, headers: hold, idempotencyKey: "inflight-a", maxAttempts: 50,
      onRetry: (o) => {
        seen.push(o);
        void k.originRelease("inflight-a");
      },
    });
    assert.equal(seen[0].kind, "in_flight");
    assert.equal(out.kind === "delivered" && out.replayed, true, JSON.stringify(out));
    const original = await first;
    assert.equal(original.kind === "delivered" && !original.replayed, true);
    assert.deepEqual(out.body, original.body);
    assert.equal((await k.originRequests("/inflight/a")).length, 1);
    await k.leases().release(lease);

    // dedup_done: delivered, the answer too large to keep (max_replay_bytes 16).
    const tiny = await k.leases().acquire("tiny", { holder: "worker", ttlMs: 30000, wait: true, waitTimeoutMs: 20000 });
    const big = { "X-Test-Size": "100" };
    out = await gate.call(tiny, "POST", "/tiny/big", { json: {}, headers: big, idempotencyKey: "big" });
    assert.deepEqual([out.kind, out.body.length], ["delivered", 100]);
    out = await gate.call(tiny, "POST", "/tiny/big", { json: {}, headers: big, idempotencyKey: "big" });
    assert.deepEqual([...brief(out), out.kind === "already_done" && out.upstreamStatus], ["already_done", 409, "dedup_done", 200]);
    assert.equal((await k.originRequests("/tiny/big")).length, 1);
    await k.leases().release(tiny);
  });

  test("in doubt outcomes", async () => {
    const k = await kit();
    const gate = k.gateway();
    // upstream_timeout (route timeout 800 ms), then dedup_in_doubt: never retried.
    const lease = await k.leases().acquire("slow", { holder: "worker", ttlMs: 30000, wait: true, waitTimeoutMs: 20000 });
    const hold = { "X-Test-Hold": "slow-a" };
    let out = await gate.call(lease, "POST", "/slow/a", { json: {}, headers: hold, idempotencyKey: "slow-a" });
    assert.deepEqual([...brief(out), out.attempts], ["in_doubt", 504, "upstream_timeout", 1]);
    out = await gate.call(lease, "POST", "/slow/a", { json: {}, headers: hold, idempotencyKey: "slow-a" });
    assert.deepEqual([...brief(out), out.attempts], ["in_doubt", 409, "dedup_in_doubt", 1]);
    await k.originRelease("slow-a");
    assert.equal((await k.originRequests("/slow/a")).length, 1);
    await k.leases().release(lease);

    // drain_aborted: an epoch-1 request still at the destination when epoch 2's
    // first request arrives; the drain (300 ms) gives up on it.
    const old = await k.leases().acquire("drain", { holder: "worker", ttlMs: 30000 });
    const first = settle(gate.call(old, "POST", "/drain/a", { json: {}, headers: { "X-Test-Hold": "drain-a" }, idempotencyKey: "drain-a" }));
    await waitFor(async () => (await k.originHeld())["drain-a"], "the epoch-1 request at the origin");
    const renewed = await k.leases().renew(old);
    out = await gate.call(renewed, "POST", "/drain/b", { json: {}, idempotencyKey: "drain-b" });
    assert.equal(out.kind, "delivered");
    const aborted = await first;
    assert.ok(!(aborted instanceof Error));
    assert.deepEqual([...brief(aborted), aborted.attempts], ["in_doubt", 504, "drain_aborted", 1]);
    // Its key is now in doubt: the same request again is not forwarded.
    out = await gate.call(renewed, "POST", "/drain/a", { json: {}, idempotencyKey: "drain-a" });
    assert.deepEqual(brief(out), ["in_doubt", 409, "dedup_in_doubt"]);
    await k.originRelease("drain-a");
    assert.deepEqual((await k.originRequests("/drain/")).map((r) => r.path), ["/drain/a", "/drain/b"]);
    await k.leases().release(renewed);
  });

  test("retried outcomes", async () => {
    const k = await kit();
    const gate = k.gateway();
    // upstream_unreachable: nothing was sent; retried with the same key.
    const dead = await k.leases().acquire("dead", { holder: "worker", ttlMs: 30000 });
    const seen: [Outcome, number][] = [];
    let out = await gate.call(dead, "POST", "/dead/a", { json: {}, maxAttempts: 3, onRetry: (o, d) => seen.push([o, d]) });
    assert.deepEqual([...brief(out), out.attempts], ["unreachable", 502, "upstream_unreachable", 3]);
    assert.deepEqual(seen.map(([o]) => o.kind), ["unreachable", "unreachable"]);

    // store_unavailable: fencegate cannot reach the store to judge a new epoch;
    // `call` waits Retry-After and retries, and the store is back by then.
    seen.length = 0;
    let lease: Lease;
    await k.relayMode("gate", "blackhole");
    try {
      lease = await k.leases().acquire("store", { holder: "worker", ttlMs: 30000 });
      out = await gate.call(lease, "POST", "/store/a", {
        json: {},
        onRetry: (o, d) => {
          seen.push([o, d]);
          void k.relayMode("gate", "pass");
        },
      });
    } finally {
      await k.relayMode("gate", "pass");
    }
    assert.equal(seen.length, 1);
    const [firstTry, delay] = seen[0];
    assert.deepEqual([...brief(firstTry), firstTry.kind === "unavailable" && firstTry.retryAfterMs], ["unavailable", 503, "store_unavailable", 1000]);
    assert.equal(delay, 1000, "waited Retry-After");
    assert.equal(out.kind, "delivered", JSON.stringify(out));
    assert.equal(out.attempts, 2);
    assert.equal((await k.originRequests("/store/")).length, 1);
    await k.leases().release(lease);
    await k.leases().release(dead);
  });
});
