/**
 * SPEC §10.2, the owner hint: a lease's next request goes to the member its
 * last answer named (`X-Fencegate-Owner`), with the same path; back to the base
 * URL when that member cannot be reached; never to anything but an http(s) URL.
 * Two local HTTP servers stand in for a cluster's members (the hint itself is
 * asserted against a real cluster in tests/it/cluster). The Python suite runs
 * the same list.
 */

import assert from "node:assert/strict";
import { createServer, type Server } from "node:http";
import { type AddressInfo } from "node:net";
import { describe, test } from "node:test";

import { GatewayClient, StoreClock, type Lease } from "fencegate-client";

class Member {
  readonly paths: string[] = [];
  owner: string | null = null;
  url = "";
  private readonly server: Server;

  constructor() {
    this.server = createServer((req, res) => {
      req.resume();
      req.on("end", () => {
        this.paths.push(req.url ?? "");
        if (this.owner) res.setHeader("X-Fencegate-Owner", this.owner);
        res.end("ok");
      });
    });
  }

  async start(): Promise<this> {
    await new Promise<void>((resolve) => this.server.listen(0, "127.0.0.1", resolve));
    this.url = `http://127.0.0.1:${(this.server.address() as AddressInfo).port}`;
    return this;
  }

  async stop(): Promise<void> {
    this.server.closeAllConnections();
    await new Promise<void>((resolve) => this.server.close(() => resolve()));
  }
}

function lease(name: string): Lease {
  return {
    name, epoch: 1, token: "t".repeat(64), holder: "w", ttlMs: 60_000,
    expiresAt: new Date(Date.now() + 60_000), clock: new StoreClock(), reconciled: false,
  };
}

describe("the owner hint", () => {
  test("the next request goes to the named owner, per lease, and back to the base when it is gone", async () => {
    const a = await new Member().start();
    const b = await new Member().start();
    try {
      a.owner = b.url;
      b.owner = b.url;
      const gw = new GatewayClient(a.url + "/base", { backoffMs: 10 });
      assert.equal((await gw.call(lease("billing"), "POST", "/x", { body: "1" })).kind, "delivered");
      assert.equal((await gw.call(lease("billing"), "POST", "/y", { body: "2" })).kind, "delivered");
      assert.deepEqual(a.paths, ["/base/x"]);
      assert.deepEqual(b.paths, ["/base/y"], "the path stays the base's");
      a.owner = null;
      await gw.call(lease("other"), "POST", "/z", { body: "3" });
      assert.deepEqual(a.paths, ["/base/x", "/base/z"]);
      await b.stop();
      assert.equal((await gw.call(lease("billing"), "POST", "/w", { body: "4" })).kind, "delivered");
      assert.equal(a.paths.at(-1), "/base/w");
      await gw.call(lease("billing"), "POST", "/v", { body: "5" });
      assert.equal(a.paths.at(-1), "/base/v");
    } finally {
      await a.stop();
    }
  });

  test("no hint is followed when told not to, or when it is no http(s) URL", async () => {
    const a = await new Member().start();
    const b = await new Member().start();
    try {
      a.owner = b.url;
      const off = new GatewayClient(a.url, { followOwner: false });
      await off.call(lease("billing"), "POST", "/x", { body: "1" });
      await off.call(lease("billing"), "POST", "/y", { body: "2" });
      assert.deepEqual(a.paths, ["/x", "/y"]);
      for (const bad of ["ftp://127.0.0.1:1", "not a url"]) {
        a.owner = bad;
        const gw = new GatewayClient(a.url);
        await gw.call(lease("billing"), "POST", "/x", { body: "1" });
        await gw.call(lease("billing"), "POST", "/y", { body: "2" });
        assert.deepEqual(a.paths.slice(-2), ["/x", "/y"], bad);
      }
      assert.deepEqual(b.paths, []);
    } finally {
      await a.stop();
      await b.stop();
    }
  });
});
