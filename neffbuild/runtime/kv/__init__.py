"""The KV room: the KV buffers, the blocks that address them and the block tables an engine hands over.

It owns the KV layout and its byte counts (``layout.py``, torch-free), allocation and the
packed-FP8 K view (``cache.py``), reading and writing the bundle's layout (``access.py``: the
one implementation of KV writes, block reads and packed-FP8 decode, traceable, which the
compiled graphs, the eager prefill and a host engine's attention, the vLLM plugin's, all call),
the KV groups, the one blocks-needed formula and the optional ``BlockManager`` (``blocks.py``,
pure Python), and block-table rows kept in one buffer and checked when written (``tables.py``).
It leaves out which artifact runs (``runtime.step``) and moving KV between processes
(``runtime.di``).
"""
