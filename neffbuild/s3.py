"""A small S3 client for neffbuild's remote tiers (the compile cache, bundle push/pull).

Covers: ``s3://BUCKET/PREFIX`` URLs, a boto3 client built from the standard AWS credential
chain (the endpoint of an S3-compatible server from ``AWS_ENDPOINT_URL_S3`` or
``AWS_ENDPOINT_URL``, read in ``settings.py``), create-only puts (``If-None-Match: *``),
whole and ranged gets, listing, and one error type whose ``kind`` says what went wrong.
Leaves out: what the objects mean (the callers' business) and deletes of anything a caller
did not name.

boto3 is the optional extra ``neffbuild[s3]``; it is imported only when a client is built
(never at import of this module, never by the runtime). No credential is ever put in a
message: every error text is scrubbed of the access key, the secret and the session token
that the chain resolved.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from neffbuild import settings
from neffbuild.errors import InvalidInput, NeffbuildError

SCHEME = "s3://"

# RemoteError.kind values
UNREACHABLE = "unreachable"  # connection refused, DNS, timeout
DENIED = "denied"  # 401/403: bad or missing credentials, or a policy refusing the action
NOT_FOUND = "not_found"  # the bucket does not exist (a missing key is not an error: get returns None)
SERVER = "server"  # 5xx, throttling, a malformed answer
NO_CREDENTIALS = "no_credentials"  # the chain resolved nothing
MISSING_EXTRA = "missing_extra"  # boto3 is not installed
TOO_LARGE = "too_large"  # an object over the size its reader allows (refused while it streams)
OTHER = "other"
_CHUNK = 64 * 1024  # a bounded read's step: what it may hold beyond its limit before it refuses


class RemoteError(NeffbuildError):
    """A remote operation failed; ``kind`` is one of the constants above, ``status`` the HTTP status if any."""

    def __init__(self, kind: str, message: str, status: int | None = None):
        self.kind, self.status = kind, status
        super().__init__(message)


@dataclass(frozen=True)
class S3Url:
    """``s3://bucket/prefix``; ``prefix`` has no leading or trailing slash (may be empty)."""

    bucket: str
    prefix: str = ""

    def key(self, *parts: str) -> str:
        """The object key of ``parts`` under the prefix (``prefix/a/b``)."""
        return "/".join(p.strip("/") for p in (self.prefix, *parts) if p and p.strip("/"))

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}" if self.prefix else f"{SCHEME}{self.bucket}"


def is_s3_url(value) -> bool:
    return isinstance(value, str) and value.startswith(SCHEME)


def parse_url(value: str, what: str = "--cache-remote") -> S3Url:
    """Parse ``s3://BUCKET[/PREFIX]``; a bad value is an InvalidInput naming ``what`` and the form."""
    form = "expected s3://BUCKET/PREFIX (for example s3://my-ci-cache/neffbuild)"
    if not is_s3_url(value):
        raise InvalidInput(f"{what}: got {value!r}, {form}")
    rest = value[len(SCHEME):]
    bucket, _, prefix = rest.partition("/")
    if not _bucket_ok(bucket):
        raise InvalidInput(f"{what}: bucket {bucket!r} is not a valid bucket name (3-63 characters: lowercase "
                           f"letters, digits, '.', '-'); {form}")
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise InvalidInput(f"{what}: prefix {prefix!r} has an empty, '.' or '..' part; {form}")
    return S3Url(bucket, prefix)


def _bucket_ok(name: str) -> bool:
    allowed = set("abcdefghijklmnopqrstuvwxyz0123456789.-")
    return 3 <= len(name) <= 63 and set(name) <= allowed and name[0].isalnum() and name[-1].isalnum()


def _import_boto3():
    try:
        import boto3
        import botocore
    except ImportError as exc:
        raise RemoteError(MISSING_EXTRA, "an s3:// remote needs boto3: pip install 'neffbuild[s3]'") from exc
    return boto3, botocore


