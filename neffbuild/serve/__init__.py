"""The serving engine above the models and the runtime (``cli -> serve -> {models, recipe, runtime}``).

``rank.open_rank`` opens a bundle for one serving rank (the engine, the DI prefill ranks, the
``--check`` reference and the vLLM plugin to come all use it); one engine (engine.py: decide with
scheduler.py, run, update with sampling.py) composed of parts (parts.py: KV source, proposer;
world.py: the ranks); ``result.generate`` is the one entry point, what ``neffbuild generate``
calls. Models and runtime never import it.
"""
