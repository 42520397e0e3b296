"""Stand-in for ``torch_neuronx`` (tests only): the documented inference contract, on CPU.

What it keeps from the documentation (torch-neuronx "Tracing API for Inference" and
"Weight Replacement API"):

- ``trace`` returns a TorchScript module that ``torch.jit.save`` / ``torch.jit.load`` round-trip.
- ``inline_weights_to_neff=True`` (the SDK default) freezes the weights into the compiled
  graph as they were at trace time; ``replace_weights`` then has nothing to replace and warns.
- ``inline_weights_to_neff=False`` keeps the weights apart; ``replace_weights(model, weights)``
  swaps them (a state dict of the traced function, or a module).
- A traced model consumes host tensors and runs on a device: it works on device copies of
  its inputs, so an input is never changed in the caller's tensor unless it is declared
  state through ``input_output_aliases`` ({input tensor: output index}); then the output it
  aliases is written back into that tensor, in place, after every call.

It compiles nothing: the "NEFF" is TorchScript that runs on the CPU, so it cannot show
anything about the device's numerics, memory or speed.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from torch_neuronx import utils  # noqa: F401  - the SDK exposes torch_neuronx.utils

__version__ = "0.0.0+standin"

FUNC = "func"  # attribute holding the traced function inside the returned module


class _OnDevice(nn.Module):
    """Runs ``func`` the way a device would: on copies of the inputs; declared state written back."""

    def __init__(self, func: nn.Module, aliases: list[tuple[int, int]]):
        super().__init__()
        self.func = func
        self.aliases = aliases  # (input position, output index)

    def forward(self, *inputs):
        device = [t.clone() for t in inputs]  # host -> device copies
        out = self.func(*device)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        for i, o in self.aliases:
            _check_alias(inputs, outs, i, o)  # at trace time (shapes are concrete then)
            inputs[i].copy_(outs[o])  # state lives on the device: the alias updates it in place
        return tuple(outs) if isinstance(out, (tuple, list)) else out


def _alias_positions(example_inputs: tuple, aliases: dict) -> list[tuple[int, int]]:
    out = []
    for tensor, index in aliases.items():
        pos = [i for i, t in enumerate(example_inputs) if t is tensor]
        if not pos:
            raise ValueError("input_output_aliases: a key is not one of example_inputs (the stand-in aliases inputs)")
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"input_output_aliases: output index {index!r} must be a non-negative int")
        out.append((pos[0], index))
    return out


def _check_alias(inputs, outs, i: int, o: int) -> None:
    if o >= len(outs):
        raise ValueError(f"input_output_aliases: output {o} does not exist ({len(outs)} outputs)")
    a, b = inputs[i], outs[o]
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"input_output_aliases: input {i} {tuple(a.shape)} {a.dtype} cannot alias output {o} "
                         f"{tuple(b.shape)} {b.dtype}")


def trace(func, example_inputs, *_, input_output_aliases=None, compiler_workdir=None, compiler_args=None,
          partitioner_config=None, inline_weights_to_neff=True, cpu_backend=False):
    """Trace ``func`` over ``example_inputs`` (a tensor or a flat tuple of tensors)."""
    import neuronxcc

    if _:
        raise TypeError("trace: pass keyword arguments as keywords")
    neuronxcc.check_args(compiler_args)
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    if not all(isinstance(t, torch.Tensor) for t in inputs):
        raise TypeError("trace: the stand-in takes a tensor or a flat tuple of tensors")
    aliases = _alias_positions(inputs, dict(input_output_aliases or {}))
    if not isinstance(func, nn.Module):
        raise TypeError("trace: the stand-in traces modules")
    if inline_weights_to_neff:
        func = _with_trace_time_copies(func)
    with torch.no_grad():
        traced = torch.jit.trace(_OnDevice(func, aliases).eval(), tuple(t.clone() for t in inputs),
                                 check_trace=False, strict=False)
    if inline_weights_to_neff:
        traced = torch.jit.freeze(traced)  # weights become constants of the graph
    return traced


def _with_trace_time_copies(func: nn.Module) -> nn.Module:
    """Copies of the weights as they are now: later changes to ``func`` do not reach the NEFF."""
    import copy

    return copy.deepcopy(func)


def _separated(neuron_model) -> dict[str, torch.Tensor]:
    prefix = FUNC + "."
    return {k[len(prefix):]: v for k, v in neuron_model.state_dict().items() if k.startswith(prefix)}


def replace_weights(neuron_model, weights) -> None:
    """Bind new weights to a model traced with ``inline_weights_to_neff=False`` (in place)."""
    state = weights.state_dict() if isinstance(weights, nn.Module) else dict(weights)
    own = _separated(neuron_model)
    if not own:
        warnings.warn("replace_weights: this Neuron model does not contain any separated weights", stacklevel=2)
        return
    for name, tensor in state.items():
        if name not in own:
            continue
        if tuple(tensor.shape) != tuple(own[name].shape) or tensor.dtype != own[name].dtype:
            raise ValueError(f"replace_weights: {name} is {tuple(tensor.shape)} {tensor.dtype}, the model has "
                             f"{tuple(own[name].shape)} {own[name].dtype}")
        *path, leaf = (FUNC + "." + name).split(".")
        module = neuron_model
        for part in path:
            module = getattr(module, part)
        setattr(module, leaf, tensor)


def move_trace_to_device(trace, device_id: int) -> None:
    """Place a weight-separated model's weights on NeuronCore ``device_id`` (nothing to move on CPU)."""
    if not isinstance(device_id, int) or device_id < 0:
        raise ValueError(f"move_trace_to_device: device_id must be a non-negative int, got {device_id!r}")
