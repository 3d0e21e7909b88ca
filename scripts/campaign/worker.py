#!/usr/bin/env python3
"""A fault-campaign worker (tests/it/campaign): contends for leases with SPEC §2
(boto3, conditional PutObject, the uncertain-result read-back) and sends requests
through fencegate to the recording origin.

Every request attempt is one JSON line in --log:
  {"ev": "attempt", "w", "req", "kind", "route", "lease", "epoch", "token", "key",
   "body", "invoke", "complete", "outcome", "status", "error", "replayed",
   "resp_body", "detail", "addr", "delivery", "seq", "q_epoch"}
(`addr`: the fencegate it was sent to. `delivery`: the X-Fencegate-Delivery
header; a queued route's 202 (`delivery` "queued", SPEC §11) also logs the
message's place `seq` and epoch `q_epoch` from its JSON body: the checker
expects every such key at the destination.)
`outcome` is "response", "conn_error" or "timeout"; times are time.monotonic_ns().
`kind` is "op" (first send), "retry" (same key and body after a timeout, a
connection error, 504, 503 or dedup_in_flight), "dup" (the same key sent concurrently),
"forged" (a wrong token), "future" (an epoch that does not exist yet) or, with
--polls P (a share of operations), "poll" and "poll-retry": a GET without an
Idempotency-Key (retried like an op), which fencegate forwards without any state
write (SPEC §6), so only its fences and the cluster's self-fencing stand between a
stale poll and the destination (`key` is ""). With --stale P, a renewal is followed
(chance P) by a "poll-stale": a poll with the superseded epoch 0.2-2 s later.

--addr-file holds one fencegate `host:port` per line (several for a cluster: every
request goes to one of them at random); it is re-read before every request.
Tenures are logged too ({"ev": "tenure", ...}) for humans.

Expiry without the Date header (the store is on this host): LastModified is the
creation time truncated to the second and creation happens after we send the PUT,
so our epoch is valid at least until t0 + ttl - 1 s, t0 = local time before the PUT.
A worker stops using a tenure then — except a "sloppy" send (10%), which skips the
check, and the nemesis may SIGSTOP us anywhere, e.g. between check and send.

TTLs are 2-4 s; with --long-ttl P a share P of tenures take 12-20 s (longer than a
cluster's gate lease: a worker epoch that outlives an owner's tenure). With --short-ttl P, a share P of the worker's tenures (a first
acquire and the renewals that follow it) are short: a TTL of 0.9-1.3 s, shorter
than a route's drain timeout, used until t0 + ttl - 0.25 s (an optimistic worker
that ignores LastModified's truncation: fencegate, which does not, may find such an
epoch expired up to 1 s before the worker does, and must refuse it). Such a worker
renews before every operation, mostly without waiting for the previous ones, so
each renewal is a raise that may have to drain the previous epoch's requests, and
the raiser may still be waiting in that drain when its epoch expires (fencegate
must then refuse it, SPEC §5). Tenure lines say
`"short": true`.

With --directed CTL the worker does no random work: it plays the cluster
campaign's directed late worker, one step at a time as the nemesis commands
(tests/it/campaign/cluster.rs). The nemesis writes `CTL.cmd`, the worker answers in
`CTL.ack`, each one line starting with the step's number N:
  `N acquire OWNER`      acquire (or renew) the first of --leases with --ttl-ms and
                         poll OWNER (host:port) until the origin answers: the
                         owner's fence now holds that epoch;
                         -> `N acquired EPOCH` or `N failed WHY`
  `N renew NEW OLD`      (OLD is cut from the store, NEW serves the shard now)
                         renew, poll NEW with the new epoch until the origin
                         answers, then poll OLD once with the superseded epoch
                         -> `N late OUTCOME` or `N failed WHY`; then release
  `N uploads OWNER`      (with --upload-leases) acquire each upload lease and send
                         OWNER one held upload per lease: a POST of
                         --upload-bytes whose body the origin reads only once
                         released (`X-Campaign-Hold: N`, scripts/campaign/origin.py),
                         so that each stays in flight at OWNER
                         -> `N uploading REQ...` (the uploads' request ids, sent
                         meanwhile) or `N failed WHY`
  `N renew-uploads`      (OWNER is cut from the store) renew every upload lease
                         -> `N renewed EPOCH...`
  `N split FIRST SECOND HOLD LEASE`
                         the split-brain probe: acquire LEASE, poll FIRST and
                         SECOND with it until the
                         origin answers, poll FIRST with it held at the origin
                         (`X-Campaign-Hold: HOLD`; again while refused at
                         once), renew, poll SECOND with the
                         newer epoch until the origin answers
                         -> `N split ok LEASE EPOCH NEWER` or `N split failed WHY`;
                         the lease is released once the held poll has ended
                         (before the next command)
  `N abort`              release the lease (the nemesis gave the step up)
  `stop`                 exit
With uploads in flight, `renew` first polls NEW with each upload lease's newer
epoch (renewing them first if `renew-uploads` did not), all at once, until the
origin answers (-> `N newer ok` or `N newer failed`), then does the above; once
it has answered `late` it waits for the uploads to end (the nemesis releases the
holds) and releases their leases.
The polls are GETs logged like any attempt (kinds "poll-directed",
"poll-directed-retry", "poll-directed-late" and "poll-split-held"), the uploads
are attempts of kind "upload": the checker judges them from the history like the
rest.
"""
import argparse
import hashlib
import http.client
import itertools
import json
import os
import random
import secrets
import threading
import time

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

