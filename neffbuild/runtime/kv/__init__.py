"""The KV room: the KV buffers, the blocks that address them and the block tables an engine hands over.

It owns the KV layout and its byte counts (``layout.py``, torch-free), allocation and the
packed-FP8 K view (``cache.py``), the KV groups, the one blocks-needed formula and the
optional ``BlockManager`` (``blocks.py``, pure Python), and block-table rows kept in one buffer
and checked when written (``tables.py``). It leaves out which artifact runs (``runtime.step``)
and moving KV between processes (``runtime.di``).
"""
