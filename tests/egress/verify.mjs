// A webhook receiver's check, done with the `standardwebhooks` npm package (the
// TypeScript/JavaScript reference library), of deliveries fencegate signed
// (tests/it/webhooks.rs). Input: a JSON file {"secrets": {NAME: "whsec_..."},
// "arrivals": [{"headers": {...}, "body_b64": "..."}]}. Output on stdout, one
// entry per arrival: which secrets verify it, and whether the same delivery
// is rejected with one byte of its body changed, and when received ten minutes
// late (Date.now moved forward: the library's own tolerance is five minutes).
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";

const { Webhook } = createRequire(import.meta.url)("standardwebhooks");
const input = JSON.parse(readFileSync(process.argv[2], "utf8"));
const realNow = Date.now;

function attempt(secret, body, headers) {
  try {
    new Webhook(secret).verify(body, headers);
    return null;
  } catch (e) {
    return String(e && e.message ? e.message : e);
  }
}

const out = input.arrivals.map((a) => {
  const body = Buffer.from(a.body_b64, "base64").toString("utf8");
  const verified = {};
  const errors = {};
  let good = null;
  for (const [name, secret] of Object.entries(input.secrets)) {
    const err = attempt(secret, body, a.headers);
    verified[name] = err === null;
    if (err !== null) errors[name] = err;
    else if (good === null) good = secret;
  }
  const entry = { id: a.headers["webhook-id"], verified, errors };
  if (good !== null) {
    const tampered = attempt(good, body + " ", a.headers);
    entry.tampered_rejected = tampered !== null;
    Date.now = () => realNow() + 10 * 60 * 1000;
    const stale = attempt(good, body, a.headers);
    Date.now = realNow;
    entry.stale_rejected = stale !== null;
    entry.stale_error = stale;
  }
  return entry;
});
process.stdout.write(JSON.stringify(out) + "\n");
