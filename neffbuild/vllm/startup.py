"""The start-up check: does the configured bundle fit vLLM's configuration? (the rules: neffbuild/vllm/checks.py)

It runs twice, and either run stops vLLM's start-up with one ``IncompatibleBundle`` naming each flag and both
values:

1. **when vLLM builds its configuration**, in the process that parses the flags (``vllm serve``'s API server,
   ``vllm.LLM``'s caller), before any engine process is spawned or any weight is read: vLLM calls its
   per-architecture hook (``MODELS_CONFIG_MAP[architecture].verify_and_update_config``) at the end of
   ``VllmConfig``'s set-up, and ``install`` (from the plugin's ``register``) puts this check behind vLLM's own
   GPT-OSS hook there. A bundle that does not fit costs vLLM's import and its config, nothing more.
   ``--block-size`` is not final yet when the flag was not given (vLLM's platform picks its default after the
   hook): that one line waits for the second run.
2. **before the model is built**, in the worker (neffbuild/vllm/model.py), on vLLM's final configuration:
   the authoritative check, every rule.

Each run judges the facts (``Bundle.read_facts``) and then opens the bundle (``open_bundle``), both behind the
signature when keys are trusted; the open re-uses the facts' verification while no file of the bundle changed
(``model_sig.file_state``), so each process hashes the bundle once, and a bundle changed in between is refused.
The worker's run is a fresh process: it hashes again, the authoritative verification.

Light on purpose: ``register`` runs in every vLLM process; this module imports no vLLM model code and opens the
bundle only when ``additional_config`` names one.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from neffbuild.errors import IncompatibleBundle, NeffbuildError
from neffbuild.vllm import checks
from neffbuild.vllm.config import from_additional_config


def check(vllm_config, *, final: bool = True):
    """The opened bundle when it fits vLLM's configuration (None without a ``neffbuild`` section), else raise.

    ``final=False``: the check on the configuration vLLM is still building (fields it resolves later skipped).
    A bundle of more than one rank is judged by its facts first (``Bundle.read_facts``: the one judge, nothing
    loaded), since vLLM's ranks and groups do not exist while it builds its configuration (None is returned
    there); in the worker it then opens on the worker's groups (neffbuild/vllm/ranks.py)."""
    settings = from_additional_config(vllm_config.additional_config)
    if settings is None:
        return None
    from neffbuild.runtime import Bundle

    bundle, facts = None, Bundle.read_facts(settings.bundle, strict=False,
                                                    trusted_keys=settings.trusted_keys)
    if facts is None or facts.parallel.world_size == 1:  # None: open_bundle names what is wrong
        bundle = open_configured(settings)
        facts = bundle.facts
    if facts.arch != SERVED_ARCH:
        raise IncompatibleBundle(f"neffbuild: bundle {settings.bundle} is of architecture "
                                 f"{facts.arch!r}; vLLM is serving "
                                 f"{vllm_config.model_config.architecture}")
    engine = engine_view(vllm_config)
    later = ("block_size",) if not final and engine.block_size is None else ()
    found = checks.problems(compiled_view(facts), engine, unresolved=later)
    if found:
        raise IncompatibleBundle(f"neffbuild: bundle {settings.bundle} does not fit this vLLM configuration "
                                 "(nothing will serve):\n  " + "\n  ".join(found))
    if bundle is None and final:
        from neffbuild.vllm.ranks import host_groups

        bundle = open_configured(settings, host_groups(facts, f"bundle {settings.bundle}"))
    return bundle


SERVED_ARCH = "gpt_oss"  # the registry name of the architecture the plugin's model class subclasses (model.py)


def open_configured(settings, host_groups=None):
    """The bundle ``settings`` name, opened by the runtime's one judge (``open_bundle``: the same refusals, in
    the same words, as ``neffbuild generate``), with the plugin's trust and verify settings; a sharded bundle on
    this worker's ``host_groups``. No vLLM needed."""
    from neffbuild.runtime import open_bundle

    return open_bundle(settings.bundle, verify=settings.verify, trusted_keys=settings.trusted_keys,
                       host_groups=host_groups)


def engine_view(vllm_config) -> checks.Engine:
    mc, cc, sc, pc = (vllm_config.model_config, vllm_config.cache_config, vllm_config.scheduler_config,
                      vllm_config.parallel_config)
    spec = vllm_config.speculative_config
    return checks.Engine(
        model_config=mc.hf_config.to_dict(), dtype=str(mc.dtype).removeprefix("torch."),
        max_model_len=mc.max_model_len, block_size=cc.block_size, num_gpu_blocks_override=cc.num_gpu_blocks_override,
        max_num_seqs=sc.max_num_seqs, kv_cache_dtype=str(cc.cache_dtype),
        tensor_parallel_size=pc.tensor_parallel_size, pipeline_parallel_size=pc.pipeline_parallel_size,
        data_parallel_size=pc.data_parallel_size, expert_parallel=bool(pc.enable_expert_parallel),
        kv_heads_per_rank=mc.get_num_kv_heads(pc), **_speculation(spec))


