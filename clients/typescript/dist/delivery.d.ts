/**
 * A queued route's message as fencegate shows it (SPEC §11), and the errors of
 * waiting for its delivery. The client (gateway.ts) sends and polls; this
 * module only reads what came back.
 */
/** A message's status; the last three are settled. */
export type DeliveryState = "pending" | "delivering" | "delivered" | "failed" | "dropped";
/**
 * One queued message: the JSON of a queued 202 and of its status URL.
 * `attempts`: the attempts started; `unknownOutcomes`: those whose outcome was
 * unknown (sent again: the destination may have seen them twice);
 * `lastStatus`, `lastError`: the last attempt's; `nextAttemptAt` while
 * pending. Times are on fencegate's clock.
 */
export interface DeliveryStatus {
    readonly route: string;
    readonly dedupKey: string;
    readonly lease: string;
    readonly epoch: number;
    readonly seq: number;
    /** A string this client does not know is kept as it came. */
    readonly status: DeliveryState;
    readonly attempts: number;
    readonly unknownOutcomes: number;
    readonly acceptedAt: Date | null;
    readonly updatedAt: Date | null;
    readonly nextAttemptAt: Date | null;
    readonly lastStatus: number | null;
    readonly lastError: string | null;
    readonly location: string;
    /** Delivered, failed or dropped: it is no longer waiting to be sent. */
    readonly settled: boolean;
    /** The JSON object as fencegate sent it. */
    readonly raw: Readonly<Record<string, unknown>>;
}
/** A DeliveryStatus from the JSON of a queued 202 or a status URL; throws when it is not one. */
export declare function parseDelivery(obj: unknown): DeliveryStatus;
/** `waitDelivered` did not see the message delivered (one of the three below). */
export declare class DeliveryError extends Error {
    constructor(message: string);
}
/**
 * The message settled without being delivered: `status` "failed" (the
 * destination refused it, or its retries ran out; an operator may retry it) or
 * "dropped" (an operator). `lastStatus`, `lastError`: its last attempt's.
 */
export declare class NotDelivered extends DeliveryError {
    readonly delivery: DeliveryStatus;
    readonly status: DeliveryState;
    readonly lastStatus: number | null;
    readonly lastError: string | null;
    constructor(delivery: DeliveryStatus);
}
/**
 * The timeout passed with the message still pending or delivering (it still
 * will be delivered): `delivery` is the last status seen (null when the status
 * URL never answered).
 */
export declare class DeliveryTimeout extends DeliveryError {
    readonly location: string;
    readonly timeoutMs: number;
    readonly delivery: DeliveryStatus | null;
    constructor(location: string, timeoutMs: number, delivery: DeliveryStatus | null, lastProblem?: string | null);
}
/**
 * The status URL refused the query: 401 token_missing, 403 token_invalid (not
 * the token the message was accepted with), 404 delivery_not_found (no such
 * message, or settled longer than `[dedup] ttl` ago and swept), or an answer
 * that is not a status. `code`: fencegate's `X-Fencegate-Error`; `details`:
 * its JSON error body.
 */
export declare class DeliveryStatusError extends DeliveryError {
    readonly location: string;
    readonly status: number;
    readonly code: string | null;
    readonly details: Readonly<Record<string, unknown>>;
    constructor(location: string, status: number, code: string | null, details: Readonly<Record<string, unknown>>);
}
