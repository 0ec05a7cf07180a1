"""Test-only stand-in for torch-neuronx (see tests/neuron_standin/neuronx_distributed): importable, nothing more."""
