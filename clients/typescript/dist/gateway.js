"use strict";
/** Calls through fencegate (SPEC §3) with typed outcomes (SPEC §7) and safe retries. */
Object.defineProperty(exports, "__esModule", { value: true });
exports.GatewayClient = exports.NO_KEY = exports.ERROR_CODES = void 0;
exports.parseRetryAfter = parseRetryAfter;
exports.parseOutcome = parseOutcome;
const node_crypto_1 = require("node:crypto");
const delivery_1 = require("./delivery");
const held_1 = require("./held");
const tenure_1 = require("./tenure");
/** Every code of SPEC §7 and the kind of outcome it becomes. */
exports.ERROR_CODES = Object.freeze({
    epoch_malformed: "invalid",
    dedup_key_malformed: "invalid",
    body_malformed: "invalid",
    dedup_key_missing: "invalid",
    token_missing: "refused",
    token_invalid: "refused",
    epoch_unknown: "refused",
    epoch_invalid: "refused",
    peer_unauthorized: "refused",
    route_not_found: "invalid",
    body_timeout: "invalid",
    epoch_stale: "stale",
    lease_expired: "expired",
    dedup_in_flight: "in_flight",
    dedup_in_doubt: "in_doubt",
    dedup_done: "already_done",
    delivery_failed: "delivery_failed",
    delivery_dropped: "delivery_dropped",
    delivery_not_found: "invalid",
    body_too_large: "invalid",
    dedup_key_reused: "key_reused",
    epoch_missing: "invalid",
    upgrade_unsupported: "invalid",
    upstream_unreachable: "unreachable",
    store_unavailable: "unavailable",
    shard_unavailable: "unavailable",
    upstream_held: "unavailable",
    queue_full: "unavailable",
    route_changed: "unavailable",
    request_malformed: "invalid",
    uri_too_long: "invalid",
    headers_too_large: "invalid",
    upstream_timeout: "in_doubt",
    drain_aborted: "in_doubt",
});
const MUST_STOP = new Set(["stale", "expired", "refused", "not_sent"]);
const RETRIED = new Set(["in_flight", "unavailable", "unreachable"]);
/** Retry-After in milliseconds: delta-seconds or an HTTP date (RFC 9110 §10.2.3). */
function parseRetryAfter(value) {
    if (value == null)
        return undefined;
    const v = value.trim();
    if (/^\d+$/.test(v))
        return Number(v) * 1000;
    const when = Date.parse(v);
    return Number.isNaN(when) ? undefined : Math.max(0, when - Date.now());
}
function build(kind, p, extra = {}) {
    let details = {};
    if (p.code !== null) {
        try {
            const d = JSON.parse(new TextDecoder().decode(p.body));
            if (typeof d === "object" && d !== null && !Array.isArray(d))
                details = d;
        }
        catch {
            // not JSON: no details
        }
    }
    const base = {
        kind, ...p, details,
        message: typeof details.message === "string" ? details.message : undefined,
        mustStop: MUST_STOP.has(kind),
        retried: RETRIED.has(kind),
        text() {
            return new TextDecoder().decode(p.body);
        },
        json() {
            return JSON.parse(new TextDecoder().decode(p.body));
        },
    };
    if (kind === "delivered")
        Object.assign(base, { replayed: p.headers["x-fencegate-replayed"] === "true" });
    if (kind === "already_done" || kind === "delivery_failed") {
        const s = details.upstream_status;
        Object.assign(base, { upstreamStatus: typeof s === "number" ? s : undefined });
    }
    if (kind === "delivery_failed") {
        const d = details.detail;
        Object.assign(base, { detail: typeof d === "string" ? d : undefined });
    }
    if (kind === "queued") {
        let delivery;
        try {
            delivery = (0, delivery_1.parseDelivery)(JSON.parse(new TextDecoder().decode(p.body)));
        }
        catch {
            // not a status: none
        }
        const location = p.headers["location"] ?? "";
        Object.assign(base, { delivery, dedupKey: p.headers["x-fencegate-dedup-key"], location, statusUrl: location });
    }
    if (kind === "unavailable")
        Object.assign(base, { retryAfterMs: parseRetryAfter(p.headers["retry-after"]) });
    return Object.assign(base, extra);
}
/**
 * The outcome of one HTTP answer from fencegate: fencegate's own (by its
 * `X-Fencegate-Error` header, or a queued route's 202 by `X-Fencegate-Delivery:
 * queued`) or the destination's.
 */
