"""Object-store errors as one line: the request timeouts, `StorageError`, and the mapping of a
botocore/aiohttp/fsspec failure to its kind (`classify`) and to the line naming the URL and the fix
(`storage_error`). Moved out of `storage.py`, which raises them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from wandistill.errors import UsageError
from wandistill.io.fsutil import WRITE_FULL
from wandistill.runtime import waiting

CONNECT_TIMEOUT_S = 5.0
"""Object stores: seconds to wait for a connection before giving up (s3fs's own default: 5)."""
READ_TIMEOUT_S = 20.0
"""Object stores: seconds to wait for an answer on an open connection (botocore's default is 60,
times 5 attempts: an endpoint that accepts and never answers was silent for minutes)."""
TIMEOUT_ENV = "WANDISTILL_STORAGE_TIMEOUT"
"""Overrides READ_TIMEOUT_S (and caps the connect timeout), in seconds."""
CONNECT_ATTEMPTS = 2
"""Object stores: attempts per request at the HTTP level (botocore's default is 5 with backoff,
so an unreachable endpoint would take a minute to report). s3fs's own retry loop is set to one
try: the worst silent-free wait of one call is CONNECT_ATTEMPTS x the timeouts."""


def timeouts() -> tuple[float, float]:
    """(connect, read) seconds for object-store requests: WANDISTILL_STORAGE_TIMEOUT, checked
    like every number (finite, in (0, 600]), else the defaults."""
    from wandistill.checks.bounds import Range, env_seconds

    fix = f"set {TIMEOUT_ENV} to a number of seconds (default {READ_TIMEOUT_S:g})"
    seconds = env_seconds(TIMEOUT_ENV, Range(gt=0, le=600), fix)
    if seconds is None:
        return CONNECT_TIMEOUT_S, READ_TIMEOUT_S
    return min(CONNECT_TIMEOUT_S, seconds), seconds


class StorageError(UsageError):
    """An object store refused or could not be reached: names the URL and the fix. `kind`: the
    class of problem (`classify`), for callers that handle one (a lost conditional PUT)."""

    def __init__(self, message: str, fix: str | None = None, kind: str = "other") -> None:
        super().__init__(message, fix=fix)
        self.kind = kind


_WATCHED = waiting.Watched()
"""Object-store calls in flight (one line when one is slow)."""


def _limit_text() -> str:
    connect, read = timeouts()
    return (
        f"each attempt gives up after {connect:g} s to connect and {read:g} s without an "
        f"answer, {CONNECT_ATTEMPTS} attempts ({TIMEOUT_ENV} sets it)"
    )


def _chain(e: BaseException) -> Iterator[BaseException]:
    """`e` and the exceptions it was raised from (s3fs keeps botocore's as `__cause__`)."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen and len(seen) < 16:
        seen.add(id(x))
        yield x
        x = x.__cause__ or x.__context__


def _types(x: BaseException) -> set[str]:
    """The names of `x`'s classes: botocore and aiohttp are optional (the s3 extra), so their
    exception types are matched by class name, through the whole hierarchy."""
    return {c.__name__ for c in type(x).__mro__}


S3_HEADERS = ("x-amz-request-id", "x-amzn-requestid", "x-amz-id-2")
"""Response headers every S3 implementation sends (AWS, MinIO, Ceph, moto): an HTTP error
without them and without an S3 error code came from some other server."""
NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"}
STALLED = {"ReadTimeoutError", "ReadTimeout", "SocketTimeoutError", "ServerTimeoutError"}
UNREACHABLE = {
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ConnectionClosedError",
    "ClientConnectionError",
    "ConnectionError",
}
NOT_S3 = {"HTTPClientError", "ResponseParserError", "BadHttpMessage", "ClientPayloadError"}
BAD_CREDENTIALS = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"}


def classify(e: BaseException) -> str:
    """The class of an object-store failure, from exception types and the HTTP status / S3
    error code of the response, never from the words of a message: not-found, exists (a lost
    conditional PUT), no-bucket, no-credentials, bad-credentials, forbidden, unreachable,
    stalled, not-s3, no-space, or other."""
    chain = list(_chain(e))
    for x in chain:  # the transport first: a reset connection wraps an HTTP-level error
        names = _types(x)
        if names & NO_CREDENTIALS:
            return "no-credentials"
        if names & STALLED or isinstance(x, TimeoutError):
            return "stalled"
        if names & UNREACHABLE:
            return "unreachable"
    for x in chain:
        if _types(x) & NOT_S3:
            return "not-s3"
        response = getattr(x, "response", None)
        if isinstance(response, dict):
            return _classify_response(response)
        status = getattr(x, "code", None)  # gcsfs's HttpError
        if isinstance(status, int) and not isinstance(status, bool) and 400 <= status < 600:
            return {401: "forbidden", 403: "forbidden", 404: "not-found"}.get(status, "other")
    if isinstance(e, FileNotFoundError):
        return "not-found"
    if isinstance(e, FileExistsError):
        return "exists"
    if isinstance(e, PermissionError):
        return "forbidden"
    if isinstance(e, OSError) and e.errno in WRITE_FULL:
        return "no-space"
    return "other"


def _classify_response(response: dict[str, Any]) -> str:
    error = response.get("Error") or {}
    meta = response.get("ResponseMetadata") or {}
    code = str(error.get("Code") or "")
    status = meta.get("HTTPStatusCode")
    headers = {str(k).lower() for k in (meta.get("HTTPHeaders") or {})}
    if not code and not headers & set(S3_HEADERS):
        return "not-s3"
    if code == "NoSuchBucket":
        return "no-bucket"
    if code in BAD_CREDENTIALS:
        return "bad-credentials"
    if code == "PreconditionFailed" or status == 412:
        return "exists"
    if code == "AccessDenied" or status in (401, 403):
        return "forbidden"
    if code in ("NoSuchKey", "NotFound", "404") or status == 404:
        return "not-found"
    return "other"


def _endpoint() -> str:
    return os.environ.get("AWS_ENDPOINT_URL") or "the provider's default endpoint"


def storage_error(where: str, e: BaseException) -> StorageError:
    """One line for an object-store failure, with the fix for its class of problem."""
    kind = classify(e)
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    endpoint = "check the endpoint (AWS_ENDPOINT_URL for an S3-compatible server) and the network"
    lines: dict[str, tuple[str, str]] = {
        "no-bucket": (
            f"the bucket {where.split('://', 1)[-1].split('/', 1)[0]!r} does not exist",
            "create the bucket, or fix the URL",
        ),
        "no-credentials": (
            "no credentials for the object store",
            "set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) for s3://, "
            "GOOGLE_APPLICATION_CREDENTIALS for gs://",
        ),
        "bad-credentials": (
            f"the object store rejected the credentials ({first})",
            "check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) and the endpoint",
        ),
        "forbidden": (
            f"access denied ({first})",
            "use credentials that may read and write it",
        ),
        "unreachable": (f"the object store at {_endpoint()} cannot be reached ({first})", endpoint),
        "stalled": (
            f"the object store at {_endpoint()} accepted the connection but did not answer "
            f"within {timeouts()[1]:g} s ({CONNECT_ATTEMPTS} attempts)",
            f"{endpoint}; raise {TIMEOUT_ENV} (seconds) if it is just slow",
        ),
        "not-s3": (
            f"the endpoint {_endpoint()} answered, but not as an S3 server (HTTP error "
            "without an S3 error code)",
            "point AWS_ENDPOINT_URL at the S3 API of the store (not its web console)",
        ),
        "no-space": (
            "no space left (or the object is too large)",
            "free space or choose another --out",
        ),
        "exists": (f"{type(e).__name__}: {first}", "another writer created it first"),
    }
    message, fix = lines.get(
        kind, (f"{type(e).__name__}: {first}", "check the URL, the endpoint and credentials")
    )
    return StorageError(f"{where}: {message}", fix=fix, kind=kind)
