"""The device owner: requests in (`types`, torch-free values), one worker thread stepping the graph, events out.

`engine` (lifecycle, admission, watchdog, the loop: schedule -> run one step -> postprocess), `scheduler` (the next
step), `runner` (the graph calls), `kv` (what a KV slot holds), `sequence` (one running request), `buckets` (prefill
plans). Must not import `api` (no HTTP, no status codes) nor a model family's protocol."""
