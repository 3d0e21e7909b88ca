/** The lease store's clock, estimated from the `Date` header of its responses (SPEC §2). */
import type { S3Client } from "@aws-sdk/client-s3";
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
export declare class StoreClock {
    private offsetMs;
    private readonly listeners;
    get known(): boolean;
    /** Feeds one response's `Date` header, received at `receivedMs` (default: now). */
    observe(dateHeader: string | undefined | null, receivedMs?: number): void;
    /** Calls `fn` whenever the estimate changes; returns the unsubscribe function. */
    subscribe(fn: () => void): () => void;
    /** The earliest the store's clock may read now (ms since the epoch). */
    earliest(): number;
    /** The latest the store's clock may read now (Date + 1 s resolution). */
    latest(): number;
    /** Milliseconds until the store's clock may first read `storeTime` (latest estimate). */
    msUntil(storeTime: Date | number): number;
    /**
     * Feeds every HTTP answer of an S3 client (errors included) into the estimate:
     * a middleware next to the transport, so each attempt of a retried call counts.
     */
    attach(s3: S3Client): void;
}
