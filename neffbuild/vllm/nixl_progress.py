"""NIXL's progress thread, made to sleep between UCX events instead of spinning.

NIXL's Python agent (``nixl._api.nixl_agent``, what vLLM's NIXL connector makes) starts its C++ agent with a
progress thread whose delay is fixed at 0 (``pthrDelay``): the thread polls UCX without a pause and takes a whole
core per agent, idle or not. On a host with few cores the prefill and decode instances' two threads take the
cores their engines need (docs/vllm.md, "Transports"). The thread's delay is how long it sleeps waiting for a UCX
event before it polls anyway: with a delay it wakes at once on an event (a read, a notification, a wire-up
message) and otherwise every ``delay`` microseconds. The Python API has no setting for it, so ``delayed_progress``
hands the agent's constructor a config with the delay set, for the agents made inside the ``with`` block.

Standard library and nixl only: benchmarks/vllm_di_nixl.py uses it without vLLM.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager

# microseconds: the idle thread then takes ~2 % of a core instead of all of it (measured on the 2-core host,
# docs/benchmarks.md), and UCX events still wake it at once
PROGRESS_DELAY_US = 1000


@contextmanager
def delayed_progress(delay_us: int = PROGRESS_DELAY_US) -> Iterator[None]:
    """Agents made by ``nixl._api.nixl_agent`` inside the block get a progress thread delay of ``delay_us``.

    A nixl whose module or config lacks what this reaches for (another release) gets its own agent, spinning
    thread and all, with a warning: the transfer matters more than the core, so this never stops start-up."""
    import logging

    import nixl._api as api

    bindings = getattr(api, "nixlBind", None)
    if bindings is None or not delay_us:
        if delay_us:
            logging.getLogger(__name__).warning("neffbuild: nixl._api has no nixlBind; NIXL's progress thread "
                                                "keeps its own delay (0: it spins on a core)")
        yield
        return

    class Bindings(types.ModuleType):
        """nixl's bindings, but the agent is made with the delay (everything else is the bindings' own)."""

        def __getattr__(self, name):
            return getattr(bindings, name)

        @staticmethod
        def nixlAgent(name, config):  # the bindings' name
            try:
                config.pthrDelay = delay_us
            except (AttributeError, TypeError):
                logging.getLogger(__name__).warning("neffbuild: this nixl's agent config has no pthrDelay; NIXL's "
                                                    "progress thread keeps its own delay")
            return bindings.nixlAgent(name, config)

    api.nixlBind = Bindings(bindings.__name__)
    try:
        yield
    finally:
        api.nixlBind = bindings
