"""Test-only stand-in for torch-neuronx (see tests/support/neuron_standin/neuronx_distributed): importable, nothing more."""
