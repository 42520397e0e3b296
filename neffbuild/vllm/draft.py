"""The EAGLE3 draft model the plugin registers for vLLM's ``LlamaForCausalLMEagle3`` architecture: vLLM's
drafter calls it, the bundle's ``draft`` artifacts compute.

Without ``additional_config["neffbuild"]`` it is vLLM's own ``Eagle3LlamaForCausalLM``, untouched. With a bundle,
``--speculative-config``'s model is the bundle's ``draft/`` folder (its config; no weight of it is read: vLLM
runs with ``--load-format dummy``) and the class builds one vLLM ``Attention`` for the draft's layer, so vLLM's
KV cache manager allocates the draft's KV tensor, which the runtime's Stepper takes as the draft's buffer.

The seam (vLLM 0.32's ``SpecDecodeBaseProposer.propose``, unpadded drafter): per engine step vLLM calls

1. ``combine_hidden_states(aux)`` with the target's aux states of the rows each request verified (kept here: the
   draft graph fuses them itself);
2. ``forward`` once over those rows (token ids shifted by one, the bonus token last, vLLM's draft block tables
   in the forward context) and ``compute_logits`` at each request's last row; then
3. ``forward`` + ``compute_logits`` k - 1 more times, one row per request, feeding back what it sampled.

The bundle's draft graph does the catch-up over the verified rows *and* the k proposals in one call, so the
first ``forward`` runs it (a prompt's rows but the last through the bundle's eager draft catch-up first, as
neffbuild's engine does) and keeps the k proposals; every ``compute_logits`` then answers vLLM with logits that
put all mass on the proposal of that request and call (the hidden states this returns carry the request and
the call). vLLM still samples, verifies, accepts and schedules; the draft's KV is written by the graph alone.
"""

from __future__ import annotations

import itertools
import time

import torch
from torch import nn
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
from vllm.v1.attention.backend import AttentionType

from neffbuild import settings
from neffbuild.errors import IncompatibleBundle
from neffbuild.vllm import decode
from neffbuild.vllm.config import from_additional_config


