"""File helpers shared by the cache, the bundle writer and the CLI outputs. Imports only neffbuild.errors."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def no_duplicate_keys(pairs: list) -> dict:
    """``json.loads(..., object_pairs_hook=no_duplicate_keys)``: a key given twice is a ValueError (readers
    of bundles and signatures would otherwise see only the last value, while another tool sees the first)."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k[:80]!r}")
        out[k] = v
    return out


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (used to sweep work folders of dead writers)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def output_problem(path: str | os.PathLike, what: str) -> str | None:
    """Why ``path`` may not be written as an output file, or None (write only what you own).

    Allowed: a regular file (overwritten in place) or an absent name in an existing folder.
    Refused: symbolic links, devices, FIFOs, sockets, folders, a missing parent folder, and any
    place inside a bundle (a folder above holds manifest.sha256): an output never replaces what
    it does not own.
    """
    import stat

    p = Path(path)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        return f"{what} {p}: cannot be inspected ({exc.strerror or exc})"
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = ("a symbolic link" if stat.S_ISLNK(st.st_mode) else "a folder" if stat.S_ISDIR(st.st_mode)
                else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device or socket")
        return f"{what} {p}: is {kind}, not a regular file; give a new file name or a regular file to overwrite"
    parent = p.absolute().parent
    if not parent.is_dir():
        return f"{what} {p}: folder {parent} does not exist (create it first)"
    for folder in [parent, *parent.parents][:64]:
        if (folder / "manifest.sha256").is_file() and (folder / "manifest.json").is_file():
            return f"{what} {p}: is inside the bundle {folder}; write outputs outside bundles"
    if not os.access(parent, os.W_OK) or (st is not None and not os.access(p, os.W_OK)):
        return f"{what} {p}: not writable (permission denied)"
    if st is None:  # a probe: /proc and /sys pass access() for root yet refuse a new file
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
        except FileExistsError:
            return None  # someone created it meanwhile: write_output checks it again
        except OSError as exc:
            return f"{what} {p}: cannot be created there ({exc.strerror or exc})"
        os.close(fd)
        os.unlink(p)
    return None


def write_output(path: str | os.PathLike, data: str | bytes, what: str) -> Path:
    """Write an output file in place after ``output_problem`` (raises InvalidInput naming it, exit 2)."""
    import stat

    from neffbuild.errors import InvalidInput

    why = output_problem(path, what)
    if why:
        raise InvalidInput(why)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        raise InvalidInput(f"{what} {path}: cannot write ({exc.strerror or exc})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped for something else since the check
            raise InvalidInput(f"{what} {path}: is not a regular file")
        os.ftruncate(fd, 0)
        view = memoryview(data.encode() if isinstance(data, str) else data)
        while view:
            view = view[os.write(fd, view):]
    except OSError as exc:
        raise InvalidInput(f"{what} {path}: cannot write ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    return Path(path)


def read_regular(path: str | os.PathLike, what: str, limit: int) -> bytes:
    """An input file's bytes: a regular file (never a FIFO, a device or a folder) of at most ``limit`` bytes.

    Opened without blocking and checked on the open descriptor, so a FIFO cannot hang the reader and
    /dev/zero cannot fill memory. InvalidInput (exit 2) naming the file otherwise.
    """
    import stat

    from neffbuild.errors import InvalidInput

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise InvalidInput(f"{what} {path}: cannot read ({exc.strerror or exc})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # checked before fdopen: a folder's descriptor cannot become a file object
        os.close(fd)
        raise InvalidInput(f"{what} {path}: not a regular file (a FIFO, device or folder cannot be read)")
    with os.fdopen(fd, "rb") as f:
        if st.st_size > limit:
            raise InvalidInput(f"{what} {path}: {st.st_size} bytes; the limit is {limit}")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise InvalidInput(f"{what} {path}: more than {limit} bytes")
    return data


def writable_dir_problem(path: str | os.PathLike, what: str) -> str | None:
    """Why ``path`` cannot be used as a folder to write into, or None (it is created, and a probe file written
    and removed: the only test that also holds for root and read-only file systems)."""
    import tempfile

    p = Path(path).expanduser()
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".neffbuild-probe.", dir=p)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        return f"{what} {path}: cannot write there ({exc.strerror or exc}); choose a folder you can write"
    return None
