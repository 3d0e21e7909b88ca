/** Calls through fencegate (SPEC §3) with typed outcomes (SPEC §7) and safe retries. */

import { randomUUID } from "node:crypto";

import {
  DeliveryStatusError, DeliveryTimeout, NotDelivered, parseDelivery, type DeliveryStatus,
} from "./delivery";
import { isExpired, msLeft, type Lease } from "./held";
import { Tenure } from "./tenure";

// --------------------------------------------------------------------------- outcomes

interface OutcomeBase {
  /** 0 when there was no HTTP answer. */
  readonly status: number;
  /** Lowercase names. */
  readonly headers: Readonly<Record<string, string>>;
  readonly body: Uint8Array;
  /** fencegate's error code (`X-Fencegate-Error`, SPEC §7); null when the destination answered. */
  readonly code: string | null;
  /** Requests sent for this call (retries included). */
  readonly attempts: number;
  /** The epoch the (last) request carried; null when nothing was sent. */
  readonly epoch: number | null;
  /** The worker must stop this work (its epoch is over, or its request can never pass). */
  readonly mustStop: boolean;
  /** `call` retries it itself (with the same key), up to `maxAttempts`. */
  readonly retried: boolean;
  /** fencegate's JSON error body (`error`, `message`, context); {} otherwise. */
  readonly details: Readonly<Record<string, unknown>>;
  readonly message: string | undefined;
  text(): string;
  json(): unknown;
}

/**
 * The destination's own answer (any status: the destination's 4xx/5xx too).
 * `replayed`: the stored answer of an earlier identical request with the same
 * key (`X-Fencegate-Replayed: true`): the action happened once, earlier.
 */
export interface Delivered extends OutcomeBase { readonly kind: "delivered"; readonly replayed: boolean }
/**
 * 202 Accepted with `X-Fencegate-Delivery: queued`: a queued route (SPEC §11)
 * wrote the request durably and will deliver it (in order, with retries); the
 * destination has not answered yet. `delivery`: the message's status (the
 * 202's JSON); `location`: its status path; `statusUrl`: the same under the
 * client's base URL (what `waitDelivered` polls). A retry of the same key gets
 * this again while the message is pending or delivering.
 */
export interface Queued extends OutcomeBase {
  readonly kind: "queued";
  readonly delivery: DeliveryStatus | undefined;
  readonly dedupKey: string | undefined;
  readonly location: string;
  readonly statusUrl: string;
}
/** 409 epoch_stale: a newer epoch exists; you are no longer the leader. Stop. */
export interface Stale extends OutcomeBase { readonly kind: "stale" }
/** 409 lease_expired: the epoch expired on the store's clock. Stop; acquire again for new work. */
export interface Expired extends OutcomeBase { readonly kind: "expired" }
/** 401 token_missing, 403 token_invalid / epoch_unknown / epoch_invalid / peer_unauthorized: a bug. Stop. */
export interface Refused extends OutcomeBase { readonly kind: "refused" }
/**
 * The request itself is wrong: 428 epoch_missing, 400 epoch_malformed /
 * dedup_key_malformed / body_malformed, 408 body_timeout, 413 body_too_large,
 * 404 route_not_found, 501 upgrade_unsupported. Nothing was forwarded; fix it.
 */
export interface Invalid extends OutcomeBase { readonly kind: "invalid" }
/** 409 dedup_in_flight: the same key is being forwarded now. Retried by `call`; returned when attempts ran out. */
export interface InFlight extends OutcomeBase { readonly kind: "in_flight" }
/**
 * May or may not have reached the destination: 504 upstream_timeout or
 * drain_aborted (this call), or 409 dedup_in_doubt (an earlier one with this
 * key). Never retried: an operator resolves the key (admin API, SPEC §8).
 */
export interface InDoubt extends OutcomeBase { readonly kind: "in_doubt" }
/** 409 dedup_done: delivered, but the response was not stored. `upstreamStatus` when known. */
export interface AlreadyDone extends OutcomeBase { readonly kind: "already_done"; readonly upstreamStatus: number | undefined }
/**
 * 409 delivery_failed: a queued message with this key failed for good (the
 * destination refused it, or its retries ran out). `upstreamStatus`: the last
 * attempt's status; `detail`: its error. An operator may retry it.
 */
