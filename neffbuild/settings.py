"""The only module that reads environment variables.

NEFFBUILD_CACHE_DIR  compile cache folder (default: ~/.cache/neffbuild); its kernels/ holds the native
                     CPU ops as built for this host (neffbuild/runtime/native.py)
CC                   the C compiler that builds them (default: cc, then gcc, from PATH)
NEFFBUILD_NATIVE_CFLAGS  the instruction-set flags they are built with (default: -march=native; e.g.
                     -march=x86-64-v3 for the AVX2 paths; part of their cache key)
NEFFBUILD_JOBS       default number of parallel compile workers (default: CPU count)
NEFFBUILD_LOG        log level for stderr logging (default: WARNING)
UCX_TLS              UCX transports for NIXL (DI); `tcp` is always kept (default: tcp,sm,self)
NEFFBUILD_CACHE_REMOTE  remote compile cache tier, s3://BUCKET/PREFIX (default: none; --cache-remote wins)
AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL  endpoint of an S3-compatible server (the AWS SDKs' own variables;
                     credentials come from the standard AWS chain, read by boto3 itself)
NEFFBUILD_TRUSTED_KEYS  PEM public keys (paths joined by the OS path separator, `:`) whose
                     signature `open_bundle` requires before it loads anything (default: none)
NEFFBUILD_CACHE_TRUSTED_KEYS  PEM public keys (paths joined by `:`) one of which must have signed a remote
                     cache entry before a build uses it (default: none; --cache-trust wins)
NEFFBUILD_CACHE_SIGN_KEY  PEM EC private key that signs the remote cache entries a build pushes (default:
                     none, entries are pushed unsigned; --cache-sign-key wins)
NEURON_LOGICAL_NC_CONFIG  the Neuron runtime's logical NeuronCore config (read to refuse a
                     bundle compiled for another LNC; the SDK's own variable)
NEFFBUILD_VLLM_DRAFT_KV_DIGEST  1: the vLLM plugin digests each request's EAGLE3 draft KV over its prompt into
                     its report (`draft_prompt_kv`: what a DI pair's test compares on both instances; a read of
                     the prompt's draft KV per request, so off by default)
NEFFBUILD_FREE_MEMORY  host memory the local compile pool may plan with (a size: 6GiB, 512MiB or
                     bytes; default: MemAvailable from /proc/meminfo)
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from neffbuild.errors import InvalidInput


def cache_dir() -> Path:
    value = os.environ.get("NEFFBUILD_CACHE_DIR")
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "neffbuild"


def c_compiler() -> str | None:
    """$CC, else cc or gcc from PATH; None when there is none."""
    import shutil

    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def native_cflags() -> tuple[str, ...]:
    """NEFFBUILD_NATIVE_CFLAGS split as a shell would (default ``-march=native``); a value with unbalanced quotes
    is InvalidInput naming the variable."""
    import shlex

    value = os.environ.get("NEFFBUILD_NATIVE_CFLAGS", "").strip()
    if not value:
        return ("-march=native",)
    try:
        return tuple(shlex.split(value))
    except ValueError as exc:
        raise InvalidInput(f"NEFFBUILD_NATIVE_CFLAGS={value[:80]!r}: {exc} (give compiler flags, e.g. "
                           f"-march=x86-64-v3)") from None


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


def parse_size(text: str, what: str = "memory size") -> int:
    """``12GiB``, ``500MB``, ``1.5G`` or a plain byte count -> bytes (binary units: G = GiB = 2^30)."""
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("kmgtib")
    unit = s[len(num):].removesuffix("b").removesuffix("i")
    try:
        value = float(num)
    except ValueError:
        value = math.nan
    if unit not in units or not math.isfinite(value) or value <= 0:
        raise InvalidInput(f"{what} {text!r} is not a size (e.g. 12GiB, 512MiB, or a byte count)")
    return int(value * units[unit])


def free_memory_bytes() -> tuple[int | None, str]:
    """(bytes of host memory free for compiles, where that came from): NEFFBUILD_FREE_MEMORY, else MemAvailable."""
    value = os.environ.get("NEFFBUILD_FREE_MEMORY", "").strip()
    if value:
        return parse_size(value, "NEFFBUILD_FREE_MEMORY"), "NEFFBUILD_FREE_MEMORY"
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable"
    except (OSError, ValueError, IndexError):
        pass
    return None, "unknown"


def cache_trusted_keys() -> list[str]:
    """NEFFBUILD_CACHE_TRUSTED_KEYS as a list of key paths (empty: remote cache entries need no signature)."""
    value = os.environ.get("NEFFBUILD_CACHE_TRUSTED_KEYS", "")
    return [part for part in value.split(os.pathsep) if part.strip()]


def remote_smoke_timeout_s() -> float:
    """NEFFBUILD_REMOTE_SMOKE_TIMEOUT_S: the least time a fetched cache entry's smoke run may take (default 30)."""
    value = os.environ.get("NEFFBUILD_REMOTE_SMOKE_TIMEOUT_S", "").strip()
    if not value:
        return 30.0
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidInput(f"NEFFBUILD_REMOTE_SMOKE_TIMEOUT_S: got {value!r}, must be a number of seconds over 0 "
                           "(for example 30)")
    return seconds


def cache_sign_key() -> str | None:
    value = os.environ.get("NEFFBUILD_CACHE_SIGN_KEY", "").strip()
    return value or None


def draft_kv_digest() -> bool:
    value = os.environ.get("NEFFBUILD_VLLM_DRAFT_KV_DIGEST", "").strip()
    if value not in ("", "0", "1"):
        raise InvalidInput(f"NEFFBUILD_VLLM_DRAFT_KV_DIGEST={value[:40]!r}: must be 1 (digest) or 0 / unset (don't)")
    return value == "1"
