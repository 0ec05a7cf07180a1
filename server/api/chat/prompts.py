"""The model as the routes see it: its name, its vocabulary and context checks, and its tokenizer (off the event loop).

Everything model-specific comes from the `ModelInfo` (its tokenizer and chat template, the protocol detected at
start-up, vocabulary and context sizes): nothing here branches on the model type.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import anyio
from jinja2 import TemplateError

from server.api.given import ImageReader, ModelInfo
from server.api.schemas import IMAGE_MARK, ChatCompletionRequest, Message, Tool
from server.config import served_as
from server.constraints.client_grammar import unmarked
from server.engine.types import ImageInput, completion_budget
from server.errors import APIError, InvalidRequest, context_overflow
from server.protocol import ChatProtocol, PromptInputs

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback: the token *is* one raw byte


class Prompts:
    def __init__(self, model: ModelInfo) -> None:
        self.model = model
        self.tokenizer = model.tokenizer
        self.created = int(time.time())
        self.token_info = functools.lru_cache(maxsize=1 << 16)(self._token_info)
        self.protocol: ChatProtocol = model.protocol

    @functools.cached_property
    def thought_markers(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """The protocol's thought-channel markers as token ids (opening, closing); None: it has no thought channel."""
        if self.protocol.thought is None:
            return None
        opening, closing = (tuple(self.tokenizer.encode(text, add_special_tokens=False)) for text in self.protocol.thought)
        return opening, closing

    def check_model(self, model: str | None) -> str:
        """The served model's id (answers carry it, whichever of its names the request gave), or a 404."""
        if model is not None and not served_as(model, self.model.names):
            shown = model if len(model) <= 200 else model[:200] + "..."  # never echo a 2 MB "model" back
            also = f" (also named {', '.join(f'`{a}`' for a in self.model.aliases)})" if self.model.aliases else ""
            raise APIError(404, f"The model `{shown}` does not exist; this server serves `{self.model.name}`{also}.",
                           param="model", code="model_not_found")
        return self.model.name

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        vocab = self.model.vocab_size
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise APIError(400, f"{param}: token id {bad} is outside the vocabulary [0, {vocab})", param=param,
                           code="invalid_value")

    def budget(self, prompt_tokens: int, requested: int | None, param: str) -> int:
        """Tokens the completion may have: the request's limit, capped by what the context leaves."""
        overflow = context_overflow(prompt_tokens, self.model.max_total, param)
        if overflow is not None:
            raise overflow
        return completion_budget(self.model.max_total, prompt_tokens, requested)

    # Tokenizing runs on a worker thread: a 2 MB prompt takes seconds, which would stall every other stream's
    # chunks on the event loop. (Encoding and decoding borrow the Rust tokenizer immutably and release the GIL.)

    async def chat_ids(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                       add_special_tokens: bool = False, *, tools: Sequence[Tool] | None = None,
                       chat_template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """A conversation's ids as a chat request with these messages, tools and template variables renders them."""
        with_images = next((index for index, message in enumerate(messages) if message.images), None)
        if with_images is not None:
            raise APIError(400, f"messages[{with_images}].content: image parts are not supported here (only text is "
                           "tokenized)", param=f"messages[{with_images}].content", code="invalid_value")
        render = functools.partial(self._prompt, messages, tools, chat_template_kwargs, None,
                                   add_generation_prompt=add_generation_prompt, add_special_tokens=add_special_tokens)
        ids, _ = await anyio.to_thread.run_sync(render)
        return ids

    async def text_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        encode = functools.partial(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)
        return await anyio.to_thread.run_sync(encode)

    async def decode(self, ids: Sequence[int]) -> str:
        return await anyio.to_thread.run_sync(self.tokenizer.decode, ids)

    async def chat_prompt(self, body: ChatCompletionRequest) -> tuple[list[int], PromptInputs, tuple[ImageInput, ...]]:
        """A chat request's prompt through the model's protocol (tools, thinking, tool messages) and template, and its
        images, read and placed (their soft tokens' offsets in the ids)."""
        images = await self.read_images(body.messages)
        ids, inputs = await anyio.to_thread.run_sync(self._chat_prompt, body, images)
        return ids, inputs, self._placed(ids, images)

    async def read_images(self, messages: Sequence[Message]) -> list[ImageInput]:
        """Every image part of `messages`, decoded and prepared at its budget (on a worker thread: a large photo
        takes a while), or a 400 naming the part."""
        refs = [(index, ref) for index, message in enumerate(messages) for ref in message.images]
        if not refs:
            return []
        reader = self.model.images
        if reader is None:
            index, ref = refs[0]
            raise APIError(400, f"messages[{index}].content: text-only model: content part {ref.part} has type "
                           f"'image_url' ({self.model.images_off})", param=f"messages[{index}].content",
                           code="invalid_value")
        if len(refs) > reader.max_images:
            raise APIError(400, f"messages: {len(refs)} images; this server takes at most {reader.max_images} per "
                           "request (--max-images-per-request)", param="messages", code="invalid_value")
        images = []
        for index, ref in refs:
            param = f"messages[{index}].content[{ref.part}]"
            try:
                images.append(await anyio.to_thread.run_sync(reader.read, ref.url, reader.budget(ref.detail)))
            except ValueError as exc:
                raise APIError(400, f"{param}: {exc}", param=param, code="invalid_value") from None
        return images

    def _placed(self, ids: list[int], images: Sequence[ImageInput]) -> tuple[ImageInput, ...]:
        """The images with their offsets: the runs of the image token in `ids`, which must be theirs exactly (a text
        that holds the image token itself would put soft tokens where no image is)."""
        if not images:
            return ()
        reader = self.model.images
        assert reader is not None
        (token,) = self.tokenizer.encode(reader.image_token, add_special_tokens=False)
        runs: list[tuple[int, int]] = []
        for position, token_id in enumerate(ids):
            if token_id == token:
                if runs and runs[-1][1] == position:
                    runs[-1] = (runs[-1][0], position + 1)
                else:
                    runs.append((position, position + 1))
        if [end - begin for begin, end in runs] != [image.soft_tokens for image in images]:
            raise APIError(400, "messages: the text holds the model's image token itself; send images as image_url "
                           "parts", param="messages", code="invalid_value")
        return tuple(replace(image, offset=begin) for image, (begin, _) in zip(images, runs, strict=True))

    def _chat_prompt(self, body: ChatCompletionRequest,
                     images: Sequence[ImageInput] = ()) -> tuple[list[int], PromptInputs]:
        return self._prompt(body.messages, body.tools, body.chat_template_kwargs, body.reasoning_effort, images=images)

    def _prompt(self, messages: Sequence[Message], tools: Sequence[Tool] | None,
                chat_template_kwargs: Mapping[str, Any] | None, reasoning_effort: str | None, *,
                add_generation_prompt: bool = True, add_special_tokens: bool = False,
                images: Sequence[ImageInput] = ()) -> tuple[list[int], PromptInputs]:
        """The one rendering of a conversation (chat, the Responses API, /tokenize, /generate): the model's protocol
        (tools, thinking, tool messages), then its template."""
        # (a client grammar a tool carries is the engine's, not the template's: server.constraints.client_grammar)
        declared = [dict(unmarked(tool.model_dump(exclude_none=True))) for tool in tools] if tools else None
        try:
            inputs = self.protocol.prompt_inputs([m.template_dict() for m in messages], tools=declared,
                                                 chat_template_kwargs=chat_template_kwargs,
                                                 reasoning_effort=reasoning_effort)
        except InvalidRequest as exc:
            raise invalid(exc.message, exc.param) from None
        ids = self._render(inputs.messages, add_generation_prompt, add_special_tokens, tools=inputs.tools,
                           images=images, **inputs.template_kwargs)
        return ids, inputs

    def _render(self, conversation: list[dict[str, Any]], add_generation_prompt: bool, add_special_tokens: bool,
                images: Sequence[ImageInput] = (), **template: Any) -> list[int]:
        """The tokenizer's chat template (the artifact's cfg/chat_template.jinja), then tokens without adding
        special tokens again: the template writes BOS itself. Each image becomes its tokens, as Gemma4Processor
        expands its image token: begin-of-image, one image token per soft token, end-of-image."""
        if not self.protocol.supports_tools:
            # A plain template knows only text turns: an assistant turn without text is an empty one.
            conversation = [{**m, "content": m.get("content") or ""} for m in conversation]
        if images and self.model.images is not None:
            # As Gemma4Processor.apply_chat_template renders them: content as parts, each image an {"type": "image"}
            # part the model's own template writes (its image token, with whatever text around it the template
            # puts there). A template that writes no image parts gets each image's mark in the text instead.
            token = self.model.images.image_token
            try:
                text = self._template([_with_parts(m) for m in conversation], add_generation_prompt, **template)
            except APIError:  # a template that takes text content only: the marks below
                text = ""
            pieces = text.split(token)
            if len(pieces) == len(images) + 1 and IMAGE_MARK not in text:
                text = pieces[0] + "".join(self.model.images.expansion(image.soft_tokens) + piece
                                           for image, piece in zip(images, pieces[1:], strict=True))
                return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        text = self._template(conversation, add_generation_prompt, **template)
        if images:
            text = _expanded(text, images, self.model.images)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _template(self, conversation: list[dict[str, Any]], add_generation_prompt: bool, **template: Any) -> str:
        """The conversation through the model's chat template; a template error is the client's 400."""
        try:
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                      **template)
        except (TemplateError, ValueError, TypeError) as exc:  # ValueError: the model ships no chat template
            raise APIError(400, f"The chat template rejected the messages: {exc}", param="messages",
                           code="invalid_value") from None
        except RecursionError:
            # A template renders nested arguments, tool results and schemas with a recursive macro, ~5 Python frames a
            # level: JSON as deep as a body may be (~200 levels) overflows it. Nothing is left half-done: a 400.
            raise APIError(400, "messages: the chat template cannot render them: their JSON (tool-call arguments, tool "
                           "results or tool schemas) is nested too deeply", param="messages",
                           code="invalid_value") from None
        return text

    def _token_info(self, token_id: int) -> tuple[str, list[int]]:
        """A token's text as OpenAI's logprobs show it, and its bytes (the raw byte for byte-fallback tokens)."""
        text = self.tokenizer.decode([token_id])
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        match = _BYTE_TOKEN.fullmatch(piece) if isinstance(piece, str) else None
        return text, [int(match.group(1), 16)] if match else list(text.encode("utf-8"))


