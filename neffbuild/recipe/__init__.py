"""Recipe: YAML -> validated, frozen ``Recipe``.

``types.py`` holds the frozen dataclasses, ``loading.py`` the safe file and YAML reading,
``checks.py`` the typed primitives, ``validator.py`` the order the section rules run in
(``*_rules.py``, one module per section). Validation collects every problem before raising
(``RecipeError``), each naming the dotted path, the value and the rule. Validation never
needs a compiler or torch.
"""

from __future__ import annotations

from pathlib import Path

from neffbuild.errors import RecipeError
from neffbuild.recipe.loading import parse_yaml, read_regular_file
from neffbuild.recipe.types import ModelSpec, Recipe, Speculative
from neffbuild.recipe.validator import Validator

__all__ = ["ModelSpec", "Recipe", "Speculative", "from_dict", "load", "parse_yaml", "read_regular_file"]


def load(path: str | Path) -> Recipe:
    """Read, parse and validate a recipe file; raise RecipeError listing every problem."""
    path = Path(path)
    text = read_regular_file(path, "recipe")
    return from_dict(parse_yaml(text, str(path)), base_dir=path.parent.resolve(), source=str(path))


def from_dict(raw: object, *, base_dir: Path | None = None, source: str = "<recipe>") -> Recipe:
    v = Validator(base_dir or Path.cwd(), source)
    recipe = v.run(raw)
    if v.problems:
        raise RecipeError(source, v.problems, v.warnings)
    return recipe
