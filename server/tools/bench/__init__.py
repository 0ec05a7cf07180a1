"""`python -m server bench` and its parts: host overhead (`host`), the constraint mask (`constraints`), load memory
(`load`); `report` prints every bench's table and JSON line."""