class NeffbuildEagle3ForCausalLM(Eagle3LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        self.neffbuild: DraftRunner | None = None
        settings = from_additional_config(vllm_config.additional_config)
        if settings is None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            return
        nn.Module.__init__(self)  # no layer of vLLM's: the bundle's draft graph computes
        self.config = vllm_config.speculative_config.draft_model_config.hf_config
        target = decode.serving(settings.bundle)
        facts = target.bundle.facts
        if facts.draft_config is None:
            raise IncompatibleBundle(f"--speculative-config: bundle {settings.bundle} has no draft; remove the flag")
        dcfg, base = facts.draft_config, f"{prefix}.model" if prefix else "model"
        # vLLM's drafter needs these to leave the target's (absent) embedding and LM head alone
        self.has_own_embed_tokens = self.has_own_lm_head = True
        self.attn = Attention(dcfg.num_attention_heads, dcfg.head_dim, dcfg.head_dim ** -0.5,
                              num_kv_heads=dcfg.num_key_value_heads, cache_config=vllm_config.cache_config,
                              quant_config=None, attn_type=AttentionType.DECODER,
                              prefix=f"{base}.layers.{facts.config.num_hidden_layers}.self_attn.attn")
        self.neffbuild = DraftRunner(target, self.attn, facts.num_speculative_tokens)
        target.speculate(facts.num_speculative_tokens, self.attn)

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.neffbuild is None:
            return super().combine_hidden_states(hidden_states)
        self.neffbuild.first_pass(hidden_states)
        return hidden_states[..., : self.config.hidden_size]  # the width vLLM checks; the graph reads the kept aux

    def forward(self, input_ids, positions, hidden_states, inputs_embeds=None):
        if self.neffbuild is None:
            return super().forward(input_ids, positions, hidden_states, inputs_embeds)
        out = self.neffbuild.forward(input_ids, positions)
        return out, out

    def compute_logits(self, hidden_states):
        if self.neffbuild is None:
            return super().compute_logits(hidden_states)
        return self.neffbuild.logits(hidden_states)

    def load_weights(self, weights):
        if self.neffbuild is None:
            return super().load_weights(weights)
        return set()


class DraftRunner:
    """One draft graph call per engine step (the first forward), its proposals handed out call by call."""

    def __init__(self, target: decode.BundleDecoder, layer: Attention, k: int):
        self.target, self.layer, self.k = target, layer, k
        self.vocab = target.bundle.vocab_size
        self._aux: torch.Tensor | None = None  # the target's aux states of the first pass's rows
        self._proposals: torch.Tensor | None = None  # [R, k] target ids
        self._call = 0
        self.digest = settings.draft_kv_digest()  # the report's draft_prompt_kv: a test's check, off by default

    def first_pass(self, aux: torch.Tensor) -> None:
        self._aux, self._proposals, self._call = aux, None, 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states carrying (request, call) in columns 0 and 1 where vLLM samples (``logits``)."""
        T = positions.shape[0]
        hidden = torch.zeros(T, self.target.hidden_size, dtype=torch.float32)
        aux, self._aux = self._aux, None
        if aux is None:  # a later call of this step (or vLLM's dummy run: no proposals)
            self._call += 1
            hidden[:, 0] = torch.arange(T, dtype=torch.float32)
            hidden[:, 1] = self._call
            return hidden
        metadata = get_forward_context().attn_metadata
        md = metadata.get(self.layer.layer_name) if isinstance(metadata, dict) else None
        if md is None or input_ids is None:
            return hidden
        starts = md.query_start_loc.tolist()
        self._proposals = self._propose(md, input_ids, positions, aux, starts)
        for r, end in enumerate(starts[1:]):
            hidden[end - 1, 0] = r
        return hidden

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """All mass on the proposal of each row's (request, call): vLLM's greedy pick and its draft probability."""
        N = hidden_states.shape[0]
        if self._proposals is None:
            return torch.zeros(N, self.vocab, dtype=torch.float32)
        rows, call = hidden_states[:, 0].long(), hidden_states[:, 1].long().clamp(max=self.k - 1)
        tokens = self._proposals[rows, call]
        return torch.full((N, self.vocab), float("-inf")).scatter_(1, tokens[:, None], 0.0)

    def _propose(self, md, input_ids, positions, aux, starts: list[int]) -> torch.Tensor:
        """The draft graph over every request's verified rows -> [R, k] proposals (draft KV written in place)."""
        stepper, q = self.target._stepper(), 1 + self.k
        began = time.perf_counter()
        rows = []
        for r, (a, b) in enumerate(itertools.pairwise(starts)):
            first, block_row = int(positions[a]), md.block_table[r].long()
            if first == 0 and b - a > 1:  # a prompt: eager catch-up over all rows but the last, as the engine does
                self.target.bundle.draft_prefill(input_ids[a:b - 1], aux[a:b - 1].float(), stepper.draft_cache,
                                                 block_row)
                first, a = first + b - 1 - a, b - 1
            while b - a > q:  # a later chunk of a prompt: the graph's catch-up, q rows at a time
                self._run(stepper, md, [r], [(input_ids[a:a + q].tolist(), aux[a:a + q].float(), first)])
                first, a = first + q, a + q
            rows.append((input_ids[a:b].tolist(), aux[a:b].float(), first))
        out = self._run(stepper, md, list(range(len(rows))), rows)
        for r, (a, b) in enumerate(itertools.pairwise(starts) if self.digest else ()):  # the DI check's digests
            first = int(positions[a])
            span = b - a if first == 0 else first if self.target.arrived.get(r) == first else 0
            if span:
                self._digest(stepper.draft_cache, md.block_table[r].long(), span)
        # what vLLM will schedule as drafts: by the next step's position and token (decode.py's placeholder check)
        self.target.handed = {(first + len(tokens), tokens[-1]): tuple(p)
                              for (tokens, _, first), p in zip(rows, out[:len(rows)].tolist(), strict=True)}
        self.target.metrics.seconds("draft", time.perf_counter() - began)
        return out

    def _digest(self, cache: torch.Tensor, block_row: torch.Tensor, span: int) -> None:
        """The report's digest of the draft's KV at positions [0, span): after a prompt's draft call (a prefill
        instance: what it wrote) and after a transferred request's first draft call, which writes from position
        span on (a DI decode instance: what arrived); equal when the draft's prompt KV moved intact
        (tests/test_vllm_spec.py). Only with NEFFBUILD_VLLM_DRAFT_KV_DIGEST=1: a read of the prompt's draft KV
        per request, which serving has no use for."""
        pos = torch.arange(span)
        kv = cache[:, block_row[pos // self.target.block_size], :, pos % self.target.block_size, :].double()
        self.target.metrics.draft_prompt_kv[span] = (float(kv.sum()), float(kv.abs().sum()))

    def _run(self, stepper, md, index: list[int], rows: list[tuple]) -> torch.Tensor:
        computed = [first + len(tokens) for tokens, _, first in rows]  # each request's tokens after acceptance
        last = torch.tensor([c + self.k - 1 for c in computed], dtype=torch.long)  # the draft's last KV write
        table = decode.trimmed_table(md.block_table, torch.tensor(index, dtype=torch.long), last,
                                     self.target.block_size)
        plan, proposals = stepper.draft(rows, table, max_computed=max(computed))
        self.target.metrics.artifact(plan.label, None, plan.family, rows=len(rows))
        return proposals
