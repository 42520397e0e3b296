"""The one loading path per backend: artifact file + the bundle's weights -> a step callable.

Every loader returns a callable with the decode graph's calling convention,
``step(input_ids, positions, block_table, block_table_swa, swa_kv_pos_offset, slot_mapping,
slot_mapping_swa, kv_caches)`` -> logits, or (logits, aux hidden states); the KV caches are
written in place. The compile side (``neffbuild/compiler/backends/``) loads through these
functions too, so a build and a server bind weights the same way. Thin: standard library,
torch and the base modules; each SDK is imported only when its loader runs.

Neuron artifacts follow the contract ``compiler/backends/neuron.py`` traces them with:
inputs flattened (the 7 step inputs, then the KV buffers), outputs ``(*kv_buffers,
*visible)``, each KV buffer declared state (aliased to its output), weights kept out of
the NEFF under the ``model.`` prefix and bound here with ``torch_neuronx.replace_weights``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from neffbuild import registry
from neffbuild.errors import BundleError

NEURON_WEIGHT_PREFIX = "model."  # the traced wrapper holds the decode module as ``model``


def load_inductor(path: Path, weights: dict[str, torch.Tensor], toolchain: dict, device: str = "cpu"):
    """An AOTInductor package with the shared weights bound as user-managed constants (never copied)."""
    # native, native_q8: they register the ops CPU graphs call (mxfp4_dot, bf16_linear, the opt-in integer forms)
    from neffbuild.runtime import native, native_q8  # noqa: F401
    from neffbuild.runtime.bundle.aoti_package import load_package

    runner = load_package(path)  # extracts into a temp folder of ours, removed if loading fails
    wanted = runner.get_constant_fqns()
    missing = [n for n in wanted if n not in weights]
    if missing:
        raise BundleError(f"{path}: the bundle's weights lack constants {missing[:5]}")
    for n in wanted:
        if not weights[n].is_contiguous():
            raise BundleError(f"{path}: weight {n!r} is not contiguous")
    runner.load_constants({n: weights[n] for n in wanted}, check_full_update=True, user_managed=True)
    return runner


NATIVE_OP_DTYPES = ("uint8", "bfloat16")  # MXFP4 blocks and scales (mxfp4_dot), bf16 linears (bf16_linear)


def prepare_native(manifest: dict, device) -> None:
    """Build (or find) and load the native ops' kernels while the bundle opens, never in its first decode step:
    for CPU inductor artifacts with MXFP4 or bfloat16 weights, which the export traced through the ops
    (``kernels.moe.native_cpu_ops``). Never raises: a failure runs the torch forms, said once on stderr."""
    toolchain = manifest.get("toolchain", {})
    if toolchain.get("backend") != "inductor" or str(toolchain.get("device", "cpu")) != "cpu" \
            or torch.device(device).type != "cpu":
        return
    pieces = (manifest.get("parallel") or {}).get("pieces") or {}
    tables = [manifest["weights"]["tensors"], *(p.get("tensors") or {} for p in pieces.values())]
    if any(isinstance(t, dict) and t.get("dtype") in NATIVE_OP_DTYPES for table in tables for t in table.values()):
        from neffbuild.runtime import native

        native.prepare()


class NeuronStep:
    """A loaded NEFF with the step calling convention: flattens the KV tuple, drops the state outputs."""

    def __init__(self, module):
        self.module = module

    def __call__(self, *args):
        *head, caches = args
        out = self.module(*head, *caches)
        visible = out[len(caches):]
        return visible[0] if len(visible) == 1 else tuple(visible)


def load_neuron(path: Path, weights: dict[str, torch.Tensor], toolchain: dict, device: str = "cpu"):
    """A TorchScript NEFF traced with separate weights; the bundle's weights bound, then moved to the core."""
    import torch_neuronx  # Neuron hosts (or the tests' stand-in) only

    module = torch.jit.load(str(path))
    torch_neuronx.replace_weights(module, {NEURON_WEIGHT_PREFIX + k: v for k, v in weights.items()})
    core = int(device.split(":", 1)[1]) if device.startswith("neuron:") else 0
    torch_neuronx.move_trace_to_device(module, core)
    return NeuronStep(module)


def reads_package_signature(toolchain: dict) -> bool:
    """Whether this backend's artifacts declare their inputs and constants in a form the runtime reads
    before loading them (AOTInductor: the generated wrapper; see runtime/bundle/aoti_package.py)."""
    return toolchain.get("backend") == "inductor"


