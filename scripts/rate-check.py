"""A route's `rate` measured at the receiver (issue 48): 50/s on both paths, 20 s
each — a direct route (four workers; past the rate each is refused 503
upstream_held `rate` and tries again 5 ms later) and a queued route with
`ordering = "none"` (1,200 messages accepted at once; attempts wait for their
token). Prints arrivals per second and the mean. A measurement, not a test:

    python3 scripts/rate-check.py target/debug/fencegate

Uses a `dir` lease store and sled in /tmp/ratecheck (no S3 server needed)."""
import http.server, threading, time, subprocess, os, json, http.client, sys, shutil, socket
root = '/tmp/ratecheck'
os.makedirs(root, exist_ok=True)
for d in ['data', 'leases']:
    shutil.rmtree(f'{root}/{d}', ignore_errors=True)
arrivals = {'direct': [], 'queued': []}
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'
    def do_POST(self):
        n = int(self.headers.get('content-length', 0)); self.rfile.read(n)
        arrivals['queued' if self.path.startswith('/q/') else 'direct'].append(time.monotonic())
        self.send_response(200); self.send_header('content-length', '2'); self.end_headers(); self.wfile.write(b'ok')
    def log_message(self, *a): pass
def free():
    s = socket.socket(); s.bind(('127.0.0.1', 0)); p = s.getsockname()[1]; s.close(); return p
origin = http.server.ThreadingHTTPServer(('127.0.0.1', 0), H)
threading.Thread(target=origin.serve_forever, daemon=True).start()
op = origin.server_address[1]; px, ad = free(), free()
cfg = f'''[server]
listen = "127.0.0.1:{px}"
admin_listen = "127.0.0.1:{ad}"
data_dir = "{root}/data"
[store]
kind = "dir"
path = "{root}/leases"
prefix = "fg/"
[[route]]
name = "d"
path_prefix = "/d/"
upstream = "http://127.0.0.1:{op}/d/"
lease = "ld"
rate = "50/s"
[[route]]
name = "q"
path_prefix = "/q/"
upstream = "http://127.0.0.1:{op}/q/"
lease = "lq"
delivery = "queued"
ordering = "none"
rate = "50/s"
'''
open(f'{root}/fg.toml', 'w').write(cfg)
fg = subprocess.Popen([sys.argv[1], 'serve', '--config', f'{root}/fg.toml'], stderr=open(f'{root}/fg.log', 'w'))
for _ in range(100):
    try:
        c = http.client.HTTPConnection('127.0.0.1', ad, timeout=2); c.request('GET', '/readyz'); 
        if c.getresponse().status == 200: break
    except Exception: pass
    time.sleep(0.1)
def lease(name):
    out = subprocess.run([sys.argv[1], 'lease', 'acquire', '--config', f'{root}/fg.toml', '--lease', name, '--holder', 'w', '--ttl-ms', '600000'], capture_output=True, text=True)
    v = json.loads(out.stdout); return str(v['epoch']), v['token']
def rate_of(ts, t0, secs):
    per = [0]*secs
    for t in ts:
        i = int(t - t0)
        if 0 <= i < secs: per[i] += 1
    return per
SECS = 20
# Direct: 4 workers, each retrying after Retry-After when refused.
ep, tok = lease('ld')
stop = time.monotonic() + SECS + 1
refused = [0]
def worker(i):
    c = http.client.HTTPConnection('127.0.0.1', px, timeout=10); n = 0
    while time.monotonic() < stop:
        n += 1
        c.request('POST', '/d/x', body=b'x', headers={'x-lease-epoch': ep, 'x-lease-token': tok, 'idempotency-key': f'd{i}-{n}'})
        r = c.getresponse(); r.read()
        if r.status == 503:
            refused[0] += 1
            time.sleep(0.005)
t0 = time.monotonic()
ths = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
[t.start() for t in ths]; [t.join() for t in ths]
per = rate_of(arrivals['direct'], t0 + 0.5, SECS)
print('direct per second:', per)
print(f'direct mean over {SECS} s (after the first half second): {sum(per)/SECS:.2f}/s; refused {refused[0]}')
# Queued: 1,200 messages accepted at once, then the deliveries' rate.
ep, tok = lease('lq')
c = http.client.HTTPConnection('127.0.0.1', px, timeout=10)
for n in range(1200):
    c.request('POST', '/q/x', body=b'x', headers={'x-lease-epoch': ep, 'x-lease-token': tok, 'idempotency-key': f'q{n}'})
    r = c.getresponse(); r.read(); assert r.status == 202, r.status
while not arrivals['queued']: time.sleep(0.01)
t0 = arrivals['queued'][0]
time.sleep(SECS + 1.5)
per = rate_of(arrivals['queued'], t0 + 0.5, SECS)
print('queued per second:', per)
print(f'queued mean over {SECS} s (after the first half second, the burst): {sum(per)/SECS:.2f}/s; delivered {len(arrivals["queued"])}')
fg.terminate(); fg.wait()
