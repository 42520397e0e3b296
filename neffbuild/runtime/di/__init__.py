"""The DI room: disaggregated inference, prefill in one group of processes and KV moved to decode over NIXL.

It owns the KV regions and the head mapping between a prefill TP and a decode TP
(``regions.py``), the NIXL agent without a spinning progress thread (``nixl_agent.py``, nixl
imported lazily), the side channel (``side_channel.py``: length-prefixed JSON over TCP), the
producer and ingest roles (``ingest.py``) and the sliding-window N-1 rule (``prompt.py``). It
leaves out running the prefill and the engine that pulls (``serve/prefill_worker.py``, ``serve/di.py``).
"""
