"""A real S3 endpoint on 127.0.0.1 for the tests: moto's server in a thread, fake credentials.

The caller's environment is what a user sets (docs/cache-format.md): AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION and AWS_ENDPOINT_URL. Subprocesses inherit it.

`traffic` counts, at the server, every request by S3 operation and the body bytes that went to
and from clients: how a test tells a server-side copy (CopyObject, no body) from a download and
upload, without timing anything.
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import os
import socket
import threading
import urllib.request
from collections import Counter
from collections.abc import Iterator
from typing import Any

BUCKET = "wandistill-test"


def _operation(environ: dict[str, Any]) -> str:
    """The S3 operation of a request, from its method, query and headers (enough for tests)."""
    method, query = environ["REQUEST_METHOD"], environ.get("QUERY_STRING", "")
    if method == "PUT" and environ.get("HTTP_X_AMZ_COPY_SOURCE"):
        return "UploadPartCopy" if "partNumber" in query else "CopyObject"
    if method == "PUT":
        return "UploadPart" if "partNumber" in query else "PutObject"
    if method == "POST":
        if "uploads" in query.split("&"):
            return "CreateMultipartUpload"
        return "CompleteMultipartUpload" if "uploadId" in query else "DeleteObjects"
    if method == "GET" and ("list-type" in query or "prefix" in query or "delimiter" in query):
        return "ListObjects"
    return {"GET": "GetObject", "HEAD": "HeadObject", "DELETE": "DeleteObject"}.get(method, method)


class Traffic:
    """Requests by operation, and body bytes received from / sent to clients, since `reset`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.uploaded = 0
        """Request body bytes (what clients sent)."""
        self.downloaded = 0
        """Response body bytes (what clients got)."""

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()
            self.uploaded = self.downloaded = 0

    def wrap(self, app: Any) -> Any:
        def counted(environ: dict[str, Any], start_response: Any) -> Iterator[bytes]:
            with self._lock:
                self.calls[_operation(environ)] += 1
                self.uploaded += int(environ.get("CONTENT_LENGTH") or 0)
            result = app(environ, start_response)
            try:
                for chunk in result:
                    with self._lock:
                        self.downloaded += len(chunk)
                    yield chunk
            finally:
                if hasattr(result, "close"):
                    result.close()

        return counted


traffic = Traffic()


def s3_env(endpoint: str) -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def forget_clients() -> None:
    """fsspec caches one S3FileSystem per set of arguments: a new endpoint needs a new one."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@contextlib.contextmanager
def s3_server() -> Iterator[dict[str, str]]:
    """Start moto's S3 server on a free port, point this process's environment at it (with an
    empty bucket BUCKET), and give back that environment; stop and restore on exit."""
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    # What moto's ThreadedMotoServer does, with the traffic counter around the app; port 0:
    # the kernel picks a free port as the server binds (no race with another test's server).
    app = traffic.wrap(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, app, True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    env = s3_env(f"http://127.0.0.1:{server.port}")
    # moto keeps its buckets in process-wide state: a server started after another one in the
    # same test process would see that one's buckets and objects. Start from an empty account.
    reset = urllib.request.Request(f"{env['AWS_ENDPOINT_URL']}/moto-api/reset", method="POST")
    urllib.request.urlopen(reset, timeout=10).close()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    forget_clients()
    try:
        import fsspec

        fsspec.filesystem("s3").mkdir(BUCKET)
        traffic.reset()
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        forget_clients()
        server.shutdown()
        thread.join()


@contextlib.contextmanager
def hostile_endpoints() -> Iterator[dict[str, str]]:
    """Endpoints that are not a working S3, for the tests and tests/bench/silent_waits.py:
    `stalled` accepts connections and never answers, `not_s3` is another HTTP server (404 pages,
    no S3 error codes), `unreachable` is a port nothing listens on."""

    class NotS3(http.server.BaseHTTPRequestHandler):
        def _page(self) -> None:
            body = b"<html>Not Found</html>"
            self.send_response(404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _page

        def log_message(self, *args: object) -> None:
            pass

    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotS3)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    with socket.socket() as silent, socket.socket() as closed:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        closed.close()
        try:
            yield {
                "stalled": f"http://127.0.0.1:{silent.getsockname()[1]}",
                "not_s3": f"http://127.0.0.1:{web.server_port}",
                "unreachable": f"http://127.0.0.1:{port}",
            }
        finally:
            web.shutdown()
            web.server_close()
