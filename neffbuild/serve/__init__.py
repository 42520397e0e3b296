"""Generation loops above the models and the runtime: greedy, EAGLE3 speculative (spec.py), DI.

``cli -> serve -> {models, runtime}``: a loop composes a model's prefill, the optional
block manager and the runtime's step API; models and runtime never import it.
"""
