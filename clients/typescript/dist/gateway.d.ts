/** Calls through fencegate (SPEC §3) with typed outcomes (SPEC §7) and safe retries. */
import { type DeliveryStatus } from "./delivery";
import { type Lease } from "./held";
import { Tenure } from "./tenure";
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
export interface Delivered extends OutcomeBase {
    readonly kind: "delivered";
    readonly replayed: boolean;
}
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
export interface Stale extends OutcomeBase {
    readonly kind: "stale";
}
/** 409 lease_expired: the epoch expired on the store's clock. Stop; acquire again for new work. */
export interface Expired extends OutcomeBase {
    readonly kind: "expired";
}
/** 401 token_missing, 403 token_invalid / epoch_unknown / epoch_invalid / peer_unauthorized: a bug. Stop. */
export interface Refused extends OutcomeBase {
    readonly kind: "refused";
}
/**
 * The request itself is wrong: 428 epoch_missing, 400 epoch_malformed /
 * dedup_key_malformed / body_malformed, 408 body_timeout, 413 body_too_large,
 * 404 route_not_found, 501 upgrade_unsupported. Nothing was forwarded; fix it.
 */
export interface Invalid extends OutcomeBase {
    readonly kind: "invalid";
}
/** 409 dedup_in_flight: the same key is being forwarded now. Retried by `call`; returned when attempts ran out. */
export interface InFlight extends OutcomeBase {
    readonly kind: "in_flight";
}
/**
 * May or may not have reached the destination: 504 upstream_timeout or
 * drain_aborted (this call), or 409 dedup_in_doubt (an earlier one with this
 * key). Never retried: an operator resolves the key (admin API, SPEC §8).
 */
export interface InDoubt extends OutcomeBase {
    readonly kind: "in_doubt";
}
/** 409 dedup_done: delivered, but the response was not stored. `upstreamStatus` when known. */
export interface AlreadyDone extends OutcomeBase {
    readonly kind: "already_done";
    readonly upstreamStatus: number | undefined;
}
/**
 * 409 delivery_failed: a queued message with this key failed for good (the
 * destination refused it, or its retries ran out). `upstreamStatus`: the last
 * attempt's status; `detail`: its error. An operator may retry it.
 */
export interface DeliveryFailed extends OutcomeBase {
    readonly kind: "delivery_failed";
    readonly upstreamStatus: number | undefined;
    readonly detail: string | undefined;
}
/** 409 delivery_dropped: a queued message with this key was dropped by an operator. */
export interface DeliveryDropped extends OutcomeBase {
    readonly kind: "delivery_dropped";
}
/** 422 dedup_key_reused: the key was used for a different request. A bug. */
export interface KeyReused extends OutcomeBase {
    readonly kind: "key_reused";
}
/** 503 store_unavailable / shard_unavailable / upstream_held / queue_full: nothing forwarded. Retried after Retry-After by `call`. */
export interface Unavailable extends OutcomeBase {
    readonly kind: "unavailable";
    readonly retryAfterMs: number | undefined;
}
/** 502 upstream_unreachable: nothing was sent to the destination. Retried by `call`. */
export interface Unreachable extends OutcomeBase {
    readonly kind: "unreachable";
}
/** An X-Fencegate-Error code this client does not know (not in SPEC §7). */
export interface UnknownError extends OutcomeBase {
    readonly kind: "unknown_error";
}
/**
 * The client did not send: the tenure must stop, or the lease has expired (on
 * the latest estimate of the store's clock). `previous`: the last answer before
 * a retry was given up for this reason.
 */
export interface NotSent extends OutcomeBase {
    readonly kind: "not_sent";
    readonly reason: string;
    readonly previous: Outcome | undefined;
}
/**
 * No HTTP answer from fencegate (refused, reset, timed out). `sent` is false
 * only when the connection was never made. Retried by `call` when nothing was
 * sent, or when the request carried an Idempotency-Key (a retry is then
 * answered from fencegate's record).
 */
export interface NoResponse extends OutcomeBase {
    readonly kind: "no_response";
    readonly error: string;
    readonly sent: boolean;
}
export type Outcome = Delivered | Queued | Stale | Expired | Refused | Invalid | InFlight | InDoubt | AlreadyDone | DeliveryFailed | DeliveryDropped | KeyReused | Unavailable | Unreachable | UnknownError | NotSent | NoResponse;
export type OutcomeKind = Outcome["kind"];
/** Every code of SPEC §7 and the kind of outcome it becomes. */
export declare const ERROR_CODES: Readonly<Record<string, OutcomeKind>>;
/** Retry-After in milliseconds: delta-seconds or an HTTP date (RFC 9110 §10.2.3). */
export declare function parseRetryAfter(value: string | undefined | null): number | undefined;
/**
 * The outcome of one HTTP answer from fencegate: fencegate's own (by its
 * `X-Fencegate-Error` header, or a queued route's 202 by `X-Fencegate-Delivery:
 * queued`) or the destination's.
 */
export declare function parseOutcome(status: number, headers: Record<string, string> | Headers, body: Uint8Array, attempts?: number, epoch?: number | null): Outcome;
/** Pass as `idempotencyKey` to send no Idempotency-Key (fencegate derives one per its route's `derive_key`). */
export declare const NO_KEY: unique symbol;
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
export declare class GatewayClient {
    private readonly base;
    private readonly timeoutMs;
    private readonly maxAttempts;
    private readonly backoffMs;
    private readonly maxRetryWaitMs;
    private readonly fetch;
    private readonly followOwner;
    /** SPEC §10.2: per lease, the origin of the owner a cluster named in its last answer. */
    private readonly owners;
    constructor(baseUrl: string, opts?: GatewayOptions);
    /**
     * Sends `method path` (a path under one of fencegate's routes, with its query)
     * carrying the holder's current epoch and token.
     *
     * A queued route's `202` (`X-Fencegate-Delivery: queued`, SPEC §11) is
     * returned as a `queued` outcome — with or without `opts.queued` — never as
     * `delivered`: the destination has not answered yet. Pass it to
     * `waitDelivered`.
     */
    call(holder: Tenure | Lease, method: string, path: string, opts?: CallOptions): Promise<Outcome>;
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
    waitDelivered(target: Queued | string, opts?: WaitDeliveredOptions): Promise<DeliveryStatus>;
    /** A queued outcome with its status URL under this client's base URL, and the token it was accepted with. */
    private accepted;
    private delay;
    private sendOnce;
    /** The base URL, or with the named owner's scheme, host and port (the path stays). */
    private target;
    /** Keeps the owner a cluster named (SPEC §10.2); anything but an http(s) URL is ignored. */
    private noteOwner;
}
export {};
