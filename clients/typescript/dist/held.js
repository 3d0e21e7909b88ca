"use strict";
/**
 * A lease we hold: one epoch with its token and expiry (`Lease`), and what
 * renews and releases it (`Renewer`: a LeaseClient). The client (lease.ts)
 * makes Leases and Tenures; a Tenure (tenure.ts) needs only this module, not
 * the client.
 */
Object.defineProperty(exports, "__esModule", { value: true });
exports.msLeft = msLeft;
exports.isExpired = isExpired;
/** Milliseconds until the lease ends, on the latest estimate of the store's clock. */
function msLeft(lease) {
    return lease.clock.msUntil(lease.expiresAt);
}
function isExpired(lease) {
    return msLeft(lease) <= 0;
}
