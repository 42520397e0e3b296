"""Recipe: YAML -> validated, frozen ``Recipe``.

``spec.py`` holds the frozen dataclasses, ``validator.py`` every validation rule, and this
module the loading: YAML with duplicate keys refused and syntax errors located.
Validation collects every problem before raising (``RecipeError``), each naming the dotted
path, the value and the rule. Validation never needs a compiler or torch.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from neffbuild.errors import InvalidInput, RecipeError
from neffbuild.recipe.spec import ModelSpec, Recipe, Speculative
from neffbuild.recipe.validator import Validator

__all__ = ["ModelSpec", "Recipe", "Speculative", "from_dict", "load", "parse_yaml"]


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (PyYAML silently keeps the last)."""


def _construct_mapping(loader, node, deep=False):
    seen = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            mark = key_node.start_mark
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {seen[key] + 1})", mark
            )
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def parse_yaml(text: str, source: str) -> object:
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        raise InvalidInput(f"{source}: YAML syntax error at {where}: {exc.problem or exc}") from None
    except yaml.YAMLError as exc:
        raise InvalidInput(f"{source}: YAML error: {exc}") from None


def load(path: str | Path) -> Recipe:
    """Read, parse and validate a recipe file; raise RecipeError listing every problem."""
    path = Path(path)
    if not path.is_file():
        raise InvalidInput(f"{path}: recipe file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"{path}: cannot read recipe: {exc}") from None
    return from_dict(parse_yaml(text, str(path)), base_dir=path.parent.resolve(), source=str(path))


def from_dict(raw: object, *, base_dir: Path | None = None, source: str = "<recipe>") -> Recipe:
    v = Validator(base_dir or Path.cwd(), source)
    recipe = v.run(raw)
    if v.problems:
        raise RecipeError(source, v.problems, v.warnings)
    return recipe
