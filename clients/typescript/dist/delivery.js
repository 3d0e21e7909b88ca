"use strict";
/**
 * A queued route's message as fencegate shows it (SPEC §11), and the errors of
 * waiting for its delivery. The client (gateway.ts) sends and polls; this
 * module only reads what came back.
 */
Object.defineProperty(exports, "__esModule", { value: true });
exports.DeliveryStatusError = exports.DeliveryTimeout = exports.NotDelivered = exports.DeliveryError = void 0;
exports.parseDelivery = parseDelivery;
const SETTLED = new Set(["delivered", "failed", "dropped"]);
const int = (v) => (typeof v === "number" && Number.isInteger(v) ? v : null);
const str = (v) => (typeof v === "string" ? v : null);
function time(v) {
    if (typeof v !== "string")
        return null;
    const t = Date.parse(v);
    return Number.isNaN(t) ? null : new Date(t);
}
/** A DeliveryStatus from the JSON of a queued 202 or a status URL; throws when it is not one. */
function parseDelivery(obj) {
    if (typeof obj !== "object" || obj === null || Array.isArray(obj))
        throw new Error("a delivery status is a JSON object");
    const o = obj;
    const route = str(o.route), dedupKey = str(o.dedup_key), status = str(o.status);
    if (route === null || dedupKey === null || status === null)
        throw new Error("a delivery status has route, dedup_key and status");
    return {
        route, dedupKey, lease: str(o.lease) ?? "", epoch: int(o.epoch) ?? 0, seq: int(o.seq) ?? 0,
        status: status, attempts: int(o.attempts) ?? 0, unknownOutcomes: int(o.unknown_outcomes) ?? 0,
        acceptedAt: time(o.accepted_at), updatedAt: time(o.updated_at), nextAttemptAt: time(o.next_attempt_at),
        lastStatus: int(o.last_status), lastError: str(o.last_error), location: str(o.location) ?? "",
        settled: SETTLED.has(status), raw: { ...o },
    };
}
/** `waitDelivered` did not see the message delivered (one of the three below). */
class DeliveryError extends Error {
    constructor(message) {
        super(message);
        this.name = "DeliveryError";
    }
}
exports.DeliveryError = DeliveryError;
/**
 * The message settled without being delivered: `status` "failed" (the
 * destination refused it, or its retries ran out; an operator may retry it) or
 * "dropped" (an operator). `lastStatus`, `lastError`: its last attempt's.
 */
class NotDelivered extends DeliveryError {
    delivery;
    status;
    lastStatus;
    lastError;
    constructor(delivery) {
        const why = [delivery.lastStatus !== null ? `last status ${delivery.lastStatus}` : "", delivery.lastError ?? ""].filter((s) => s);
        super(`message ${JSON.stringify(delivery.dedupKey)} of route ${JSON.stringify(delivery.route)}: ${delivery.status} after ` +
            `${delivery.attempts} attempt(s)${why.length ? ` (${why.join("; ")})` : ""}`);
        this.delivery = delivery;
        this.name = "NotDelivered";
        this.status = delivery.status;
        this.lastStatus = delivery.lastStatus;
        this.lastError = delivery.lastError;
    }
}
exports.NotDelivered = NotDelivered;
/**
 * The timeout passed with the message still pending or delivering (it still
 * will be delivered): `delivery` is the last status seen (null when the status
 * URL never answered).
 */
class DeliveryTimeout extends DeliveryError {
    location;
    timeoutMs;
    delivery;
    constructor(location, timeoutMs, delivery, lastProblem = null) {
        super(`${location}: not delivered within ${timeoutMs} ms: ${delivery ? `still ${delivery.status}` : `no status (${lastProblem ?? "no answer"})`}`);
        this.location = location;
        this.timeoutMs = timeoutMs;
        this.delivery = delivery;
        this.name = "DeliveryTimeout";
    }
}
exports.DeliveryTimeout = DeliveryTimeout;
/**
 * The status URL refused the query: 401 token_missing, 403 token_invalid (not
 * the token the message was accepted with), 404 delivery_not_found (no such
 * message, or settled longer than `[dedup] ttl` ago and swept), or an answer
 * that is not a status. `code`: fencegate's `X-Fencegate-Error`; `details`:
 * its JSON error body.
 */
class DeliveryStatusError extends DeliveryError {
    location;
    status;
    code;
    details;
    constructor(location, status, code, details) {
        const msg = typeof details.message === "string" ? `: ${details.message}` : "";
        super(`${location}: ${status}${code ? ` ${code}` : ""}${msg}`);
        this.location = location;
        this.status = status;
        this.code = code;
        this.details = details;
        this.name = "DeliveryStatusError";
    }
}
exports.DeliveryStatusError = DeliveryStatusError;