class S3Remote:
    """One bucket + prefix, reached through a boto3 client from the standard chain.

    Every method raises RemoteError (never a botocore exception) for a failure; ``get`` and
    ``head`` return None for a missing key, ``put_if_absent`` False when the key exists.
    """

    def __init__(self, url: S3Url | str, *, connect_timeout: float = 5.0, read_timeout: float = 60.0,
                 attempts: int = 2):
        self.url = url if isinstance(url, S3Url) else parse_url(url)
        boto3, botocore = _import_boto3()
        for name in ("boto3", "botocore", "s3transfer", "urllib3"):  # their DEBUG logs print signed headers
            logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger(name).getEffectiveLevel()))
        from botocore.config import Config

        self._botocore = botocore
        self._secrets: list[str] = []
        try:
            session = boto3.session.Session()
            creds = session.get_credentials()
            if creds is not None:
                frozen = creds.get_frozen_credentials()
                self._secrets = [s for s in (frozen.access_key, frozen.secret_key, frozen.token) if s]
            self.endpoint = settings.s3_endpoint_url()
            self.client = session.client(
                "s3", endpoint_url=self.endpoint, region_name=session.region_name or "us-east-1",
                config=Config(connect_timeout=connect_timeout, read_timeout=read_timeout,
                              retries={"max_attempts": attempts, "mode": "standard"},
                              s3={"addressing_style": "path"} if self.endpoint else None))
        except Exception as exc:  # a malformed config file or endpoint: still a RemoteError, scrubbed
            raise self._classify(exc, "client") from None

    # -- helpers
    def scrub(self, text: str) -> str:
        """``text`` with every resolved credential replaced by ``***``."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _classify(self, exc: BaseException, op: str, key: str = "") -> RemoteError:
        where = f"{SCHEME}{self.url.bucket}/{key}" if key else str(self.url)
        bc = getattr(self, "_botocore", None)
        exceptions = getattr(bc, "exceptions", None)
        if exceptions is not None and isinstance(exc, exceptions.NoCredentialsError):
            return RemoteError(NO_CREDENTIALS, f"{op} {where}: no AWS credentials found (set AWS_ACCESS_KEY_ID/"
                                               f"AWS_SECRET_ACCESS_KEY, AWS_PROFILE or an instance role)")
        if exceptions is not None and isinstance(exc, exceptions.ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            msg = self.scrub(f"{op} {where}: {code or status}: {err.get('Message', '')}".rstrip(": "))
            if status in (401, 403) or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                                                "InvalidClientTokenId", "ExpiredToken", "InvalidToken"):
                return RemoteError(DENIED, msg, status)
            if code == "NoSuchBucket":
                return RemoteError(NOT_FOUND, msg, status)
            if status is not None and (status >= 500 or status == 429):
                return RemoteError(SERVER, msg, status)
            return RemoteError(OTHER, msg, status)
        connection_errors = tuple(getattr(exceptions, n) for n in (
            "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError")
            if exceptions is not None and hasattr(exceptions, n))
        if connection_errors and isinstance(exc, connection_errors):
            return RemoteError(UNREACHABLE, self.scrub(f"{op} {where}: cannot reach {self.endpoint or 'S3'}: "
                                                       f"{type(exc).__name__}"))
        if isinstance(exc, OSError):
            return RemoteError(UNREACHABLE, self.scrub(f"{op} {where}: {type(exc).__name__}: {exc}"))
        return RemoteError(OTHER, self.scrub(f"{op} {where}: {type(exc).__name__}: {exc}"))

    def _call(self, op: str, key: str, fn, **kwargs):
        try:
            return fn(**kwargs)
        except RemoteError:
            raise
        except Exception as exc:
            raise self._classify(exc, op, key) from None

    # -- operations
    def put_if_absent(self, key: str, data: bytes | Path) -> bool:
        """Create ``key`` with ``data`` only if absent (``If-None-Match: *``): True if created, False if it existed."""
        body = Path(data).read_bytes() if isinstance(data, (str, Path)) else bytes(data)
        try:
            self.client.put_object(Bucket=self.url.bucket, Key=key, Body=body, IfNoneMatch="*")
        except self._botocore.exceptions.ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = exc.response.get("Error", {}).get("Code")
            if status == 412 or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                return False
            raise self._classify(exc, "put", key) from None
        except Exception as exc:
            raise self._classify(exc, "put", key) from None
        return True

    def put(self, key: str, data: bytes | Path) -> None:
        """Write ``key`` unconditionally (for tests and callers that own the key, e.g. a bundle's index)."""
        body = Path(data).read_bytes() if isinstance(data, (str, Path)) else bytes(data)
        self._call("put", key, self.client.put_object, Bucket=self.url.bucket, Key=key, Body=body)

    def _get_object(self, key: str, read, **extra):
        """``read(response)`` of the object, or None when the key is missing; other failures classified."""
        try:
            return read(self.client.get_object(Bucket=self.url.bucket, Key=key, **extra))
        except RemoteError:
            raise
        except self._botocore.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise self._classify(exc, "get", key) from None
        except Exception as exc:
            raise self._classify(exc, "get", key) from None

    def too_large(self, key: str, limit: int, size: int | None = None) -> RemoteError:
        got = f"{size} bytes" if size is not None else "more bytes"
        return RemoteError(TOO_LARGE, f"get {SCHEME}{self.url.bucket}/{key}: {got} than its limit of {limit} "
                                      f"bytes; refused (read no further: a remote object never fills memory)")

    def get(self, key: str, *, limit: int, byte_range: tuple[int, int] | None = None) -> bytes | None:
        """The object's bytes (``byte_range`` = inclusive ``(first, last)``), or None when the key is missing.

        At most ``limit`` bytes: a larger object (by its Content-Length, or by what streams) is a RemoteError
        TOO_LARGE naming it and the limit, raised after reading at most ``limit`` + one chunk, the connection
        dropped (a 1 GiB object planted where a small record belongs costs no memory)."""
        extra = {} if byte_range is None else {"Range": f"bytes={int(byte_range[0])}-{int(byte_range[1])}"}
        return self._get_object(key, lambda resp: self._bounded(resp, key, limit), **extra)

    def _bounded(self, resp, key: str, limit: int) -> bytes:
        body, size = resp["Body"], resp.get("ContentLength")
        try:
            if isinstance(size, int) and size > limit:
                raise self.too_large(key, limit, size)
            buf = bytearray()
            for chunk in body.iter_chunks(_CHUNK):
                buf += chunk
                if len(buf) > limit:
                    raise self.too_large(key, limit)
            return bytes(buf)
        finally:
            body.close()

    def get_to_file(self, key: str, dest: Path, *, limit: int) -> bool:
        """Stream the object into ``dest`` (written to ``dest`` + ``.part`` then renamed); False when missing.
        Over ``limit`` bytes (the size its record promises): RemoteError TOO_LARGE, the part file removed."""
        dest = Path(dest)
        part = dest.with_name(dest.name + f".{os.getpid()}.part")

        def stream(resp) -> bool:
            body, size, written = resp["Body"], resp.get("ContentLength"), 0
            try:
                if isinstance(size, int) and size > limit:
                    raise self.too_large(key, limit, size)
                with open(part, "wb") as fh:
                    for chunk in body.iter_chunks(1 << 20):
                        written += len(chunk)
                        if written > limit:
                            raise self.too_large(key, limit)
                        fh.write(chunk)
            finally:
                body.close()
            os.replace(part, dest)
            return True

        try:
            return bool(self._get_object(key, stream))
        finally:
            part.unlink(missing_ok=True)

    def put_file_if_absent(self, key: str, path: Path, *, part_size: int = 64 << 20, on_bytes=None,
                           replace: bool = False) -> bool:
        """Stream a file into ``key`` only if absent: True if created, False if the key existed.

        Up to ``part_size`` bytes: one create-only PUT. Larger: a multipart upload (memory bounded by one
        part; files over S3's 5 GiB single-PUT limit work) completed with ``If-None-Match: *``, aborted on
        any failure. ``on_bytes(n)`` is called as bytes are sent (per part), for progress bars. ``replace``:
        write whatever is there (a content-addressed blob found holding other bytes than its address says).
        """
        path = Path(path)
        size = path.stat().st_size
        if size <= part_size:
            created = True
            if replace:
                self.put(key, path)
            else:
                created = self.put_if_absent(key, path)
            if on_bytes:
                on_bytes(size)
            return created
        upload = self._call("put", key, self.client.create_multipart_upload, Bucket=self.url.bucket, Key=key)
        uid = upload["UploadId"]
        try:
            parts = []
            with open(path, "rb") as fh:
                for number in range(1, -(-size // part_size) + 1):
                    body = fh.read(part_size)
                    r = self._call("put", key, self.client.upload_part, Bucket=self.url.bucket, Key=key,
                                   UploadId=uid, PartNumber=number, Body=body)
                    parts.append({"ETag": r["ETag"], "PartNumber": number})
                    if on_bytes:
                        on_bytes(len(body))
            try:
                self.client.complete_multipart_upload(Bucket=self.url.bucket, Key=key, UploadId=uid,
                                                      MultipartUpload={"Parts": parts},
                                                      **({} if replace else {"IfNoneMatch": "*"}))
            except self._botocore.exceptions.ClientError as exc:
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if status == 412 or exc.response.get("Error", {}).get("Code") in ("PreconditionFailed",
                                                                                   "ConditionalRequestConflict"):
                    self._abort(key, uid)
                    return False
                raise self._classify(exc, "put", key) from None
            return True
        except BaseException:
            self._abort(key, uid)
            raise

    def _abort(self, key: str, upload_id: str) -> None:
        with contextlib.suppress(Exception):  # best effort: a bucket lifecycle rule cleans up what this cannot
            self.client.abort_multipart_upload(Bucket=self.url.bucket, Key=key, UploadId=upload_id)

    def iter_from(self, key: str, start: int = 0, chunk: int = 1 << 20):
        """The object's bytes from offset ``start`` to the end (a ranged read), as chunks; None when missing."""
        kwargs = {"Bucket": self.url.bucket, "Key": key, **({"Range": f"bytes={int(start)}-"} if start else {})}
        try:
            body = self.client.get_object(**kwargs)["Body"]
        except self._botocore.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise self._classify(exc, "get", key) from None
        except Exception as exc:
            raise self._classify(exc, "get", key) from None
        return self._chunks(body, key, chunk)

    def _chunks(self, body, key: str, chunk: int):
        try:
            yield from body.iter_chunks(chunk)
        except Exception as exc:
            raise self._classify(exc, "get", key) from None

    def head(self, key: str) -> dict | None:
        """``{"size", "etag", "last_modified"}`` of the key, or None when it is missing."""
        try:
            resp = self.client.head_object(Bucket=self.url.bucket, Key=key)
        except self._botocore.exceptions.ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 404 or exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return None
            raise self._classify(exc, "head", key) from None
        except Exception as exc:
            raise self._classify(exc, "head", key) from None
        return {"size": resp.get("ContentLength"), "etag": resp.get("ETag", "").strip('"'),
                "last_modified": resp.get("LastModified")}

    def list(self, sub: str = "") -> Iterator[dict]:
        """Every object under ``prefix/sub``: ``{"key", "size", "last_modified"}`` (keys are full object keys)."""
        prefix = self.url.key(sub)
        prefix = prefix + "/" if prefix else ""
        token = None
        while True:
            kwargs = {"Bucket": self.url.bucket, "Prefix": prefix}
            if token:
                kwargs["ContinuationToken"] = token
            resp = self._call("list", prefix, self.client.list_objects_v2, **kwargs)
            for obj in resp.get("Contents", []):
                yield {"key": obj["Key"], "size": obj.get("Size"), "last_modified": obj.get("LastModified")}
            if not resp.get("IsTruncated"):
                return
            token = resp.get("NextContinuationToken")

    def delete(self, key: str) -> None:
        """Delete one named key (callers delete only what they wrote themselves; a cache never deletes)."""
        self._call("delete", key, self.client.delete_object, Bucket=self.url.bucket, Key=key)

    def bucket_exists(self) -> bool:
        """True if the bucket answers HEAD; False for 404; RemoteError for anything else."""
        try:
            self.client.head_bucket(Bucket=self.url.bucket)
        except self._botocore.exceptions.ClientError as exc:
            if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return False
            raise self._classify(exc, "head-bucket") from None
        except Exception as exc:
            raise self._classify(exc, "head-bucket") from None
        return True


def open_remote(url: str | S3Url, **kwargs) -> S3Remote:
    """An S3Remote for ``url`` (parsed first, so a bad URL is an InvalidInput before boto3 is imported)."""
    return S3Remote(url if isinstance(url, S3Url) else parse_url(url), **kwargs)
