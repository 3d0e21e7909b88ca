#!/usr/bin/env bash
# A three-instance fencegate cluster on loopback (config/cluster/fencegate-{a,b,c}.toml),
# with the test S3 server, a private PostgreSQL and a recording origin. It shows
# the shard map, sends a worker's requests through every instance, then kills fg-a
# with -9 and prints the shard map until fg-b and fg-c own every shard — the
# takeover. Everything stops on exit (Ctrl-C).
#
#   scripts/cluster.sh               the tour above, then keeps running until Ctrl-C
#   scripts/cluster.sh --no-kill     the cluster only (watch it with curl)
#   scripts/cluster.sh --preflight   only choose the ports and say which (no build)
#   scripts/cluster.sh --fixed-ports use exactly the ports below, or fail naming
#                                    the one that is taken (with the others)
#
# Ports: S3 9000, PostgreSQL 15432, origin 8081, proxies 8181-8183, admins
# 9191-9193 — all below Linux's ephemeral range. One that is taken is replaced by
# the next free port above it (said on the way), unless --fixed-ports; the
# instances' configs are written with the ports chosen (in the work directory).
# A step that fails prints the last lines of its log (e.g. pg_ctl's "Address
# already in use"), not only that it failed.
#
# Needs: cargo, python3 (the S3 server's venv is made by setup-s3server.sh) and
# PostgreSQL's server binaries (scripts/setup-postgres.sh installs them as root).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
KILL=yes PREFLIGHT=no FIXED=no
for arg in "$@"; do
    case "$arg" in
        --no-kill) KILL=no ;;
        --preflight) PREFLIGHT=yes ;;
        --fixed-ports) FIXED=yes ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "cluster.sh: unknown argument $arg (see the header of $0)" >&2; exit 2 ;;
    esac
done

# --- ports: each role's default, or the next free one above it -----------------
ROLES=(s3 pg origin proxy_a proxy_b proxy_c admin_a admin_b admin_c)
DEFAULTS=(9000 15432 8081 8181 8182 8183 9191 9192 9193)
NAMES=("the S3 test server" "PostgreSQL" "the origin" "fg-a's proxy" "fg-b's proxy"
    "fg-c's proxy" "fg-a's admin" "fg-b's admin" "fg-c's admin")
# Who holds a port, when ss can say.
holder() {
    command -v ss >/dev/null 2>&1 || return 0
    ss -ltnpH "sport = :$1" 2>/dev/null | grep -o 'users:(([^)]*))' | head -1 |
        sed -E 's/users:\(\("([^"]*)",pid=([0-9]+).*/\1 (pid \2)/' || true
}
# Prints "port taken" per default port: "9000 1" when it cannot be bound.
CHECK=$(python3 - "${DEFAULTS[@]}" <<'EOF'
import socket, sys
for p in sys.argv[1:]:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", int(p)))
        print(p, 0)
    except OSError:
        print(p, 1)
    finally:
        s.close()
EOF
)
declare -A PORT
taken=()
i=0
while read -r p busy; do
    role=${ROLES[$i]}
    if [ "$busy" = 1 ]; then
        taken+=("$p (${NAMES[$i]}) is taken$(h=$(holder "$p"); [ -n "$h" ] && echo " by $h")")
    fi
    PORT[$role]=$p
    i=$((i + 1))
