"""The composition root: binds the port, assembles host + protocol + engine + API, runs uvicorn, drains on SIGTERM.

Owns process-wide policy (threads, the collector, malloc_trim) and the one place start-up files are read.
Imported by `__main__` and the tools only."""
