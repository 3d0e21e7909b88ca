/** The errors of the lease protocol. */
/** The store refused an operation, or the protocol gave up after `maxRounds` attempts. */
export declare class LeaseError extends Error {
    constructor(message: string, options?: {
        cause?: unknown;
    });
}
/** Someone else holds the lease (a live acquire that is not ours). */
export declare class LeaseHeld extends LeaseError {
    readonly lease: string;
    readonly epoch: number;
    readonly holder: string | null;
    readonly expiresAt: Date | null;
    constructor(lease: string, epoch: number, holder: string | null, expiresAt: Date | null);
}
/** The lease is no longer ours: a newer epoch exists, or ours expired. */
export declare class LeaseLost extends LeaseError {
    constructor(message: string);
}
/** Why a tenure ended: its renewal missed the deadline, a newer epoch exists, or `close()`. */
export type StopReason = "deadline" | "lost" | "closed";
/** The work must stop: the tenure ended. */
export declare class TenureEnded extends LeaseError {
    readonly lease: string;
    readonly reason: StopReason;
    constructor(lease: string, reason: StopReason);
}
