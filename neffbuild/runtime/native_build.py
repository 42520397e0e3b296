"""The native ops' build cache: ``native_cpu.c`` compiled for this host, kept by the compile cache's rules
(``compiler/cache.py``, which the runtime may not import).

Layout under the cache root (``settings.cache_dir()``)::

    kernels/<key>/native_cpu.so      the library
    kernels/<key>/meta.json          its sha256 and size, the compiler, the flags, the ISA paths it reported
    kernels/<key>.lock               flock: one build per key at a time, across processes (N ranks build once)
    kernels/tmp.<key>.<pid>.<rand>/  a build in progress, never loaded

Key = sha256 over the C source, the compiler's ``--version``, the CPU's identity, the flags and ``LAYOUT``.

- A library is built aside, loaded and run on a known answer in a child process (``native_check.py``), then
  published with ``os.replace``; a failed build or check is never published.
- Before a library is loaded, its sha256 must match ``meta.json``; a mismatch, an unreadable record or a library
  that does not load is removed and rebuilt (so a bad entry never outlives the run that finds it).
- The folders native code is loaded from (the cache root, ``kernels/``, the entry) and the entry's files must be
  owned by this user and not writable by group or others: whoever can write there would run code in every serving
  process. A root or ``kernels/`` that is refused or cannot be written means a build in a private temporary folder
  (0700, removed once the library is loaded): this process only.
- A compiler that is missing, fails, or runs past ``BUILD_TIMEOUT_S`` means no library: the torch forms run.

``obtain`` returns the library and at most one line for stderr saying what was refused or went wrong.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import platform
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from neffbuild import settings
from neffbuild.fsutil import pid_alive, sha256_file

SOURCE = Path(__file__).with_name("native_cpu.c")
CHECK = Path(__file__).with_name("native_check.py")
LIBRARY, META = "native_cpu.so", "meta.json"
LAYOUT = "kernels-v2"  # bump when the entry layout or the key recipe changes: older entries are then never read
BASE_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c11", "-fopenmp")  # OpenMP: the C loops run on torch's thread count
VERSION_TIMEOUT_S = 10.0
BUILD_TIMEOUT_S = 60.0
PROGRESS_AFTER_S = 2.0  # a build slower than this says so on stderr while it runs
CHECK_TIMEOUT_S = 30.0
LOCK_WAIT_S = BUILD_TIMEOUT_S + CHECK_TIMEOUT_S + 30.0  # past this, another process's build is given up on


class Failed(Exception):
    """No library from this build: the message says why (one clause of the stderr line)."""


class FolderRefused(Exception):
    """The cache folder may not hold native code (owner, mode) or cannot be written: build privately instead."""


def cpu_identity() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in text.splitlines() if ln.startswith(("flags", "model name", "Features", "CPU part"))]
    return "\n".join(dict.fromkeys(lines))  # one line of each kind (every core repeats them)


def _run(cmd: list[str], timeout: float, what: str, progress: str | None = None) -> subprocess.CompletedProcess:
    """``cmd`` in a session of its own, killed with its children past ``timeout``; Failed naming ``what``."""
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    except OSError as exc:
        raise Failed(f"{what} could not start ({exc.strerror or exc})") from None
    first = min(PROGRESS_AFTER_S, timeout) if progress else timeout
    try:
        try:
            out, err = proc.communicate(timeout=first)
        except subprocess.TimeoutExpired:
            if first >= timeout:
                raise
            print(f"neffbuild: {progress}", file=sys.stderr, flush=True)
            out, err = proc.communicate(timeout=timeout - first)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.SubprocessError):
            proc.communicate(timeout=5)
        raise Failed(f"{what} ran past {timeout:.0f} s (stopped)") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def entry_key(cc: str, flags: tuple[str, ...]) -> str:
    """The entry's name; a compiler that hangs on ``--version`` is Failed (one that fails it is keyed without it,
    and its build says what is wrong)."""
    version = _run([cc, "--version"], VERSION_TIMEOUT_S, f"{cc} --version",
                   progress=f"building native kernels ({SOURCE.name} with {cc}: waiting for {cc} --version)...").stdout
    parts = [LAYOUT, SOURCE.read_text(), version, cpu_identity(), *flags]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def build(cc: str, flags: tuple[str, ...], folder: Path) -> tuple[Path, dict]:
    """Compile into ``folder`` and check the result in a child process: (the library, its ISA paths)."""
    lib = folder / LIBRARY
    run = _run([cc, *BASE_FLAGS, *flags, "-o", str(lib), str(SOURCE), "-lm"], BUILD_TIMEOUT_S, cc,
               progress=f"building native kernels ({SOURCE.name} with {cc})...")
    if run.returncode != 0:
        raise Failed(f"{cc} could not build {SOURCE.name} ({run.stderr.strip()[:300]})")
    os.chmod(lib, 0o755)
    if not sys.executable:  # an embedded interpreter: no child to run the check in
        raise Failed("no Python executable to check the built library in")
    check = _run([sys.executable, "-I", "-S", str(CHECK), str(lib)], CHECK_TIMEOUT_S, "the built library's check")
    if check.returncode != 0:
        why = check.stderr.strip()[-300:] or f"the check died with signal {-check.returncode}"
        raise Failed(f"the built {SOURCE.name} failed its known-answer check ({why})")
    try:
        isa = json.loads(check.stdout)
    except ValueError:
        raise Failed(f"the built library's check printed {check.stdout[:100]!r}") from None
    return lib, isa


def ownership_problem(path: Path, st: os.stat_result, kind: str) -> str | None:
    """Why native code may not be loaded from (or through) ``path``: another owner, or writable by group/others."""
    if st.st_uid != os.geteuid():
        return f"{kind} {path} is owned by uid {st.st_uid}, not this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{kind} {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}; chmod go-w it)"
    return None


def _folder_ready(root: Path, kernels: Path) -> None:
    """Create (0700) and check the cache root and ``kernels/``; FolderRefused saying why not."""
    try:
        for folder in (root, kernels):
            if not os.path.lexists(folder):
                folder.parent.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(FileExistsError):
                    os.mkdir(folder, 0o700)
            st = os.stat(folder) if folder == root else os.lstat(folder)  # the root may be a link; kernels/ not
            if not stat.S_ISDIR(st.st_mode):
                raise FolderRefused(f"cache folder {folder} is not a folder")
            why = ownership_problem(folder, st, "cache folder")
            if why:
                raise FolderRefused(why)
    except OSError as exc:
        raise FolderRefused(f"cache folder {kernels} cannot be written ({exc.strerror or exc})") from None


@contextlib.contextmanager
def _locked(path: Path):
    """Exclusive flock on ``path``, waited for up to LOCK_WAIT_S (then FolderRefused: build privately)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise FolderRefused(f"another process held {path} past {LOCK_WAIT_S:.0f} s") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


