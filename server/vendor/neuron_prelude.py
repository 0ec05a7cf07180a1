"""What must happen before anything Neuron is imported or loaded; shared by the server and the compile recipe.

Two steps, as the published build's proven compile and deploy scripts do them:

1. NxD's ``neuronx_distributed.pipeline.trace`` runs ``from transformers.utils.fx import HFTracer`` whenever
   transformers is installed, and transformers 5 (which Gemma-4 needs) removed ``transformers.utils.fx``. So
   when that module is missing, a stand-in with the two names NxD's import touches (``HFTracer``,
   ``symbolic_trace``) is registered. NxD uses them only for pipeline-parallel FX tracing, which neither the
   server nor the recipe does; both raise if anything ever calls them.
2. ``neuronx_distributed.trace.model_builder`` is imported: it registers the ``neuron.SPMDModel`` TorchScript
   class, without which ``torch.jit.load`` of a ModelBuilder graph fails.

This file is standalone (standard library only, torch imported lazily) and has no import-time side effects:
the server imports it as ``server.vendor.neuron_prelude``; the recipe, a plain script with no dependency on
``server``, loads it by path from its own directory.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

FX_MODULE = "transformers.utils.fx"
MODEL_BUILDER = "neuronx_distributed.trace.model_builder"


def install_fx_standin() -> bool:
    """Register a stand-in ``transformers.utils.fx`` when transformers is installed without it; True if it did."""
    if FX_MODULE in sys.modules:
        return False
    try:
        importlib.import_module(FX_MODULE)
        return False  # transformers 4.x: the real module is there
    except ModuleNotFoundError as exc:
        if exc.name != FX_MODULE:
            return False  # no transformers at all: NxD skips its import as well
    import torch.fx

    unavailable = f"{FX_MODULE} does not exist in transformers 5; this is the stand-in NxD imports, not a tracer"

    class HFTracer(torch.fx.Tracer):  # NxD subclasses it (with an ABC) at import time: it must be a real class
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError(unavailable)

    def symbolic_trace(*args: object, **kwargs: object) -> None:
        raise RuntimeError(unavailable)

    module = types.ModuleType(FX_MODULE, "Stand-in for transformers.utils.fx (see neuron_prelude.py).")
    module.HFTracer = HFTracer
    module.symbolic_trace = symbolic_trace
    sys.modules[FX_MODULE] = module
    sys.modules["transformers.utils"].fx = module
    return True


def prepare_neuron_imports() -> str | None:
    """Make NxD importable next to transformers 5 and register ``neuron.SPMDModel``; None when NxD is not installed.

    When NxD is installed its import errors propagate: on a Neuron host a graph cannot load without it, and the
    real cause is more useful than TorchScript's later "unknown type neuron.SPMDModel".
    """
    if importlib.util.find_spec("neuronx_distributed") is None:
        return None
    install_fx_standin()
    importlib.import_module(MODEL_BUILDER)
    return MODEL_BUILDER
