/** Leases on an S3 lease store: acquire, renew, release (SPEC §2, docs/worker-protocol.md). */
import { type S3Client } from "@aws-sdk/client-s3";
import { StoreClock } from "./clock";
import { type StopReason } from "./errors";
import { type Lease } from "./held";
import { Tenure } from "./tenure";
export declare const LEASE_NAME: RegExp;
export declare const MAX_ROUNDS = 16;
/** An epoch object as read from the store (SPEC §2). */
export interface EpochObject {
    readonly epoch: number;
    /** "invalid": does not parse or disagrees with its key (an epoch all the same). */
    readonly kind: "acquire" | "release" | "invalid";
    readonly holder: string | null;
    readonly tokenSha256: string | null;
    readonly ttlMs: number | null;
    readonly lastModified: Date;
    /** LastModified + ttl_ms (acquires only). */
    readonly expiresAt: Date | null;
    readonly raw: Uint8Array;
}
/** Lowercase hex SHA-256 of the token's bytes as sent in X-Lease-Token. */
export declare function tokenSha256(token: string): string;
export declare function parseEpochObject(lease: string, epoch: number, raw: Uint8Array, lastModified: Date): EpochObject;
export interface LeaseClientOptions {
    bucket: string;
    /** fencegate's `[store] prefix`: empty or ending in "/" (default "fencegate/"). */
    prefix?: string;
    /** fencegate's `[store] grace_ms` (default 2000). */
    graceMs?: number;
    clock?: StoreClock;
    maxRounds?: number;
}
export interface AcquireOptions {
    holder: string;
    /** Default 30000. */
    ttlMs?: number;
    /** Wait for the holder's expiry + grace instead of throwing LeaseHeld. */
    wait?: boolean;
    /** With `wait`: give up (LeaseHeld) after this long. Default: never. */
    waitTimeoutMs?: number;
}
export interface HoldOptions extends AcquireOptions {
    /** How long before the lease could end the work is told to stop. Default 2000. */
    marginMs?: number;
    onStop?: (reason: StopReason) => void;
}
/**
 * The lease protocol of SPEC §2 on an S3 (or S3-compatible) lease store.
 *
 * `s3` is an S3Client; this client adds a middleware to it that feeds every
 * response's `Date` header into `this.clock`. `prefix` and `graceMs` must match
 * fencegate's `[store]`.
 */
export declare class LeaseClient {
    readonly s3: S3Client;
    readonly bucket: string;
    readonly prefix: string;
    readonly graceMs: number;
    readonly clock: StoreClock;
    readonly maxRounds: number;
    constructor(s3: S3Client, opts: LeaseClientOptions);
    key(lease: string, epoch: number): string;
    static checkName(lease: string): void;
    /**
     * Throws LeaseError on a store that ignores If-None-Match: creates one probe
     * object twice under `{prefix}.probe/`; the second must be refused.
     */
    selfTest(): Promise<void>;
    /** The greatest epoch listed under {prefix}{lease}/ (0: none). */
    latestEpoch(lease: string): Promise<number>;
    /** The epoch object, or null when it does not exist. */
    read(lease: string, epoch: number): Promise<EpochObject | null>;
    /** [latest epoch, its object]: 0 and null when the lease has no epoch. */
    status(lease: string): Promise<[number, EpochObject | null]>;
    /**
     * No epoch, a release, an invalid object, or an acquire expired by more than
     * grace — judged on the EARLIEST the store's clock may read.
     */
    isFree(obj: EpochObject | null): boolean;
    /** Acquires `lease` if it is free; throws LeaseHeld when someone else holds it. */
    acquire(lease: string, opts: AcquireOptions): Promise<Lease>;
    /** Acquires epoch L+1 while holding L (a fresh token); throws LeaseLost when L is not ours any more. */
    renew(current: Lease, ttlMs?: number): Promise<Lease>;
    /** Creates epoch L+1 of kind "release": the lease is free at once. Returns that epoch. */
    release(current: Lease): Promise<number>;
    /**
     * Acquires `lease` and returns a started Tenure: it renews itself in the
     * background and signals stop `marginMs` before the lease could end.
     */
    hold(lease: string, opts: HoldOptions): Promise<Tenure>;
    private static mine;
    /**
     * Creates `epoch` with If-None-Match: *. Returns [won, object, reconciled].
     * Whatever the PUT said, the object is read back: a 412 may be our own first
     * attempt answered late (SDK retries do this), a timeout or 5xx may or may not
     * have been applied, and a success needs LastModified for the expiry.
     */
    private createDecided;
    private acquireOrRenew;
}
