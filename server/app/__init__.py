"""The composition root: binds the port, assembles host + protocol + engine + API, runs uvicorn, drains on SIGTERM; owns
process-wide policy and reads the start-up files. Imported by `__main__` and the tools only."""
