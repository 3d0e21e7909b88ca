/** Leases on an S3 lease store: acquire, renew, release (SPEC §2, docs/worker-protocol.md). */

import { createHash, randomBytes, timingSafeEqual } from "node:crypto";
import {
  DeleteObjectCommand,
  GetObjectCommand,
  ListObjectsV2Command,
  PutObjectCommand,
  type S3Client,
} from "@aws-sdk/client-s3";

import { StoreClock } from "./clock";
import { LeaseError, LeaseHeld, LeaseLost, type StopReason } from "./errors";
import { isExpired, type Lease } from "./held";
import { Tenure } from "./tenure";

export const LEASE_NAME = /^[a-z0-9][a-z0-9._-]{0,62}$/;
const EPOCH_FILE = /^(\d{20})\.json$/;
export const MAX_ROUNDS = 16;

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
export function tokenSha256(token: string): string {
  return createHash("sha256").update(token, "utf8").digest("hex");
}

function sameHex(a: string | null, b: string): boolean {
  if (a === null || a.length !== b.length) return false;
  return timingSafeEqual(Buffer.from(a), Buffer.from(b));
}

function isInt(v: unknown): v is number {
  return typeof v === "number" && Number.isInteger(v);
}

export function parseEpochObject(lease: string, epoch: number, raw: Uint8Array, lastModified: Date): EpochObject {
  const invalid: EpochObject = {
    epoch, kind: "invalid", holder: null, tokenSha256: null, ttlMs: null, lastModified, expiresAt: null, raw,
  };
  let o: unknown;
  try {
    o = JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(raw));
  } catch {
    return invalid;
  }
  if (typeof o !== "object" || o === null || Array.isArray(o)) return invalid;
  const r = o as Record<string, unknown>;
  if (r.v !== 1 || r.lease !== lease || r.epoch !== epoch) return invalid;
  const holder = typeof r.holder === "string" ? r.holder : null;
  if (r.kind === "release") return { ...invalid, kind: "release", holder };
  if (r.kind !== "acquire") return invalid;
  const digest = r.token_sha256;
  const ttl = r.ttl_ms;
  if (typeof digest !== "string" || !/^[0-9a-f]{64}$/.test(digest)) return invalid;
  if (!isInt(ttl) || ttl <= 0) return invalid;
  return {
    ...invalid, kind: "acquire", holder, tokenSha256: digest, ttlMs: ttl,
    expiresAt: new Date(lastModified.getTime() + ttl),
  };
}

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

interface S3ErrorLike {
  name?: string;
  $metadata?: { httpStatusCode?: number };
}

function s3Status(e: unknown): number | undefined {
  return (e as S3ErrorLike)?.$metadata?.httpStatusCode;
}

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

function encode(obj: Record<string, unknown>): Uint8Array {
  return new TextEncoder().encode(JSON.stringify(obj));
}

function bytesEqual(a: Uint8Array, b: Uint8Array): boolean {
  return a.length === b.length && a.every((x, i) => x === b[i]);
}

/**
 * The lease protocol of SPEC §2 on an S3 (or S3-compatible) lease store.
 *
 * `s3` is an S3Client; this client adds a middleware to it that feeds every
 * response's `Date` header into `this.clock`. `prefix` and `graceMs` must match
 * fencegate's `[store]`.
 */
export class LeaseClient {
  readonly bucket: string;
  readonly prefix: string;
  readonly graceMs: number;
  readonly clock: StoreClock;
  readonly maxRounds: number;

  constructor(
    readonly s3: S3Client,
    opts: LeaseClientOptions,
  ) {
    this.bucket = opts.bucket;
    this.prefix = opts.prefix ?? "fencegate/";
    if (this.prefix && !this.prefix.endsWith("/")) throw new Error(`prefix ${this.prefix} must be empty or end in '/'`);
    this.graceMs = opts.graceMs ?? 2000;
    this.maxRounds = opts.maxRounds ?? MAX_ROUNDS;
    this.clock = opts.clock ?? new StoreClock();
    this.clock.attach(s3);
  }

  key(lease: string, epoch: number): string {
    return `${this.prefix}${lease}/${String(epoch).padStart(20, "0")}.json`;
  }

  static checkName(lease: string): void {
    if (!LEASE_NAME.test(lease)) {
      throw new Error(`invalid lease name ${JSON.stringify(lease)}: must match [a-z0-9][a-z0-9._-]{0,62}`);
    }
  }

