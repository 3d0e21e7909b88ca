"use strict";
/** The errors of the lease protocol. */
Object.defineProperty(exports, "__esModule", { value: true });
exports.TenureEnded = exports.LeaseLost = exports.LeaseHeld = exports.LeaseError = void 0;
/** The store refused an operation, or the protocol gave up after `maxRounds` attempts. */
class LeaseError extends Error {
    constructor(message, options) {
        super(message);
        this.name = "LeaseError";
        if (options?.cause !== undefined)
            this.cause = options.cause;
    }
}
exports.LeaseError = LeaseError;
/** Someone else holds the lease (a live acquire that is not ours). */
class LeaseHeld extends LeaseError {
    lease;
    epoch;
    holder;
    expiresAt;
    constructor(lease, epoch, holder, expiresAt) {
        super(`lease ${lease} is held by ${JSON.stringify(holder)} at epoch ${epoch} until ${expiresAt?.toISOString() ?? "?"}`);
        this.lease = lease;
        this.epoch = epoch;
        this.holder = holder;
        this.expiresAt = expiresAt;
        this.name = "LeaseHeld";
    }
}
exports.LeaseHeld = LeaseHeld;
/** The lease is no longer ours: a newer epoch exists, or ours expired. */
class LeaseLost extends LeaseError {
    constructor(message) {
        super(message);
        this.name = "LeaseLost";
    }
}
exports.LeaseLost = LeaseLost;
/** The work must stop: the tenure ended. */
class TenureEnded extends LeaseError {
    lease;
    reason;
    constructor(lease, reason) {
        super(`tenure of lease ${lease} ended (${reason}): stop the work`);
        this.lease = lease;
        this.reason = reason;
        this.name = "TenureEnded";
    }
}
exports.TenureEnded = TenureEnded;
