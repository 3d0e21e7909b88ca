"use strict";
/** Leases on an S3 lease store: acquire, renew, release (SPEC §2, docs/worker-protocol.md). */
Object.defineProperty(exports, "__esModule", { value: true });
exports.LeaseClient = exports.MAX_ROUNDS = exports.LEASE_NAME = void 0;
exports.tokenSha256 = tokenSha256;
exports.parseEpochObject = parseEpochObject;
const node_crypto_1 = require("node:crypto");
const client_s3_1 = require("@aws-sdk/client-s3");
const clock_1 = require("./clock");
const errors_1 = require("./errors");
const held_1 = require("./held");
const tenure_1 = require("./tenure");
exports.LEASE_NAME = /^[a-z0-9][a-z0-9._-]{0,62}$/;
const EPOCH_FILE = /^(\d{20})\.json$/;
exports.MAX_ROUNDS = 16;
/** Lowercase hex SHA-256 of the token's bytes as sent in X-Lease-Token. */
function tokenSha256(token) {
    return (0, node_crypto_1.createHash)("sha256").update(token, "utf8").digest("hex");
}
function sameHex(a, b) {
    if (a === null || a.length !== b.length)
        return false;
    return (0, node_crypto_1.timingSafeEqual)(Buffer.from(a), Buffer.from(b));
}
function isInt(v) {
    return typeof v === "number" && Number.isInteger(v);
}
function parseEpochObject(lease, epoch, raw, lastModified) {
    const invalid = {
        epoch, kind: "invalid", holder: null, tokenSha256: null, ttlMs: null, lastModified, expiresAt: null, raw,
    };
    let o;
    try {
        o = JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(raw));
    }
    catch {
        return invalid;
    }
    if (typeof o !== "object" || o === null || Array.isArray(o))
        return invalid;
    const r = o;
    if (r.v !== 1 || r.lease !== lease || r.epoch !== epoch)
        return invalid;
    const holder = typeof r.holder === "string" ? r.holder : null;
    if (r.kind === "release")
        return { ...invalid, kind: "release", holder };
    if (r.kind !== "acquire")
        return invalid;
    const digest = r.token_sha256;
    const ttl = r.ttl_ms;
    if (typeof digest !== "string" || !/^[0-9a-f]{64}$/.test(digest))
        return invalid;
    if (!isInt(ttl) || ttl <= 0)
        return invalid;
    return {
        ...invalid, kind: "acquire", holder, tokenSha256: digest, ttlMs: ttl,
        expiresAt: new Date(lastModified.getTime() + ttl),
    };
}
function s3Status(e) {
    return e?.$metadata?.httpStatusCode;
}
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
function encode(obj) {
    return new TextEncoder().encode(JSON.stringify(obj));
}
function bytesEqual(a, b) {
    return a.length === b.length && a.every((x, i) => x === b[i]);
}
/**
 * The lease protocol of SPEC §2 on an S3 (or S3-compatible) lease store.
 *
 * `s3` is an S3Client; this client adds a middleware to it that feeds every
 * response's `Date` header into `this.clock`. `prefix` and `graceMs` must match
 * fencegate's `[store]`.
 */