  /**
   * Throws LeaseError on a store that ignores If-None-Match: creates one probe
   * object twice under `{prefix}.probe/`; the second must be refused.
   */
  async selfTest(): Promise<void> {
    const Key = `${this.prefix}.probe/${randomBytes(8).toString("hex")}.json`;
    const put = () =>
      this.s3.send(new PutObjectCommand({
        Bucket: this.bucket, Key, Body: '{"probe":true}', IfNoneMatch: "*", ContentType: "application/json",
      }));
    await put();
    let rejected = false;
    try {
      await put();
    } catch (e) {
      const status = s3Status(e);
      if (status !== 409 && status !== 412) throw e;
      rejected = true;
    } finally {
      await this.s3.send(new DeleteObjectCommand({ Bucket: this.bucket, Key })).catch(() => undefined);
    }
    if (!rejected) {
      throw new LeaseError(
        `bucket ${this.bucket} ignores conditional writes (a second PutObject with If-None-Match: * succeeded): ` +
          "fencing is impossible on this store",
      );
    }
  }

  /** The greatest epoch listed under {prefix}{lease}/ (0: none). */
  async latestEpoch(lease: string): Promise<number> {
    const lp = `${this.prefix}${lease}/`;
    let latest = 0;
    let token: string | undefined;
    for (;;) {
      const out = await this.s3.send(new ListObjectsV2Command({
        Bucket: this.bucket, Prefix: lp, ContinuationToken: token,
      }));
      for (const o of out.Contents ?? []) {
        const m = EPOCH_FILE.exec((o.Key ?? "").slice(lp.length));
        if (m && Number(m[1]) > 0) latest = Math.max(latest, Number(m[1]));
      }
      if (!out.IsTruncated) return latest;
      token = out.NextContinuationToken;
    }
  }

  /** The epoch object, or null when it does not exist. */
  async read(lease: string, epoch: number): Promise<EpochObject | null> {
    try {
      const out = await this.s3.send(new GetObjectCommand({ Bucket: this.bucket, Key: this.key(lease, epoch) }));
      const raw = out.Body ? await out.Body.transformToByteArray() : new Uint8Array();
      return parseEpochObject(lease, epoch, raw, out.LastModified ?? new Date(0));
    } catch (e) {
      if ((e as S3ErrorLike).name === "NoSuchKey" || s3Status(e) === 404) return null;
      throw e;
    }
  }

  /** [latest epoch, its object]: 0 and null when the lease has no epoch. */
  async status(lease: string): Promise<[number, EpochObject | null]> {
    LeaseClient.checkName(lease);
    const latest = await this.latestEpoch(lease);
    return [latest, latest ? await this.read(lease, latest) : null];
  }

  /**
   * No epoch, a release, an invalid object, or an acquire expired by more than
   * grace — judged on the EARLIEST the store's clock may read.
   */
  isFree(obj: EpochObject | null): boolean {
    if (obj === null || obj.kind !== "acquire" || obj.expiresAt === null) return true;
    return this.clock.earliest() > obj.expiresAt.getTime() + this.graceMs;
  }

  /** Acquires `lease` if it is free; throws LeaseHeld when someone else holds it. */
  acquire(lease: string, opts: AcquireOptions): Promise<Lease> {
    return this.acquireOrRenew(lease, opts, null);
  }

  /** Acquires epoch L+1 while holding L (a fresh token); throws LeaseLost when L is not ours any more. */
  renew(current: Lease, ttlMs?: number): Promise<Lease> {
    return this.acquireOrRenew(current.name, { holder: current.holder, ttlMs: ttlMs ?? current.ttlMs }, current);
  }

  /** Creates epoch L+1 of kind "release": the lease is free at once. Returns that epoch. */
  async release(current: Lease): Promise<number> {
    const [latest, obj] = await this.status(current.name);
    if (!LeaseClient.mine(obj, latest, current)) {
      throw new LeaseLost(`lease ${current.name}: epoch ${current.epoch} is no longer the latest (${latest})`);
    }
    const body = encode({ v: 1, lease: current.name, epoch: current.epoch + 1, kind: "release", holder: current.holder });
    const [won] = await this.createDecided(current.name, current.epoch + 1, body, (o) => bytesEqual(o.raw, body));
    if (!won) throw new LeaseLost(`lease ${current.name}: epoch ${current.epoch + 1} was created by someone else`);
    return current.epoch + 1;
  }

  /**
   * Acquires `lease` and returns a started Tenure: it renews itself in the
   * background and signals stop `marginMs` before the lease could end.
   */
  async hold(lease: string, opts: HoldOptions): Promise<Tenure> {
    const marginMs = opts.marginMs ?? 2000;
    if (marginMs < 0 || marginMs >= (opts.ttlMs ?? 30000)) throw new Error("marginMs must be in [0, ttlMs)");
    const held = await this.acquire(lease, opts);
    return new Tenure(this, held, { marginMs: opts.marginMs, onStop: opts.onStop });
  }

