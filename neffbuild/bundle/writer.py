"""Write a bundle into a temp folder beside its destination, then rename it into place.

Nothing half-written is ever visible under ``<out>/<name>-<version>``: a crash leaves only
a ``.<name>-<version>.tmp-<pid>`` folder, swept by the next build.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import socket
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from neffbuild.bundle import manifest, paths, provenance, signing
from neffbuild.errors import InvalidInput
from neffbuild.fsutil import pid_alive, sha256_file

TMP_MARK = ".tmp-"


class BundleWriter:
    def __init__(self, out_dir: str | Path, name: str, version: str):
        self.out_dir = Path(out_dir)
        self.final = self.out_dir / paths.bundle_dirname(name, version)
        self.started = time.time()
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            sweep(self.out_dir)
            self.tmp = self.out_dir / f".{self.final.name}{TMP_MARK}{os.getpid()}"
            shutil.rmtree(self.tmp, ignore_errors=True)
            for d in (paths.WEIGHTS_DIR, paths.ARTIFACTS_DIR, paths.LOGS_DIR, paths.METRICS_DIR):
                (self.tmp / d).mkdir(parents=True)
        except OSError as exc:
            raise InvalidInput(f"--out {out_dir}: cannot create the bundle folder there ({exc.strerror or exc}); "
                               "give a folder path") from None

    def path(self, rel: str) -> Path:
        return self.tmp / rel

    def write_weights(self, tensors: dict[str, torch.Tensor], rel: str = paths.WEIGHTS_PATH) -> dict:
        save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(self.path(rel)))
        return {"file": rel,
                "tensors": {k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)}
                            for k, v in sorted(tensors.items())}}

    def add_artifact(self, label: str, ext: str, source: Path) -> str:
        rel = paths.artifact_path(label, ext)
        shutil.copyfile(source, self.path(rel))
        return rel

    def write_text(self, rel: str, text: str) -> None:
        p = self.path(rel)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")

    def checksums(self) -> dict:
        files = {}
        for p in sorted(self.tmp.rglob("*")):
            rel = p.relative_to(self.tmp).as_posix()
            if not p.is_file() or rel in paths.UNCHECKED_PATHS or rel.split("/")[0] in paths.UNCHECKED_DIRS:
                continue
            files[rel] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
        return files

    def finish(self, recipe, *, toolchain: dict, kv_layout, artifacts: list[dict], weights: dict,
               report_context: dict, parallel=None, sign_key=None) -> Path:
        """Write the manifest and its digest, then the per-build records (provenance included); with
        ``sign_key`` sign every file (bundle/signing.py); publish with a rename."""
        self.write_text(paths.RECIPE_PATH, recipe.to_yaml())
        m = manifest.build(recipe, toolchain=toolchain, kv_layout=kv_layout, artifacts=artifacts, weights=weights,
                           files=self.checksums(), parallel=parallel)
        text = manifest.dumps(m)
        self.write_text(paths.MANIFEST_PATH, text)
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        self.write_text(paths.MANIFEST_DIGEST_PATH, f"{digest}  {paths.MANIFEST_PATH}\n")
        seconds = report_context.get("seconds", {})
        self.write_text(paths.COMPILE_METRICS_PATH, compile_metrics(seconds))
        self.write_text(paths.REPORT_PATH, render_report(m, **report_context))
        info = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": socket.gethostname(),
                "python": platform.python_version(),
                **{k: v for k, v in report_context.items() if k not in ("hits", "seconds")},
                "compile_seconds": dict(sorted(seconds.items())),
                "cache_hits": sorted(k for k, v in report_context.get("hits", {}).items() if v)}
        self.write_text(paths.BUILD_INFO_PATH, json.dumps(info, sort_keys=True, indent=1) + "\n")
        self.write_text(paths.PROVENANCE_PATH, provenance.dumps(provenance.statement(
            recipe, m, digest, report_context.get("hits", {}), started=self.started,
            extra={"executor": report_context.get("executor")})))
        if sign_key is not None:  # last: the signature covers every other file, provenance included
            signing.sign(self.tmp, sign_key, name=self.final.name)
        return self.publish()

    def publish(self) -> Path:
        old = None
        if self.final.exists():
            old = self.out_dir / f".{self.final.name}.old-{os.getpid()}"
            os.replace(self.final, old)
        os.replace(self.tmp, self.final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.final

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def sweep(out_dir: Path) -> None:
    """Remove temp bundles whose writer process is gone."""
    for p in out_dir.glob(".*"):
        marker = TMP_MARK if TMP_MARK in p.name else (".old-" if ".old-" in p.name else None)
        if marker is None:
            continue
        pid = p.name.rsplit(marker, 1)[1]
        if pid.isdigit() and pid_alive(int(pid)):
            continue
        shutil.rmtree(p, ignore_errors=True)


def compile_metrics(seconds: dict[str, float]) -> str:
    """Prometheus text of each artifact's compile time: through prometheus_client when installed."""
    name, doc = "neffbuild_compilation_time_seconds", "Compile time of one artifact."
    try:
        from prometheus_client import CollectorRegistry, Gauge, generate_latest
    except ImportError:
        lines = [f"# HELP {name} {doc}", f"# TYPE {name} gauge"]
        lines += [f'{name}{{bucket="{label}"}} {float(s)}' for label, s in sorted(seconds.items())]
        return "\n".join(lines) + "\n"
    registry = CollectorRegistry()
    gauge = Gauge(name, doc, ["bucket"], registry=registry)
    for label, s in sorted(seconds.items()):
        gauge.labels(bucket=label).set(s)
    return generate_latest(registry).decode()


def render_report(m: dict, *, hits: dict, seconds: dict, built: int, cached: int, wall_s: float, **_records) -> str:
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("neffbuild.bundle", "templates"),
                             autoescape=jinja2.select_autoescape(["html", "j2"]))
    weights_mb = m["files"].get(paths.WEIGHTS_PATH, {}).get("bytes", 0) / 1e6
    total_mb = sum(a["bytes"] for a in m["artifacts"]) / 1e6
    return env.get_template("report.html.j2").render(
        m=m, hits=hits, seconds=seconds, built=built, cached=cached, wall_s=wall_s, weights_mb=weights_mb,
        total_mb=total_mb,
        graph_inputs=json.dumps(m["graph_inputs"], indent=1, sort_keys=True))