function parseOutcome(status, headers, body, attempts = 1, epoch = null) {
    const h = {};
    if (typeof headers.get === "function") {
        headers.forEach((v, k) => { h[k.toLowerCase()] = v; });
    }
    else {
        for (const [k, v] of Object.entries(headers))
            h[k.toLowerCase()] = v;
    }
    const code = h["x-fencegate-error"] ?? null;
    const queued = code === null && status === 202 && (h["x-fencegate-delivery"] ?? "").trim().toLowerCase() === "queued"
        && h["x-fencegate-replayed"] !== "true";
    const kind = queued ? "queued" : code === null ? "delivered" : (exports.ERROR_CODES[code] ?? "unknown_error");
    return build(kind, { status, headers: h, body, code, attempts, epoch });
}
// --------------------------------------------------------------------------- the client
/** Pass as `idempotencyKey` to send no Idempotency-Key (fencegate derives one per its route's `derive_key`). */
exports.NO_KEY = Symbol("NO_KEY");
/** The token each queued outcome was accepted with (kept off the object: it is a secret). */
const ACCEPTED_WITH = new WeakMap();
const RESERVED = new Set(["x-lease-epoch", "x-lease-token", "idempotency-key"]);
// Connection failures: nothing was sent.
const NOT_SENT_CODES = new Set(["ECONNREFUSED", "ENOTFOUND", "EAI_AGAIN", "EHOSTUNREACH", "ENETUNREACH", "UND_ERR_CONNECT_TIMEOUT"]);
function checkKey(key) {
    if (key.length < 1 || key.length > 255 || !/^[\x21-\x7e]+$/.test(key)) {
        throw new Error("Idempotency-Key must be 1-255 visible ASCII characters (SPEC §3)");
    }
}
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
/**
 * Sends requests through fencegate with the epoch and token of a Lease or a
 * Tenure (SPEC §3) and returns typed outcomes (SPEC §7).
 *
 * Retries — always with the same Idempotency-Key, at most `maxAttempts`
 * requests per call, never past the tenure's stop — only what SPEC says is
 * safe: 503 store_unavailable / shard_unavailable / upstream_held / queue_full (after Retry-After), 502
 * upstream_unreachable, 409 dedup_in_flight, and no answer at all (when nothing
 * was sent, or when the request carried a key). Everything else is returned.
 */
