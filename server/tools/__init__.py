"""Command-line jobs beside serving: `fetch`, `export`, the `demo` export, and the benches (`bench/`). May import
anything below; nothing on the serving path imports them (except `__main__`)."""
