"""Stand-in for ``neuronxcc`` (tests only): the version and the documented argument rules.

``check_args`` accepts what ``neuronx-cc compile`` documents for the options neffbuild
passes (target, logical NeuronCore config, optimisation level, model type, auto-cast,
saturate-infinity, logfile) and refuses the combinations the docs refuse (an LNC of 2
on trn1, an unknown target or level). Other flags pass through unchecked, as the real
compiler would judge them.
"""

from __future__ import annotations

__version__ = "0.0.0+standin"

TARGETS = ("inf2", "trn1", "trn1n", "trn2", "trn3")
OPTLEVELS = ("1", "2", "3")


class CompilerArgumentError(ValueError):
    """A compiler argument the documented CLI refuses."""


def _options(args) -> dict[str, str]:
    out = {}
    for arg in args:
        name, _, value = arg.partition("=")
        out[name] = value
    return out


def check_args(args) -> dict[str, str]:
    """Validate ``compiler_args``; return {"target", "lnc", "optlevel"}."""
    if isinstance(args, str):
        args = args.split()
    opts = _options(args or ())
    target = opts.get("--target")
    if target not in TARGETS:
        raise CompilerArgumentError(f"--target must be one of {TARGETS}, got {target!r}")
    lnc = opts.get("--logical-nc-config", opts.get("-lnc", "2" if target in ("trn2", "trn3") else "1"))
    if lnc not in ("1", "2") or (lnc == "2" and target not in ("trn2", "trn3")):
        raise CompilerArgumentError(f"NCC_EARG001: logical NeuronCore config {lnc} is not supported on {target}")
    level = opts.get("--optlevel", "2")
    if level not in OPTLEVELS:
        raise CompilerArgumentError(f"--optlevel must be one of {OPTLEVELS}, got {level!r}")
    return {"target": target, "lnc": lnc, "optlevel": level}
