// The operator page in a real browser (issues 16, 29 and 32): a real fencegate
// process with in-doubt keys, headless Chromium driven by Playwright. Log in,
// read the shard map's leases, the members, an expired lease and a key's detail
// view; see the reload pause while the pointer is on the page or a form is open;
// open "resolve…", refuse the confirmation, then confirm "not delivered", see the
// key gone and the worker's retry forwarded at the origin; drop a queued message
// the destination refused from the queue panel.
//
// Run by scripts/browser-test.sh, which installs Chromium and this folder's npm
// packages and builds fencegate. Environment:
//   FENCEGATE_BIN   the fencegate binary
//   CHROMIUM        the browser (default /usr/bin/chromium)
//   ARTIFACTS       where screenshots go (default ./artifacts)
//   SCREENSHOT      where docs/admin.md's screenshot is written (optional)

import { test } from "node:test";
import assert from "node:assert/strict";
import { spawn, execFileSync } from "node:child_process";
import { mkdtempSync, writeFileSync, mkdirSync, copyFileSync, rmSync } from "node:fs";
import { createServer } from "node:http";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";

const BIN = process.env.FENCEGATE_BIN;
const ARTIFACTS = process.env.ARTIFACTS ?? "artifacts";
const TOKEN = "browser-test-admin-token";

/** An origin that records what it received; `x-test-hold` keeps the answer
 * back past the route's timeout, so the key goes in doubt; `x-test-status` is
 * the status it answers. */
async function startOrigin() {
  const arrivals = [];
  const server = createServer((req, res) => {
    let body = "";
    req.on("data", (c) => (body += c));
    req.on("end", () => {
      arrivals.push({ method: req.method, url: req.url, key: req.headers["idempotency-key"], body });
      const answer = () => {
        res.writeHead(Number(req.headers["x-test-status"] ?? 200), { "content-type": "application/json" });
        res.end(JSON.stringify({ ok: true, seq: arrivals.length }));
      };
      if (req.headers["x-test-hold"]) setTimeout(answer, 1500);
      else answer();
    });
  });
  await new Promise((r) => server.listen(0, "127.0.0.1", r));
  return { server, arrivals, port: server.address().port };
}

async function freePort() {
  const s = createServer();
  await new Promise((r) => s.listen(0, "127.0.0.1", r));
  const { port } = s.address();
  await new Promise((r) => s.close(r));
  return port;
}

