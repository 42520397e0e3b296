"""The only module that reads environment variables.

NEFFBUILD_CACHE_DIR  compile cache folder (default: ~/.cache/neffbuild)
NEFFBUILD_JOBS       default number of parallel compile workers (default: CPU count)
NEFFBUILD_LOG        log level for stderr logging (default: WARNING)
UCX_TLS              UCX transports for NIXL (DI); `tcp` is always kept (default: tcp,sm,self)
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


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level() -> str:
    """NEFFBUILD_LOG as a logging level name; anything else is InvalidInput naming the variable (exit 2)."""
    value = os.environ.get("NEFFBUILD_LOG", "WARNING").strip().upper() or "WARNING"
    if value not in LOG_LEVELS:
        from neffbuild.errors import InvalidInput

        raise InvalidInput(f"NEFFBUILD_LOG={os.environ.get('NEFFBUILD_LOG', '')[:40]!r}: must be one of "
                           f"{', '.join(LOG_LEVELS)} (case does not matter)")
    return value


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
