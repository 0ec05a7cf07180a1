"""The chat route family: the model as routes see it (`plan.Prompts`), the chat plan (`planner`), OpenAI's response
formats (`formats`) and the routes (`routes`). Must not import torch, the engine's internals, nor `server.api.responses`."""
