"""The model's host side: the artifact directory, structure (meta device), tokenizer and chat templates, the
detokenizer, the memory-mapped embedding table and weights, start-up caches. Must not import the engine or the API."""
