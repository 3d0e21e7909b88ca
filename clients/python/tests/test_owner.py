"""SPEC §10.2, the owner hint: a lease's next request goes to the member its
last answer named (`X-Fencegate-Owner`), with the same path; back to the base
URL when that member cannot be reached; never to anything but an http(s) URL.
Two local HTTP servers stand in for a cluster's members (the hint itself is
asserted against a real cluster in tests/it/cluster)."""

from __future__ import annotations

import http.server
import socket
import threading
import unittest
from datetime import datetime, timedelta, timezone
from typing import List, Optional

from fencegate_client import Delivered, GatewayClient, Lease
from fencegate_client.clock import StoreClock


class Member:
    """Answers 200, naming `owner` (if set) as the lease's owner; logs paths."""

    def __init__(self) -> None:
        self.paths: List[str] = []
        self.owner: Optional[str] = None
        member = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                self.rfile.read(int(self.headers.get("content-length", 0)))
                member.paths.append(self.path)
                self.send_response(200)
                if member.owner:
                    self.send_header("X-Fencegate-Owner", member.owner)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def lease(name: str) -> Lease:
    return Lease(name=name, epoch=1, token="t" * 64, holder="w", ttl_ms=60_000,
                 expires_at=datetime.now(timezone.utc) + timedelta(minutes=1), clock=StoreClock())


def closed_port_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


class OwnerHint(unittest.TestCase):
    def test_the_next_request_goes_to_the_named_owner(self) -> None:
        a, b = Member(), Member()
        try:
            a.owner = b.url
            b.owner = b.url
            gw = GatewayClient(a.url + "/base", backoff=0.01)
            billing, other = lease("billing"), lease("other")
            self.assertIsInstance(gw.call(billing, "POST", "/x", b"1"), Delivered)
            self.assertIsInstance(gw.call(billing, "POST", "/y", b"2"), Delivered)
            self.assertEqual(a.paths, ["/base/x"])
            self.assertEqual(b.paths, ["/base/y"], "the path stays the base's")
            # Per lease: another lease's hint is its own.
            a.owner = None
            gw.call(other, "POST", "/z", b"3")
            self.assertEqual(a.paths, ["/base/x", "/base/z"])
            # The owner gone: the base again, and the hint forgotten.
            b.stop()
            self.assertIsInstance(gw.call(billing, "POST", "/w", b"4"), Delivered)
            self.assertEqual(a.paths[-1], "/base/w")
            gw.call(billing, "POST", "/v", b"5")
            self.assertEqual(a.paths[-1], "/base/v")
        finally:
            a.stop()

    def test_no_hint_is_followed_when_told_not_to_or_when_it_is_no_url(self) -> None:
        a, b = Member(), Member()
        try:
            a.owner = b.url
            gw = GatewayClient(a.url, follow_owner=False)
            gw.call(lease("billing"), "POST", "/x", b"1")
            gw.call(lease("billing"), "POST", "/y", b"2")
            self.assertEqual(a.paths, ["/x", "/y"])
            for bad in ["ftp://127.0.0.1:1", "not a url", closed_port_url()[7:]]:
                a.owner = bad
                gw = GatewayClient(a.url)
                gw.call(lease("billing"), "POST", "/x", b"1")
                gw.call(lease("billing"), "POST", "/y", b"2")
                self.assertEqual(a.paths[-2:], ["/x", "/y"], bad)
            self.assertEqual(b.paths, [])
        finally:
            a.stop()
            b.stop()


if __name__ == "__main__":
    unittest.main()
