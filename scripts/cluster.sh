#!/usr/bin/env bash
# A three-instance fencegate cluster on loopback (config/cluster/fencegate-{a,b,c}.toml),
# with the test S3 server on :9000, a private PostgreSQL on :55432 and a recording
# origin on :8081. It shows the shard map, sends a worker's requests through every
# instance, then kills fg-a with -9 and prints the shard map until fg-b and fg-c
# own every shard — the takeover. Everything stops on exit (Ctrl-C).
#
#   scripts/cluster.sh           the tour above, then keeps running until Ctrl-C
#   scripts/cluster.sh --no-kill the cluster only (watch it with curl)
#
# Needs: cargo, python3 (the S3 server's venv is made by setup-s3server.sh) and
# PostgreSQL's server binaries (scripts/setup-postgres.sh installs them as root).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
KILL=yes
[ "${1:-}" = "--no-kill" ] && KILL=no

WORK=$(mktemp -d /tmp/fencegate-cluster.XXXXXX)
chmod 755 "$WORK"
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    [ -n "${PGBIN:-}" ] && as_pg "$PGBIN/pg_ctl" -D "$WORK/pg" -m immediate stop >/dev/null 2>&1 || true
    echo "logs were in $WORK"
}
trap cleanup EXIT

PY=$(bash scripts/setup-s3server.sh)
[ "$(bash scripts/setup-postgres.sh)" = yes ] || { echo "PostgreSQL is needed" >&2; exit 1; }
PGBIN=$(pg_config --bindir 2>/dev/null || ls -d /usr/lib/postgresql/*/bin | tail -1)
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
[ "$(id -u)" = 0 ] && chown postgres "$WORK"

echo "== building fencegate"
cargo build --locked --quiet --bin fencegate
FG=$REPO/target/debug/fencegate

echo "== S3 test server on :9000, PostgreSQL on :55432, origin on :8081"
"$PY" scripts/s3server.py --port 9000 --bucket leases >"$WORK/s3.log" 2>&1 &
PIDS+=($!)
as_pg "$PGBIN/initdb" -D "$WORK/pg" -A trust -U fg >/dev/null
as_pg "$PGBIN/pg_ctl" -D "$WORK/pg" -o "-p 55432 -k $WORK/pg -c listen_addresses=127.0.0.1" -l "$WORK/pg.log" start >/dev/null
python3 - >"$WORK/origin.log" 2>&1 <<'EOF' &
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        print(f"origin received {self.path} epoch={self.headers.get('x-lease-epoch')} body={body.decode(errors='replace')}", flush=True)
        self.send_response(200); self.send_header("content-length", "3"); self.end_headers(); self.wfile.write(b"ok\n")
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", 8081), H).serve_forever()
EOF
PIDS+=($!)
for _ in $(seq 50); do "$PGBIN/pg_isready" -q -h 127.0.0.1 -p 55432 && break; sleep 0.1; done

export FENCEGATE_PG_URL="postgres://fg@127.0.0.1:55432/postgres"
export FENCEGATE_PEER_TOKEN="cluster-demo-peer-token-$(date +%s)"
export AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test AWS_EC2_METADATA_DISABLED=true
declare -A PID
for id in a b c; do
    "$FG" serve --config "config/cluster/fencegate-$id.toml" >"$WORK/fg-$id.out" 2>"$WORK/fg-$id.log" &
    PID[$id]=$!
    PIDS+=($!)
done

shard_map() { # owners of the 16 shards, as instance 'b' sees them
    curl -s "http://127.0.0.1:9192/v1/cluster" | python3 -c '
import json, sys
v = json.load(sys.stdin); me = v["instance_id"]
owners = [me if s["served_here"] else (s["owner"] or "-") for s in v["shard_map"]]
print(" ".join(o.replace("fg-", "") for o in owners))'
}

echo "== waiting for the shards to settle (each instance holds 5 or 6 of 16)"
for _ in $(seq 120); do
    ready=0
    for p in 9191 9192 9193; do curl -sf "http://127.0.0.1:$p/readyz" >/dev/null && ready=$((ready + 1)); done
    [ $ready = 3 ] && break
    sleep 0.5
done
sleep 6
echo "owners of shards 0..15 (a/b/c, - for none):"
shard_map

echo "== a worker acquires lease 'billing' and sends one request through each instance"
LEASE=$("$FG" lease acquire --config config/cluster/fencegate-a.toml --lease billing --holder demo-worker --ttl-ms 60000)
EPOCH=$(echo "$LEASE" | python3 -c 'import json,sys; print(json.load(sys.stdin)["epoch"])')
TOKEN=$(echo "$LEASE" | python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')
for p in 8181 8182 8183; do
    curl -s -o /dev/null -w "via :$p -> %{http_code}\n" -X POST "http://127.0.0.1:$p/billing/charge" \
        -H "X-Lease-Epoch: $EPOCH" -H "X-Lease-Token: $TOKEN" -H "Idempotency-Key: demo-$p" -d "charge via $p"
done
sed 's/^/   /' "$WORK/origin.log"

if [ $KILL = yes ]; then
    echo "== kill -9 fg-a; its shards are taken after its gate leases expire (gate_ttl 10 s + grace 2 s, plus up to 2 s of clock resolution)"
    kill -9 "${PID[a]}"
    SECONDS=0
    for _ in $(seq 40); do
        sleep 1
        printf '%3ds  ' "$SECONDS"
        map=$(shard_map)
        echo "$map"
        case "$map" in *a*|*-*) ;; *) break ;; esac
    done
    echo "== the same requests, retried through fg-b: answered from the shared records, not sent again"
    curl -s -o /dev/null -w "retry via :8182 -> %{http_code}\n" -X POST "http://127.0.0.1:8182/billing/charge" \
        -H "X-Lease-Epoch: $EPOCH" -H "X-Lease-Token: $TOKEN" -H "Idempotency-Key: demo-8181" -d "charge via 8181"
fi
echo "== running; admin: curl 127.0.0.1:9192/v1/cluster | Ctrl-C stops everything"
wait
