"""Run in the vLLM venv: the plugin's attention (neffbuild/vllm/attention.py) against vLLM's CPU kernel.

The same K/V history and queries (a prefill of 70 tokens, a decode row at 101, a 20-token chunk at 150) go
through vLLM's ``cpu_attn_reshape_and_cache`` + ``cpu_attention_with_kv_cache`` on vLLM's layout and through
the plugin's ``do_kv_cache_update`` + ``forward`` on the bundle's view; full attention and a 64-token window,
with sinks. ``check()`` returns (and run alone, this script prints as one JSON line) the largest output
difference per window, whether the plugin's K sits plain at ``[0, block, :, offset]`` of the bundle's view, and
whether vLLM's own kernel keeps K transposed. generate.py runs it after the native generation
(``--attention-check``): one vLLM process, not two.
"""

import json
import types

import torch


def check() -> dict:
    import vllm._custom_ops as ops

    from neffbuild.vllm.attention import BundleLayoutAttention, bundle_view

    torch.manual_seed(0)
    nb, kv, bs, d, H = 40, 2, 32, 64, 4
    lens = [(70, 70), (101, 1), (150, 20)]  # (seq_len, query_len) per request
    seq_lens = torch.tensor([L for L, _ in lens], dtype=torch.int32)
    qsl = torch.tensor([0, 70, 71, 91], dtype=torch.int32)
    table = torch.tensor([[1, 2, 3, 0, 0], [5, 9, 7, 11, 0], [12, 13, 14, 15, 16]], dtype=torch.int32)
    keys = torch.randn(sum(L for L, _ in lens), kv, d)
    values = torch.randn_like(keys)
    slots = torch.tensor([int(table[r, p // bs]) * bs + p % bs for r, (L, _) in enumerate(lens) for p in range(L)])
    q, sinks = torch.randn(91, H, d), torch.randn(H)
    out = {"diff": {}}
    for window in (-1, 64):
        theirs = torch.zeros(nb, kv, bs, 2 * d)
        kc, vc = theirs.view(nb, kv, 2 * bs, d).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys, values, kc, vc, slots, "vec")
        meta = ops.cpu_attn_get_scheduler_metadata(3, H, kv, d, seq_lens, torch.float32, qsl, True, window, "vec",
                                                   False)
        ref = torch.zeros(91, H, d)
        ops.cpu_attention_with_kv_cache(q, kc, vc, ref, qsl, seq_lens, 0.125, True, None, window, table, 0.0, meta,
                                        sinks)
        ours = torch.zeros(nb, kv, bs, 2 * d)
        impl = types.SimpleNamespace(num_heads=H, head_size=d, sliding_window=window, scale=0.125, sinks=sinks,
                                     neffbuild_packed=False, neffbuild_skip=None)
        impl._attend = lambda *a, impl=impl: BundleLayoutAttention._attend(impl, *a)
        BundleLayoutAttention.do_kv_cache_update(impl, None, keys, values, ours, slots)
        got = torch.zeros(91, H, d)
        BundleLayoutAttention.forward(impl, None, q, None, None, ours,
                                      types.SimpleNamespace(query_start_loc=qsl, seq_lens=seq_lens, block_table=table),
                                      got)
        out["diff"][str(window)] = (got - ref).abs().max().item()
        buffer = bundle_view(ours)
        out["plain_k"] = bool(torch.equal(buffer[0, 1, :, 5], keys[5]) and torch.equal(buffer[1, 1, :, 5], values[5]))
        out["vllm_k_transposed"] = bool(torch.equal(kc[1, 0].reshape(d, bs)[:, 5], keys[5, 0]))
    return out


if __name__ == "__main__":
    print(json.dumps(check()), flush=True)
