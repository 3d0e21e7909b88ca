#!/usr/bin/env bash
# Instructions per request, counted by callgrind (repeatable here, unlike wall
# clock): the bare hyper pass-through, fencegate fencing only, and fencegate with
# durable dedup, each forwarding the same N requests (c keep-alive connections,
# 100-byte answers) to the load bench's origin. Instrumentation is switched on
# after a warm-up and off before shutdown, so start-up and exit are not counted.
#
#   cargo bench --bench load --no-run && cargo build --release
#   scripts/callgrind.sh [N=2000] [c=8] [fencegate binary]
#
# Prints Ir per request for each and the top functions (inclusive) per request;
# the raw profiles stay in the printed directory for callgrind_annotate.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
N=${1:-2000}
C=${2:-8}
FG=${3:-target/release/fencegate}
command -v valgrind >/dev/null || { echo "valgrind is not installed (apt-get install valgrind)" >&2; exit 2; }
BENCH=$(ls -t target/release/deps/load-* 2>/dev/null | grep -v '\.d$' | head -1)
[ -x "$BENCH" ] || { echo "build the load bench first: cargo bench --bench load --no-run" >&2; exit 2; }
[ -x "$FG" ] || { echo "no fencegate binary at $FG: cargo build --release" >&2; exit 2; }
out=$(mktemp -d /tmp/fencegate-callgrind.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

# Starts "$@" with stdout to $out/$name.out; waits for its JSON "listening" line
# and sets PID and ADDR.
start() {
    local name=$1; shift
    "$@" >"$out/$name.out" 2>"$out/$name.err" &
    PID=$!
    pids+=("$PID")
    for _ in $(seq 600); do
        grep -q listening "$out/$name.out" 2>/dev/null && break
        sleep 0.1
    done
    ADDR=$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["proxy"])' "$out/$name.out")
}
cg() { exec valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$out/$1.cg" "${@:2}"; }

start origin "$BENCH" --role origin
origin=$ADDR
mkdir -p "$out/store" "$out/state-fencing" "$out/state-dedup"
for mode in fencing dedup; do
    key=none; [ $mode = dedup ] && key=content
    cat >"$out/$mode.toml" <<EOF
[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
data_dir = "$out/state-$mode"
[store]
kind = "dir"
path = "$out/store-$mode"
prefix = "fencegate/"
[[route]]
name = "bench"
path_prefix = "/bench/"
upstream = "http://$origin/v1/"
lease = "bench"
timeout_ms = 10000
derive_key = "$key"
EOF
done

# Drives $1 (host:port) with $2 requests over $C connections; each body unique.
load() {
    python3 - "$1" "$2" "$C" "${EPOCH:-1}" "${TOKEN:-x}" "$3" <<'EOF'
import http.client, sys, threading
addr, n, c, epoch, token, tag = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
host, port = addr.rsplit(":", 1)
errors = []
def worker(w):
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    for i in range(w, n, c):
        body = ('{"amount":4200,"n":"%s-%d-%d"}' % (tag, w, i)).encode()
        conn.request("POST", "/bench/charge", body, {"X-Lease-Epoch": epoch, "X-Lease-Token": token, "Content-Type": "application/json"})
        r = conn.getresponse(); r.read()
        if r.status != 200: errors.append(r.status)
ts = [threading.Thread(target=worker, args=(w,)) for w in range(c)]
[t.start() for t in ts]; [t.join() for t in ts]
if errors: sys.exit("errors: %s" % errors[:5])
EOF
}

measure() { # name addr pid
    load "$2" 300 warm-$1
    callgrind_control -i on "$3" >/dev/null 2>&1
    load "$2" "$N" "$1"
    callgrind_control -i off "$3" >/dev/null 2>&1
    callgrind_control -d "$3" >/dev/null 2>&1
    kill -TERM "$3"
    wait "$3" 2>/dev/null || true
}

start passthrough cg passthrough "$BENCH" --role passthrough --upstream "$origin"
measure passthrough "$ADDR" "$PID"
for mode in fencing dedup; do
    eval "$("$FG" lease acquire --config "$out/$mode.toml" --lease bench --holder cg --ttl-ms 86400000 --format env)"
    EPOCH=$FENCEGATE_EPOCH TOKEN=$FENCEGATE_TOKEN
    FENCEGATE_LOG="info,fencegate::access=off" start "$mode" cg "$mode" "$FG" serve --config "$out/$mode.toml"
    measure "$mode" "$ADDR" "$PID"
done

echo "Instructions per request (callgrind Ir), N=$N over c=$C connections:"
for name in passthrough fencing dedup; do
    f=$(ls -S "$out/$name.cg"* | head -1)
    total=$(callgrind_annotate "$f" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",","",$1); print $1}')
    echo "  $name: $((total / N)) Ir/request"
done
for name in fencing dedup; do
    f=$(ls -S "$out/$name.cg"* | head -1)
    echo
    echo "== $name: top functions, inclusive Ir per request =="
    callgrind_annotate --inclusive=yes --threshold=99 "$f" 2>/dev/null |
        awk -v n="$N" '/^ *[0-9,]+ \(/ { v=$1; gsub(",","",v); $1=""; $2=""; printf "%9d  %s\n", v/n, substr($0, 1, 160) }' |
        head -45 || true
done
echo
echo "profiles: $out"