class LeaseClient {
    s3;
    bucket;
    prefix;
    graceMs;
    clock;
    maxRounds;
    constructor(s3, opts) {
        this.s3 = s3;
        this.bucket = opts.bucket;
        this.prefix = opts.prefix ?? "fencegate/";
        if (this.prefix && !this.prefix.endsWith("/"))
            throw new Error(`prefix ${this.prefix} must be empty or end in '/'`);
        this.graceMs = opts.graceMs ?? 2000;
        this.maxRounds = opts.maxRounds ?? exports.MAX_ROUNDS;
        this.clock = opts.clock ?? new clock_1.StoreClock();
        this.clock.attach(s3);
    }
    key(lease, epoch) {
        return `${this.prefix}${lease}/${String(epoch).padStart(20, "0")}.json`;
    }
    static checkName(lease) {
        if (!exports.LEASE_NAME.test(lease)) {
            throw new Error(`invalid lease name ${JSON.stringify(lease)}: must match [a-z0-9][a-z0-9._-]{0,62}`);
        }
    }
    /**
     * Throws LeaseError on a store that ignores If-None-Match: creates one probe
     * object twice under `{prefix}.probe/`; the second must be refused.
     */
    async selfTest() {
        const Key = `${this.prefix}.probe/${(0, node_crypto_1.randomBytes)(8).toString("hex")}.json`;
        const put = () => this.s3.send(new client_s3_1.PutObjectCommand({
            Bucket: this.bucket, Key, Body: '{"probe":true}', IfNoneMatch: "*", ContentType: "application/json",
        }));
        await put();
        let rejected = false;
        try {
            await put();
        }
        catch (e) {
            const status = s3Status(e);
            if (status !== 409 && status !== 412)
                throw e;
            rejected = true;
        }
        finally {
            await this.s3.send(new client_s3_1.DeleteObjectCommand({ Bucket: this.bucket, Key })).catch(() => undefined);
        }
        if (!rejected) {
            throw new errors_1.LeaseError(`bucket ${this.bucket} ignores conditional writes (a second PutObject with If-None-Match: * succeeded): ` +
                "fencing is impossible on this store");
        }
    }
    /** The greatest epoch listed under {prefix}{lease}/ (0: none). */
    async latestEpoch(lease) {
        const lp = `${this.prefix}${lease}/`;
        let latest = 0;
        let token;
        for (;;) {
            const out = await this.s3.send(new client_s3_1.ListObjectsV2Command({
                Bucket: this.bucket, Prefix: lp, ContinuationToken: token,
            }));
            for (const o of out.Contents ?? []) {
                const m = EPOCH_FILE.exec((o.Key ?? "").slice(lp.length));
                if (m && Number(m[1]) > 0)
                    latest = Math.max(latest, Number(m[1]));
            }
            if (!out.IsTruncated)
                return latest;
            token = out.NextContinuationToken;
        }
    }
    /** The epoch object, or null when it does not exist. */
    async read(lease, epoch) {
        try {
            const out = await this.s3.send(new client_s3_1.GetObjectCommand({ Bucket: this.bucket, Key: this.key(lease, epoch) }));
            const raw = out.Body ? await out.Body.transformToByteArray() : new Uint8Array();
            return parseEpochObject(lease, epoch, raw, out.LastModified ?? new Date(0));
        }
        catch (e) {
            if (e.name === "NoSuchKey" || s3Status(e) === 404)
                return null;
            throw e;
        }
    }
    /** [latest epoch, its object]: 0 and null when the lease has no epoch. */
    async status(lease) {
        LeaseClient.checkName(lease);
        const latest = await this.latestEpoch(lease);
        return [latest, latest ? await this.read(lease, latest) : null];
    }
    /**
     * No epoch, a release, an invalid object, or an acquire expired by more than
     * grace — judged on the EARLIEST the store's clock may read.
     */
    isFree(obj) {
        if (obj === null || obj.kind !== "acquire" || obj.expiresAt === null)
            return true;
        return this.clock.earliest() > obj.expiresAt.getTime() + this.graceMs;
    }
    /** Acquires `lease` if it is free; throws LeaseHeld when someone else holds it. */
    acquire(lease, opts) {
        return this.acquireOrRenew(lease, opts, null);
    }
    /** Acquires epoch L+1 while holding L (a fresh token); throws LeaseLost when L is not ours any more. */
    renew(current, ttlMs) {
        return this.acquireOrRenew(current.name, { holder: current.holder, ttlMs: ttlMs ?? current.ttlMs }, current);
    }
    /** Creates epoch L+1 of kind "release": the lease is free at once. Returns that epoch. */
    async release(current) {
        const [latest, obj] = await this.status(current.name);
        if (!LeaseClient.mine(obj, latest, current)) {
            throw new errors_1.LeaseLost(`lease ${current.name}: epoch ${current.epoch} is no longer the latest (${latest})`);
        }
        const body = encode({ v: 1, lease: current.name, epoch: current.epoch + 1, kind: "release", holder: current.holder });
        const [won] = await this.createDecided(current.name, current.epoch + 1, body, (o) => bytesEqual(o.raw, body));
        if (!won)
            throw new errors_1.LeaseLost(`lease ${current.name}: epoch ${current.epoch + 1} was created by someone else`);
        return current.epoch + 1;
    }
    /**
     * Acquires `lease` and returns a started Tenure: it renews itself in the
     * background and signals stop `marginMs` before the lease could end.
     */
    async hold(lease, opts) {
        const marginMs = opts.marginMs ?? 2000;
        if (marginMs < 0 || marginMs >= (opts.ttlMs ?? 30000))
            throw new Error("marginMs must be in [0, ttlMs)");
        const held = await this.acquire(lease, opts);
        return new tenure_1.Tenure(this, held, { marginMs: opts.marginMs, onStop: opts.onStop });
    }
    static mine(obj, latest, current) {
        return obj !== null && obj.kind === "acquire" && latest === current.epoch &&
            sameHex(obj.tokenSha256, tokenSha256(current.token));
    }
    /**
     * Creates `epoch` with If-None-Match: *. Returns [won, object, reconciled].
     * Whatever the PUT said, the object is read back: a 412 may be our own first
     * attempt answered late (SDK retries do this), a timeout or 5xx may or may not
     * have been applied, and a success needs LastModified for the expiry.
     */
    async createDecided(lease, epoch, body, ours) {
        const Key = this.key(lease, epoch);
        let uncertain = false;
        let put = true;
        let lastError;
        for (let attempt = 0; attempt < this.maxRounds; attempt++) {
            if (attempt)
                await sleep(Math.min(20 * 2 ** attempt, 1000));
            if (put) {
                try {
                    await this.s3.send(new client_s3_1.PutObjectCommand({
                        Bucket: this.bucket, Key, Body: body, IfNoneMatch: "*", ContentType: "application/json",
                    }));
                }
                catch (e) {
                    const status = s3Status(e);
                    const name = e.name;
                    const conflict = status === 412 || name === "PreconditionFailed" || name === "ConditionalRequestConflict";
                    const unknown = status === undefined || status >= 500 || status === 408 || status === 429;
                    if (!(conflict || unknown)) {
                        throw new errors_1.LeaseError(`create ${Key} refused: ${name ?? status}: ${e.message}`, { cause: e });
                    }
                    uncertain = true;
                    lastError = e;
                }
            }
            let obj;
            try {
                obj = await this.read(lease, epoch);
            }
            catch (e) {
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
        throw new errors_1.LeaseError(`could not decide the create of ${Key} after ${this.maxRounds} attempts`, { cause: lastError });
    }
    async acquireOrRenew(lease, opts, current) {
        LeaseClient.checkName(lease);
        const ttlMs = opts.ttlMs ?? 30000;
        if (!(ttlMs > 0))
            throw new Error("ttlMs must be positive");
        const giveUp = opts.waitTimeoutMs === undefined ? Infinity : performance.now() + opts.waitTimeoutMs;
        let backoff = 100;
        let lostRaces = 0;
        for (;;) {
            const [latest, obj] = await this.status(lease);
            if (current !== null) {
                if (!LeaseClient.mine(obj, latest, current)) {
                    throw new errors_1.LeaseLost(`lease ${lease}: epoch ${current.epoch} is no longer the latest (${latest})`);
                }
                if ((0, held_1.isExpired)(current))
                    throw new errors_1.LeaseLost(`lease ${lease}: epoch ${current.epoch} has expired`);
            }
            else if (!this.isFree(obj)) {
                const o = obj;
                const held = new errors_1.LeaseHeld(lease, latest, o.holder, o.expiresAt);
                if (!opts.wait || performance.now() >= giveUp)
                    throw held;
                const freeIn = o.expiresAt.getTime() + this.graceMs - this.clock.earliest();
                let pause = Math.max(50, Math.min(backoff, freeIn + 50));
                pause = Math.max(0, Math.min(pause, giveUp - performance.now()));
                await sleep(pause);
                backoff = Math.min(backoff * 2, 2000);
                continue;
            }
            const token = (0, node_crypto_1.randomBytes)(32).toString("hex"); // 256 bits
            const digest = tokenSha256(token);
            const body = encode({
                v: 1, lease, epoch: latest + 1, kind: "acquire", holder: opts.holder, token_sha256: digest, ttl_ms: ttlMs,
            });
            const [won, got, uncertain] = await this.createDecided(lease, latest + 1, body, (o) => o.kind === "acquire" && sameHex(o.tokenSha256, digest));
            if (won) {
                return {
                    name: lease, epoch: latest + 1, token, holder: opts.holder, ttlMs, expiresAt: got.expiresAt,
                    clock: this.clock, reconciled: uncertain,
                };
            }
            if (current !== null)
                throw new errors_1.LeaseLost(`lease ${lease}: epoch ${latest + 1} was created by someone else`);
            // Losing a race is never permission to work: look again.
            if (++lostRaces >= this.maxRounds)
                throw new errors_1.LeaseError(`lease ${lease}: lost ${lostRaces} races in a row`);
        }
    }
}
exports.LeaseClient = LeaseClient;
