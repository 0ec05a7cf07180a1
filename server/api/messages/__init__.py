"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens): its body (`schemas`), the translation onto the
chat plan (`translate`), its content blocks and stream events (`builder`) and the routes. Must not import torch; of
`server.api.chat`, only `plan` (an import contract in pyproject.toml)."""
