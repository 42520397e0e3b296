"""The only module that reads environment variables.

NEFFBUILD_CACHE_DIR  compile cache folder (default: ~/.cache/neffbuild)
NEFFBUILD_JOBS       default number of parallel compile workers (default: CPU count)
NEFFBUILD_LOG        log level for stderr logging (default: WARNING)
UCX_TLS              UCX transports for NIXL (DI); `tcp` is always kept (default: tcp,sm,self)
NEFFBUILD_CACHE_REMOTE  remote compile cache tier, s3://BUCKET/PREFIX (default: none; --cache-remote wins)
AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL  endpoint of an S3-compatible server (the AWS SDKs' own variables;
                     credentials come from the standard AWS chain, read by boto3 itself)
NEFFBUILD_TRUSTED_KEYS  PEM public keys (paths joined by the OS path separator, `:`) whose
                     signature `open_bundle` requires before it loads anything (default: none)
NEURON_LOGICAL_NC_CONFIG  the Neuron runtime's logical NeuronCore config (read to refuse a
                     bundle compiled for another LNC; the SDK's own variable)
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    value = os.environ.get("NEFFBUILD_CACHE_DIR")
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "neffbuild"


def default_jobs() -> int:
    value = os.environ.get("NEFFBUILD_JOBS")
    if value and value.isdigit() and int(value) > 0:
        return int(value)
    return os.cpu_count() or 1


def log_level() -> str:
    return os.environ.get("NEFFBUILD_LOG", "WARNING").upper()


def export_ucx_tls() -> str:
    """Set UCX_TLS for NIXL's UCX backend, keeping ``tcp`` so two processes on one host connect.

    Unset: ``tcp,sm,self`` (shared memory is 3-4x faster between two processes on one host,
    benchmarks/kv_ingest.py). A user value without ``tcp`` (and not ``all``) gets ``tcp`` appended.
    """
    value = os.environ.get("UCX_TLS", "").strip()
    parts = [p for p in value.split(",") if p]
    if not parts:
        parts = ["tcp", "sm", "self"]
    elif "tcp" not in parts and "all" not in parts:
        parts.append("tcp")
    os.environ["UCX_TLS"] = ",".join(parts)
    return os.environ["UCX_TLS"]


def neuron_logical_nc_config() -> int | None:
    value = os.environ.get("NEURON_LOGICAL_NC_CONFIG", "").strip()
    return int(value) if value.isdigit() else None


def cache_remote() -> str | None:
    value = os.environ.get("NEFFBUILD_CACHE_REMOTE", "").strip()
    return value or None


def s3_endpoint_url() -> str | None:
    """The S3 endpoint override: ``AWS_ENDPOINT_URL_S3`` first, then ``AWS_ENDPOINT_URL`` (None: AWS itself)."""
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


def trusted_keys() -> list[str]:
    """NEFFBUILD_TRUSTED_KEYS as a list of key paths (empty: no signature required)."""
    value = os.environ.get("NEFFBUILD_TRUSTED_KEYS", "")
    return [part for part in value.split(os.pathsep) if part.strip()]
