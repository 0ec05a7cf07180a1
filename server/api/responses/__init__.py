"""The Responses API (/v1/responses): its body (`schemas`), the translation onto the chat plan (`translate`), its output
items and typed events (`builder`), the bounded store and the routes. Must not import torch; of `server.api.chat`, only
`plan` (an import contract in pyproject.toml)."""
