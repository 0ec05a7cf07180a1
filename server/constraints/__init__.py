"""Token constraints: grammars (llguidance) and token sets compiled into per-step vocabulary masks. Torch-free.

Builds matchers from grammars it is given; must not import a model family (protocol/) nor torch."""
