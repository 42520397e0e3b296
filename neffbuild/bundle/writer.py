"""Write a bundle into a temp folder beside its destination, then rename it into place.

Nothing half-written is ever visible under ``<out>/<name>-<version>``: a crash leaves only
a ``.<name>-<version>.tmp-<pid>`` folder, swept by the next build of that bundle. A writer owns
only what it made: it sweeps only folders of that exact form (and ``.<name>-<version>.old-<pid>``)
whose process is gone, replaces ``<name>-<version>`` only when it is a bundle (a folder holding
``manifest.json`` and ``manifest.sha256``), and follows no symbolic link in these paths.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import socket
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from neffbuild import registry
from neffbuild.bundle import manifest, paths, provenance, signing
from neffbuild.errors import InvalidInput
from neffbuild.fsutil import pid_alive, sha256_file

TMP_MARK = ".tmp-"
OLD_MARK = ".old-"


class BundleWriter:
    def __init__(self, out_dir: str | Path, name: str, version: str):
        self.out_dir = Path(out_dir)
        self.final = self.out_dir / paths.bundle_dirname(name, version)
        self.started = time.time()
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            refuse_replacing(self.final)  # before any work: a build must not end in a refusal
            sweep(self.out_dir, self.final.name)
            self.tmp = self.out_dir / f".{self.final.name}{TMP_MARK}{os.getpid()}"
            if self.tmp.is_symlink():
                raise InvalidInput(f"{self.tmp}: a symbolic link where the bundle's temp folder goes; remove it")
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp.mkdir()  # created here: what is written below is ours
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
        hf = registry.arch(recipe.model.arch).get("hf_config")(recipe.model.config, recipe.model.weights_dtype)
        self.write_text(paths.HF_CONFIG_PATH, json.dumps(hf, indent=1, sort_keys=True) + "\n")
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
        refuse_replacing(self.final)  # again: the folder may have changed during the build
        if self.final.exists():
            old = self.out_dir / f".{self.final.name}{OLD_MARK}{os.getpid()}"
            if os.path.lexists(old):
                raise InvalidInput(f"{old}: exists (not made by this build); remove it, then compile again")
            os.replace(self.final, old)
        os.replace(self.tmp, self.final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.final

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def is_bundle_dir(path: Path) -> bool:
    """A real folder (not a link) holding a manifest and its digest as regular files."""
    marks = (paths.MANIFEST_PATH, paths.MANIFEST_DIGEST_PATH)
    return path.is_dir() and not path.is_symlink() and all(
        (path / f).is_file() and not (path / f).is_symlink() for f in marks)


def refuse_replacing(final: Path) -> None:
    """InvalidInput unless ``final`` is absent or a bundle: a build never replaces what it does not own."""
    if not os.path.lexists(final) or is_bundle_dir(final):
        return
    kind = "a symbolic link" if final.is_symlink() else "a folder that is not a bundle" if final.is_dir() else \
        "a file"
    raise InvalidInput(f"--out: {final} exists and is {kind} (no manifest.json and manifest.sha256); it is not "
                       "replaced: move it away or choose another --out")


def sweep(out_dir: Path, name: str) -> None:
    """Remove the temp folders of bundle ``name`` (``.NAME.tmp-PID``, ``.NAME.old-PID``, exactly) whose writer
    process is gone; nothing else in ``out_dir`` is touched, and a link is never followed."""
    form = re.compile(rf"\.{re.escape(name)}(?:{re.escape(TMP_MARK)}|{re.escape(OLD_MARK)})([0-9]+)")
    for p in out_dir.glob(f".{glob_escape(name)}.*"):
        m = form.fullmatch(p.name)
        if m is None or p.is_symlink() or not p.is_dir() or pid_alive(int(m.group(1))):
            continue
        shutil.rmtree(p, ignore_errors=True)


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


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
