"""A real S3 endpoint on 127.0.0.1 for the tests: moto's server in a thread, fake credentials.

The caller's environment is what a user sets (docs/cache-format.md): AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION and AWS_ENDPOINT_URL. Subprocesses inherit it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import urllib.request
from collections.abc import Iterator

BUCKET = "wandistill-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = s3_env(f"http://127.0.0.1:{port}")
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
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        forget_clients()
        server.stop()
