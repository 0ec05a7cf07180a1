"""The chat route family: the model as the routes see it (`prompts.Prompts`), output constraints (`constraints`), the
chat plan every chat-shaped API submits through (`plan`), OpenAI's response formats (`formats`) and the routes
(`routes`). Must not import torch, the engine's internals, nor `server.api.responses`."""
