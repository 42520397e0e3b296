"""The first request to a remote, with short limits: a remote that accepts and never answers is found in seconds.

Every remote user (the compile cache's tier, ``cache remote check``, ``push`` and ``pull``) asks the
remote once with these limits before its long-timeout requests, and says on stderr when that wait
outlives a second: never minutes of silence behind an endpoint that accepts connections and never
answers (boto3's defaults retry a 60 s read several times).
"""

from __future__ import annotations

from neffbuild import s3, settings

PROBE_CONNECT_S, PROBE_READ_S = 3.0, 5.0
PROBE_SAY_AFTER_S = 1.0  # a probe still waiting after this long says so on stderr


def say_while_waiting(what: str, timeout_s: float):
    """A started timer that prints one line on stderr if the wait outlives PROBE_SAY_AFTER_S (cancel it)."""
    import sys
    import threading

    timer = threading.Timer(PROBE_SAY_AFTER_S, lambda: print(
        f"waiting for {what} (giving up after {timeout_s:.0f} s)...", file=sys.stderr, flush=True))
    timer.daemon = True
    timer.start()
    return timer


def probe(url: s3.S3Url, key: str, what: str) -> None:
    """Ask ``url`` once with the probe's short limits (HEAD of ``key``; one attempt), saying on stderr when it
    waits over a second. Any answer (found, missing, refused) proves the endpoint answers; RemoteError only
    when it cannot be reached or used (unreachable, no boto3, no credentials), naming the endpoint."""
    limit = PROBE_CONNECT_S + PROBE_READ_S
    timer = say_while_waiting(what, limit)
    try:
        quick = s3.S3Remote(url, connect_timeout=PROBE_CONNECT_S, read_timeout=PROBE_READ_S, attempts=1)
        quick.head(key)
    except s3.RemoteError as exc:
        if exc.kind == s3.UNREACHABLE:
            endpoint = settings.s3_endpoint_url() or "of AWS S3"
            raise s3.RemoteError(s3.UNREACHABLE, f"{what}: the endpoint {endpoint} did not answer within "
                                                 f"{limit:.0f} s ({exc}); check the network and AWS_ENDPOINT_URL_S3, "
                                                 "then try again") from None
        if exc.kind in (s3.MISSING_EXTRA, s3.NO_CREDENTIALS):
            raise
    finally:
        timer.cancel()


def check(url: str, sub: str = "") -> dict:
    """``cache remote check``: {"url", "endpoint", "reachable", "readable", "writable", "errors"}; ``sub`` is
    the folder listed to prove reads.

    Writable is tested by a create-only put of a probe object under ``PREFIX/.neffbuild-probe/``
    (left there: the cache never deletes; its name is unique per check). Each request waits at most
    PROBE_CONNECT_S + PROBE_READ_S, once; a wait longer than a second says so on stderr."""
    out = {"url": url, "endpoint": None, "reachable": False, "readable": False, "writable": False, "errors": []}
    timer = say_while_waiting(url, 2 * (PROBE_CONNECT_S + PROBE_READ_S))
    try:
        return _check(url, sub, out)
    finally:
        timer.cancel()


def _check(url: str, sub: str, out: dict) -> dict:
    import uuid

    client = None
    try:
        client = s3.open_remote(url, connect_timeout=PROBE_CONNECT_S, read_timeout=PROBE_READ_S, attempts=1)
        out["endpoint"] = client.endpoint
        next(iter(client.list(sub)), None)
        out["reachable"] = out["readable"] = True
    except s3.RemoteError as exc:
        out["errors"].append(str(exc))
        if exc.kind in (s3.DENIED, s3.NOT_FOUND, s3.OTHER, s3.SERVER):
            out["reachable"] = True
        if client is None or exc.kind in (s3.UNREACHABLE, s3.MISSING_EXTRA, s3.NO_CREDENTIALS):
            return out
    try:
        out["writable"] = client.put_if_absent(client.url.key(".neffbuild-probe", uuid.uuid4().hex), b"probe")
        out["reachable"] = True
    except s3.RemoteError as exc:
        out["errors"].append(str(exc))
    return out
