"""The neuron backend's recipe-time rule: what layouts it can build (torch-free, so the recipe
validator reaches it through the registry's ``layout_rule`` part without importing the SDK or torch)."""

from __future__ import annotations

# Physical NeuronCores of the largest instance per target (trn1.32xlarge, trn2.48xlarge): a TP
# group's in-graph collectives stay inside one instance, so tp x lnc must fit in it.
NEURON_CORES_PER_INSTANCE = {"trn1": 32, "trn2": 128}


def neuron_instance_limit(err, tp: int, compiler: dict, lnc: int) -> None:
    """A TP group must fit the NeuronCores of one instance."""
    cores = NEURON_CORES_PER_INSTANCE.get(compiler.get("target"))
    if cores and tp * lnc > cores:
        err("parallel.tp", tp, f"tp x neuron_config.lnc ({tp * lnc}) must fit the {cores} NeuronCores of one "
                               f"{compiler.get('target')} instance (the neuron backend cannot build a TP group across "
                               "instances)")
