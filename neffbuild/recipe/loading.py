"""Reading a recipe file safely: a regular file of bounded size, YAML with bounded depth, aliases
and expanded size, merge keys supported, duplicate and complex keys refused, errors located.

Imports no rule module, so the rules (``model_rules`` reads ``config.json`` files) can use
``read_regular_file`` without an import cycle.
"""

from __future__ import annotations

import stat
from pathlib import Path

import yaml

from neffbuild.errors import Problem, RecipeError

MAX_RECIPE_BYTES = 1024 * 1024
MAX_DEPTH = 32  # a recipe nests 4 levels; JSON config files a few more
MAX_ALIASES = 100
MAX_NODES = 100_000  # after expanding aliases: a billion-laughs document stops here
MERGE_TAG = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate and non-scalar mapping keys; ``<<`` merge keys work."""


def _construct_mapping(loader, node, deep=False):
    seen = {}
    for key_node, _ in node.value:
        if key_node.tag == MERGE_TAG:
            continue  # merged keys may be overridden by explicit ones (YAML merge semantics)
        if not isinstance(key_node, yaml.ScalarNode):
            raise yaml.constructor.ConstructorError(None, None, "mapping keys must be plain scalars, not a "
                                                    f"{key_node.id}", key_node.start_mark)
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {seen[key] + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _file_error(source: str, message: str) -> RecipeError:
    return RecipeError(source, [Problem("(file)", message)])


def _check_shape(text: str, source: str) -> None:
    """Depth, alias count, recursive aliases and expanded size, from the event stream (no recursion)."""
    depth, aliases, open_anchors, sizes, stack = 0, 0, set(), {}, []
    total = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise _file_error(source, f"nested deeper than {MAX_DEPTH} levels (line {event.start_mark.line + 1})")
            stack.append((event.anchor, total))
            if event.anchor:
                open_anchors.add(event.anchor)
            total += 1
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
            anchor, start = stack.pop()
            if anchor:
                open_anchors.discard(anchor)
                sizes[anchor] = total - start
        elif isinstance(event, yaml.ScalarEvent):
            total += 1
            if event.anchor:
                sizes[event.anchor] = 1
        elif isinstance(event, yaml.AliasEvent):
            aliases += 1
            if event.anchor in open_anchors:
                raise _file_error(source, f"alias *{event.anchor} refers to its own enclosing node "
                                  f"(line {event.start_mark.line + 1}); recursive documents are refused")
            if aliases > MAX_ALIASES:
                raise _file_error(source, f"more than {MAX_ALIASES} aliases")
            total += sizes.get(event.anchor, 1)
        if total > MAX_NODES:
            raise _file_error(source, f"expands to more than {MAX_NODES} values (aliases included)")


def parse_yaml(text: str, source: str) -> object:
    """Parse recipe YAML safely: bounded depth, aliases and size; located syntax errors."""
    try:
        _check_shape(text, source)
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        raise _file_error(source, f"YAML error at {where}: {exc.problem or exc}") from None
    except yaml.YAMLError as exc:
        raise _file_error(source, f"YAML error: {str(exc)[:200]}") from None
    except RecursionError:
        raise _file_error(source, "nested too deeply") from None
    except Exception as exc:
        raise _file_error(source, f"YAML value error: {type(exc).__name__}: {str(exc)[:200]}") from None


def read_regular_file(path: Path, what: str, limit: int = MAX_RECIPE_BYTES) -> str:
    """Text of a regular file of bounded size; FIFOs, devices and folders are refused before reading."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise _file_error(str(path), f"{what} file not found") from None
    except OSError as exc:
        raise _file_error(str(path), f"cannot read {what}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise _file_error(str(path), f"{what} is not a regular file (a folder, FIFO or device); refused before reading")
    if st.st_size > limit:
        raise _file_error(str(path), f"{what} is {st.st_size} bytes; the limit is {limit}")
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _file_error(str(path), f"{what} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise _file_error(str(path), f"cannot read {what}: {exc.strerror or exc}") from None
