/** The real parts under test (clients/testkit/testkit.py), started once per test run. */

import { spawn, type ChildProcess } from "node:child_process";
import { createInterface } from "node:readline";
import * as path from "node:path";
import { S3Client } from "@aws-sdk/client-s3";

import { GatewayClient, LeaseClient, type GatewayOptions } from "fencegate-client";

// .test-build/test/kit.js -> the repository's root
export const REPO = path.resolve(__dirname, "..", "..", "..", "..");
const TESTKIT = path.join(REPO, "clients", "testkit", "testkit.py");

export interface Info {
  control: string;
  s3: string;
  s3_relay: string;
  gateway: string;
  gateway_relay: string;
  admin: string;
  admin_token: string;
  bucket: string;
  prefix: string;
  grace_ms: number;
}

export interface OriginRequest {
  seq: number;
  method: string;
  path: string;
  epoch: string | null;
  idempotency_key: string | null;
  token_forwarded: boolean;
  body: string;
  completed: boolean;
}

export interface RelayState {
  mode: string;
  held: number;
  dropped: number;
  matched: number;
}

export class Kit {
  private constructor(
    private readonly proc: ChildProcess,
    readonly info: Info,
  ) {}

  static async start(): Promise<Kit> {
    const python = process.env.FENCEGATE_TEST_PYTHON ?? "python3";
    const proc = spawn(python, [TESTKIT], { stdio: ["pipe", "pipe", "inherit"] });
    const lines = createInterface({ input: proc.stdout! });
    const first = await new Promise<string>((resolve, reject) => {
      lines.once("line", resolve);
      proc.once("exit", (code) => reject(new Error(`the testkit exited (${code}) before it was ready`)));
    });
    return new Kit(proc, JSON.parse(first) as Info);
  }

  async stop(): Promise<void> {
    if (this.proc.exitCode !== null) return;
    const exited = new Promise((resolve) => this.proc.once("exit", resolve));
    this.proc.stdin?.end(); // the testkit stops what it started
    await exited;
  }

  // ---- the control API

  async control<T>(method: "GET" | "POST", p: string): Promise<T> {
    const res = await fetch(this.info.control + p, { method });
    if (!res.ok) throw new Error(`control ${method} ${p}: ${res.status} ${await res.text()}`);
    return (await res.json()) as T;
  }

  originRequests(prefix: string): Promise<OriginRequest[]> {
    return this.control("GET", `/origin/requests?path=${encodeURIComponent(prefix)}`);
  }

  originHeld(): Promise<Record<string, number>> {
    return this.control("GET", "/origin/held");
  }

  async originRelease(tag: string): Promise<void> {
    await this.control("POST", `/origin/release?tag=${tag}`);
  }

  relay(name: string): Promise<RelayState> {
    return this.control("GET", `/relay/${name}`);
  }

  async relayMode(name: string, mode: "pass" | "blackhole"): Promise<void> {
    await this.control("POST", `/relay/${name}/mode?mode=${mode}`);
  }

  async relayArm(name: string, match: string, o: { conditional?: boolean; hold?: boolean; drop?: boolean }): Promise<void> {
    const q = `match=${encodeURIComponent(match)}&conditional=${+!!o.conditional}&hold=${+!!o.hold}&drop=${+!!o.drop}`;
    await this.control("POST", `/relay/${name}/arm?${q}`);
  }

  async relayRelease(name: string): Promise<void> {
    await this.control("POST", `/relay/${name}/release`);
  }

  // ---- clients

  s3(viaRelay = false): S3Client {
    return new S3Client({
      endpoint: viaRelay ? this.info.s3_relay : this.info.s3,
      region: "us-east-1",
      forcePathStyle: true,
      credentials: { accessKeyId: "test", secretAccessKey: "test" },
      maxAttempts: 2,
      requestHandler: { connectionTimeout: 1000, requestTimeout: 2000 },
      requestChecksumCalculation: "WHEN_REQUIRED",
      responseChecksumValidation: "WHEN_REQUIRED",
    });
  }

  leases(viaRelay = false): LeaseClient {
    return new LeaseClient(this.s3(viaRelay), {
      bucket: this.info.bucket, prefix: this.info.prefix, graceMs: this.info.grace_ms,
    });
  }

  gateway(viaRelay = false, opts: GatewayOptions = {}): GatewayClient {
    return new GatewayClient(viaRelay ? this.info.gateway_relay : this.info.gateway, opts);
  }
}

let shared: Promise<Kit> | undefined;

export function kit(): Promise<Kit> {
  shared ??= Kit.start();
  return shared;
}

export async function stopKit(): Promise<void> {
  if (shared) await (await shared).stop();
}

/** Polls `cond` until it returns something truthy; fails after `timeoutMs`. */
export async function waitFor<T>(cond: () => T | Promise<T>, what: string, timeoutMs = 10000): Promise<T> {
  const deadline = performance.now() + timeoutMs;
  for (;;) {
    const v = await cond();
    if (v) return v;
    if (performance.now() > deadline) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}

/** Settles a promise into a value or the error it threw, without an unhandled rejection. */
export function settle<T>(p: Promise<T>): Promise<T | Error> {
  return p.then((v) => v, (e: unknown) => (e instanceof Error ? e : new Error(String(e))));
}
