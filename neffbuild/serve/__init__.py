"""Generation loops above the models and the runtime (greedy today; EAGLE3 and DI next).

``cli -> serve -> {models, runtime}``: a loop composes a model's prefill, the optional
block manager and the runtime's step API; models and runtime never import it.
"""
