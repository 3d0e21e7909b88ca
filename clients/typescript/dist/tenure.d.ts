/** A tenure: a held lease that renews itself and says when the work must stop. */
import { type StopReason } from "./errors";
import { type Lease, type Renewer } from "./held";
export interface TenureOptions {
    /** How long before the lease could end the work is told to stop. Default 2000. */
    marginMs?: number;
    onStop?: (reason: StopReason) => void;
}
/**
 * Holds a lease: renews it in the background and signals stop BEFORE it ends.
 *
 * The stop deadline is `expiresAt - marginMs`, with `expiresAt` judged on the
 * latest estimate of the store's clock (so up to ~1 s earlier still): it runs on
 * the monotonic clock, comes earlier when a newer estimate says so, and moves
 * later only with a successful renewal. A renewal is attempted when half of the time to
 * the deadline is left, and retried (every ≤ 1 s) until the deadline. The signal
 * does not depend on the renewal returning: a timer fires it at the deadline
 * even while a renewal hangs on an unreachable store.
 *
 * `marginMs` is the time the work needs to notice the signal and stop what it
 * is doing (including actions that do not go through fencegate). fencegate
 * itself refuses the epoch from `expiresAt` on (409 lease_expired) and once a
 * newer epoch is admitted (409 epoch_stale).
 *
 * The tenure's timers keep Node's event loop alive until it stops or is closed.
 */
export declare class Tenure {
    private readonly client;
    readonly marginMs: number;
    /** Aborted (with a TenureEnded reason) when the work must stop. */
    readonly signal: AbortSignal;
    /** Successful renewals so far. */
    renewals: number;
    lastError: unknown;
    /** The latest estimate of the store's clock when stop was signalled. */
    stoppedAt: Date | null;
    private current;
    private reason;
    private released;
    private stopAt;
    private watchdog;
    private renewTimer;
    private renewing;
    private readonly controller;
    private readonly onStop;
    private readonly unsubscribe;
    constructor(client: Renewer, lease: Lease, opts?: TenureOptions);
    /** The current epoch (it changes at each renewal: use it for every request). */
    get lease(): Lease;
    get name(): string;
    get mustStop(): boolean;
    get stopReason(): StopReason | null;
    /** Milliseconds until the work must stop (≤ 0: now). */
    msLeft(): number;
    /**
     * This tenure's lease if it holds `epoch` or a later one, waiting up to
     * `timeoutMs` for a renewal on its way: a request sent with the epoch before
     * the renewal is refused as stale (409 epoch_stale) once fencegate has seen
     * the renewal's epoch, before the renewal has returned here. null: a newer
     * epoch that is not this tenure's, or the work must stop.
     */
    holdsAtLeast(epoch: number, timeoutMs: number): Promise<Lease | null>;
    /** Throws TenureEnded if the work must stop. */
    check(): void;
    /** Resolves true once the stop signal came, or false after `timeoutMs`. */
    wait(timeoutMs?: number): Promise<boolean>;
    /**
     * Stops renewing (the work must stop) and, with `release` (default), releases
     * the current epoch so that the next worker need not wait for expiry. Returns
     * the release epoch, or undefined. Waits up to `timeoutMs` for a renewal in progress.
     */
    close(opts?: {
        release?: boolean;
        timeoutMs?: number;
    }): Promise<number | undefined>;
    private deadline;
    private halfway;
    private armWatchdog;
    private scheduleRenewal;
    private renewOnce;
    private clockMoved;
    private stop;
}
