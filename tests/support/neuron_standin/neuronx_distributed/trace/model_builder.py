"""Stand-in for ``neuronx_distributed.trace.model_builder`` (see the package docstring): test apparatus only.

Importing the real module registers the ``neuron.SPMDModel`` TorchScript class, so that ``torch.jit.load`` of a
ModelBuilder graph works. This one makes ``torch.jit.load`` return what such a graph is on the device, around the
CPU-traced contract module it is given:

- an ``nxd_model`` whose ``initialize_with_saved_weights(start_rank)`` must run before the first call;
- a call that returns the logits alone (NxD drops aliased outputs; the KV stays in ``nxd_model.state``).

Every ``torch.jit.load`` and ``initialize_with_saved_weights`` call is appended as one JSON line to the file named
by ``NXD_STANDIN_RECORD``, for the test to read.
"""

import json
import os

import torch

_jit_load = torch.jit.load


def _record(event: dict) -> None:
    with open(os.environ["NXD_STANDIN_RECORD"], "a", encoding="utf-8") as handle:
        handle.write(json.dumps(event) + "\n")


class NxdModel:
    def __init__(self) -> None:
        self.initialized = False

    def initialize_with_saved_weights(self, start_rank: torch.Tensor) -> None:
        _record({"call": "initialize_with_saved_weights", "start_rank": start_rank.tolist(),
                 "dtype": str(start_rank.dtype)})
        self.initialized = True


class SPMDModel:
    def __init__(self, module: torch.jit.ScriptModule) -> None:
        self.module = module
        self.nxd_model = NxdModel()

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        if not self.nxd_model.initialized:
            raise RuntimeError("the weights were never pushed to the device (initialize_with_saved_weights)")
        return self.module(*inputs)[0]  # the logits alone, as on the device


def load(f, *args, **kwargs) -> SPMDModel:
    _record({"call": "torch.jit.load", "positional": 1 + len(args), "keywords": sorted(kwargs)})
    return SPMDModel(_jit_load(f, *args, **kwargs))


torch.jit.load = load


class ModelBuilder:  # the name the server and recipe import; nothing here builds anything
    pass
