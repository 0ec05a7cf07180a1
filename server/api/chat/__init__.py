"""The chat route family: a request planned into prompt ids + generation requests (`plan`), and the routes of
/v1/chat/completions, /v1/completions, /generate, models and tokenize (`routes`). Torch-free."""