def _speculation(spec) -> dict:
    """vLLM's speculative settings as ``checks.Engine`` fields (none without ``--speculative-config``)."""
    if spec is None:
        return {}
    draft = getattr(getattr(spec, "draft_model_config", None), "hf_config", None)
    dims = {key: getattr(draft, key) for key in checks.DRAFT_KEYS if getattr(draft, key, None) is not None}
    return {"num_speculative_tokens": spec.num_speculative_tokens or 0, "speculative_method": spec.method,
            "draft_config": dims, "aux_layers": tuple(draft_aux_layers(draft) or ()),
            "unpadded_drafts": bool(getattr(spec, "disable_padded_drafter_batch", False))}


def draft_aux_layers(draft_hf_config) -> list[int] | None:
    """The target states vLLM's EAGLE3 drafter reads, as its model runner finds them in the draft's config."""
    ids = getattr(draft_hf_config, "eagle_aux_hidden_state_layer_ids", None)
    eagle = getattr(draft_hf_config, "eagle_config", None)
    if not ids and isinstance(eagle, dict):
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if ids else None


def compiled_view(facts) -> checks.Compiled:
    kv, grid = facts.graph_inputs.kv_layout, facts.graph_inputs.grid
    dtype, kv_cache_dtype = facts.engine_dtypes()
    return checks.Compiled(
        model_config=facts.config.to_hf_dict(), max_model_len=grid.max_model_len, block_size=kv.block_size,
        num_blocks=kv.num_blocks, num_seqs_buckets=tuple(grid.num_seqs_buckets), dtype=dtype,
        kv_cache_dtype=kv_cache_dtype, tp=facts.parallel.tp, dp=facts.parallel.dp, ep=facts.parallel.ep,
        kv_heads_per_rank=len(facts.kv_heads),
        num_speculative_tokens=facts.num_speculative_tokens, speculative_method=facts.speculative_method,
        draft_config=facts.draft_config.to_hf_dict() if facts.draft_config is not None else {},
        aux_layers=vllm_aux_layers(facts))


def vllm_aux_layers(facts) -> tuple[int, ...]:
    """The bundle's aux layers as vLLM's drafter names them: one numbering on both sides (id i: the residual stream
    entering target layer i, 0 the embeddings; EAGLE3 checkpoints' ``eagle_aux_hidden_state_layer_ids``)."""
    return tuple(facts.aux_layers)


def install(architecture: str) -> None:
    """Chain ``check(final=False)`` behind vLLM's config hook for ``architecture`` (GPT-OSS's; idempotent:
    register runs repeatedly)."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig

    base = MODELS_CONFIG_MAP.get(architecture, VerifyAndUpdateConfig)
    if getattr(base, "neffbuild_check", False):
        return

    class BundleFitsConfig(base):
        neffbuild_check = True

        @staticmethod
        def verify_and_update_config(vllm_config) -> None:
            base.verify_and_update_config(vllm_config)  # vLLM's own GPT-OSS settings first
            with one_line_refusals():
                check(vllm_config, final=False)

    MODELS_CONFIG_MAP[architecture] = BundleFitsConfig


@contextmanager
def one_line_refusals() -> Iterator[None]:
    """A refusal while vLLM builds its configuration, as the operator of ``vllm serve`` should see it.

    vLLM's CLI catches nothing around ``create_engine_config``: a raised error reaches the terminal as the last
    line of a 50-line traceback through vLLM's start-up. Under vLLM's own entry points the refusal is therefore
    printed alone on stderr and the process exits with the error's status (2 for invalid input), like
    ``neffbuild``'s CLI. A program that builds ``vllm.LLM`` itself gets the exception, so it can catch it."""
    try:
        yield
    except NeffbuildError as err:
        if not _under_vllm_cli():
            raise
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(err.exit_code) from None


def _under_vllm_cli() -> bool:
    """Is this process one of vLLM's command-line entry points (``vllm serve``, ``python -m vllm.entrypoints...``)?"""
    main = sys.modules.get("__main__")
    names = (getattr(getattr(main, "__spec__", None), "name", None) or "",
             getattr(getattr(main, "main", None), "__module__", None) or "")
    return any(name.startswith("vllm.entrypoints") for name in names)
