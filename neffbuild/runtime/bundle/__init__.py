"""The bundle room: what a bundle is on disk and how the runtime trusts it.

It owns opening a bundle (``reader.open_bundle``: format and version, the manifest digest, its
schema, ``schema.py``, and the fields the schema left to the reader, ``gate.py``, paths, sizes
and sha256, the weights' safetensors header, the toolchain), the manifest's typed parts
(``graph_inputs.GraphInputs``; the parallel section is ``runtime.parallel.ParallelSection``),
every bundle path as a constant (``paths.py``), the ``model.sig`` signature check
(``model_sig.py``: the cryptographic signature, not an artifact's input signature), memory-mapped
weights (``weights_file.py``) and loading artifacts through each backend's one loader
(``loaders.py``, ``aoti_package.py``, ``cpu_features.py``). ``reader.check`` is the one place that
decides whether a bundle is valid. It leaves out running steps (``runtime.step``) and KV memory.
"""
