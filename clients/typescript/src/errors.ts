/** The errors of the lease protocol. */

/** The store refused an operation, or the protocol gave up after `maxRounds` attempts. */
export class LeaseError extends Error {
  constructor(message: string, options?: { cause?: unknown }) {
    super(message);
    this.name = "LeaseError";
    if (options?.cause !== undefined) (this as { cause?: unknown }).cause = options.cause;
  }
}

/** Someone else holds the lease (a live acquire that is not ours). */
export class LeaseHeld extends LeaseError {
  constructor(
    readonly lease: string,
    readonly epoch: number,
    readonly holder: string | null,
    readonly expiresAt: Date | null,
  ) {
    super(`lease ${lease} is held by ${JSON.stringify(holder)} at epoch ${epoch} until ${expiresAt?.toISOString() ?? "?"}`);
    this.name = "LeaseHeld";
  }
}

/** The lease is no longer ours: a newer epoch exists, or ours expired. */
export class LeaseLost extends LeaseError {
  constructor(message: string) {
    super(message);
    this.name = "LeaseLost";
  }
}

/** Why a tenure ended: its renewal missed the deadline, a newer epoch exists, or `close()`. */
export type StopReason = "deadline" | "lost" | "closed";

/** The work must stop: the tenure ended. */
export class TenureEnded extends LeaseError {
  constructor(
    readonly lease: string,
    readonly reason: StopReason,
  ) {
    super(`tenure of lease ${lease} ended (${reason}): stop the work`);
    this.name = "TenureEnded";
  }
}
