#!/usr/bin/env bash
# Counters per request, measured over the load window only (issue 37): the bare
# pass-through, fencegate fencing-only and fencegate with durable dedup on sled,
# each pinned with its origin and wrk to one CPU, under `wrk -c CONNS` for SECS
# seconds; `perf stat -p` on the proxy alone (task-clock, context switches,
# syscalls, page faults) while wrk runs. No timing is asserted anywhere: figures.
#
#   scripts/profile.sh [SECS] [CONNS] [FENCEGATE] [record]
#
# FENCEGATE: the binary to measure (default target/release/fencegate). With
# `record` as the 4th argument it also writes a `perf record -g` profile per
# target in $PROFILE_DIR (default /tmp/fencegate-profile). Needs perf and wrk
# (Debian: linux-perf, wrk) and a release build (`cargo bench --bench load
# --no-run` builds the helper roles).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
secs=${1:-5}
conns=${2:-64}
fg=$(realpath "${3:-target/release/fencegate}")
record=${4:-}
out=${PROFILE_DIR:-/tmp/fencegate-profile}
cpu=${PROFILE_CPU:-0}
mkdir -p "$out"
roles=$(ls -t target/release/deps/load-* | grep -v '\.d$' | head -1)
work=$(mktemp -d)
pids=()
cleanup() { [ -n "${PROFILE_SHOW:-}" ] && grep -h "$PROFILE_SHOW" "$work"/*.err;  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT

# Starts a process pinned to the CPU; waits for its `listening` line.
start() {
    local name=$1; shift
    taskset -c "$cpu" "$@" >"$work/$name.out" 2>"$work/$name.err" &
    pids+=($!)
    eval "${name}_pid=$!"
    for _ in $(seq 200); do
        if grep -q '"listening"' "$work/$name.out" 2>/dev/null; then
            eval "${name}_addr=$(grep -o '"proxy":"[^"]*"' "$work/$name.out" | head -1 | cut -d'"' -f4)"
            return
        fi
        sleep 0.05
    done
    cat "$work/$name.err" >&2
    echo "$name did not start" >&2
    exit 1
}

start origin "$roles" --role origin
start pass "$roles" --role passthrough --upstream "$origin_addr"
BENCH_RT=current start passct "$roles" --role passthrough --upstream "$origin_addr"
# PROFILE_B=PATH: another fencegate build, fencing only (target `fencingb`).
for kind in fencing dedup ${PROFILE_B:+fencingb}; do
    derive=none
    bin=$fg
    [ "$kind" = dedup ] && derive=content
    [ "$kind" = fencingb ] && bin=$(realpath "$PROFILE_B")
    cat >"$work/$kind.toml" <<TOML
[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
data_dir = "$work/state-$kind"
[store]
kind = "dir"
path = "$work/leases-$kind"
prefix = "fencegate/"
[[route]]
name = "bench"
path_prefix = "/bench/"
upstream = "http://$origin_addr/v1/"
lease = "bench"
timeout_ms = 10000
derive_key = "$derive"
TOML
    FENCEGATE_LOG="info,fencegate::access=off" start "$kind" "$bin" serve --config "$work/$kind.toml"
    "$bin" lease acquire --config "$work/$kind.toml" --lease bench --holder profile --ttl-ms 86400000 >"$work/$kind.lease"
done

# wrk's Lua: each request carries the lease's epoch and token; dedup's bodies
# are unique per request (content-derived keys, every one a new record).
lua() {
    local epoch token
    epoch=$(grep -o '"epoch":[0-9]*' "$work/$1.lease" | cut -d: -f2)
    token=$(grep -o '"token":"[^"]*"' "$work/$1.lease" | cut -d'"' -f4)
    cat <<LUA
local n = 0
request = function()
  n = n + 1
  local body = '{"n":' .. n .. ',"r":' .. math.random(1, 2000000000) .. '}'
  return wrk.format("POST", "/bench/charge", {["X-Lease-Epoch"] = "$epoch", ["X-Lease-Token"] = "$token", ["Content-Type"] = "application/json"}, body)
end
LUA
}
lua fencing >"$work/fencing.lua"
lua dedup >"$work/dedup.lua"
[ -n "${PROFILE_B:-}" ] && lua fencingb >"$work/fencingb.lua"
printf 'request = function() return wrk.format("POST", "/bench/charge", {["Content-Type"] = "application/json"}, "{}") end\n' >"$work/pass.lua"
cp "$work/pass.lua" "$work/passct.lua"

printf '| target | req/s | CPU µs/req | context switches/req | syscalls/req | page faults/req |\n|---|---:|---:|---:|---:|---:|\n'
for t in ${PROFILE_TARGETS:-pass passct fencing dedup}; do
    pid_var="${t}_pid"; addr_var="${t}_addr"
    pid=${!pid_var}; addr=${!addr_var}
    # Warm-up: pools, allocators, the first epoch's mark.
    taskset -c "$cpu" wrk -t1 -c"$conns" -d1s -s "$work/$t.lua" "http://$addr/bench/charge" >/dev/null
    perf stat -x, -e task-clock,context-switches,raw_syscalls:sys_enter,page-faults -p "$pid" -o "$work/$t.stat" &
    stat=$!
    if [ -n "$record" ]; then
        perf record -q -F ${PROFILE_HZ:-2999} ${PROFILE_CALLGRAPH:--g} -p "$pid" -o "$out/$t.perf.data" &
        rec=$!
    fi
    taskset -c "$cpu" wrk -t1 -c"$conns" -d"${secs}s" -s "$work/$t.lua" "http://$addr/bench/charge" >"$work/$t.wrk"
    kill -INT "$stat"; wait "$stat" || true
    if [ -n "$record" ]; then kill -INT "$rec"; wait "$rec" || true; fi
    reqs=$(grep -o '[0-9]* requests in' "$work/$t.wrk" | cut -d' ' -f1)
    non2xx=$(grep -o 'Non-2xx or 3xx responses: [0-9]*' "$work/$t.wrk" | grep -o '[0-9]*$' || echo 0)
    [ "${non2xx:-0}" = 0 ] || { cat "$work/$t.wrk" >&2; echo "$t: $non2xx refused" >&2; exit 1; }
    val() { grep ",$1" "$work/$t.stat" | head -1 | cut -d, -f1; }
    awk -v t="$t" -v r="$reqs" -v s="$secs" -v cpu="$(val task-clock)" -v cs="$(val context-switches)" \
        -v sc="$(val raw_syscalls:sys_enter)" -v pf="$(val page-faults)" \
        'BEGIN { printf "| %s | %.0f | %.1f | %.3f | %.2f | %.4f |\n", t, r/s, cpu*1000/r, cs/r, sc/r, pf/r }'
done
