"""A real S3-compatible server for the tests: moto's standalone server on a free local port (as s3fs's own tests
run it), optionally behind a proxy that answers the first requests with HTTP 503 ``SlowDown``.

The environment points botocore at it (``AWS_ENDPOINT_URL``) with dummy credentials, the way a user points
ckptverify at an S3-compatible store.
"""

from __future__ import annotations

import http.client
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: A credential the tests look for in every report and message: it must never appear in one.
SECRET = "ckptverify-test-secret-7f3a9c"


class MotoS3:
    """moto's server in a thread; :meth:`env` is the environment that points S3 clients at it."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        # Port 0: the server binds a free port itself and keeps it (no port picked and released for it).
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        self.port = int(self.server._server.server_address[1])  # type: ignore[union-attr]
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": SECRET,
                "AWS_ENDPOINT_URL": endpoint or self.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}

    def stop(self) -> None:
        self.server.stop()


class SlowDownProxy:
    """Forwards HTTP to ``upstream``; the first ``failures`` requests are answered 503 ``SlowDown`` instead (as
    S3 answers a client it throttles; ``status`` and ``code`` choose another answer). ``only_ranged``: only GETs
    of a byte range are refused. ``seen`` counts the requests, ``refused`` those refused."""

    def __init__(self, upstream_port: int, failures: int, *, only_ranged: bool = False, status: int = 503,
                 code: bytes = b"SlowDown") -> None:
        self.failures = failures
        self.seen = 0
        self.refused = 0
        lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                with lock:
                    proxy.seen += 1
                    refuse = proxy.refused < proxy.failures and (not only_ranged or "Range" in self.headers)
                    if refuse:
                        proxy.refused += 1
                if refuse:
                    payload = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>' + code + b"</Code>"
                               b"<Message>Please reduce your request rate.</Message></Error>")
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                headers["Host"] = f"127.0.0.1:{upstream_port}"
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                        self.send_header(k, v)
                # A HEAD's length is the object's, not the (empty) body's.
                self.send_header("Content-Length", resp.getheader("Content-Length", "0") if self.command == "HEAD"
                                 else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve_bucket(bucket: str) -> Iterator[Any]:
    """For a module's fixture: moto's server with ``bucket`` made, the environment pointing S3 clients at it
    while the module runs; yields an ``s3fs`` file system on it."""
    server = MotoS3()
    before = apply_env(server.env())
    import s3fs

    # fsspec keeps one S3FileSystem per set of arguments, whatever the endpoint in the environment: DCP's
    # fsspec writer would reuse one made for another module's server.
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir(bucket)
    try:
        yield fs
    finally:
        restore_env(before)
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


def apply_env(env: dict[str, str]) -> dict[str, str | None]:
    """Set ``env``; returns what to restore."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    return before


def restore_env(before: dict[str, str | None]) -> None:
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
