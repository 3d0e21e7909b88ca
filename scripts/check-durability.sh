#!/usr/bin/env bash
# Shows, with strace, what a group commit does on disk: sled's flush ends in
# sync_file_range, and fencegate follows it with fdatasync of sled's data file.
# Usage: scripts/check-durability.sh   (needs strace, curl, python3; builds debug)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
command -v strace >/dev/null || { echo "needs strace (apt-get install strace)" >&2; exit 2; }
cargo build --quiet --bin fencegate
bin=$PWD/target/debug/fencegate
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
origin_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
(cd "$work" && python3 -m http.server "$origin_port" --bind 127.0.0.1 >/dev/null 2>&1) &
cat > "$work/fg.toml" <<TOML
[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
data_dir = "$work/state"
[store]
kind = "dir"
path = "$work/leases"
[[route]]
name = "r"
path_prefix = "/r/"
upstream = "http://127.0.0.1:$origin_port/"
lease = "demo"
TOML
lease=$("$bin" lease acquire --config "$work/fg.toml" --lease demo --holder check --ttl-ms 60000)
epoch=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["epoch"])' "$lease")
token=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["token"])' "$lease")
strace -f -e trace=fsync,fdatasync,sync_file_range -o "$work/trace" "$bin" serve --config "$work/fg.toml" > "$work/ready" 2>/dev/null &
for _ in $(seq 100); do [ -s "$work/ready" ] && break; sleep 0.1; done
proxy=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["proxy"])' "$work/ready")
echo "--- one request (raises the mark, writes in_flight then done) ---"
curl -s -o /dev/null -w 'HTTP %{http_code}\n' -X GET "http://$proxy/r/" -H "X-Lease-Epoch: $epoch" -H "X-Lease-Token: $token"
sleep 0.5
echo "--- syscalls on the durable path (pid: call) ---"
grep -E 'sync_file_range|fdatasync|fsync' "$work/trace" | sed -E 's/^([0-9]+) +/\1: /' | tail -n 20
n_sfr=$(grep -c sync_file_range "$work/trace" || true)
n_fds=$(grep -c fdatasync "$work/trace" || true)
echo "sync_file_range: $n_sfr, fdatasync: $n_fds"
[ "$n_fds" -ge 2 ] || { echo "FAIL: expected an fdatasync per group commit" >&2; exit 1; }
echo "OK: each flush is followed by fdatasync"
