/**
 * A lease we hold: one epoch with its token and expiry (`Lease`), and what
 * renews and releases it (`Renewer`: a LeaseClient). The client (lease.ts)
 * makes Leases and Tenures; a Tenure (tenure.ts) needs only this module, not
 * the client.
 */

import type { StoreClock } from "./clock";

/** One epoch of a lease that we hold. `expiresAt` is on the store's clock. */
export interface Lease {
  readonly name: string;
  readonly epoch: number;
  readonly token: string;
  readonly holder: string;
  readonly ttlMs: number;
  readonly expiresAt: Date;
  /** The estimate `expiresAt` is judged with. */
  readonly clock: StoreClock;
  /**
   * True when the create's answer was not a plain success (lost, a 412 after an
   * SDK retry, a 5xx) and reading the object back decided that we won.
   */
  readonly reconciled: boolean;
}

/** Milliseconds until the lease ends, on the latest estimate of the store's clock. */
export function msLeft(lease: Lease): number {
  return lease.clock.msUntil(lease.expiresAt);
}

export function isExpired(lease: Lease): boolean {
  return msLeft(lease) <= 0;
}

/** What a Tenure renews and releases its lease with (a LeaseClient). */
export interface Renewer {
  renew(current: Lease, ttlMs?: number): Promise<Lease>;
  release(current: Lease): Promise<number>;
}