def _discard(folder: Path) -> None:
    trash = folder.with_name(f"tmp.trash.{folder.name}.{os.getpid()}.{time.monotonic_ns()}")
    with contextlib.suppress(OSError):
        os.replace(folder, trash)
        shutil.rmtree(trash, ignore_errors=True)


def _sweep(kernels: Path, key: str) -> None:
    """Remove this key's build folders left by processes that no longer run (a kill -9 mid-build)."""
    for d in kernels.glob(f"tmp.{key}.*"):
        pid = d.name.split(".")[2]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def _entry_problem(entry: Path) -> str | None:
    """Why the published entry may not be loaded: its folder or files, its record, its digest."""
    lib = entry / LIBRARY
    for path, kind in ((entry, "cache folder"), (lib, "library"), (entry / META, "record")):
        st = os.lstat(path)
        if not (stat.S_ISDIR if kind == "cache folder" else stat.S_ISREG)(st.st_mode):
            return f"{kind} {path} is not a plain {'folder' if kind == 'cache folder' else 'file'}"
        why = ownership_problem(path, st, kind)
        if why:
            return why
    meta = json.loads((entry / META).read_text())
    if not isinstance(meta, dict) or not isinstance(meta.get("sha256"), str):
        return f"{entry / META} holds no sha256"
    if sha256_file(lib) != meta["sha256"]:
        return f"{lib} does not match the sha256 recorded beside it"
    return None


