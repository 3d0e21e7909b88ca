"use strict";
/** The lease store's clock, estimated from the `Date` header of its responses (SPEC §2). */
Object.defineProperty(exports, "__esModule", { value: true });
exports.StoreClock = void 0;
/**
 * `Date` has one-second resolution and is truncated: when a response arrives,
 * the store's clock reads somewhere in [Date, Date + 1 s) (plus transit). Which
 * end to use depends on the question, and the answer must be the safe one:
 *
 * - "has MY tenure expired?"        -> latest():   the holder stops early;
 * - "has SOMEONE ELSE's expired?"   -> earliest(): a contender takes over late.
 *
 * Before any response has been seen, the local clock stands in (offset 0).
 */
class StoreClock {
    offsetMs = null;
    listeners = new Set();
    get known() {
        return this.offsetMs !== null;
    }
    /** Feeds one response's `Date` header, received at `receivedMs` (default: now). */
    observe(dateHeader, receivedMs = Date.now()) {
        if (!dateHeader)
            return;
        const date = Date.parse(dateHeader);
        if (Number.isNaN(date))
            return;
        const offset = date - receivedMs;
        if (offset === this.offsetMs)
            return;
        this.offsetMs = offset;
        for (const fn of [...this.listeners])
            fn();
    }
    /** Calls `fn` whenever the estimate changes; returns the unsubscribe function. */
    subscribe(fn) {
        this.listeners.add(fn);
        return () => this.listeners.delete(fn);
    }
    /** The earliest the store's clock may read now (ms since the epoch). */
    earliest() {
        return Date.now() + (this.offsetMs ?? 0);
    }
    /** The latest the store's clock may read now (Date + 1 s resolution). */
    latest() {
        return Date.now() + (this.offsetMs === null ? 0 : this.offsetMs + 1000);
    }
    /** Milliseconds until the store's clock may first read `storeTime` (latest estimate). */
    msUntil(storeTime) {
        return +storeTime - this.latest();
    }
    /**
     * Feeds every HTTP answer of an S3 client (errors included) into the estimate:
     * a middleware next to the transport, so each attempt of a retried call counts.
     */
    attach(s3) {
        const observe = (response) => {
            const headers = response?.headers;
            this.observe(headers?.["date"] ?? headers?.["Date"]);
        };
        // eslint-disable-next-line @typescript-eslint/no-explicit-any
        const middleware = (next) => async (args) => {
            const out = await next(args);
            observe(out?.response);
            return out;
        };
        s3.middlewareStack.add(middleware, {
            step: "deserialize",
            priority: "low",
            name: "fencegateStoreClock",
            override: true,
        });
    }
}
exports.StoreClock = StoreClock;
