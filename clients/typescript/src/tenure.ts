/** A tenure: a held lease that renews itself and says when the work must stop. */

import { LeaseLost, TenureEnded, type StopReason } from "./errors";
import { isExpired, type Lease, type Renewer } from "./held";

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
export class Tenure {
  readonly marginMs: number;
  /** Aborted (with a TenureEnded reason) when the work must stop. */
  readonly signal: AbortSignal;
  /** Successful renewals so far. */
  renewals = 0;
  lastError: unknown = undefined;
  /** The latest estimate of the store's clock when stop was signalled. */
  stoppedAt: Date | null = null;

  private current: Lease;
  private reason: StopReason | null = null;
  private released = false;
  private stopAt: number; // performance.now() ms
  private watchdog: NodeJS.Timeout | undefined;
  private renewTimer: NodeJS.Timeout | undefined;
  private renewing: Promise<void> | undefined;
  private readonly controller = new AbortController();
  private readonly onStop: ((reason: StopReason) => void) | undefined;
  private readonly unsubscribe: () => void;

  constructor(
    private readonly client: Renewer,
    lease: Lease,
    opts: TenureOptions = {},
  ) {
    this.marginMs = opts.marginMs ?? 2000;
    if (this.marginMs < 0 || this.marginMs >= lease.ttlMs) throw new Error("marginMs must be in [0, ttlMs)");
    this.onStop = opts.onStop;
    this.signal = this.controller.signal;
    this.current = lease;
    this.stopAt = this.deadline(lease);
    // A newer estimate of the store's clock may bring the deadline forward.
    this.unsubscribe = lease.clock.subscribe(() => this.clockMoved());
    this.armWatchdog();
    this.scheduleRenewal(this.halfway());
  }

  /** The current epoch (it changes at each renewal: use it for every request). */
  get lease(): Lease {
    return this.current;
  }

  get name(): string {
    return this.current.name;
  }

  get mustStop(): boolean {
    return this.reason !== null || performance.now() >= this.stopAt;
  }

  get stopReason(): StopReason | null {
    return this.reason;
  }

  /** Milliseconds until the work must stop (≤ 0: now). */
  msLeft(): number {
    return this.reason !== null ? 0 : this.stopAt - performance.now();
  }

  /**
   * This tenure's lease if it holds `epoch` or a later one, waiting up to
   * `timeoutMs` for a renewal on its way: a request sent with the epoch before
   * the renewal is refused as stale (409 epoch_stale) once fencegate has seen
   * the renewal's epoch, before the renewal has returned here. null: a newer
   * epoch that is not this tenure's, or the work must stop.
   */
  async holdsAtLeast(epoch: number, timeoutMs: number): Promise<Lease | null> {
    const renewing = this.renewing;
    if (this.current.epoch < epoch && renewing !== undefined && this.reason === null) {
      let timer: NodeJS.Timeout | undefined;
      const timeout = new Promise<void>((resolve) => {
        timer = setTimeout(resolve, Math.max(0, timeoutMs));
      });
      await Promise.race([renewing, timeout]);
      clearTimeout(timer);
    }
    if (this.reason !== null || this.current.epoch < epoch) return null;
    return this.current;
  }

  /** Throws TenureEnded if the work must stop. */
  check(): void {
    if (this.mustStop) throw new TenureEnded(this.name, this.reason ?? "deadline");
  }

  /** Resolves true once the stop signal came, or false after `timeoutMs`. */
  wait(timeoutMs?: number): Promise<boolean> {
    if (this.signal.aborted) return Promise.resolve(true);
    return new Promise((resolve) => {
      let timer: NodeJS.Timeout | undefined;
      const done = () => {
        if (timer) clearTimeout(timer);
        resolve(true);
      };
      this.signal.addEventListener("abort", done, { once: true });
      if (timeoutMs !== undefined) {
        timer = setTimeout(() => {
          this.signal.removeEventListener("abort", done);
          resolve(false);
        }, Math.max(0, timeoutMs));
      }
    });
  }

  /**
   * Stops renewing (the work must stop) and, with `release` (default), releases
   * the current epoch so that the next worker need not wait for expiry. Returns
   * the release epoch, or undefined. Waits up to `timeoutMs` for a renewal in progress.
   */
  async close(opts: { release?: boolean; timeoutMs?: number } = {}): Promise<number | undefined> {
    this.stop("closed");
    const pending = this.renewing;
    let finished = pending === undefined;
    if (pending) {
      let timer: NodeJS.Timeout | undefined;
      await Promise.race([
        pending.then(() => { finished = true; }),
        new Promise<void>((resolve) => { timer = setTimeout(resolve, opts.timeoutMs ?? 10000); }),
      ]);
      if (timer) clearTimeout(timer);
    }
    if (opts.release === false || !finished || this.reason === "lost" || this.released) return undefined;
    this.released = true;
    if (isExpired(this.current)) return undefined;
    return this.client.release(this.current);
  }

  // ---- inside

  private deadline(lease: Lease): number {
    return performance.now() + lease.clock.msUntil(lease.expiresAt) - this.marginMs;
  }

  private halfway(): number {
    const now = performance.now();
    return now + Math.max(0, this.stopAt - now) / 2;
  }

  private armWatchdog(): void {
    if (this.watchdog) clearTimeout(this.watchdog);
    const ms = this.stopAt - performance.now();
    if (ms <= 0) {
      this.stop("deadline");
      return;
    }
    // Timers may fire a little early: check again then.
    this.watchdog = setTimeout(() => this.armWatchdog(), Math.ceil(ms));
  }

  private scheduleRenewal(at: number): void {
    if (this.renewTimer) clearTimeout(this.renewTimer);
    this.renewTimer = setTimeout(() => {
      this.renewTimer = undefined;
      this.renewing = this.renewOnce();
    }, Math.max(0, at - performance.now()));
  }

  private async renewOnce(): Promise<void> {
    if (this.reason !== null) return;
    const current = this.current;
    let next: Lease;
    try {
      next = await this.client.renew(current);
    } catch (e) {
      this.lastError = e;
      if (e instanceof LeaseLost) {
        this.stop("lost");
        return;
      }
      if (this.reason !== null) return;
      // The store is unreachable or failing: retry until the deadline.
      const left = this.stopAt - performance.now();
      this.scheduleRenewal(performance.now() + Math.min(1000, Math.max(50, left / 4)));
      return;
    }
    this.current = next;
    if (this.reason !== null) {
      // The renewal came back after the stop: nobody works under the new epoch,
      // so free it now rather than make the next worker wait.
      this.released = true;
      await this.client.release(next).catch(() => undefined);
      return;
    }
    this.renewals++;
    this.stopAt = this.deadline(next);
    this.armWatchdog();
    this.scheduleRenewal(this.halfway());
  }

  private clockMoved(): void {
    if (this.reason !== null) return;
    const fresh = this.deadline(this.current);
    if (fresh < this.stopAt) {
      this.stopAt = fresh;
      this.armWatchdog();
    }
  }

  private stop(reason: StopReason): void {
    if (this.reason !== null) return;
    this.reason = reason;
    this.unsubscribe();
    this.stoppedAt = new Date(this.current.clock.latest());
    if (this.watchdog) clearTimeout(this.watchdog);
    if (this.renewTimer) clearTimeout(this.renewTimer);
    this.controller.abort(new TenureEnded(this.name, reason));
    if (this.onStop) {
      try {
        this.onStop(reason);
      } catch {
        // a callback's failure must not break the tenure
      }
    }
  }
}
