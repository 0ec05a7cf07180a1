"""The device owner: requests in (`types`, torch-free values), one worker thread stepping the graph, events out.

Owns admission, prefix reuse, prefill chunking, the decode loop, timeouts and the watchdog. Must not import `api`
(no HTTP, no status codes) nor a model family's protocol."""
