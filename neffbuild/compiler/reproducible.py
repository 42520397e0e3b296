"""Make an AOTInductor package byte-reproducible, so two cold builds give identical manifests.

Two things in a ``.pt2`` vary between builds of the same graph while the compiled code does not:
the generated ``*.cpp`` sources get "// Compile cmd" / "// Link cmd" comments appended each time
inductor (re)builds them in its shared cache, and the archive's ``.data/serialization_id`` is
random. ``normalize_pt2`` strips the comments, derives the id from the other members' bytes, and
rewrites the zip with fixed member order and timestamps. The shared object is left as it is.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

TRAILER = b"\n// Compile cmd\n"
SERIALIZATION_ID = ".data/serialization_id"
FIXED_TIME = (1980, 1, 1, 0, 0, 0)


def _clean(name: str, data: bytes) -> bytes:
    if name.endswith(".cpp") and TRAILER in data:
        return data[: data.index(TRAILER)] + b"\n"
    return data


def normalize_pt2(path: str | Path) -> None:
    """Rewrite the package at path in place (via a temp file and a rename)."""
    path = Path(path)
    with zipfile.ZipFile(path) as z:
        members = [(i.filename, _clean(i.filename, z.read(i))) for i in z.infolist()]
    digest = hashlib.sha256()
    for name, data in members:
        if not name.endswith(SERIALIZATION_ID):
            digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    stable_id = str(int(digest.hexdigest(), 16))[:40].encode()
    tmp = path.with_name(path.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as out:
        for name, data in members:
            info = zipfile.ZipInfo(name, date_time=FIXED_TIME)
            info.external_attr = 0o644 << 16
            out.writestr(info, stable_id if name.endswith(SERIALIZATION_ID) else data)
    os.replace(tmp, path)