done <<<"$CHECK"
if [ ${#taken[@]} -gt 0 ]; then
    if [ $FIXED = yes ]; then
        for t in "${taken[@]}"; do echo "cluster.sh: port $t" >&2; done
        echo "cluster.sh: free it, or run without --fixed-ports to use other ports" >&2
        exit 1
    fi
    # The next free port above each taken one, none chosen twice, none of the defaults.
    NEW=$(python3 - "${DEFAULTS[@]}" <<'EOF'
import socket, sys
defaults = [int(p) for p in sys.argv[1:]]
held, out = [], []
for p in defaults:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", p))
        out.append(p)
        held.append(s)
        continue
    except OSError:
        s.close()
    q = p + 1
    while True:
        if q not in defaults and q not in out:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", q))
                out.append(q)
                held.append(s)
                break
            except OSError:
                s.close()
        q += 1
print(" ".join(map(str, out)))
EOF
)
    read -r -a chosen <<<"$NEW"
    for i in "${!ROLES[@]}"; do
        role=${ROLES[$i]}
        if [ "${chosen[$i]}" != "${PORT[$role]}" ]; then
            echo "port ${PORT[$role]} (${NAMES[$i]}) is taken$(h=$(holder "${PORT[$role]}"); [ -n "$h" ] && echo " by $h"): using ${chosen[$i]}"
            PORT[$role]=${chosen[$i]}
        fi
    done
fi
printf 'ports:'
for role in "${ROLES[@]}"; do printf ' %s=%s' "$role" "${PORT[$role]}"; done
echo
[ $PREFLIGHT = yes ] && exit 0

WORK=$(mktemp -d /tmp/fencegate-cluster.XXXXXX)
chmod 755 "$WORK"
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    [ -n "${PGBIN:-}" ] && as_pg "$PGBIN/pg_ctl" -D "$WORK/pg" -m immediate stop >/dev/null 2>&1 || true
    echo "logs were in $WORK"
}
trap cleanup EXIT
# Says why a step failed: its message, then the last lines of its log.
fail() { # fail WHAT LOG
    echo "cluster.sh: $1 failed; the end of $2:" >&2
    tail -n 15 "$2" 2>/dev/null | sed 's/^/    /' >&2
    exit 1
}

echo "== setting up the S3 test server's venv and PostgreSQL"
PY=$(bash scripts/setup-s3server.sh)
[ "$(bash scripts/setup-postgres.sh)" = yes ] || { echo "PostgreSQL is needed" >&2; exit 1; }
PGBIN=$(pg_config --bindir 2>/dev/null || ls -d /usr/lib/postgresql/*/bin | tail -1)
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
[ "$(id -u)" = 0 ] && chown postgres "$WORK"

echo "== building fencegate (cargo's progress below; the first build takes minutes)"
cargo build --locked --bin fencegate
FG=$REPO/target/debug/fencegate

# The instances' configs, with the ports chosen.
for id in a b c; do
    sed -e "s/127\.0\.0\.1:9000/127.0.0.1:${PORT[s3]}/" \
        -e "s/127\.0\.0\.1:8081/127.0.0.1:${PORT[origin]}/" \
        -e "s/127\.0\.0\.1:8181/127.0.0.1:${PORT[proxy_a]}/; s/127\.0\.0\.1:8182/127.0.0.1:${PORT[proxy_b]}/; s/127\.0\.0\.1:8183/127.0.0.1:${PORT[proxy_c]}/" \
        -e "s/127\.0\.0\.1:9191/127.0.0.1:${PORT[admin_a]}/; s/127\.0\.0\.1:9192/127.0.0.1:${PORT[admin_b]}/; s/127\.0\.0\.1:9193/127.0.0.1:${PORT[admin_c]}/" \
        -e "s|^data_dir = .*|data_dir = \"$WORK/data-$id\"|" \
        "config/cluster/fencegate-$id.toml" >"$WORK/fencegate-$id.toml"
done

echo "== S3 test server on :${PORT[s3]}, PostgreSQL on :${PORT[pg]}, origin on :${PORT[origin]}"
"$PY" scripts/s3server.py --port "${PORT[s3]}" --bucket leases >"$WORK/s3.log" 2>&1 &
PIDS+=($!)
as_pg "$PGBIN/initdb" -D "$WORK/pg" -A trust -U fg >"$WORK/initdb.log" 2>&1 || fail "initdb" "$WORK/initdb.log"
as_pg "$PGBIN/pg_ctl" -D "$WORK/pg" -o "-p ${PORT[pg]} -k $WORK/pg -c listen_addresses=127.0.0.1" -l "$WORK/pg.log" start >/dev/null \
    || fail "starting PostgreSQL (pg_ctl)" "$WORK/pg.log"
python3 - "${PORT[origin]}" >"$WORK/origin.log" 2>&1 <<'EOF' &
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        print(f"origin received {self.path} epoch={self.headers.get('x-lease-epoch')} body={body.decode(errors='replace')}", flush=True)
        self.send_response(200); self.send_header("content-length", "3"); self.end_headers(); self.wfile.write(b"ok\n")
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
EOF
PIDS+=($!)
pg_up=no
for _ in $(seq 50); do "$PGBIN/pg_isready" -q -h 127.0.0.1 -p "${PORT[pg]}" && { pg_up=yes; break; }; sleep 0.1; done
[ $pg_up = yes ] || fail "PostgreSQL answering on :${PORT[pg]}" "$WORK/pg.log"
s3_up=no
for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:${PORT[s3]}/" && { s3_up=yes; break; }; sleep 0.1; done
[ $s3_up = yes ] || fail "the S3 test server on :${PORT[s3]}" "$WORK/s3.log"
kill -0 "${PIDS[-1]}" 2>/dev/null || fail "the origin on :${PORT[origin]}" "$WORK/origin.log"

export FENCEGATE_PG_URL="postgres://fg@127.0.0.1:${PORT[pg]}/postgres"
export FENCEGATE_PEER_TOKEN="cluster-demo-peer-token-$(date +%s)"
export AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test AWS_EC2_METADATA_DISABLED=true
declare -A PID
for id in a b c; do
    "$FG" serve --config "$WORK/fencegate-$id.toml" >"$WORK/fg-$id.out" 2>"$WORK/fg-$id.log" &
    PID[$id]=$!
    PIDS+=($!)
done

shard_map() { # owners of the 16 shards, as instance 'b' sees them
    curl -s "http://127.0.0.1:${PORT[admin_b]}/v1/cluster" | python3 -c '
import json, sys
v = json.load(sys.stdin); me = v["instance_id"]
owners = [me if s["served_here"] else (s["owner"] or "-") for s in v["shard_map"]]
print(" ".join(o.replace("fg-", "") for o in owners))'
}

echo "== waiting for the shards to settle (each instance holds 5 or 6 of 16)"
for _ in $(seq 120); do
    ready=0
    for id in a b c; do
        kill -0 "${PID[$id]}" 2>/dev/null || fail "fencegate fg-$id" "$WORK/fg-$id.log"
        admin=admin_$id
        curl -sf "http://127.0.0.1:${PORT[$admin]}/readyz" >/dev/null && ready=$((ready + 1))
    done
    [ $ready = 3 ] && break
    sleep 0.5
done
sleep 6
echo "owners of shards 0..15 (a/b/c, - for none):"
shard_map

echo "== a worker acquires lease 'billing' and sends one request through each instance"
LEASE=$("$FG" lease acquire --config "$WORK/fencegate-a.toml" --lease billing --holder demo-worker --ttl-ms 60000)
EPOCH=$(echo "$LEASE" | python3 -c 'import json,sys; print(json.load(sys.stdin)["epoch"])')
TOKEN=$(echo "$LEASE" | python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')
for id in a b c; do
    proxy=proxy_$id
    p=${PORT[$proxy]}
    curl -s -o /dev/null -w "via :$p -> %{http_code}\n" -X POST "http://127.0.0.1:$p/billing/charge" \
        -H "X-Lease-Epoch: $EPOCH" -H "X-Lease-Token: $TOKEN" -H "Idempotency-Key: demo-$id" -d "charge via fg-$id"
done
sed 's/^/   /' "$WORK/origin.log"

if [ $KILL = yes ]; then
    echo "== kill -9 fg-a; fg-b and fg-c take its shards once their ownership rows (in PostgreSQL) have gone unrenewed for gate_ttl + grace_ms (10 s + 2 s)"
    kill -9 "${PID[a]}"
    SECONDS=0
    for _ in $(seq 40); do
        sleep 1
        printf '%3ds  ' "$SECONDS"
        map=$(shard_map)
        echo "$map"
        case "$map" in *a*|*-*) ;; *) break ;; esac
    done
    echo "== fg-a's request retried through fg-b (same key): answered from the shared record, not sent again"
    echo "   (until the shard's new owner serves it, 503 shard_unavailable with Retry-After: tried again)"
    for _ in $(seq 30); do
        head=$(curl -s -o /dev/null -D - -X POST "http://127.0.0.1:${PORT[proxy_b]}/billing/charge" \
            -H "X-Lease-Epoch: $EPOCH" -H "X-Lease-Token: $TOKEN" -H "Idempotency-Key: demo-a" -d "charge via fg-a" | tr -d '\r')
        code=$(echo "$head" | awk 'NR == 1 {print $2}')
        why=$(echo "$head" | awk -F': ' 'tolower($1) == "x-fencegate-error" {print $2}')
        replayed=$(echo "$head" | awk -F': ' 'tolower($1) == "x-fencegate-replayed" {print $2}')
        echo "   retry via :${PORT[proxy_b]} -> $code${why:+ $why}${replayed:+ (replayed: $replayed)}"
        [ "$code" = 503 ] || break
        sleep 0.5
    done
    echo "   the origin received (demo-a once):"
    sed 's/^/   /' "$WORK/origin.log"
fi
echo "== running; admin: curl 127.0.0.1:${PORT[admin_b]}/v1/cluster | Ctrl-C stops everything"
wait
