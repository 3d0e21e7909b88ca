"use strict";
/**
 * fencegate's worker client: leases on an S3 lease store (SPEC §2) and calls
 * through fencegate (SPEC §3) with typed outcomes (SPEC §7).
 *
 * ```ts
 * const leases = new LeaseClient(new S3Client({}), { bucket: "leases", graceMs: 2000 });
 * const gate = new GatewayClient("http://127.0.0.1:8080");
 * const tenure = await leases.hold("billing", { holder: "worker-1", ttlMs: 30000, marginMs: 2000 });
 * const out = await gate.call(tenure, "POST", "/billing/charges", { json: { amount: 5 }, idempotencyKey: "charge-42" });
 * if (out.mustStop) ...; await tenure.close();
 * ```
 *
 * A queued route (SPEC §11) answers a `queued` outcome; `gate.waitDelivered(out)`
 * polls its status URL until it is delivered (or throws NotDelivered / DeliveryTimeout).
 */
Object.defineProperty(exports, "__esModule", { value: true });
exports.parseRetryAfter = exports.parseOutcome = exports.NO_KEY = exports.GatewayClient = exports.ERROR_CODES = exports.Tenure = exports.tokenSha256 = exports.parseEpochObject = exports.MAX_ROUNDS = exports.LEASE_NAME = exports.LeaseClient = exports.msLeft = exports.isExpired = exports.TenureEnded = exports.LeaseLost = exports.LeaseHeld = exports.LeaseError = exports.parseDelivery = exports.NotDelivered = exports.DeliveryTimeout = exports.DeliveryStatusError = exports.DeliveryError = exports.StoreClock = void 0;
var clock_1 = require("./clock");
Object.defineProperty(exports, "StoreClock", { enumerable: true, get: function () { return clock_1.StoreClock; } });
var delivery_1 = require("./delivery");
Object.defineProperty(exports, "DeliveryError", { enumerable: true, get: function () { return delivery_1.DeliveryError; } });
Object.defineProperty(exports, "DeliveryStatusError", { enumerable: true, get: function () { return delivery_1.DeliveryStatusError; } });
Object.defineProperty(exports, "DeliveryTimeout", { enumerable: true, get: function () { return delivery_1.DeliveryTimeout; } });
Object.defineProperty(exports, "NotDelivered", { enumerable: true, get: function () { return delivery_1.NotDelivered; } });
Object.defineProperty(exports, "parseDelivery", { enumerable: true, get: function () { return delivery_1.parseDelivery; } });
var errors_1 = require("./errors");
Object.defineProperty(exports, "LeaseError", { enumerable: true, get: function () { return errors_1.LeaseError; } });
Object.defineProperty(exports, "LeaseHeld", { enumerable: true, get: function () { return errors_1.LeaseHeld; } });
Object.defineProperty(exports, "LeaseLost", { enumerable: true, get: function () { return errors_1.LeaseLost; } });
Object.defineProperty(exports, "TenureEnded", { enumerable: true, get: function () { return errors_1.TenureEnded; } });
var held_1 = require("./held");
Object.defineProperty(exports, "isExpired", { enumerable: true, get: function () { return held_1.isExpired; } });
Object.defineProperty(exports, "msLeft", { enumerable: true, get: function () { return held_1.msLeft; } });
var lease_1 = require("./lease");
Object.defineProperty(exports, "LeaseClient", { enumerable: true, get: function () { return lease_1.LeaseClient; } });
Object.defineProperty(exports, "LEASE_NAME", { enumerable: true, get: function () { return lease_1.LEASE_NAME; } });
Object.defineProperty(exports, "MAX_ROUNDS", { enumerable: true, get: function () { return lease_1.MAX_ROUNDS; } });
Object.defineProperty(exports, "parseEpochObject", { enumerable: true, get: function () { return lease_1.parseEpochObject; } });
Object.defineProperty(exports, "tokenSha256", { enumerable: true, get: function () { return lease_1.tokenSha256; } });
var tenure_1 = require("./tenure");
Object.defineProperty(exports, "Tenure", { enumerable: true, get: function () { return tenure_1.Tenure; } });
var gateway_1 = require("./gateway");
Object.defineProperty(exports, "ERROR_CODES", { enumerable: true, get: function () { return gateway_1.ERROR_CODES; } });
Object.defineProperty(exports, "GatewayClient", { enumerable: true, get: function () { return gateway_1.GatewayClient; } });
Object.defineProperty(exports, "NO_KEY", { enumerable: true, get: function () { return gateway_1.NO_KEY; } });
Object.defineProperty(exports, "parseOutcome", { enumerable: true, get: function () { return gateway_1.parseOutcome; } });
Object.defineProperty(exports, "parseRetryAfter", { enumerable: true, get: function () { return gateway_1.parseRetryAfter; } });
