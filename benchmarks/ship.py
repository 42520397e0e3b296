"""Shipping costs (issue 22): sign / verify time, push / pull throughput against a local S3 server.

    python benchmarks/ship.py BUNDLE [--gib 1] [--s3-mib 512]

1. Sign and verify (model.sig over every file) of BUNDLE (a real bundle, e.g. the tiny test
   bundle) and of a bundle-shaped folder of --gib GiB (one weights file, 24 artifact-sized
   files, small JSON files; random bytes: hashing cost does not depend on content).
2. push / pull of BUNDLE against moto in server mode on 127.0.0.1 (tests/s3_server.py), then
   the blob paths push and pull use (create-only multipart put, streamed ranged get + sha256)
   on one --s3-mib MiB file, each next to a plain file copy of the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import machine


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def shaped_folder(root: Path, gib: float) -> Path:
    """A folder laid out like a bundle: weights 80 %, 24 artifacts, manifest and records."""
    total = int(gib * 2**30)
    (root / "weights").mkdir(parents=True)
    (root / "artifacts").mkdir()
    chunk = os.urandom(1 << 24)

    def write(path: Path, size: int):
        with open(path, "wb") as f:
            while size > 0:
                f.write(chunk[: min(size, len(chunk))])
                size -= len(chunk)

    write(root / "weights" / "model.safetensors", int(total * 0.8))
    for i in range(24):
        write(root / "artifacts" / f"decode_{i}.pt2", int(total * 0.2 / 24))
    for name in ("manifest.json", "manifest.sha256", "recipe.yaml", "report.html", "build-info.json"):
        (root / name).write_text("{}\n")
    return root


def sign_verify(root: Path, key, pub: Path, check: bool) -> tuple[float, float]:
    from neffbuild.bundle import signing
    from neffbuild.runtime.bundle import model_sig as signature

    s = _timed(lambda: signing.sign(root, key, check=check))
    v = _timed(lambda: signature.verify_bundle(root, [pub]))
    return s, v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--s3-mib", type=int, default=512)
    args = ap.parse_args()
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        tmp = Path(tmp)
        key = ec.generate_private_key(ec.SECP256R1())
        pub = tmp / "pub.pem"
        pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                      serialization.PublicFormat.SubjectPublicKeyInfo))
        tiny = tmp / args.bundle.name
        shutil.copytree(args.bundle, tiny)
        size = sum(p.stat().st_size for p in tiny.rglob("*") if p.is_file())
        s, v = sign_verify(tiny, key, pub, check=True)
        print(f"sign   {size / 2**20:8.1f} MiB bundle: {s:6.3f} s   verify {v:6.3f} s")
        big = shaped_folder(tmp / "shaped-1.0", args.gib)
        bsize = sum(p.stat().st_size for p in big.rglob("*") if p.is_file())
        s, v = sign_verify(big, key, pub, check=False)
        c = _timed(lambda: shutil.copytree(big, tmp / "copy"))
        shutil.rmtree(tmp / "copy")
        print(f"sign   {bsize / 2**20:8.1f} MiB folder: {s:6.3f} s   verify {v:6.3f} s   "
              f"(plain copy of the folder {c:.3f} s)")
        shutil.rmtree(big)
        s3_part(tmp, tiny, size, args.s3_mib)


def s3_part(tmp: Path, tiny: Path, size: int, mib: int) -> None:
    import hashlib

    from neffbuild import s3
    from neffbuild.bundle import remote
    from tests.s3_server import start_server

    server = start_server()
    try:
        os.environ.update({k: v for k, v in server.env("rw").items() if k.startswith("AWS_")})
        url = server.url()
        p = _timed(lambda: remote.push(tiny, url))
        m = json.loads((tiny / "manifest.json").read_text())
        q = _timed(lambda: remote.pull(f"{url}/{m['name']}-{m['version']}", tmp / "pulled"))
        c = _timed(lambda: shutil.copytree(tiny, tmp / "copied"))
        mb = size / 2**20
        print(f"bundle {mb:.1f} MiB: push {p:.3f} s ({mb / p:.0f} MiB/s), pull {q:.3f} s ({mb / q:.0f} MiB/s), "
              f"plain copy {c:.3f} s ({mb / c:.0f} MiB/s)")
        blob = tmp / "blob"
        with open(blob, "wb") as f:
            for _ in range(mib // 16):
                f.write(os.urandom(16 << 20))
        r = s3.open_remote(url)
        p = _timed(lambda: r.put_file_if_absent("bench/blob", blob))

        def get():
            h = hashlib.sha256()
            with open(tmp / "blob.down", "wb") as f:
                for chunk in r.iter_from("bench/blob", 0):
                    f.write(chunk)
                    h.update(chunk)

        q = _timed(get)
        c = _timed(lambda: shutil.copyfile(blob, tmp / "blob.copy"))
        print(f"blob {mib} MiB: put {p:.2f} s ({mib / p:.0f} MiB/s), ranged get + sha256 {q:.2f} s "
              f"({mib / q:.0f} MiB/s), plain copy {c:.2f} s ({mib / c:.0f} MiB/s)")
    finally:
        server.proc.terminate()
        server.proc.wait()


if __name__ == "__main__":
    main()
