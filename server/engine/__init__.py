"""The device owner: requests in (`types`, torch-free values), one worker thread stepping the graph (`engine`), events
out. Must not import `api` (no HTTP, no status codes) nor a model family's protocol."""