export interface DeliveryFailed extends OutcomeBase {
  readonly kind: "delivery_failed"; readonly upstreamStatus: number | undefined; readonly detail: string | undefined;
}
/** 409 delivery_dropped: a queued message with this key was dropped by an operator. */
export interface DeliveryDropped extends OutcomeBase { readonly kind: "delivery_dropped" }
/** 422 dedup_key_reused: the key was used for a different request. A bug. */
export interface KeyReused extends OutcomeBase { readonly kind: "key_reused" }
/** 503 store_unavailable / shard_unavailable / upstream_held / queue_full: nothing forwarded. Retried after Retry-After by `call`. */
export interface Unavailable extends OutcomeBase { readonly kind: "unavailable"; readonly retryAfterMs: number | undefined }
/** 502 upstream_unreachable: nothing was sent to the destination. Retried by `call`. */
export interface Unreachable extends OutcomeBase { readonly kind: "unreachable" }
/** An X-Fencegate-Error code this client does not know (not in SPEC §7). */
export interface UnknownError extends OutcomeBase { readonly kind: "unknown_error" }
/**
 * The client did not send: the tenure must stop, or the lease has expired (on
 * the latest estimate of the store's clock). `previous`: the last answer before
 * a retry was given up for this reason.
 */
export interface NotSent extends OutcomeBase { readonly kind: "not_sent"; readonly reason: string; readonly previous: Outcome | undefined }
/**
 * No HTTP answer from fencegate (refused, reset, timed out). `sent` is false
 * only when the connection was never made. Retried by `call` when nothing was
 * sent, or when the request carried an Idempotency-Key (a retry is then
 * answered from fencegate's record).
 */
export interface NoResponse extends OutcomeBase { readonly kind: "no_response"; readonly error: string; readonly sent: boolean }

export type Outcome =
  | Delivered | Queued | Stale | Expired | Refused | Invalid | InFlight | InDoubt | AlreadyDone | DeliveryFailed
  | DeliveryDropped | KeyReused | Unavailable | Unreachable | UnknownError | NotSent | NoResponse;

export type OutcomeKind = Outcome["kind"];