  private static mine(obj: EpochObject | null, latest: number, current: Lease): boolean {
    return obj !== null && obj.kind === "acquire" && latest === current.epoch &&
      sameHex(obj.tokenSha256, tokenSha256(current.token));
  }

  /**
   * Creates `epoch` with If-None-Match: *. Returns [won, object, reconciled].
   * Whatever the PUT said, the object is read back: a 412 may be our own first
   * attempt answered late (SDK retries do this), a timeout or 5xx may or may not
   * have been applied, and a success needs LastModified for the expiry.
   */
  private async createDecided(
    lease: string, epoch: number, body: Uint8Array, ours: (o: EpochObject) => boolean,
  ): Promise<[boolean, EpochObject, boolean]> {
    const Key = this.key(lease, epoch);
    let uncertain = false;
    let put = true;
    let lastError: unknown;
    for (let attempt = 0; attempt < this.maxRounds; attempt++) {
      if (attempt) await sleep(Math.min(20 * 2 ** attempt, 1000));
      if (put) {
        try {
          await this.s3.send(new PutObjectCommand({
            Bucket: this.bucket, Key, Body: body, IfNoneMatch: "*", ContentType: "application/json",
          }));
        } catch (e) {
          const status = s3Status(e);
          const name = (e as S3ErrorLike).name;
          const conflict = status === 412 || name === "PreconditionFailed" || name === "ConditionalRequestConflict";
          const unknown = status === undefined || status >= 500 || status === 408 || status === 429;
          if (!(conflict || unknown)) {
            throw new LeaseError(`create ${Key} refused: ${name ?? status}: ${(e as Error).message}`, { cause: e });
          }
          uncertain = true;
          lastError = e;
        }
      }
      let obj: EpochObject | null;
      try {
        obj = await this.read(lease, epoch);
      } catch (e) {
        lastError = e;
        put = false; // retry the GET, do not guess
        continue;
      }
      if (obj === null) {
        put = true; // the create did not happen: the same conditional PUT is safe
        continue;
      }
      return [ours(obj), obj, uncertain];
    }
    throw new LeaseError(`could not decide the create of ${Key} after ${this.maxRounds} attempts`, { cause: lastError });
  }

  private async acquireOrRenew(lease: string, opts: AcquireOptions, current: Lease | null): Promise<Lease> {
    LeaseClient.checkName(lease);
    const ttlMs = opts.ttlMs ?? 30000;
    if (!(ttlMs > 0)) throw new Error("ttlMs must be positive");
    const giveUp = opts.waitTimeoutMs === undefined ? Infinity : performance.now() + opts.waitTimeoutMs;
    let backoff = 100;
    let lostRaces = 0;
    for (;;) {
      const [latest, obj] = await this.status(lease);
      if (current !== null) {
        if (!LeaseClient.mine(obj, latest, current)) {
          throw new LeaseLost(`lease ${lease}: epoch ${current.epoch} is no longer the latest (${latest})`);
        }
        if (isExpired(current)) throw new LeaseLost(`lease ${lease}: epoch ${current.epoch} has expired`);
      } else if (!this.isFree(obj)) {
        const o = obj as EpochObject;
        const held = new LeaseHeld(lease, latest, o.holder, o.expiresAt);
        if (!opts.wait || performance.now() >= giveUp) throw held;
        const freeIn = (o.expiresAt as Date).getTime() + this.graceMs - this.clock.earliest();
        let pause = Math.max(50, Math.min(backoff, freeIn + 50));
        pause = Math.max(0, Math.min(pause, giveUp - performance.now()));
        await sleep(pause);
        backoff = Math.min(backoff * 2, 2000);
        continue;
      }
      const token = randomBytes(32).toString("hex"); // 256 bits
      const digest = tokenSha256(token);
      const body = encode({
        v: 1, lease, epoch: latest + 1, kind: "acquire", holder: opts.holder, token_sha256: digest, ttl_ms: ttlMs,
      });
      const [won, got, uncertain] = await this.createDecided(
        lease, latest + 1, body, (o) => o.kind === "acquire" && sameHex(o.tokenSha256, digest),
      );
      if (won) {
        return {
          name: lease, epoch: latest + 1, token, holder: opts.holder, ttlMs, expiresAt: got.expiresAt as Date,
          clock: this.clock, reconciled: uncertain,
        };
      }
      if (current !== null) throw new LeaseLost(`lease ${lease}: epoch ${latest + 1} was created by someone else`);
      // Losing a race is never permission to work: look again.
      if (++lostRaces >= this.maxRounds) throw new LeaseError(`lease ${lease}: lost ${lostRaces} races in a row`);
    }
  }
}
