/**
 * A queued route's message as fencegate shows it (SPEC §11), and the errors of
 * waiting for its delivery. The client (gateway.ts) sends and polls; this
 * module only reads what came back.
 */

/** A message's status; the last three are settled. */
export type DeliveryState = "pending" | "delivering" | "delivered" | "failed" | "dropped";

const SETTLED: ReadonlySet<string> = new Set(["delivered", "failed", "dropped"]);

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

const int = (v: unknown): number | null => (typeof v === "number" && Number.isInteger(v) ? v : null);
const str = (v: unknown): string | null => (typeof v === "string" ? v : null);
function time(v: unknown): Date | null {
  if (typeof v !== "string") return null;
  const t = Date.parse(v);
  return Number.isNaN(t) ? null : new Date(t);
}

/** A DeliveryStatus from the JSON of a queued 202 or a status URL; throws when it is not one. */
export function parseDelivery(obj: unknown): DeliveryStatus {
  if (typeof obj !== "object" || obj === null || Array.isArray(obj)) throw new Error("a delivery status is a JSON object");
  const o = obj as Record<string, unknown>;
  const route = str(o.route), dedupKey = str(o.dedup_key), status = str(o.status);
  if (route === null || dedupKey === null || status === null) throw new Error("a delivery status has route, dedup_key and status");
  return {
    route, dedupKey, lease: str(o.lease) ?? "", epoch: int(o.epoch) ?? 0, seq: int(o.seq) ?? 0,
    status: status as DeliveryState, attempts: int(o.attempts) ?? 0, unknownOutcomes: int(o.unknown_outcomes) ?? 0,
    acceptedAt: time(o.accepted_at), updatedAt: time(o.updated_at), nextAttemptAt: time(o.next_attempt_at),
    lastStatus: int(o.last_status), lastError: str(o.last_error), location: str(o.location) ?? "",
    settled: SETTLED.has(status), raw: { ...o },
  };
}

/** `waitDelivered` did not see the message delivered (one of the three below). */
export class DeliveryError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "DeliveryError";
  }
}

/**
 * The message settled without being delivered: `status` "failed" (the
 * destination refused it, or its retries ran out; an operator may retry it) or
 * "dropped" (an operator). `lastStatus`, `lastError`: its last attempt's.
 */
export class NotDelivered extends DeliveryError {
  readonly status: DeliveryState;
  readonly lastStatus: number | null;
  readonly lastError: string | null;
  constructor(readonly delivery: DeliveryStatus) {
    const why = [delivery.lastStatus !== null ? `last status ${delivery.lastStatus}` : "", delivery.lastError ?? ""].filter((s) => s);
    super(`message ${JSON.stringify(delivery.dedupKey)} of route ${JSON.stringify(delivery.route)}: ${delivery.status} after ` +
      `${delivery.attempts} attempt(s)${why.length ? ` (${why.join("; ")})` : ""}`);
    this.name = "NotDelivered";
    this.status = delivery.status;
    this.lastStatus = delivery.lastStatus;
    this.lastError = delivery.lastError;
  }
}

/**
 * The timeout passed with the message still pending or delivering (it still
 * will be delivered): `delivery` is the last status seen (null when the status
 * URL never answered).
 */
export class DeliveryTimeout extends DeliveryError {
  constructor(
    readonly location: string,
    readonly timeoutMs: number,
    readonly delivery: DeliveryStatus | null,
    lastProblem: string | null = null,
  ) {
    super(`${location}: not delivered within ${timeoutMs} ms: ${delivery ? `still ${delivery.status}` : `no status (${lastProblem ?? "no answer"})`}`);
    this.name = "DeliveryTimeout";
  }
}

/**
 * The status URL refused the query: 401 token_missing, 403 token_invalid (not
 * the token the message was accepted with), 404 delivery_not_found (no such
 * message, or settled longer than `[dedup] ttl` ago and swept), or an answer
 * that is not a status. `code`: fencegate's `X-Fencegate-Error`; `details`:
 * its JSON error body.
 */
export class DeliveryStatusError extends DeliveryError {
  constructor(
    readonly location: string,
    readonly status: number,
    readonly code: string | null,
    readonly details: Readonly<Record<string, unknown>>,
  ) {
    const msg = typeof details.message === "string" ? `: ${details.message}` : "";
    super(`${location}: ${status}${code ? ` ${code}` : ""}${msg}`);
    this.name = "DeliveryStatusError";
  }
}
