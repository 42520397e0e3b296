"""compiler.flags / compiler.target_flags: recipes are data, so flags come from an allow-list.

An inductor config option can name a program (``cpp.cxx``), a path or a command; setting one
from a recipe made ``compile`` execute whatever the recipe named. So the inductor backend takes
only the options below, each with the values it may hold: tuning switches and sizes, nothing
that names a program, a path, a command or extra compiler arguments. The backend checks the
same list again before it compiles (inductor.py beside this module), whoever built the Recipe.

Neuron flags are arguments to the one program the backend runs (neuronx-cc); they must look
like ``--name`` or ``--name=value`` with a plain value (no path separators, no shell syntax).
With ``backend: auto`` the flags must satisfy the inductor list (use ``backend: neuron`` for
neuronx-cc flags). Pure Python, torch-free: the registry hands ``inductor_problem`` /
``neuron_problem`` to the recipe validator as each backend's ``flag_problem`` part.
"""

from __future__ import annotations

import json
import re

# set by the backend itself: weights live outside the .pt2; the CPU target (compiler.target) picks -march/simdlen
RESERVED = {"aot_inductor.package_constants_in_so", "cpp.march", "cpp.simdlen"}


def _bool(v) -> bool:
    return isinstance(v, bool)


def _int(lo: int, hi: int):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


# option -> (value check, what the value may be)
INDUCTOR_OPTIONS = {
    **dict.fromkeys((
        "max_autotune", "max_autotune_pointwise", "max_autotune_gemm", "coordinate_descent_tuning",
        "epilogue_fusion", "pattern_matcher", "aggressive_fusion", "shape_padding", "permute_fusion",
        "split_reductions", "size_asserts", "nan_asserts", "fallback_random", "comprehensive_padding",
        "cpp.dynamic_threads", "cpp.enable_unsafe_math_opt_flag", "cpp.enable_floating_point_contract_flag",
        "cpp.fallback_scatter_reduce_sum", "aot_inductor.debug_compile"), (_bool, "true or false")),
    "cpp.threads": (_int(-1, 1024), "an integer in [-1, 1024] (-1: all cores)"),
    "cpp.min_chunk_size": (_int(1, 1 << 20), "an integer in [1, 1048576]"),
    "cpp.max_horizontal_fusion_size": (_int(1, 1 << 16), "an integer in [1, 65536]"),
    "max_fusion_size": (_int(1, 1 << 16), "an integer in [1, 65536]"),
}

NEURON_FLAG = re.compile(r"--?[A-Za-z][A-Za-z0-9_-]*(=[A-Za-z0-9_.,:+-]*)?")


def parse_value(text: str):
    """A flag's value: JSON when it parses (true, 3, null), else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def inductor_problem(flag) -> str | None:
    """Why one ``name=value`` flag is not allowed for the inductor backend, or None."""
    if not isinstance(flag, str) or "=" not in flag:
        return "must be name=value (an inductor config option from the allow-list; see docs/recipe.md)"
    name, text = (s.strip() for s in flag.split("=", 1))
    if name in RESERVED:
        return f"{name!r} is set by neffbuild itself and cannot be changed by a recipe"
    if name not in INDUCTOR_OPTIONS:
        return (f"{name!r} is not an allowed inductor option (recipes are data: options that name a program, "
                f"a path or a command are refused); allowed: {', '.join(sorted(INDUCTOR_OPTIONS))}")
    ok, what = INDUCTOR_OPTIONS[name]
    if not ok(parse_value(text)):
        return f"{name} must be {what}, got {text!r}"
    return None


def neuron_problem(flag) -> str | None:
    if not isinstance(flag, str) or not NEURON_FLAG.fullmatch(flag):
        return ("must be a neuronx-cc option --name or --name=value with a plain value "
                "(letters, digits, . , : + - _; no paths, no shell syntax)")
    return None
