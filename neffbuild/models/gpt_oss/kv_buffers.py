"""Which KV buffer each GPT-OSS layer writes: paired layers 2j (sliding) and 2j+1 (full) share buffer j.

The GK decode graph lays the KV out this way (as vLLM's hybrid KV manager does); the DI code
registers regions per layer through this part (registry ``kv_buffer_of_layer``), so the
runtime itself assumes no pairing.
"""

from __future__ import annotations


def kv_buffer_of_layer(layer: int) -> int:
    return layer // 2