LOG_LOCK = threading.Lock()


class Store:
    """SPEC §2 on S3: list, read, conditional create with the uncertain-result read-back."""

    def __init__(self, endpoint, bucket, prefix):
        self.s3 = boto3.client(
            "s3", endpoint_url=endpoint, region_name="us-east-1",
            aws_access_key_id="test", aws_secret_access_key="test",
            config=Config(connect_timeout=1, read_timeout=1.5, s3={"addressing_style": "path"},
                          retries={"max_attempts": 2, "mode": "standard"}))
        self.bucket, self.prefix = bucket, prefix
        self.known = {}

    def key(self, lease, epoch):
        return f"{self.prefix}{lease}/{epoch:020}.json"

    def latest(self, lease):
        """The greatest epoch of `lease`. Listing starts after the latest one we have
        seen: epoch objects are never deleted while they matter (SPEC §2)."""
        known = self.known.get(lease, 0)
        args = {"Bucket": self.bucket, "Prefix": f"{self.prefix}{lease}/"}
        if known:
            args["StartAfter"] = self.key(lease, known)
        while True:
            r = self.s3.list_objects_v2(**args)
            for o in r.get("Contents", []):
                known = max(known, int(o["Key"].rsplit("/", 1)[1][:20]))
            if not r.get("IsTruncated"):
                break
            args["ContinuationToken"] = r["NextContinuationToken"]
        self.known[lease] = known
        return known

    def read(self, lease, epoch):
        """(object as dict, LastModified as Unix seconds), or None if absent."""
        try:
            r = self.s3.get_object(Bucket=self.bucket, Key=self.key(lease, epoch))
        except ClientError as e:
            if e.response["Error"]["Code"] in ("NoSuchKey", "404"):
                return None
            raise
        return json.loads(r["Body"].read()), r["LastModified"].timestamp()

    def create(self, lease, epoch, obj, ours):
        """True if we created it, False if someone else did; raises if unknown."""
        body = json.dumps(obj).encode()
        for _ in range(5):
            try:
                self.s3.put_object(Bucket=self.bucket, Key=self.key(lease, epoch), Body=body,
                                   IfNoneMatch="*", ContentType="application/json")
                return True
            except ClientError as e:
                status = e.response["ResponseMetadata"].get("HTTPStatusCode", 0)
                retried = e.response["ResponseMetadata"].get("RetryAttempts", 0) > 0
                if status in (409, 412) and not retried:
                    return False  # lost the race (no hidden earlier attempt)
                if status not in (409, 412) and status < 500:
                    raise
            except BotoCoreError:
                pass
            # The uncertain result: read it back.
            try:
                found = self.read(lease, epoch)
            except (BotoCoreError, ClientError):
                time.sleep(0.2)
                continue
            if found is not None:
                return ours(found[0])
        raise RuntimeError(f"could not decide the create of {lease} epoch {epoch}")