async function waitFor(what, check, ms = 30000) {
  const end = Date.now() + ms;
  for (;;) {
    try {
      if (await check()) return;
    } catch {}
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

test("an operator resolves an in-doubt key from the page", { timeout: 180000 }, async (t) => {
  assert.ok(BIN, "FENCEGATE_BIN must name the fencegate binary");
  mkdirSync(ARTIFACTS, { recursive: true });
  const dir = mkdtempSync(join(tmpdir(), "fencegate-browser-"));
  const origin = await startOrigin();
  const [proxyPort, adminPort] = [await freePort(), await freePort()];
  const config = join(dir, "fencegate.toml");
  const route = (name, extra = "") => `[[route]]
name = "${name}"
path_prefix = "/${name}/"
upstream = "http://127.0.0.1:${origin.port}/v1/"
lease = "${name}"
timeout_ms = 300
${extra}`;
  writeFileSync(
    config,
    `[server]
listen = "127.0.0.1:${proxyPort}"
admin_listen = "127.0.0.1:${adminPort}"
data_dir = "${join(dir, "state")}"
admin_token = "${TOKEN}"

[store]
kind = "dir"
path = "${join(dir, "leases")}"
prefix = "fencegate/"
refresh_interval_ms = 200

${route("billing")}
${route("hooks", 'delivery = "queued"\n')}
${route("payouts")}
${route("reports")}`,
  );
  const fg = spawn(BIN, ["serve", "--config", config], { stdio: ["ignore", "inherit", "inherit"] });
  const exited = new Promise((r) => fg.once("exit", r));
  // One cleanup, in order, that never throws: a failed step must not skip the
  // browser's close (a live Chromium keeps node, and CI, waiting forever), and
  // the directory goes only after fencegate has exited (it writes there on
  // its way out: the instance guard's release).
  let browser;
  t.after(async () => {
    const step = async (what, f) => {
      try {
        await f();
      } catch (e) {
        console.error(`cleanup: ${what}: ${e}`);
      }
    };
    await step("close the browser", () => browser?.close());
    await step("stop fencegate", async () => {
      fg.kill("SIGTERM");
      const late = setTimeout(() => fg.kill("SIGKILL"), 15000);
      await exited;
      clearTimeout(late);
    });
    await step("stop the origin", () => {
      origin.server.closeAllConnections?.();
      origin.server.close();
    });
    await step("remove the temp dir", () => rmSync(dir, { recursive: true, force: true, maxRetries: 5 }));
  });
  const admin = `http://127.0.0.1:${adminPort}`;
  const proxy = `http://127.0.0.1:${proxyPort}`;
  await waitFor("fencegate to be ready", async () => (await fetch(`${admin}/readyz`)).ok);

  const lease = (...args) =>
    JSON.parse(execFileSync(BIN, ["lease", ...args, "--config", config], { encoding: "utf8" }));
  const send = (path, w, key, hold, status) =>
    fetch(`${proxy}${path}`, {
      method: "POST",
      headers: {
        "x-lease-epoch": String(w.epoch),
        "x-lease-token": w.token,
        "idempotency-key": key,
        ...(hold ? { "x-test-hold": "yes" } : {}),
        ...(status ? { "x-test-status": String(status) } : {}),
      },
      body: JSON.stringify({ amount: 1042 }),
    });

  // billing: worker-a, then worker-b takes over (the mark rises).
  const a = lease("acquire", "--lease", "billing", "--holder", "worker-a", "--ttl-ms", "60000");
  assert.equal((await send("/billing/charges", a, "order-1041")).status, 200);
  lease("release", "--lease", "billing", "--holder", "worker-a", "--epoch", String(a.epoch), "--token", a.token);
  const b = lease("acquire", "--lease", "billing", "--holder", "worker-b", "--ttl-ms", "60000");
  assert.ok(b.epoch > a.epoch);
  // Three requests the origin answers too late: their keys are in doubt.
  assert.equal((await send("/billing/charges", b, "order-1042", true)).status, 504);
  assert.equal((await send("/billing/refunds", b, "refund-77", true)).status, 504);
  const p = lease("acquire", "--lease", "payouts", "--holder", "payout-runner", "--ttl-ms", "20000");
  assert.equal((await send("/payouts/batch", p, "payout-2026-12-01", true)).status, 504);
  // reports: a tenure of 1 s, used once, then over.
  const r = lease("acquire", "--lease", "reports", "--holder", "report-runner", "--ttl-ms", "1000");
  assert.equal((await send("/reports/daily", r, "report-1")).status, 200);
  // hooks (queued): a message the destination refuses for good (400): failed.
  const h = lease("acquire", "--lease", "hooks", "--holder", "hook-sender", "--ttl-ms", "60000");
  assert.equal((await send("/hooks/events", h, "hook-1", false, 400)).status, 202);
  await waitFor("hook-1 to fail", async () =>
    (await (await fetch(`${admin}/v1/deliveries/hooks/hook-1`)).json()).status === "failed");
  await new Promise((res) => setTimeout(res, 2500));
  assert.equal(origin.arrivals.filter((x) => x.key === "order-1042").length, 1);

  browser = await chromium.launch({
    executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
    headless: true,
    args: [
      "--no-sandbox",
      "--disable-gpu",
      "--disable-quic",
      "--no-first-run",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
    ],
  });
  const context = await browser.newContext({ viewport: { width: 1180, height: 900 } });
  const page = await context.newPage();
  const outside = [];
  page.on("request", (r) => {
    if (!r.url().startsWith(admin)) outside.push(r.url());
  });

  // No session: the login form. A wrong token is refused.
  await page.goto(`${admin}/`);
  await page.locator('input[type="password"]').fill("not-the-token");
  await page.getByRole("button", { name: "log in" }).click();
  await page.getByText("That is not the admin token.").waitFor();
  assert.equal(page.url().includes(TOKEN), false);

  await page.locator('input[type="password"]').fill(TOKEN);
  await page.getByRole("button", { name: "log in" }).click();
  await page.locator("#in-doubt").waitFor();
  assert.equal(page.url(), `${admin}/`, "no token in the URL");
  const cookies = await context.cookies();
  const session = cookies.find((c) => c.name === "fencegate_admin");
  assert.ok(session && session.httpOnly && session.sameSite === "Strict", JSON.stringify(cookies));
  assert.equal(session.value.includes(TOKEN), false);

  const rows = page.locator("tr.key");
  assert.equal(await rows.count(), 3);
  const order = rows.filter({ hasText: "order-1042" });
  await assert.doesNotReject(order.getByText("POST /billing/charges").waitFor());
  const billing = page.locator("tr.lease", { hasText: "billing" });
  assert.match(await billing.innerText(), /worker-b/);
  // One name for one thing: "in doubt", as in the API; never "lingering".
  assert.equal(await page.getByText("lingering").count(), 0);
  // An expired tenure says so (not "time left: 2 s ago").
  const reports = page.locator("tr.lease", { hasText: "reports" });
  assert.match(await reports.locator('td[data-label="time left"]').innerText(), /^expired \d+ s ago$/);
  // The shard map names each shard's leases; the members list this instance.
  const shard = page.locator("tr.shard");
  assert.equal(await shard.locator("td.leases").innerText(), "billing hooks payouts reports");
  const member = page.locator("tr.member");
  assert.equal(await member.count(), 1);
  assert.match(await member.innerText(), /\(this instance\)\s+alive\s+0/);
  // Each route's protection of its destination (issue 29): nothing held here.
  const routes = page.locator("tr.route");
  assert.equal(await routes.count(), 4);
  const billingRoute = routes.filter({ hasText: "billing" });
  assert.equal(await billingRoute.locator('td[data-label="held"]').innerText(), "—");
  assert.equal(await billingRoute.locator('td[data-label="in flight"]').innerText(), "0");
  // Paths wrap at their slashes only.
  const path = order.locator("code.path");
  assert.equal(await path.evaluate((e) => getComputedStyle(e).wordBreak), "normal");
  assert.equal(await path.locator("wbr").count(), 2);
  await page.screenshot({ path: join(ARTIFACTS, "operator-page.png"), fullPage: true });
  if (process.env.SCREENSHOT) copyFileSync(join(ARTIFACTS, "operator-page.png"), process.env.SCREENSHOT);
  // A narrow screen: the tables become cards.
  await page.setViewportSize({ width: 390, height: 844 });
  await page.screenshot({ path: join(ARTIFACTS, "operator-page-narrow.png"), fullPage: true });
  await page.setViewportSize({ width: 1180, height: 900 });

  // The reload waits while the pointer is on the page, or a form is open.
  const status = page.locator("#refresh");
  await page.mouse.move(400, 300);
  await status.getByText("reload paused: the pointer is on the page").waitFor();
  await page.dispatchEvent("html", "mouseleave");
  await status.getByText(/^reloads in \d+ s$/).waitFor();
  await order.locator("summary", { hasText: "resolve…" }).click();
  await status.getByText("reload paused: a form is open").waitFor();
  await page.evaluate(() => (window.stillHere = true));
  await page.dispatchEvent("html", "mouseleave");
  await new Promise((res) => setTimeout(res, 11500));
  assert.equal(await page.evaluate(() => window.stillHere), true, "no reload while a form is open");
  await order.locator("summary", { hasText: "resolve…" }).click();
  await page.dispatchEvent("html", "mouseleave");
  await page.waitForEvent("load", { timeout: 15000 });
  assert.equal(await page.evaluate(() => window.stillHere), undefined, "reloaded once nothing held it");

  // A key's detail view: the request, its lease and epoch, what the destination answered.
  await page.locator("tr.key", { hasText: "refund-77" }).getByRole("link").click();
  const detail = page.locator("section#key");
  await detail.waitFor();
  const detailText = await detail.innerText();
  assert.match(detailText, /STATE\s+in doubt/i);
  assert.match(detailText, /POST \/billing\/refunds/);
  assert.match(detailText, new RegExp(`billing, epoch ${b.epoch}`));
  assert.match(detailText, /timed out/);
  await page.screenshot({ path: join(ARTIFACTS, "key-detail.png"), fullPage: true });
  await page.goto(`${admin}/`);

  // The operator checked the destination: not delivered — after a confirmation.
  const row = page.locator("tr.key", { hasText: "order-1042" });
  await row.locator("summary", { hasText: "resolve…" }).click();
  const asked = [];
  page.once("dialog", (d) => {
    asked.push(d.message());
    d.dismiss();
  });
  await row.getByRole("button", { name: "not delivered" }).click();
  await waitFor("the confirmation", () => asked.length === 1);
  assert.match(asked[0], /^Resolve billing \/ order-1042 as not delivered\?/);
  assert.equal(await page.locator("tr.key").count(), 3, "refused: nothing resolved");
  page.once("dialog", (d) => d.accept());
  await row.getByRole("button", { name: "not delivered" }).click();
  await page.getByText("Resolved billing / order-1042 as not delivered.").waitFor();
  assert.equal(await page.locator("tr.key", { hasText: "order-1042" }).count(), 0);
  assert.equal(await page.locator("tr.key").count(), 2);
  await page.screenshot({ path: join(ARTIFACTS, "after-resolve.png"), fullPage: true });

  // The worker's retry is forwarded now, with its key.
  const retry = await send("/billing/charges", b, "order-1042");
  assert.equal(retry.status, 200);
  const got = origin.arrivals.filter((x) => x.key === "order-1042");
  assert.equal(got.length, 2, JSON.stringify(origin.arrivals));
  assert.equal(got[1].url, "/v1/charges");

  // The queue panel: the refused message, failed; dropped after a confirmation.
  const queued = page.locator("tr.queue", { hasText: "hooks" });
  assert.equal(await queued.locator('td[data-label="failed"] .bad').innerText(), "1");
  // Its "Retry all" (a bulk job, SPEC §11) is there, behind a confirmation.
  assert.equal(await queued.locator('td[data-label="failed"] button').innerText(), "Retry all");
  const message = page.locator("tr.message", { hasText: "hook-1" });
  assert.equal(await message.locator('td[data-label="status"]').innerText(), "failed");
  assert.equal(await message.locator('td[data-label="last status"]').innerText(), "400");
  const dropAsked = [];
  page.once("dialog", (d) => {
    dropAsked.push(d.message());
    d.accept();
  });
  await message.getByRole("button", { name: "Drop" }).click();
  await page.getByText("Dropped hooks / hook-1").waitFor();
  assert.match(dropAsked[0], /^Drop hooks \/ hook-1\?/);
  assert.equal(await page.locator("tr.message").count(), 0);
  const dropped = await (await fetch(`${admin}/v1/deliveries/hooks/hook-1`)).json();
  assert.equal(dropped.status, "dropped");
  await page.screenshot({ path: join(ARTIFACTS, "after-drop.png"), fullPage: true });
  assert.deepEqual(outside, [], "the page fetched nothing from elsewhere");
});
