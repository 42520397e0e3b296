"""The serving engine above the models and the runtime (``cli -> serve -> {models, runtime}``).

One engine (engine.py) composed of parts (parts.py: KV source, proposer; world.py: the ranks);
``result.generate`` is what ``neffbuild generate`` calls. Models and runtime never import it.
"""