def _with_parts(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose text holds image marks with its content as the parts it was sent as: text parts and
    {"type": "image"} parts (server.api.schemas.split_parts joined them, "\n" between parts)."""
    content = message.get("content")
    if not isinstance(content, str) or IMAGE_MARK not in content:
        return message
    pieces = content.split(IMAGE_MARK)
    parts: list[dict[str, Any]] = []
    for index, piece in enumerate(pieces):
        piece = piece.removeprefix("\n") if index > 0 else piece
        piece = piece.removesuffix("\n") if index < len(pieces) - 1 else piece
        if piece:
            parts.append({"type": "text", "text": piece})
        if index < len(pieces) - 1:
            parts.append({"type": "image"})
    return {**message, "content": parts}


def _expanded(text: str, images: Sequence[ImageInput], reader: ImageReader | None) -> str:
    pieces = text.split(IMAGE_MARK)
    if reader is None or len(pieces) != len(images) + 1:
        raise APIError(400, "messages: the chat template did not render every image part once", param="messages",
                       code="invalid_value")
    return pieces[0] + "".join(reader.expansion(image.soft_tokens) + piece
                               for image, piece in zip(images, pieces[1:], strict=True))


def invalid(message: str, param: str | None) -> APIError:
    """A 400 for a protocol or constraint error, its message starting with the field it names."""
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    return APIError(400, message, param=param, code="invalid_value")
