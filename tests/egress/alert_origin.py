"""An https destination that completes the TLS 1.3 handshake, reads and records
each request (the application has it), and then ends the connection with a fatal
TLS alert of its choosing, for tests/it/client_cert.rs. Built on tlslite-ng (pure
Python TLS), the one test server here that can send any alert at any moment.

    python alert_origin.py CERT KEY LOG MODE ALERT

MODE: `alert` (the alert instead of an answer, as a server that checks the
client at the application layer and hangs up does) or `answer_then_alert` (a
200 answer and the alert in one write). ALERT: a tlslite AlertDescription name,
e.g. access_denied, bad_certificate, handshake_failure. Prints {"port": N}
once listening on 127.0.0.1; appends {"event": "request", "key": ..., "path":
...} to LOG for each request it read whole.
"""
import json
import socket
import sys
import threading

from tlslite.api import HandshakeSettings, TLSConnection, X509CertChain, parsePEMKey
from tlslite.constants import AlertDescription, AlertLevel
from tlslite.messages import Alert

CERT, KEY, LOG, MODE, ALERT = sys.argv[1:6]
LOCK = threading.Lock()
CHAIN = X509CertChain()
CHAIN.parsePemList(open(CERT).read())
PRIV = parsePEMKey(open(KEY).read(), private=True)


def record(**event):
    with LOCK, open(LOG, "a") as f:
        f.write(json.dumps(event) + "\n")


class Buffered:
    """A socket whose writes are held until flush(): the answer and the alert
    leave in one write, so they reach the client in one read."""

    def __init__(self, sock):
        self.sock, self.held = sock, None

    def __getattr__(self, name):
        return getattr(self.sock, name)

    def send(self, data):
        if self.held is None:
            return self.sock.send(data)
        self.held += bytes(data)
        return len(data)

    def sendall(self, data):
        self.send(data)

    def flush(self):
        data, self.held = self.held, None
        self.sock.sendall(data)


def read_request(conn):
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = conn.read(max=65536)
        if not chunk:
            return None
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = conn.read(max=65536)
        if not chunk:
            return None
        rest += chunk
    return lines[0].split(" ")[1], headers


def serve(sock):
    raw = Buffered(sock)
    conn = TLSConnection(raw)
    settings = HandshakeSettings()
    settings.minVersion = (3, 4)
    settings.maxVersion = (3, 4)
    try:
        conn.handshakeServer(
            certChain=CHAIN, privateKey=PRIV, settings=settings, alpn=[bytearray(b"http/1.1")]
        )
        got = read_request(conn)
        if got is None:
            return
        path, headers = got
        record(
            event="request",
            path=path,
            key=headers.get("idempotency-key"),
            webhook_id=headers.get("webhook-id"),
        )
        raw.held = b""
        if MODE == "answer_then_alert":
            conn.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: 16\r\n\r\n{\"charged\":true}"
            )
        alert = Alert().create(getattr(AlertDescription, ALERT), AlertLevel.fatal)
        for _ in conn._sendMsg(alert):
            pass
        raw.flush()
    except Exception as e:  # noqa: BLE001 - a test server: log and go on
        import traceback; traceback.print_exc()
    finally:
        sock.close()


def main():
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(16)
    print(json.dumps({"port": lst.getsockname()[1]}), flush=True)
    while True:
        s, _ = lst.accept()
        threading.Thread(target=serve, args=(s,), daemon=True).start()


if __name__ == "__main__":
    main()