class GatewayClient {
    base;
    timeoutMs;
    maxAttempts;
    backoffMs;
    maxRetryWaitMs;
    fetch;
    followOwner;
    /** SPEC §10.2: per lease, the origin of the owner a cluster named in its last answer. */
    owners = new Map();
    constructor(baseUrl, opts = {}) {
        const u = new URL(baseUrl);
        if (u.protocol !== "http:" && u.protocol !== "https:")
            throw new Error(`baseUrl ${baseUrl}: want http(s)://host[:port][/path]`);
        this.base = baseUrl.replace(/\/+$/, "");
        this.timeoutMs = opts.timeoutMs ?? 30000;
        this.maxAttempts = opts.maxAttempts ?? 5;
        this.backoffMs = opts.backoffMs ?? 200;
        this.maxRetryWaitMs = opts.maxRetryWaitMs ?? 30000;
        this.fetch = opts.fetch ?? fetch;
        this.followOwner = opts.followOwner ?? true;
    }
    /**
     * Sends `method path` (a path under one of fencegate's routes, with its query)
     * carrying the holder's current epoch and token.
     *
     * A queued route's `202` (`X-Fencegate-Delivery: queued`, SPEC §11) is
     * returned as a `queued` outcome — with or without `opts.queued` — never as
     * `delivered`: the destination has not answered yet. Pass it to
     * `waitDelivered`.
     */
    async call(holder, method, path, opts = {}) {
        let key;
        if (opts.idempotencyKey === undefined)
            key = `fgc-${(0, node_crypto_1.randomUUID)().replace(/-/g, "")}`;
        else if (opts.idempotencyKey === exports.NO_KEY)
            key = null;
        else {
            key = opts.idempotencyKey;
            checkKey(key);
        }
        if (opts.json !== undefined && opts.body !== undefined)
            throw new Error("pass body or json, not both");
        const body = opts.json !== undefined ? JSON.stringify(opts.json) : opts.body;
        const baseHeaders = {};
        for (const [k, v] of Object.entries(opts.headers ?? {}))
            if (!RESERVED.has(k.toLowerCase()))
                baseHeaders[k] = v;
        if (opts.json !== undefined && !Object.keys(baseHeaders).some((k) => k.toLowerCase() === "content-type")) {
            baseHeaders["Content-Type"] = "application/json";
        }
        const attempts = opts.maxAttempts ?? this.maxAttempts;
        let previous;
        for (let attempt = 1;; attempt++) {
            const [lease, why] = current(holder);
            if (lease === null)
                return notSent(attempt - 1, why, previous);
            const h = { ...baseHeaders, "X-Lease-Epoch": String(lease.epoch), "X-Lease-Token": lease.token };
            if (key !== null)
                h["Idempotency-Key"] = key;
            let outcome = this.accepted(await this.sendOnce(method, path, body, h, opts.timeoutMs ?? this.timeoutMs, attempt, lease.epoch, lease.name), lease);
            const renewed = await renewedPast(holder, lease, outcome);
            if (renewed !== null) {
                // Refused at admission (nothing was forwarded) because this tenure's
                // own renewal reached fencegate first: the same request again, at the
                // renewed epoch.
                h["X-Lease-Epoch"] = String(renewed.epoch);
                h["X-Lease-Token"] = renewed.token;
                outcome = this.accepted(await this.sendOnce(method, path, body, h, opts.timeoutMs ?? this.timeoutMs, attempt, renewed.epoch, lease.name), renewed);
            }
            if (attempt >= attempts || !shouldRetry(outcome, key !== null)) {
                if (opts.queued && outcome.kind === "delivered" && !outcome.replayed) {
                    process.emitWarning(`${method} ${path}: answered by the destination, not queued: the route is direct ` +
                        "(queued: true expected X-Fencegate-Delivery: queued)", { code: "FENCEGATE_NOT_QUEUED" });
                }
                return outcome;
            }
            const delay = this.delay(outcome, attempt);
            if (delay > this.maxRetryWaitMs)
                return outcome;
            const left = holder instanceof tenure_1.Tenure ? holder.msLeft() : (0, held_1.msLeft)(holder);
            if (left <= delay)
                return outcome; // the work must stop before the retry could be sent
            opts.onRetry?.(outcome, delay);
            if (holder instanceof tenure_1.Tenure) {
                if (await holder.wait(delay))
                    return notSent(attempt, `tenure ended (${holder.stopReason})`, outcome);
            }
            else {
                await sleep(delay);
            }
            previous = outcome;
        }
    }
    /**
     * Polls a queued message's status URL until it is delivered, and resolves to
     * its status. `target`: a `queued` outcome, or its status URL (absolute, or a
     * path such as `/.fencegate/deliveries/{route}/{key}`, taken under this
     * client's base URL).
     *
     * Throws `NotDelivered` when it settles failed or dropped (`status`,
     * `lastStatus`, `lastError`), `DeliveryTimeout` when `timeoutMs` passes first,
     * `DeliveryStatusError` when the status URL refuses the query (401, 403, 404
     * delivery_not_found). No answer or a 5xx is polled again.
     */
    async waitDelivered(target, opts = {}) {
        let url;
        let token = typeof opts.token === "string" ? opts.token : opts.token?.token;
        if (typeof target === "string") {
            url = target;
        }
        else if (typeof target === "object" && target !== null && target.kind === "queued") {
            url = target.statusUrl || target.location;
            token ??= ACCEPTED_WITH.get(target);
        }
        else {
            throw new TypeError("waitDelivered: want a queued outcome or a status URL");
        }
        if (!url)
            throw new Error("waitDelivered: no status URL (a queued outcome without Location)");
        if (url.startsWith("/"))
            url = this.base + url;
        const u = new URL(url);
        if (u.protocol !== "http:" && u.protocol !== "https:")
            throw new Error(`waitDelivered: ${url} is not an http(s) URL or an absolute path`);
        const timeoutMs = opts.timeoutMs ?? 60000;
        const maxIntervalMs = opts.maxIntervalMs ?? 2000;
        const headers = { Accept: "application/json" };
        if (token !== undefined)
            headers["X-Lease-Token"] = token;
        const deadline = performance.now() + timeoutMs;
        let interval = Math.min(100, maxIntervalMs);
        let seen = null;
        let problem = null;
        for (;;) {
            const left = deadline - performance.now();
            let res;
            let payload;
            try {
                res = await this.fetch(url, {
                    method: "GET", headers, redirect: "manual", signal: AbortSignal.timeout(Math.ceil(Math.min(this.timeoutMs, Math.max(left, 500)))),
                });
                payload = new Uint8Array(await res.arrayBuffer());
            }
            catch (e) {
                problem = describe(e);
                res = undefined;
            }
            if (res !== undefined && payload !== undefined) {
                if (res.status === 200) {
                    try {
                        seen = (0, delivery_1.parseDelivery)(JSON.parse(new TextDecoder().decode(payload)));
                    }
                    catch (e) {
                        throw new delivery_1.DeliveryStatusError(url, 200, null, { message: `not a delivery status: ${describe(e)}` });
                    }
                    if (seen.status === "delivered")
                        return seen;
                    if (seen.status === "failed" || seen.status === "dropped")
                        throw new delivery_1.NotDelivered(seen);
                }
                else if (res.status >= 400 && res.status < 500 && res.status !== 408 && res.status !== 429) {
                    const out = parseOutcome(res.status, res.headers, payload);
                    throw new delivery_1.DeliveryStatusError(url, res.status, out.code, out.details);
                }
                else {
                    problem = `HTTP ${res.status}${res.headers.get("x-fencegate-error") ? ` ${res.headers.get("x-fencegate-error")}` : ""}`;
                }
            }
            const rest = deadline - performance.now();
            if (rest <= 0)
                throw new delivery_1.DeliveryTimeout(url, timeoutMs, seen, problem);
            await sleep(Math.min(interval, rest));
            interval = Math.min(interval * 2, maxIntervalMs);
        }
    }
    /** A queued outcome with its status URL under this client's base URL, and the token it was accepted with. */
    accepted(outcome, lease) {
        if (outcome.kind !== "queued")
            return outcome;
        const q = Object.assign(outcome, { statusUrl: outcome.location ? this.base + outcome.location : "" });
        ACCEPTED_WITH.set(q, lease.token);
        return q;
    }
    delay(outcome, attempt) {
        const backoff = Math.min(this.backoffMs * 2 ** (attempt - 1), 5000);
        if (outcome.kind === "unavailable")
            return outcome.retryAfterMs ?? Math.max(1000, backoff);
        return backoff;
    }
    async sendOnce(method, path, body, headers, timeoutMs, attempt, epoch, lease) {
        const hinted = this.followOwner ? this.owners.get(lease) : undefined;
        let res;
        try {
            res = await this.fetch(this.target(hinted) + path, {
                method, headers, body, redirect: "manual", signal: AbortSignal.timeout(timeoutMs),
            });
        }
        catch (e) {
            const cause = e.cause;
            const sent = !(cause?.code !== undefined && NOT_SENT_CODES.has(cause.code));
            // The named owner cannot be reached: the base URL again (its member
            // relays the request to whoever owns the lease now).
            if (!sent && hinted !== undefined)
                this.owners.delete(lease);
            return noResponse(attempt, sent ? epoch : null, describe(e), sent);
        }
        this.noteOwner(lease, res.headers.get("x-fencegate-owner"));
        let payload;
        try {
            payload = new Uint8Array(await res.arrayBuffer());
        }
        catch (e) {
            return noResponse(attempt, epoch, describe(e), true);
        }
        return parseOutcome(res.status, res.headers, payload, attempt, epoch);
    }
    /** The base URL, or with the named owner's scheme, host and port (the path stays). */
    target(owner) {
        if (owner === undefined)
            return this.base;
        const u = new URL(this.base);
        return owner + u.pathname.replace(/\/+$/, "");
    }
    /** Keeps the owner a cluster named (SPEC §10.2); anything but an http(s) URL is ignored. */
    noteOwner(lease, owner) {
        if (!this.followOwner || !owner)
            return;
        let u;
        try {
            u = new URL(owner);
        }
        catch {
            return;
        }
        if (u.protocol !== "http:" && u.protocol !== "https:")
            return;
        this.owners.set(lease, u.origin);
    }
}
exports.GatewayClient = GatewayClient;
/**
 * The tenure's renewed lease when `outcome` is a 409 epoch_stale whose newer
 * epoch is the tenure's own renewal (it holds it now, or once its renewal on
 * the way returns); null otherwise.
 */
