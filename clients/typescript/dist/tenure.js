"use strict";
/** A tenure: a held lease that renews itself and says when the work must stop. */
Object.defineProperty(exports, "__esModule", { value: true });
exports.Tenure = void 0;
const errors_1 = require("./errors");
const held_1 = require("./held");
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
class Tenure {
    client;
    marginMs;
    /** Aborted (with a TenureEnded reason) when the work must stop. */
    signal;
    /** Successful renewals so far. */
    renewals = 0;
    lastError = undefined;
    /** The latest estimate of the store's clock when stop was signalled. */
    stoppedAt = null;
    current;
    reason = null;
    released = false;
    stopAt; // performance.now() ms
    watchdog;
    renewTimer;
    renewing;
    controller = new AbortController();
    onStop;
    unsubscribe;
    constructor(client, lease, opts = {}) {
        this.client = client;
        this.marginMs = opts.marginMs ?? 2000;
        if (this.marginMs < 0 || this.marginMs >= lease.ttlMs)
            throw new Error("marginMs must be in [0, ttlMs)");
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
    get lease() {
        return this.current;
    }
    get name() {
        return this.current.name;
    }
    get mustStop() {
        return this.reason !== null || performance.now() >= this.stopAt;
    }
    get stopReason() {
        return this.reason;
    }
    /** Milliseconds until the work must stop (≤ 0: now). */
    msLeft() {
        return this.reason !== null ? 0 : this.stopAt - performance.now();
    }
    /**
     * This tenure's lease if it holds `epoch` or a later one, waiting up to
     * `timeoutMs` for a renewal on its way: a request sent with the epoch before
     * the renewal is refused as stale (409 epoch_stale) once fencegate has seen
     * the renewal's epoch, before the renewal has returned here. null: a newer
     * epoch that is not this tenure's, or the work must stop.
     */
    async holdsAtLeast(epoch, timeoutMs) {
        const renewing = this.renewing;
        if (this.current.epoch < epoch && renewing !== undefined && this.reason === null) {
            let timer;
            const timeout = new Promise((resolve) => {
                timer = setTimeout(resolve, Math.max(0, timeoutMs));
            });
            await Promise.race([renewing, timeout]);
            clearTimeout(timer);
        }
        if (this.reason !== null || this.current.epoch < epoch)
            return null;
        return this.current;
    }
    /** Throws TenureEnded if the work must stop. */
    check() {
        if (this.mustStop)
            throw new errors_1.TenureEnded(this.name, this.reason ?? "deadline");
    }
    /** Resolves true once the stop signal came, or false after `timeoutMs`. */
    wait(timeoutMs) {
        if (this.signal.aborted)
            return Promise.resolve(true);
        return new Promise((resolve) => {
            let timer;
            const done = () => {
                if (timer)
                    clearTimeout(timer);
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
    async close(opts = {}) {
        this.stop("closed");
        const pending = this.renewing;
        let finished = pending === undefined;
        if (pending) {
            let timer;
            await Promise.race([
                pending.then(() => { finished = true; }),
                new Promise((resolve) => { timer = setTimeout(resolve, opts.timeoutMs ?? 10000); }),
            ]);
            if (timer)
                clearTimeout(timer);
        }
        if (opts.release === false || !finished || this.reason === "lost" || this.released)
            return undefined;
        this.released = true;
        if ((0, held_1.isExpired)(this.current))
            return undefined;
        return this.client.release(this.current);
    }
    // ---- inside
    deadline(lease) {
        return performance.now() + lease.clock.msUntil(lease.expiresAt) - this.marginMs;
    }
    halfway() {
        const now = performance.now();
        return now + Math.max(0, this.stopAt - now) / 2;
    }
    armWatchdog() {
        if (this.watchdog)
            clearTimeout(this.watchdog);
        const ms = this.stopAt - performance.now();
        if (ms <= 0) {
            this.stop("deadline");
            return;
        }
        // Timers may fire a little early: check again then.
        this.watchdog = setTimeout(() => this.armWatchdog(), Math.ceil(ms));
    }
    scheduleRenewal(at) {
        if (this.renewTimer)
            clearTimeout(this.renewTimer);
        this.renewTimer = setTimeout(() => {
            this.renewTimer = undefined;
            this.renewing = this.renewOnce();
        }, Math.max(0, at - performance.now()));
    }
    async renewOnce() {
        if (this.reason !== null)
            return;
        const current = this.current;
        let next;
        try {
            next = await this.client.renew(current);
        }
        catch (e) {
            this.lastError = e;
            if (e instanceof errors_1.LeaseLost) {
                this.stop("lost");
                return;
            }
            if (this.reason !== null)
                return;
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
    clockMoved() {
        if (this.reason !== null)
            return;
        const fresh = this.deadline(this.current);
        if (fresh < this.stopAt) {
            this.stopAt = fresh;
            this.armWatchdog();
        }
    }
    stop(reason) {
        if (this.reason !== null)
            return;
        this.reason = reason;
        this.unsubscribe();
        this.stoppedAt = new Date(this.current.clock.latest());
        if (this.watchdog)
            clearTimeout(this.watchdog);
        if (this.renewTimer)
            clearTimeout(this.renewTimer);
        this.controller.abort(new errors_1.TenureEnded(this.name, reason));
        if (this.onStop) {
            try {
                this.onStop(reason);
            }
            catch {
                // a callback's failure must not break the tenure
            }
        }
    }
}
exports.Tenure = Tenure;
