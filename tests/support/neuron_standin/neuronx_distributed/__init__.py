"""Test-only stand-in for AWS neuronx-distributed (NxD): an external system that cannot run here (no Inferentia).

Kept minimal: it reproduces only what our load path depends on. Put on sys.path by tests/test_neuron_path.py for
one server subprocess, never installed, never imported by the server's code directly.

What the real package's import does and this one does too: it pulls in ``neuronx_distributed.pipeline.trace``,
which, whenever transformers is installed, runs ``from transformers.utils.fx import HFTracer`` and subclasses it
together with an ABC. transformers 5 has no ``transformers.utils.fx``, so this import fails there unless the
server installed its stand-in first.
"""

from abc import ABC

from transformers.utils.fx import HFTracer


class NxDTracer(ABC):  # noqa: B024  (NxD's tracer mixin; only its metaclass matters here)
    pass


class HFTracerWrapper(NxDTracer, HFTracer):
    pass
