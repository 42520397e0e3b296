"""Every path and marker of a bundle as a named constant (spec: docs/bundle-format.md).

This module imports nothing, so the thin runtime reader shares it.
"""

BUNDLE_FORMAT = "neffbuild-bundle"
# Bump when a reader of the previous version would misread a bundle (a field changes
# meaning or a new MUST is added). Adding an optional field does not bump it.
# Version 2: manifest.sha256 added (a MUST); compile_seconds moved out of artifact entries.
# Version 3: the GPT-OSS expert weights are stacked [out, in] per expert (gate_up_w [L, E, 2I, H],
# down_w [L, E, H, I]); a version-2 reader would bind them as [in, out].
# Version 4: parallel.rank_pieces lists each rank's pieces (the architecture's rule, recorded) instead of a
# sentence; graph_inputs.speculative_method names the draft's method (a MUST with drafts).
BUNDLE_FORMAT_VERSION = 4
SUPPORTED_FORMAT_VERSIONS = (4,)

MANIFEST_PATH = "manifest.json"
MANIFEST_DIGEST_PATH = "manifest.sha256"  # "<sha256 of manifest.json>  manifest.json\n" (sha256sum -c format)
BUILD_INFO_PATH = "build-info.json"
RECIPE_PATH = "recipe.yaml"
# The model's Hugging Face config (the architecture's keys, architectures, model_type, dtype): a host engine
# that starts from a model folder (vLLM) starts from the bundle folder; listed and checksummed like every file.
HF_CONFIG_PATH = "config.json"
# EAGLE3 bundles: the draft as a model folder (config.json + model.safetensors, from the bundle's own draft tensors)
# that a host engine's draft loader reads (vLLM's --speculative-config model); listed and checksummed like every file.
DRAFT_DIR = "draft"
WEIGHTS_DIR = "weights"
WEIGHTS_PATH = "weights/model.safetensors"
ARTIFACTS_DIR = "artifacts"
LOGS_DIR = "logs"
METRICS_DIR = "metrics"
COMPILE_METRICS_PATH = "metrics/compile.prom"
REPORT_PATH = "report.html"
# Signature file (OpenSSF model-signing format, key mode) over every other file: written by
# `neffbuild sign` after the bundle is complete; model-signing's default file name.
SIGNATURE_PATH = "model.sig"
# SLSA v1 provenance statement (recipe hash, checkpoint digest, toolchain, builder host, cache hits).
PROVENANCE_PATH = "provenance.json"

# Per-build records: they differ between two builds of the same inputs, so they are not
# listed in the manifest's checksums (which must be byte-identical for identical inputs).
# The manifest and its digest cover each other and are not listed either.
# The signature covers them all (it is written last); provenance names the host, so it is per build.
UNCHECKED_PATHS = (MANIFEST_PATH, MANIFEST_DIGEST_PATH, BUILD_INFO_PATH, REPORT_PATH, SIGNATURE_PATH,
                   PROVENANCE_PATH)
UNCHECKED_DIRS = (LOGS_DIR, METRICS_DIR)


def bundle_dirname(name: str, version: str) -> str:
    return f"{name}-{version}"


def weights_piece_path(piece: str) -> str:
    """A sharded bundle's per-rank weight piece (``tp0``, ``ep3``); the replicated piece is WEIGHTS_PATH."""
    return f"{WEIGHTS_DIR}/{piece}.safetensors"


def artifact_path(label: str, ext: str) -> str:
    return f"{ARTIFACTS_DIR}/{label}.{ext}"


def log_path(label: str) -> str:
    return f"{LOGS_DIR}/{label}.log"
