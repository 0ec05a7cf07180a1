"""One row of logits -> the next token: bias, penalties, top-k, soft-cap, temperature, min-p, top-p, the draw, and a
constraint's mask applied to the row. Pure functions of their inputs; must not import the engine or the API."""