def inductor_problem(toolchain: dict) -> str | None:
    built = str(toolchain.get("torch", "")).split("+")[0]
    here = torch.__version__.split("+")[0]
    if built != here:
        return (f"artifacts were compiled by torch {toolchain.get('torch')} and this process runs torch "
                f"{torch.__version__}; AOTInductor artifacts only load in the torch that built them. "
                f"Install torch=={built} or rebuild the bundle")
    return cpu_problem(toolchain)


def cpu_problem(toolchain: dict) -> str | None:
    """Why this CPU cannot run the artifacts' native code: instruction-set features it lacks (checked
    before any artifact loads; a bundle from before the target was recorded has no requirement)."""
    from neffbuild.runtime.bundle import cpu_features

    cpu = toolchain.get("cpu_target")
    if not isinstance(cpu, dict):
        return None
    lacking = cpu_features.missing(cpu.get("features"))
    if not lacking:
        return None
    return (f"artifacts were compiled for compiler.target {cpu.get('target')!r} (-march={cpu.get('march')}) and "
            f"need CPU features this host lacks: {', '.join(lacking)}; running them would die with an illegal "
            f"instruction. Rebuild with a portable compiler.target (e.g. x86-64-v2) or open the bundle on a CPU "
            f"that has these features")


def host_lnc(platform: str) -> int:
    """The runtime's logical NeuronCore config: NEURON_LOGICAL_NC_CONFIG, else 2 on trn2/trn3, 1 elsewhere."""
    from neffbuild import settings

    value = settings.neuron_logical_nc_config()
    return value if value is not None else (2 if platform in ("trn2", "trn3") else 1)


def neuron_problem(toolchain: dict) -> str | None:
    """Why this host cannot run the bundle's NEFFs: no SDK, another NeuronCore target or LNC."""
    if importlib.util.find_spec("torch_neuronx") is None:
        return "artifacts are NEFFs; this host has no torch-neuronx (the Neuron SDK)"
    from torch_neuronx.utils import get_platform_target

    platform = get_platform_target()
    lnc = host_lnc(platform)
    want_target, want_lnc = toolchain.get("target"), toolchain.get("lnc")
    if (platform, lnc) != (want_target, want_lnc):
        return (f"artifacts were compiled for {want_target} with logical NeuronCore config {want_lnc}, and this host "
                f"is {platform} with NEURON_LOGICAL_NC_CONFIG={lnc}; a NEFF runs only on the NeuronCore target and "
                f"LNC it was compiled for. Rebuild with compiler.target: {platform} and neuron_config.lnc: {lnc}"
                + (f", or set NEURON_LOGICAL_NC_CONFIG={want_lnc}" if platform == want_target else ""))
    return None


def toolchain_problem(toolchain: dict) -> str | None:
    """Why the running toolchain cannot run these artifacts, or None."""
    entry = registry.BACKENDS.get(toolchain.get("backend"))
    if entry is None:
        return f"unknown backend {toolchain.get('backend')!r} in the manifest (known: {', '.join(registry.BACKENDS)})"
    return entry.get("host_problem")(toolchain)


def device_problem(toolchain: dict, device) -> str | None:
    """Why the artifacts cannot run on ``device``, or None. An inductor artifact runs only on the device type it
    was compiled for (the fingerprint's ``device``), and only where torch has that device: a meta or fake
    device has no memory for the KV writes (the first step would crash in native code)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        return f"device {str(device)[:40]!r} is not a torch device (e.g. 'cpu', 'cuda:0')"
    if toolchain.get("backend") == "neuron":
        return None if dev.type in ("cpu", "privateuseone") or str(device).startswith("neuron") else \
            f"device {dev}: a neuron bundle runs on its NeuronCores (device 'neuron:N')"
    built_for = str(toolchain.get("device", "cpu"))
    if dev.type != torch.device(built_for).type:
        return f"device {dev}: these artifacts were compiled for {built_for!r} and run only there"
    if dev.type == "cuda" and not torch.cuda.is_available():
        return f"device {dev}: this torch has no CUDA device (torch.cuda.is_available() is False)"
    return None


def load(toolchain: dict, path: Path, weights: dict[str, torch.Tensor], device: str = "cpu"):
    """Load one artifact through its backend's loader (named in neffbuild/registry.py)."""
    return registry.backend(toolchain["backend"]).get("loader")(path, weights, toolchain, device)
