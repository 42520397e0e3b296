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
    """The plugin's settings, or None when vLLM was not given a bundle (the plugin then stays out of the way).

    Present but unusable is an error, never "absent": ``{"neffbuild": null}`` and a top-level key one typo away
    from ``neffbuild`` would otherwise let vLLM serve natively while the operator believes the bundle serves."""
    additional = additional or {}
    for other in additional:
        hint = did_you_mean(other, (KEY,)) if other != KEY else ""
        if hint:
            raise InvalidInput(f"--additional-config {other}: not a key the neffbuild plugin reads{hint} "
                               f"(as written, no bundle would serve)")
    if KEY not in additional:
        return None
    section = additional[KEY]
    where = f"--additional-config {KEY}"
    if not isinstance(section, dict):
        raise InvalidInput(f"{where}: must be an object like {{\"bundle\": \"artifacts/NAME-VERSION\"}}, "
                           f"got {'null' if section is None else repr(section)} (remove the key to serve natively)")
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


def for_architecture(additional: dict | None, architecture: str | None, served: str) -> PluginConfig | None:
    """The settings when vLLM serves ``architecture``; a section on a model the plugin does not serve is an error
    (vLLM would serve that model natively while the operator believes the bundle serves)."""
    settings = from_additional_config(additional)
    if settings is not None and architecture != served:
        raise InvalidInput(f"--additional-config {KEY}: the plugin serves {served} checkpoints only; vLLM is "
                           f"serving {architecture} (serve the checkpoint bundle {settings.bundle} was compiled "
                           f"from, or remove the {KEY} key)")
    return settings
