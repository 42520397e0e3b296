"""The plugin's settings: vLLM's ``additional_config["neffbuild"]``, checked like a recipe section.

    {"neffbuild": {"bundle": "artifacts/NAME-VERSION",      required: the bundle folder
                   "trusted_keys": ["keys/release.pub"],      optional: the bundle's signature must verify
                   "verify": "sizes"}}                        optional: open_bundle's file check (sizes | full)

Read in vLLM's worker (vLLM passes ``additional_config`` to every process); no environment variable is read here.
"""

from __future__ import annotations

from dataclasses import dataclass

from neffbuild.errors import InvalidInput, did_you_mean

KEY = "neffbuild"
FIELDS = ("bundle", "trusted_keys", "verify")


@dataclass(frozen=True)
class PluginConfig:
    bundle: str
    trusted_keys: tuple[str, ...] | None = None
    verify: str = "sizes"


def from_additional_config(additional: dict | None) -> PluginConfig | None:
    """The plugin's settings, or None when vLLM was not given a bundle (the plugin then stays out of the way)."""
    section = (additional or {}).get(KEY)
    if section is None:
        return None
    where = f"--additional-config {KEY}"
    if not isinstance(section, dict):
        raise InvalidInput(f"{where}: must be an object like {{\"bundle\": \"artifacts/NAME-VERSION\"}}, "
                           f"got {section!r}")
    unknown = sorted(set(section) - set(FIELDS))
    if unknown:
        raise InvalidInput(f"{where}.{unknown[0]}: unknown key{did_you_mean(unknown[0], FIELDS)} "
                           f"(known: {', '.join(FIELDS)})")
    bundle = section.get("bundle")
    if not isinstance(bundle, str) or not bundle:
        raise InvalidInput(f"{where}.bundle: required, the bundle folder (got {bundle!r})")
    keys = section.get("trusted_keys")
    if keys is not None and (not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k for k in keys)):
        raise InvalidInput(f"{where}.trusted_keys: a non-empty list of PEM public key paths (got {keys!r}); leave "
                           "it out to use NEFFBUILD_TRUSTED_KEYS")
    verify = section.get("verify", "sizes")
    if verify not in ("sizes", "full"):
        raise InvalidInput(f"{where}.verify: 'sizes' or 'full' (got {verify!r})")
    return PluginConfig(bundle, tuple(keys) if keys is not None else None, verify)