/** Every code of SPEC §7 and the kind of outcome it becomes. */
export const ERROR_CODES: Readonly<Record<string, OutcomeKind>> = Object.freeze({
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

const MUST_STOP: ReadonlySet<OutcomeKind> = new Set<OutcomeKind>(["stale", "expired", "refused", "not_sent"]);
const RETRIED: ReadonlySet<OutcomeKind> = new Set<OutcomeKind>(["in_flight", "unavailable", "unreachable"]);

/** Retry-After in milliseconds: delta-seconds or an HTTP date (RFC 9110 §10.2.3). */
export function parseRetryAfter(value: string | undefined | null): number | undefined {
  if (value == null) return undefined;
  const v = value.trim();
  if (/^\d+$/.test(v)) return Number(v) * 1000;
  const when = Date.parse(v);
  return Number.isNaN(when) ? undefined : Math.max(0, when - Date.now());
}

interface Parts {
  status: number;
  headers: Record<string, string>;
  body: Uint8Array;
  code: string | null;
  attempts: number;
  epoch: number | null;
}

function build(kind: OutcomeKind, p: Parts, extra: Record<string, unknown> = {}): Outcome {
  let details: Record<string, unknown> = {};
  if (p.code !== null) {
    try {
      const d: unknown = JSON.parse(new TextDecoder().decode(p.body));
      if (typeof d === "object" && d !== null && !Array.isArray(d)) details = d as Record<string, unknown>;
    } catch {
      // not JSON: no details
    }
  }
  const base = {
    kind, ...p, details,
    message: typeof details.message === "string" ? details.message : undefined,
    mustStop: MUST_STOP.has(kind),
    retried: RETRIED.has(kind),
    text(): string {
      return new TextDecoder().decode(p.body);
    },
    json(): unknown {
      return JSON.parse(new TextDecoder().decode(p.body));
    },
  };
  if (kind === "delivered") Object.assign(base, { replayed: p.headers["x-fencegate-replayed"] === "true" });
  if (kind === "already_done" || kind === "delivery_failed") {
    const s = details.upstream_status;
    Object.assign(base, { upstreamStatus: typeof s === "number" ? s : undefined });
  }
  if (kind === "delivery_failed") {
    const d = details.detail;
    Object.assign(base, { detail: typeof d === "string" ? d : undefined });
  }
  if (kind === "queued") {
    let delivery: DeliveryStatus | undefined;
    try {
      delivery = parseDelivery(JSON.parse(new TextDecoder().decode(p.body)));
    } catch {
      // not a status: none
    }
    const location = p.headers["location"] ?? "";
    Object.assign(base, { delivery, dedupKey: p.headers["x-fencegate-dedup-key"], location, statusUrl: location });
  }
  if (kind === "unavailable") Object.assign(base, { retryAfterMs: parseRetryAfter(p.headers["retry-after"]) });
  return Object.assign(base, extra) as unknown as Outcome;
}

/**
 * The outcome of one HTTP answer from fencegate: fencegate's own (by its
 * `X-Fencegate-Error` header, or a queued route's 202 by `X-Fencegate-Delivery:
 * queued`) or the destination's.
 */
export function parseOutcome(
  status: number, headers: Record<string, string> | Headers, body: Uint8Array, attempts = 1, epoch: number | null = null,
): Outcome {
  const h: Record<string, string> = {};
  if (typeof (headers as Headers).get === "function") {
    (headers as Headers).forEach((v, k) => { h[k.toLowerCase()] = v; });
  } else {
    for (const [k, v] of Object.entries(headers as Record<string, string>)) h[k.toLowerCase()] = v;
  }
  const code = h["x-fencegate-error"] ?? null;
  const queued = code === null && status === 202 && (h["x-fencegate-delivery"] ?? "").trim().toLowerCase() === "queued"
    && h["x-fencegate-replayed"] !== "true";
  const kind: OutcomeKind = queued ? "queued" : code === null ? "delivered" : (ERROR_CODES[code] ?? "unknown_error");
  return build(kind, { status, headers: h, body, code, attempts, epoch });
}

// --------------------------------------------------------------------------- the client

/** Pass as `idempotencyKey` to send no Idempotency-Key (fencegate derives one per its route's `derive_key`). */
export const NO_KEY: unique symbol = Symbol("NO_KEY");

export interface GatewayOptions {
  /** Per request. Default 30000. */
  timeoutMs?: number;
  /** Requests per call, retries included. Default 5. */
  maxAttempts?: number;
  /** First backoff between retries (doubling, at most 5 s). Default 200. */
  backoffMs?: number;
  /** A retry that would have to wait longer than this is not made. Default 30000. */
  maxRetryWaitMs?: number;
  /** Default: the global fetch. */
  fetch?: typeof fetch;
  /**
   * Send a lease's requests to the cluster member its last answer named as the
   * owner (`X-Fencegate-Owner`, SPEC §10.2), skipping the relay; the base URL
   * again when that member cannot be reached. Default true; false behind a
   * load balancer whose members the worker cannot reach (or whose TLS names
   * differ).
   */
  followOwner?: boolean;
}

export interface CallOptions {
  body?: string | Uint8Array;
  /** Sent as JSON (with Content-Type: application/json unless `headers` sets one). */
  json?: unknown;
  /**
   * One key per *action*; pass the same key to retry the same action later
   * (another process, after a crash). Default: a fresh key for this call, kept by
   * its own retries. NO_KEY: none sent.
   */
  idempotencyKey?: string | typeof NO_KEY;
  headers?: Record<string, string>;
  timeoutMs?: number;
  maxAttempts?: number;
  /** Called before each retry. */
  onRetry?: (outcome: Outcome, delayMs: number) => void;
  /**
   * The route is meant to be queued (SPEC §11). A queued route's 202 is a
   * `queued` outcome with or without this; with it, an answer that shows the
   * route is direct (the destination's own, fresh) is still returned as
   * `delivered`, and a process warning (`FENCEGATE_NOT_QUEUED`) is emitted.
   */
  queued?: boolean;
}

export interface WaitDeliveredOptions {
  /** Default 60000. */
  timeoutMs?: number;
  /**
   * The lease token (or the Lease) the message was accepted with. A `queued`
   * outcome carries its own; a renewed epoch's token is refused (403). None on
   * a route with `require_token = false`.
   */
  token?: string | Lease;
  /** Polls every 100 ms at first, doubling up to this. Default 2000. */
  maxIntervalMs?: number;
}

/** The token each queued outcome was accepted with (kept off the object: it is a secret). */
const ACCEPTED_WITH = new WeakMap<object, string>();

const RESERVED = new Set(["x-lease-epoch", "x-lease-token", "idempotency-key"]);
// Connection failures: nothing was sent.
const NOT_SENT_CODES = new Set(["ECONNREFUSED", "ENOTFOUND", "EAI_AGAIN", "EHOSTUNREACH", "ENETUNREACH", "UND_ERR_CONNECT_TIMEOUT"]);

function checkKey(key: string): void {
  if (key.length < 1 || key.length > 255 || !/^[\x21-\x7e]+$/.test(key)) {
    throw new Error("Idempotency-Key must be 1-255 visible ASCII characters (SPEC §3)");
  }
}

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

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
export class GatewayClient {
  private readonly base: string;
  private readonly timeoutMs: number;
  private readonly maxAttempts: number;
  private readonly backoffMs: number;
  private readonly maxRetryWaitMs: number;
  private readonly fetch: typeof fetch;
  private readonly followOwner: boolean;
  /** SPEC §10.2: per lease, the origin of the owner a cluster named in its last answer. */
  private readonly owners = new Map<string, string>();

  constructor(baseUrl: string, opts: GatewayOptions = {}) {
    const u = new URL(baseUrl);
    if (u.protocol !== "http:" && u.protocol !== "https:") throw new Error(`baseUrl ${baseUrl}: want http(s)://host[:port][/path]`);
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
  async call(holder: Tenure | Lease, method: string, path: string, opts: CallOptions = {}): Promise<Outcome> {
    let key: string | null;
    if (opts.idempotencyKey === undefined) key = `fgc-${randomUUID().replace(/-/g, "")}`;
    else if (opts.idempotencyKey === NO_KEY) key = null;
    else {
      key = opts.idempotencyKey;
      checkKey(key);
    }
    if (opts.json !== undefined && opts.body !== undefined) throw new Error("pass body or json, not both");
    const body = opts.json !== undefined ? JSON.stringify(opts.json) : opts.body;
    const baseHeaders: Record<string, string> = {};
    for (const [k, v] of Object.entries(opts.headers ?? {})) if (!RESERVED.has(k.toLowerCase())) baseHeaders[k] = v;
    if (opts.json !== undefined && !Object.keys(baseHeaders).some((k) => k.toLowerCase() === "content-type")) {
      baseHeaders["Content-Type"] = "application/json";
    }
    const attempts = opts.maxAttempts ?? this.maxAttempts;
    let previous: Outcome | undefined;
    for (let attempt = 1; ; attempt++) {
      const [lease, why] = current(holder);
      if (lease === null) return notSent(attempt - 1, why, previous);
      const h: Record<string, string> = { ...baseHeaders, "X-Lease-Epoch": String(lease.epoch), "X-Lease-Token": lease.token };
      if (key !== null) h["Idempotency-Key"] = key;
      let outcome = this.accepted(
        await this.sendOnce(method, path, body, h, opts.timeoutMs ?? this.timeoutMs, attempt, lease.epoch, lease.name), lease);
      const renewed = await renewedPast(holder, lease, outcome);
      if (renewed !== null) {
        // Refused at admission (nothing was forwarded) because this tenure's
        // own renewal reached fencegate first: the same request again, at the
        // renewed epoch.
        h["X-Lease-Epoch"] = String(renewed.epoch);
        h["X-Lease-Token"] = renewed.token;
        outcome = this.accepted(
          await this.sendOnce(method, path, body, h, opts.timeoutMs ?? this.timeoutMs, attempt, renewed.epoch, lease.name), renewed);
      }
      if (attempt >= attempts || !shouldRetry(outcome, key !== null)) {
        if (opts.queued && outcome.kind === "delivered" && !outcome.replayed) {
          process.emitWarning(`${method} ${path}: answered by the destination, not queued: the route is direct ` +
            "(queued: true expected X-Fencegate-Delivery: queued)", { code: "FENCEGATE_NOT_QUEUED" });
        }
        return outcome;
      }
      const delay = this.delay(outcome, attempt);
      if (delay > this.maxRetryWaitMs) return outcome;
      const left = holder instanceof Tenure ? holder.msLeft() : msLeft(holder);
      if (left <= delay) return outcome; // the work must stop before the retry could be sent
      opts.onRetry?.(outcome, delay);
      if (holder instanceof Tenure) {
        if (await holder.wait(delay)) return notSent(attempt, `tenure ended (${holder.stopReason})`, outcome);
      } else {
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
  async waitDelivered(target: Queued | string, opts: WaitDeliveredOptions = {}): Promise<DeliveryStatus> {
    let url: string;
    let token: string | undefined = typeof opts.token === "string" ? opts.token : opts.token?.token;
    if (typeof target === "string") {
      url = target;
    } else if (typeof target === "object" && target !== null && target.kind === "queued") {
      url = target.statusUrl || target.location;
      token ??= ACCEPTED_WITH.get(target);
    } else {
      throw new TypeError("waitDelivered: want a queued outcome or a status URL");
    }
    if (!url) throw new Error("waitDelivered: no status URL (a queued outcome without Location)");
    if (url.startsWith("/")) url = this.base + url;
    const u = new URL(url);
    if (u.protocol !== "http:" && u.protocol !== "https:") throw new Error(`waitDelivered: ${url} is not an http(s) URL or an absolute path`);
    const timeoutMs = opts.timeoutMs ?? 60000;
    const maxIntervalMs = opts.maxIntervalMs ?? 2000;
    const headers: Record<string, string> = { Accept: "application/json" };
    if (token !== undefined) headers["X-Lease-Token"] = token;
    const deadline = performance.now() + timeoutMs;
    let interval = Math.min(100, maxIntervalMs);
    let seen: DeliveryStatus | null = null;
    let problem: string | null = null;
    for (;;) {
      const left = deadline - performance.now();
      let res: Response | undefined;
      let payload: Uint8Array | undefined;
      try {
        res = await this.fetch(url, {
          method: "GET", headers, redirect: "manual", signal: AbortSignal.timeout(Math.ceil(Math.min(this.timeoutMs, Math.max(left, 500)))),
        });
        payload = new Uint8Array(await res.arrayBuffer());
      } catch (e) {
        problem = describe(e);
        res = undefined;
      }
      if (res !== undefined && payload !== undefined) {
        if (res.status === 200) {
          try {
            seen = parseDelivery(JSON.parse(new TextDecoder().decode(payload)));
          } catch (e) {
            throw new DeliveryStatusError(url, 200, null, { message: `not a delivery status: ${describe(e)}` });
          }
          if (seen.status === "delivered") return seen;
          if (seen.status === "failed" || seen.status === "dropped") throw new NotDelivered(seen);
        } else if (res.status >= 400 && res.status < 500 && res.status !== 408 && res.status !== 429) {
          const out = parseOutcome(res.status, res.headers, payload);
          throw new DeliveryStatusError(url, res.status, out.code, out.details);
        } else {
          problem = `HTTP ${res.status}${res.headers.get("x-fencegate-error") ? ` ${res.headers.get("x-fencegate-error")}` : ""}`;
        }
      }
      const rest = deadline - performance.now();
      if (rest <= 0) throw new DeliveryTimeout(url, timeoutMs, seen, problem);
      await sleep(Math.min(interval, rest));
      interval = Math.min(interval * 2, maxIntervalMs);
    }
  }

  /** A queued outcome with its status URL under this client's base URL, and the token it was accepted with. */
  private accepted(outcome: Outcome, lease: Lease): Outcome {
    if (outcome.kind !== "queued") return outcome;
    const q = Object.assign(outcome, { statusUrl: outcome.location ? this.base + outcome.location : "" });
    ACCEPTED_WITH.set(q, lease.token);
    return q;
  }

  private delay(outcome: Outcome, attempt: number): number {
    const backoff = Math.min(this.backoffMs * 2 ** (attempt - 1), 5000);
    if (outcome.kind === "unavailable") return outcome.retryAfterMs ?? Math.max(1000, backoff);
    return backoff;
  }

  private async sendOnce(
    method: string, path: string, body: string | Uint8Array | undefined, headers: Record<string, string>,
    timeoutMs: number, attempt: number, epoch: number, lease: string,
  ): Promise<Outcome> {
    const hinted = this.followOwner ? this.owners.get(lease) : undefined;
    let res: Response;
    try {
      res = await this.fetch(this.target(hinted) + path, {
        method, headers, body, redirect: "manual", signal: AbortSignal.timeout(timeoutMs),
      });
    } catch (e) {
      const cause = (e as { cause?: { code?: string } }).cause;
      const sent = !(cause?.code !== undefined && NOT_SENT_CODES.has(cause.code));
      // The named owner cannot be reached: the base URL again (its member
      // relays the request to whoever owns the lease now).
      if (!sent && hinted !== undefined) this.owners.delete(lease);
      return noResponse(attempt, sent ? epoch : null, describe(e), sent);
    }
    this.noteOwner(lease, res.headers.get("x-fencegate-owner"));
    let payload: Uint8Array;
    try {
      payload = new Uint8Array(await res.arrayBuffer());
    } catch (e) {
      return noResponse(attempt, epoch, describe(e), true);
    }
    return parseOutcome(res.status, res.headers, payload, attempt, epoch);
  }

  /** The base URL, or with the named owner's scheme, host and port (the path stays). */
  private target(owner: string | undefined): string {
    if (owner === undefined) return this.base;
    const u = new URL(this.base);
    return owner + u.pathname.replace(/\/+$/, "");
  }

  /** Keeps the owner a cluster named (SPEC §10.2); anything but an http(s) URL is ignored. */
  private noteOwner(lease: string, owner: string | null): void {
    if (!this.followOwner || !owner) return;
    let u: URL;
    try {
      u = new URL(owner);
    } catch {
      return;
    }
    if (u.protocol !== "http:" && u.protocol !== "https:") return;
    this.owners.set(lease, u.origin);
  }
}

/**
 * The tenure's renewed lease when `outcome` is a 409 epoch_stale whose newer
 * epoch is the tenure's own renewal (it holds it now, or once its renewal on
 * the way returns); null otherwise.
 */
async function renewedPast(holder: Tenure | Lease, sent: Lease, outcome: Outcome): Promise<Lease | null> {
  if (outcome.kind !== "stale" || !(holder instanceof Tenure)) return null;
  const latest = outcome.details.latest_epoch;
  if (typeof latest !== "number" || latest <= sent.epoch) return null;
  return holder.holdsAtLeast(latest, holder.msLeft());
}

function current(holder: Tenure | Lease): [Lease | null, string] {
  if (holder instanceof Tenure) {
    if (holder.mustStop) return [null, `tenure ended (${holder.stopReason ?? "deadline"})`];
    return [holder.lease, ""];
  }
  if (isExpired(holder)) return [null, `epoch ${holder.epoch} of lease ${holder.name} has expired on the store's clock`];
  return [holder, ""];
}

function shouldRetry(outcome: Outcome, keyed: boolean): boolean {
  if (outcome.kind === "no_response") return !outcome.sent || keyed;
  // dedup_in_flight: a key (ours, or one derived from this same request) is
  // being forwarded; the same request again is answered from its record.
  return outcome.retried;
}

function describe(e: unknown): string {
  const err = e as { name?: string; message?: string; cause?: { code?: string; message?: string } };
  const cause = err.cause ? ` (${err.cause.code ?? ""} ${err.cause.message ?? ""})`.replace("( ", "(") : "";
  return `${err.name ?? "Error"}: ${err.message ?? String(e)}${cause}`;
}

const EMPTY = { status: 0, headers: {}, body: new Uint8Array(), code: null };

function notSent(attempts: number, reason: string, previous: Outcome | undefined): NotSent {
  return build("not_sent", { ...EMPTY, attempts, epoch: null }, { reason, previous }) as NotSent;
}

function noResponse(attempts: number, epoch: number | null, error: string, sent: boolean): NoResponse {
  return build("no_response", { ...EMPTY, attempts, epoch }, { error, sent }) as NoResponse;
}
