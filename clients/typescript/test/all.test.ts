/**
 * The whole suite in one process, so that one testkit (S3 server, relays, origin,
 * fencegate) serves every test: `node --test .test-build/test/all.test.js`.
 */

import { after } from "node:test";

import { stopKit } from "./kit";
import "./lease";
import "./outcomes";
import "./owner";
import "./queued";
import "./scenarios";

after(stopKit);