def load(path: Path) -> ctypes.CDLL:
    """The library at ``path``, its four entry points present (Failed otherwise)."""
    from neffbuild.runtime.native_check import SYMBOLS

    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise Failed(f"{path} does not load ({str(exc)[:200]})") from None
    missing = [name for name in SYMBOLS if not hasattr(lib, name)]
    if missing:
        raise Failed(f"{path} exports no {missing[0]}")
    return lib


def _from_entry(entry: Path, notes: list[str]) -> ctypes.CDLL | None:
    """The published library, or None (a bad entry is removed, and said, for the caller to rebuild)."""
    if not os.path.lexists(entry):
        return None
    try:
        why = _entry_problem(entry)
        if why is None:
            return load(entry / LIBRARY)
    except (OSError, ValueError, RecursionError) as exc:
        why = f"cache entry {entry} is unreadable ({exc})"
    except Failed as exc:
        why = str(exc)
    _discard(entry)
    notes.append(f"{why}: removed")
    return None


def _publish(cc: str, flags: tuple[str, ...], kernels: Path, key: str) -> Path:
    """Build in ``kernels/tmp.<key>.<pid>.*``, record, and rename into ``kernels/<key>`` (under the key's lock)."""
    stage = Path(tempfile.mkdtemp(prefix=f"tmp.{key}.{os.getpid()}.", dir=kernels))
    try:
        lib, isa = build(cc, flags, stage)
        meta = {"sha256": sha256_file(lib), "bytes": lib.stat().st_size, "compiler": cc, "flags": list(flags),
                "isa": isa, "created": time.time()}
        fd = os.open(stage / META, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w") as f:
            json.dump(meta, f, sort_keys=True, indent=1)
        os.chmod(stage, 0o755)
        entry = kernels / key
        if os.path.lexists(entry):
            _discard(entry)
        os.replace(stage, entry)
        return entry / LIBRARY
    finally:
        if stage.exists():
            shutil.rmtree(stage, ignore_errors=True)


def _cached(cc: str, flags: tuple[str, ...], key: str, notes: list[str]) -> ctypes.CDLL:
    root = settings.cache_dir()
    kernels = root / "kernels"
    _folder_ready(root, kernels)
    try:
        with _locked(kernels / f"{key}.lock"):
            lib = _from_entry(kernels / key, notes)
            if lib is not None:
                return lib
            _sweep(kernels, key)
            lib = load(_publish(cc, flags, kernels, key))
            if notes:
                notes[-1] += " and rebuilt"
            return lib
    except OSError as exc:
        raise FolderRefused(f"cache folder {kernels} cannot be written ({exc.strerror or exc})") from None


def _private(cc: str, flags: tuple[str, ...]) -> ctypes.CDLL:
    """Built and loaded in a fresh 0700 temporary folder, removed once loaded (the mapping outlives the file)."""
    with tempfile.TemporaryDirectory(prefix="neffbuild-kernels-") as tmp:
        lib, _ = build(cc, flags, Path(tmp))
        return load(lib)


def obtain(flags: tuple[str, ...] | None = None) -> tuple[ctypes.CDLL | None, str | None]:
    """(the library, or None for the torch forms; the one stderr line, or None when nothing needs saying).

    ``flags``: the instruction-set flags (default ``settings.native_cflags()``: ``-march=native``)."""
    notes: list[str] = []
    try:
        flags = settings.native_cflags() if flags is None else tuple(flags)
        cc = settings.c_compiler()
        if not cc:
            raise Failed("no C compiler (cc/gcc, or $CC)")
        key = entry_key(cc, flags)
        try:
            return _cached(cc, flags, key, notes), "; ".join(notes) or None
        except FolderRefused as exc:
            notes.append(str(exc))
        lib = _private(cc, flags)
        return lib, "; ".join(notes) + ": built the native kernels in a private temporary folder (this process only)"
    except Exception as exc:  # any failure to build or load runs the torch forms: never a failed step
        why = str(exc) if isinstance(exc, Failed) else f"{type(exc).__name__}: {str(exc)[:200]}"
        return None, "; ".join([*notes, why])