async function renewedPast(holder, sent, outcome) {
    if (outcome.kind !== "stale" || !(holder instanceof tenure_1.Tenure))
        return null;
    const latest = outcome.details.latest_epoch;
    if (typeof latest !== "number" || latest <= sent.epoch)
        return null;
    return holder.holdsAtLeast(latest, holder.msLeft());
}
function current(holder) {
    if (holder instanceof tenure_1.Tenure) {
        if (holder.mustStop)
            return [null, `tenure ended (${holder.stopReason ?? "deadline"})`];
        return [holder.lease, ""];
    }
    if ((0, held_1.isExpired)(holder))
        return [null, `epoch ${holder.epoch} of lease ${holder.name} has expired on the store's clock`];
    return [holder, ""];
}
function shouldRetry(outcome, keyed) {
    if (outcome.kind === "no_response")
        return !outcome.sent || keyed;
    // dedup_in_flight: a key (ours, or one derived from this same request) is
    // being forwarded; the same request again is answered from its record.
    return outcome.retried;
}
function describe(e) {
    const err = e;
    const cause = err.cause ? ` (${err.cause.code ?? ""} ${err.cause.message ?? ""})`.replace("( ", "(") : "";
    return `${err.name ?? "Error"}: ${err.message ?? String(e)}${cause}`;
}
const EMPTY = { status: 0, headers: {}, body: new Uint8Array(), code: null };
function notSent(attempts, reason, previous) {
    return build("not_sent", { ...EMPTY, attempts, epoch: null }, { reason, previous });
}
function noResponse(attempts, epoch, error, sent) {
    return build("no_response", { ...EMPTY, attempts, epoch }, { error, sent });
}