class Tenure:
    def __init__(self, lease, epoch, token, deadline, short=False, long=False):
        self.lease, self.epoch, self.token, self.deadline = lease, epoch, token, deadline
        self.short, self.long = short, long

    def left(self):
        return self.deadline - time.monotonic()


class Worker:
    def __init__(self, a):
        self.a, self.id = a, a.id
        self.rng = random.Random(a.seed)
        self.store = Store(a.endpoint, a.bucket, a.prefix)
        self.log = open(a.log, "a", encoding="utf-8")
        self.counter = itertools.count(1)
        self.stop_at = time.monotonic() + a.secs
        self.pending = []  # split probes' held polls, and the tenure to release after

    def holding(self, ten):
        """Tells the nemesis which lease we hold (it prefers to pause holders)."""
        with open(self.a.state_file + ".tmp", "w") as f:
            f.write(f"{ten.lease} {ten.epoch}" if ten else "")
        os.replace(self.a.state_file + ".tmp", self.a.state_file)

    def emit(self, rec):
        with LOG_LOCK:
            self.log.write(json.dumps(rec, separators=(",", ":")) + "\n")
            self.log.flush()

    def create_epoch(self, lease, epoch, kind, short=False, long=False):
        token = secrets.token_hex(32)
        obj = {"v": 1, "lease": lease, "epoch": epoch, "kind": kind, "holder": f"w{self.id}",
               "nonce": token}
        if kind == "acquire":
            obj["token_sha256"] = hashlib.sha256(token.encode()).hexdigest()
            obj["ttl_ms"] = (self.a.ttl_ms if self.a.ttl_ms
                             else self.rng.randint(900, 1300) if short
                             else self.rng.randint(12000, 20000) if long
                             else self.rng.randint(2000, 4000))
        t0 = time.monotonic()
        won = self.store.create(lease, epoch, obj, lambda o: o.get("nonce") == token)
        if not won or kind != "acquire":
            return None
        margin = 0.25 if short else 1.0
        ten = Tenure(lease, epoch, token, t0 + obj["ttl_ms"] / 1000 - margin, short, long)
        self.emit({"ev": "tenure", "w": self.id, "lease": lease, "epoch": epoch,
                   "ttl_ms": obj["ttl_ms"], "short": short, "at": time.monotonic_ns()})
        return ten

    def acquire(self, lease, current=None, short=False, long=False):
        """SPEC §2 steps 1-4 (renewal when `current`); None when held, lost or unsure."""
        try:
            latest = self.store.latest(lease)
            if current is not None and (latest != current.epoch or current.left() <= 0):
                return None  # someone took over, or our tenure is over
            if current is None and latest > 0:
                found = self.store.read(lease, latest)
                if found and found[0].get("kind") == "acquire":
                    expiry = found[1] + found[0].get("ttl_ms", 0) / 1000
                    if expiry + self.a.grace_ms / 1000 >= time.time():
                        return None  # held
            short = current.short if current is not None else short
            long = current.long if current is not None else long
            return self.create_epoch(lease, latest + 1, "acquire", short, long)
        except (BotoCoreError, ClientError, RuntimeError, ValueError):
            return None

    def release(self, ten):
        try:
            if ten.left() > 0.3 and self.store.latest(ten.lease) == ten.epoch:
                self.create_epoch(ten.lease, ten.epoch + 1, "release")
        except (BotoCoreError, ClientError, RuntimeError, ValueError):
            pass

    def send(self, ten, kind, key, body, epoch=None, token=None, addr=None, hold=None):
        req = f"w{self.id}-{next(self.counter)}"
        epoch = ten.epoch if epoch is None else epoch
        token = ten.token if token is None else token
        route = "r" + ten.lease[1:]
        rec = {"ev": "attempt", "w": self.id, "req": req, "kind": kind, "route": route,
               "lease": ten.lease, "epoch": epoch, "token": token, "key": key, "body": body,
               "status": None, "error": None, "replayed": False, "resp_body": None, "detail": None,
               "delivery": None, "seq": None, "q_epoch": None}
        rec["invoke"] = time.monotonic_ns()
        try:
            if addr is None:
                with open(self.a.addr_file) as f:
                    addrs = f.read().split()
                addr = addrs[0] if len(addrs) == 1 else self.rng.choice(addrs)
            rec["addr"] = addr
            host, port = addr.rsplit(":", 1)
            conn = http.client.HTTPConnection(host, int(port), timeout=self.a.client_timeout)
            headers = {"x-lease-epoch": str(epoch), "x-lease-token": token,
                       "x-campaign-req": req, "content-type": "application/json"}
            if hold is not None:
                headers["x-campaign-hold"] = hold
            if kind.startswith("poll"):
                conn.request("GET", f"/{route}/op", headers=headers)
            else:
                headers["idempotency-key"] = key
                conn.request("POST", f"/{route}/op", body=body.encode(), headers=headers)
            r = conn.getresponse()
            data = r.read()
            conn.close()
            rec.update(outcome="response", status=r.status, error=r.getheader("x-fencegate-error"),
                       replayed=r.getheader("x-fencegate-replayed") == "true",
                       resp_body=data.decode("latin-1"),
                       delivery=r.getheader("x-fencegate-delivery"))
            if rec["delivery"] == "queued" and r.status == 202:
                try:
                    msg = json.loads(data)
                    rec.update(seq=msg.get("seq"), q_epoch=msg.get("epoch"))
                except ValueError:
                    pass  # no place: the checker reports the 202 as no acceptance
        except TimeoutError as e:
            rec.update(outcome="timeout", detail=repr(e))
        except (OSError, http.client.HTTPException, ValueError) as e:
            rec.update(outcome="conn_error", detail=repr(e))
        rec["complete"] = time.monotonic_ns()
        self.emit(rec)
        return rec

    def operation(self, ten, opn):
        """One action: a fresh key and body, retried with the same key until decided."""
        key = f"w{self.id}-op{opn}-{secrets.token_hex(4)}"
        body = json.dumps({"w": self.id, "lease": ten.lease, "op": opn, "data": secrets.token_hex(6)})
        poll = self.a.polls > 0 and self.rng.random() < self.a.polls
        retry = "poll-retry" if poll else "retry"
        x = self.rng.random()
        if poll:
            key, body = "", ""
            rec = self.send(ten, "poll", key, body)
        elif x < 0.03:
            return self.send(ten, "forged", key, body, token=secrets.token_hex(32))
        elif x < 0.05:
            return self.send(ten, "future", key, body, epoch=ten.epoch + self.rng.randint(2, 6))
        elif x < 0.12:
            dup = threading.Thread(target=self.send, args=(ten, "dup", key, body))
            dup.start()
            rec = self.send(ten, "op", key, body)
            dup.join()
        else:
            rec = self.send(ten, "op", key, body)
        for _ in range(3):
            again = rec["outcome"] != "response" or rec["error"] in (
                "upstream_timeout", "drain_aborted", "store_unavailable", "dedup_in_flight",
                "shard_unavailable")
            if not again or time.monotonic() > self.stop_at:
                return rec
            time.sleep(self.rng.uniform(0.2, 0.8))
            if ten.left() <= 0 and self.rng.random() > 0.2:
                return rec  # our tenure is over: a careful worker stops here
            rec = self.send(ten, retry, key, body)
        return rec

    def stale_poll(self, old):
        """A part of us that did not hear of the renewal: a poll with the superseded
        epoch, a moment later (SPEC §1's late worker, inside one worker)."""
        time.sleep(self.rng.uniform(0.2, 2.0))
        if time.monotonic() < self.stop_at:
            self.send(old, "poll-stale", "", "")

    def forwarded(self, ten, addr, secs):
        """Polls `addr` with `ten` until the origin answers (True), for `secs` at most."""
        end = time.monotonic() + secs
        kind = "poll-directed"
        while time.monotonic() < end:
            rec = self.send(ten, kind, "", "", addr=addr)
            if rec["outcome"] == "response" and rec["error"] is None and not rec["replayed"]:
                return True
            kind = "poll-directed-retry"
            time.sleep(0.2)
        return False

    def upload(self, ten, addr, hold, body):
        """A held upload (module doc): a POST of `body` without an Idempotency-Key
        on a route that records nothing, so fencegate streams it. Returns the
        thread sending it and the attempt's request id."""
        req = f"w{self.id}-{next(self.counter)}"

        def run():
            route = "r" + ten.lease[1:]
            rec = {"ev": "attempt", "w": self.id, "req": req, "kind": "upload", "route": route,
                   "lease": ten.lease, "epoch": ten.epoch, "token": ten.token, "key": "",
                   "body": f"{len(body)} bytes", "status": None, "error": None,
                   "replayed": False, "resp_body": None, "detail": None, "addr": addr,
                   "invoke": time.monotonic_ns()}
            try:
                host, port = addr.rsplit(":", 1)
                conn = http.client.HTTPConnection(host, int(port), timeout=60)
                conn.request("POST", f"/{route}/upload", body=body, headers={
                    "x-lease-epoch": str(ten.epoch), "x-lease-token": ten.token,
                    "x-campaign-req": req, "x-campaign-hold": hold,
                    "content-type": "application/octet-stream"})
                r = conn.getresponse()
                data = r.read()
                conn.close()
                rec.update(outcome="response", status=r.status,
                           error=r.getheader("x-fencegate-error"),
                           replayed=r.getheader("x-fencegate-replayed") == "true",
                           resp_body=data.decode("latin-1"))
            except TimeoutError as e:
                rec.update(outcome="timeout", detail=repr(e))
            except (OSError, http.client.HTTPException, ValueError) as e:
                rec.update(outcome="conn_error", detail=repr(e))
            rec["complete"] = time.monotonic_ns()
            self.emit(rec)

        t = threading.Thread(target=run)
        t.start()
        return t, req

    def split(self, first, second, hold, lease):
        """The split-brain probe: a poll of a fresh epoch of `lease` through
        `first`, held at the origin (token `hold`), then the next epoch polled
        through `second` until the origin answers, then the lease released once
        the held poll ended. Returns the words of the answer."""
        ten = None
        for _ in range(20):
            ten = self.acquire(lease)
            if ten:
                break
            time.sleep(0.3)
        if ten is None:
            return ["failed", "could not acquire", lease]
        # First a poll through each until the origin answers: whatever serves
        # the lease behind `first` holds this epoch and has settled (a takeover's
        # settle would hold the held poll back until the newer epoch made it
        # stale), and so does whatever serves it behind `second` (its raise then
        # has nothing of its own to drain: the newer poll follows the held one
        # closely, however long a takeover behind `second` took).
        for addr, secs in ((first, 10), (second, 15)):
            if not self.forwarded(ten, addr, secs):
                self.pending.append((None, ten))
                return ["failed", "not forwarded through", addr]
        # Until a held poll stays unanswered (held at the origin): one refused at
        # once (a member still taking its shards) is sent again.
        for _ in range(20):
            held = threading.Thread(target=self.send, args=(ten, "poll-split-held", "", ""),
                                    kwargs={"addr": first, "hold": hold})
            held.start()
            held.join(timeout=0.5)
            if held.is_alive():
                break
            time.sleep(0.3)
        new = self.acquire(lease, current=ten)
        if new is None:
            words = ["failed", "could not renew", lease]
        elif self.forwarded(new, second, 6):
            words = ["ok", lease, ten.epoch, new.epoch]
        else:
            words = ["failed", "the newer epoch was not forwarded", lease]
        self.pending.append((held, new or ten))
        return words

    def directed(self):
        """The directed late worker (--directed, module doc): steps on command."""
        lease = self.a.leases.split(",")[0]
        cmd, ack = self.a.directed + ".cmd", self.a.directed + ".ack"

        def answer(n, *words):
            with open(ack + ".tmp", "w") as f:
                f.write(" ".join([n, *map(str, words)]))
            os.replace(ack + ".tmp", ack)

        ten, done = None, None
        upload_leases = [l for l in self.a.upload_leases.split(",") if l]
        # The uploads' threads, their tenures, and the renewed tenures.
        uploads, up_tens, up_new, body = [], [], [], None

        def end_uploads():
            """Waits for the uploads (bounded by the origin's longest hold) and
            releases their leases."""
            nonlocal uploads, up_tens, up_new
            for t in uploads:
                t.join(timeout=70)
            for u in up_new + up_tens:
                self.release(u)
            uploads, up_tens, up_new = [], [], []

        def renew_uploads():
            nonlocal up_new
            if not up_new:
                up_new = [u for u in (self.acquire(u.lease, current=u) for u in up_tens) if u]

        def poll_uploads(addr):
            """Polls `addr` with every renewed upload lease at once: whether the
            origin answered each."""
            got = [False] * len(up_new)

            def one(i, u):
                got[i] = self.forwarded(u, addr, 10)
            threads = [threading.Thread(target=one, args=(i, u)) for i, u in enumerate(up_new)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return bool(got) and all(got) and len(up_new) == len(up_tens)

        while time.monotonic() < self.stop_at:
            try:
                with open(cmd) as f:
                    words = f.read().split()
            except FileNotFoundError:
                words = []
            if words == ["stop"]:
                break
            if len(words) < 2 or words[:2] == done:
                time.sleep(0.05)
                continue
            done = words[:2]
            n, verb = words[0], words[1]
            # A split probe's held poll ends once the nemesis released it.
            for t, u in self.pending:
                if t is not None:
                    t.join(timeout=20)
                self.release(u)
            self.pending = []
            if verb == "acquire":
                new = None
                for _ in range(20):
                    live = ten is not None and ten.left() > 1
                    new = self.acquire(lease, current=ten if live else None)
                    if new:
                        break
                    time.sleep(0.3)
                if new is None:
                    answer(n, "failed", "could not acquire")
                    continue
                ten = new
                if self.forwarded(ten, words[2], 6):
                    answer(n, "acquired", ten.epoch)
                else:
                    answer(n, "failed", "the owner did not forward")
            elif verb == "uploads" and upload_leases:
                end_uploads()
                if body is None:
                    body = b"u" * self.a.upload_bytes
                for ul in upload_leases:
                    u = None
                    for _ in range(10):
                        u = self.acquire(ul)
                        if u:
                            break
                        time.sleep(0.3)
                    if u:
                        up_tens.append(u)
                if len(up_tens) < len(upload_leases):
                    end_uploads()
                    answer(n, "failed", "could not acquire the upload leases")
                    continue
                reqs = []
                for u in up_tens:
                    t, req = self.upload(u, words[2], f"u{n}", body)
                    uploads.append(t)
                    reqs.append(req)
                answer(n, "uploading", *reqs)
            elif verb == "split":
                answer(n, "split", *self.split(words[2], words[3], words[4], words[5]))
            elif verb == "renew-uploads":
                renew_uploads()
                answer(n, "renewed", *[u.epoch for u in up_new])
            elif verb == "renew" and ten is not None:
                if up_tens:
                    renew_uploads()
                    answer(n, "newer", "ok" if poll_uploads(words[2]) else "failed")
                old, new = ten, self.acquire(lease, current=ten)
                if new is None:
                    answer(n, "failed", "could not renew")
                elif not self.forwarded(new, words[2], 15):
                    ten = new
                    answer(n, "failed", "the successor did not forward")
                else:
                    ten = new
                    rec = self.send(old, "poll-directed-late", "", "", addr=words[3])
                    how = ([rec["status"], rec["error"] or "origin"] if rec["outcome"] == "response"
                           else [rec["outcome"]])
                    answer(n, "late", *how)
                self.release(ten)
                ten = None
                end_uploads()
            else:  # abort, or a renewal without a tenure
                if ten is not None:
                    self.release(ten)
                    ten = None
                end_uploads()
                if verb != "abort":
                    answer(n, "failed", "no tenure to renew")

    def run(self):
        if self.a.directed:
            self.directed()
            for t, u in self.pending:
                if t is not None:
                    t.join(timeout=20)
                self.release(u)
            return None
        leases = self.a.leases.split(",")
        while time.monotonic() < self.stop_at:
            lease = self.rng.choice(leases)
            short = self.a.short_ttl > 0 and self.rng.random() < self.a.short_ttl
            long = not short and self.a.long_ttl > 0 and self.rng.random() < self.a.long_ttl
            ten = None
            for _ in range(10):
                ten = self.acquire(lease, short=short, long=long)
                if ten or time.monotonic() > self.stop_at:
                    break
                time.sleep(self.rng.uniform(0.2, 0.6))  # moto is single-threaded: poll gently
            if ten is None:
                continue
            self.holding(ten)
            live = []  # operations still in flight: a renewal may overtake them (the drain)
            # A short tenure holds the lease for a few operations only: its requests are
            # mostly refused as expired (fencegate's upper bound on the store's clock is
            # Date + 1 s + the round trip), and renewing for 25 of them would keep the
            # lease from the long-TTL workers for the whole run on a slow machine.
            for opn in range(self.rng.randint(3, 8) if ten.short else self.rng.randint(5, 25)):
                if time.monotonic() > self.stop_at:
                    break
                if ten.left() < 1.0 or (live and self.rng.random() < 0.3):
                    old = ten
                    ten = self.acquire(lease, current=ten) or ten  # renew (SPEC §2 step 4)
                    self.holding(ten)
                    if ten is not old and self.a.stale > 0 and self.rng.random() < self.a.stale:
                        live.append(threading.Thread(target=self.stale_poll, args=(old,)))
                        live[-1].start()
                sloppy = self.rng.random() < 0.1
                if ten.left() <= 0 and not sloppy:
                    break
                # work; a SIGSTOP here makes a late worker
                time.sleep(self.rng.uniform(0, 0.15) + self.rng.uniform(0, 2 * self.a.think))
                for j in range(self.rng.choice((1, 1, 2, 3))):
                    live.append(threading.Thread(target=self.operation,
                                                 args=(ten, f"{ten.epoch}.{opn}.{j}")))
                    live[-1].start()
                # A short tenure mostly keeps its operations in flight across the
                # renewal: the raise then has a drain to wait in.
                if self.rng.random() < (0.2 if ten.short else 0.6) or len(live) > 6:
                    for t in live:
                        t.join()
                live = [t for t in live if t.is_alive()]
            for t in live:
                t.join()
            if self.rng.random() < 0.7:
                self.release(ten)
            self.holding(None)
            time.sleep(self.rng.uniform(0, 0.3))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("--endpoint", "--addr-file", "--log", "--state-file", "--leases"):
        p.add_argument(name, required=True)
    p.add_argument("--id", type=int, required=True)
    p.add_argument("--bucket", default="leases")
    p.add_argument("--prefix", default="fencegate/")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--secs", type=float, default=20)
    p.add_argument("--grace-ms", type=int, default=500)
    p.add_argument("--client-timeout", type=float, default=8)
    p.add_argument("--short-ttl", type=float, default=0.0,
                   help="share of tenures with a 0.9-1.3 s TTL")
    p.add_argument("--long-ttl", type=float, default=0.0,
                   help="share of tenures with a 12-20 s TTL (longer than a gate lease)")
    p.add_argument("--stale", type=float, default=0.0,
                   help="chance that a renewal is followed by a poll with the superseded epoch")
    p.add_argument("--polls", type=float, default=0.0,
                   help="share of operations sent as a GET without an Idempotency-Key")
    p.add_argument("--think", type=float, default=0.0,
                   help="mean extra pause in seconds before each operation (a slower worker)")
    p.add_argument("--ttl-ms", type=int, default=0,
                   help="every tenure's TTL (instead of the random ones)")
    p.add_argument("--directed", default="",
                   help="play the directed late worker, commanded through CTL.cmd/CTL.ack")
    p.add_argument("--upload-leases", default="",
                   help="with --directed: the leases of the held uploads (command `uploads`)")
    p.add_argument("--upload-bytes", type=int, default=32 << 20,
                   help="the size of each held upload's body")

    Worker(p.parse_args()).run()


if __name__ == "__main__":
    main()
