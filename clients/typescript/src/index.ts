/**
 * fencegate's worker client: leases on an S3 lease store (SPEC §2) and calls
 * through fencegate (SPEC §3) with typed outcomes (SPEC §7).
 *
 * ```ts
 * const leases = new LeaseClient(new S3Client({}), { bucket: "leases", graceMs: 2000 });
 * const gate = new GatewayClient("http://127.0.0.1:8080");
 * const tenure = await leases.hold("billing", { holder: "worker-1", ttlMs: 30000, marginMs: 2000 });
 * const out = await gate.call(tenure, "POST", "/billing/charges", { json: { amount: 5 }, idempotencyKey: "charge-42" });
 * if (out.mustStop) ...; await tenure.close();
 * ```
 *
 * A queued route (SPEC §11) answers a `queued` outcome; `gate.waitDelivered(out)`
 * polls its status URL until it is delivered (or throws NotDelivered / DeliveryTimeout).
 */

export { StoreClock } from "./clock";
export {
  DeliveryError, DeliveryStatusError, DeliveryTimeout, NotDelivered, parseDelivery,
  type DeliveryState, type DeliveryStatus,
} from "./delivery";
export { LeaseError, LeaseHeld, LeaseLost, TenureEnded, type StopReason } from "./errors";
export { isExpired, msLeft, type Lease } from "./held";
export {
  LeaseClient, LEASE_NAME, MAX_ROUNDS, parseEpochObject, tokenSha256,
  type AcquireOptions, type EpochObject, type HoldOptions, type LeaseClientOptions,
} from "./lease";
export { Tenure, type TenureOptions } from "./tenure";
export {
  ERROR_CODES, GatewayClient, NO_KEY, parseOutcome, parseRetryAfter,
  type AlreadyDone, type CallOptions, type Delivered, type DeliveryDropped, type DeliveryFailed, type Expired,
  type GatewayOptions, type InDoubt, type InFlight, type Invalid, type KeyReused, type NoResponse, type NotSent,
  type Outcome, type OutcomeKind, type Queued, type Refused, type Stale, type Unavailable, type UnknownError,
  type Unreachable, type WaitDeliveredOptions,
} from "./gateway";
