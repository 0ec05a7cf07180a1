"""The generation routes: OpenAI's chat and legacy completions, the seed server's `/generate`, and vLLM's
`/tokenize` / `/detokenize` and `/v1/models`.

Each route reads and validates the whole request, tokenizes it, checks the context budget, builds the
`GenerationRequest` and submits it to the engine *before* any response starts: every client mistake, a full
queue (429) and a server that is not ready (503) are real HTTP statuses. Only what happens after the headers
of a stream are sent (a generation error, a cancellation at shutdown) travels in-band, as vLLM does:
`data: {"error": {...}}` then `data: [DONE]`.

Deliberate choices:
- `max_tokens` beyond what the context leaves is capped, not rejected (finish_reason says "length"): with a
  512-token graph, clients that send max_tokens=1024 should still get an answer.
- Unset sampling fields take the model's generation_config.json defaults, then OpenAI's.
- Completions with `echo` and `logprobs` score the prompt: its tokens' logprobs (the first null) come before the
  completion's, as OpenAI's legacy API and vLLM give them, for evaluation harnesses (lm-evaluation-harness's
  `local-completions`: token-id prompts, `max_tokens` 1, `logprobs` 1, `echo`). Such a prompt is prefilled whole (no
  cached prefix: the cache keeps no logits) and bounded by --max-prompt-logprobs; `max_tokens` 0 (with echo) asks for
  the prompt alone, as vLLM takes it.
- `n > 1` and a list of prompts: the choices are admitted together (all or none). A prompt's choices run one after
  another in one KV slot, so the 2nd..nth finds it in the cache and runs no prefill; other prompts, and other
  requests, run beside them where there are slots. A stream sends each choice's chunks in turn, every chunk naming
  its `index`. `best_of` is refused: it would generate choices nobody sees.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.api.chat.constraints import OutputConstraints
from server.api.chat.formats import ChatFormat, CompletionFormat, Envelope, Format, usage
from server.api.chat.plan import ChatPlan
from server.api.chat.prompts import Prompts
from server.api.http import parse, read_body
from server.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    Message,
    SamplingFields,
    TokenizeRequest,
)
from server.api.service import Service
from server.api.sse import DONE, frame
from server.constraints.constraint import ConstraintSpec
from server.constraints.thought import ThoughtBudget
from server.engine.types import Completion, Delta, Finish, GenerationRequest, PromptLogprobs, RequestHandle, SamplingParams
from server.errors import APIError
from server.protocol import PromptInputs
from server.protocol.base import UNLIMITED, reasoning_budget


class OpenAIRoutes:
    def __init__(self, service: Service, prompts: Prompts, constraints: OutputConstraints) -> None:
        self.service = service
        self.prompts = prompts
        self.constraints = constraints
        self.settings = service.settings

    async def _body(self, request: Request) -> bytes:
        return await read_body(request, self.settings.max_body_bytes, self.settings.body_timeout_s)

    def _sampling(self, body: SamplingFields, top_logprobs: int | None) -> SamplingParams:
        """`top_logprobs` None = no logprobs. Unset fields: the model's defaults, then OpenAI's."""
        defaults = self.prompts.model.generation_defaults

        def pick(value: float | None, name: str, fallback: float) -> float:
            return float(value if value is not None else defaults.get(name, fallback))

        bias = tuple((int(key), float(value)) for key, value in (body.logit_bias or {}).items())
        self.prompts.check_token_ids([token for token, _ in bias], "logit_bias")
        return SamplingParams(
            temperature=pick(body.temperature, "temperature", 1.0),
            top_k=max(0, int(pick(body.top_k, "top_k", 0))),
            top_p=pick(body.top_p, "top_p", 1.0),
            min_p=pick(body.min_p, "min_p", 0.0),
            repetition_penalty=pick(body.repetition_penalty, "repetition_penalty", 1.0),
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logit_bias=bias,
            seed=body.seed,
            logprobs=top_logprobs is not None,
            top_logprobs=top_logprobs or 0,
        )

    def check_choices(self, choices: int, param: str = "n") -> None:
        """A request's choices (n, times its prompts) are admitted together: bounded by --max-n and --max-queue."""
        limit = min(self.settings.max_n, self.settings.max_queue)
        if choices > limit:
            which = "--max-n" if limit == self.settings.max_n else "--max-queue"
            raise APIError(400, f"{param}: this request asks for {choices} choices; this server generates at most "
                           f"{limit} per request ({which})", param=param, code="invalid_value")

    def submit(self, prompts: Sequence[Sequence[int]], limit: int | None, param: str, n: int, *,
               sampling: SamplingParams, request_id: str, constraint: ConstraintSpec | None = None,
               **fields: Any) -> list[RequestHandle]:
        """The one place GenerationRequests are built from a parsed body: `n` choices per prompt, each prompt with its
        budget, then `fields`. Choice i (prompt-major, OpenAI's index) draws with seed + i, so a seeded request is
        reproducible and its choices differ; every choice carries the same `constraint` (a value)."""
        requests = []
        for p, ids in enumerate(prompts):
            budget = self.prompts.budget(len(ids), limit, param)
            for j in range(n):
                index = p * n + j
                seed = None if sampling.seed is None else sampling.seed + index
                requests.append(GenerationRequest(
                    prompt_ids=tuple(ids), max_new_tokens=budget, sampling=replace(sampling, seed=seed),
                    request_id=request_id if len(prompts) * n == 1 else f"{request_id}-{index}",
                    constraint=constraint, **fields))
        return self.service.submit(requests)

    def submit_plan(self, plan: ChatPlan, body: ChatCompletionRequest, n: int, *, param: str,
                    request_id: str) -> list[RequestHandle]:
        """`ChatPlanner.submit_plan`: chat completions and the Responses API submit a plan here, and only here."""
        return self.submit([plan.ids], body.token_limit, param, n, sampling=plan.sampling, constraint=plan.constraint,
                           stop=body.stop, request_id=request_id, skip_special_tokens=not plan.keep_special_tokens,
                           thought_budget=plan.thought_budget, images=plan.images, **self._eos_fields(body))

    async def _respond(self, request: Request, handles: Sequence[RequestHandle], fmts: Sequence[Format], n: int,
                       stream: bool, include_usage: bool) -> Response:
        def whole(done: list[Completion]) -> dict[str, Any]:
            choices = [fmt.choice(c) for fmt, c in zip(fmts, done, strict=True)]
            return fmts[0].envelope.wrap(fmts[0].object_name, choices, usage=usage([c.finish for c in done], n, fmts))

        return await self.service.answer(request, handles, self._stream(handles, fmts, n, include_usage) if stream else None,
                                         whole)

    async def _stream(self, handles: Sequence[RequestHandle], fmts: Sequence[Format], n: int,
                      include_usage: bool) -> AsyncIterator[bytes]:
        """The choices in turn, each chunk naming its choice's index: one that runs beside an earlier choice (another
        prompt of the list) keeps its events queued until that one has ended."""
        envelope = fmts[0].envelope
        try:
            for fmt in fmts:
                for payload in fmt.opening():
                    yield frame(payload)
            finishes: list[Finish] = []
            for handle, fmt in zip(handles, fmts, strict=True):
                async for event in self.service.events(handle):
                    if isinstance(event, Delta | PromptLogprobs):
                        chunk = fmt.chunk(event) if isinstance(event, Delta) else fmt.prompt(event)
                        if chunk is not None:
                            yield frame(chunk)
                        continue
                    finishes.append(event)
                    for payload in fmt.final_chunks(event.reason):
                        yield frame(payload)
            if include_usage:
                yield frame(envelope.wrap(fmts[0].chunk_object_name, [], usage=usage(finishes, n, fmts)))
        except Exception as exc:  # noqa: BLE001 - after the headers: in-band; a bug must still end the stream properly
            yield frame(self.service.stream_failure(exc, envelope.id).to_json())
        yield frame(DONE)

    # ------------------------------------------------------------------ POST /v1/chat/completions

    async def chat_completions(self, request: Request) -> Response:
        body = parse(ChatCompletionRequest, await self._body(request))
        n = body.n or 1
        self.check_choices(n)
        plan = await self.plan_chat(body)
        envelope = Envelope(f"chatcmpl-{request.state.completion_id}", plan.model)
        handles = self.submit_plan(plan, body, n, param="messages", request_id=envelope.id)
        fmts = [ChatFormat(self.prompts, envelope, i, plan.sampling.logprobs, plan.new_parser()) for i in range(n)]
        return await self._respond(request, handles, fmts, n, bool(body.stream), body.include_usage)

    async def plan_chat(self, body: ChatCompletionRequest) -> ChatPlan:
        """Checks, the prompt through the model's protocol and template, and the output constraint."""
        model = self.prompts.check_model(body.model)
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs=true", param="top_logprobs", code="invalid_value")
        sampling = self._sampling(body, (body.top_logprobs or 0) if body.logprobs else None)
        ids, inputs, images = await self.prompts.chat_prompt(body)
        constraint = await self.constraints.plan(body, inputs)
        protocol = self.prompts.protocol
        tool_names = [tool.function["name"] for tool in body.tools or ()]
        parse_tools = bool(tool_names) and body.tool_choice != "none"
        return ChatPlan(model, ids, inputs, sampling, constraint,
                        functools.partial(protocol.parser, tool_names=tool_names, parse_tool_calls=parse_tools),
                        protocol.keep_special_tokens, self._thought_budget(body, inputs), images)

    def _thought_budget(self, body: ChatCompletionRequest, inputs: PromptInputs) -> ThoughtBudget | None:
        """The thought's cap: the request's reasoning_budget, else its reasoning_effort's, else --reasoning-budget;
        None when unlimited, or when thinking is off (nothing to cap: no error, and no cost)."""
        tokens = reasoning_budget(body.reasoning_budget, body.reasoning_effort, self.settings.reasoning_budget)
        markers = self.prompts.thought_markers
        if tokens == UNLIMITED or not inputs.thinking or markers is None:
            return None
        return ThoughtBudget(*markers, tokens=tokens)

    async def prompt_ids(self, body: ChatCompletionRequest) -> list[int]:
        """`ChatPlanner.prompt_ids`: the model checked and the prompt rendered as `plan_chat` renders it (no sampling
        or constraint planned: a count needs neither, nor the grammar vocabulary)."""
        self.prompts.check_model(body.model)
        ids, _, _ = await self.prompts.chat_prompt(body)
        return ids

    @staticmethod
    def _eos_fields(body: SamplingFields) -> dict[str, Any]:
        return {"ignore_eos": bool(body.ignore_eos), "min_tokens": body.min_tokens or 0}

    # ------------------------------------------------------------------ POST /v1/completions

    async def completions(self, request: Request) -> Response:
        body = parse(CompletionRequest, await self._body(request))
        model = self.prompts.check_model(body.model)
        scored = bool(body.echo) and body.logprobs is not None  # the prompt's own token logprobs
        n = body.n or 1
        self.check_choices(n * len(body.prompt), "n" if len(body.prompt) == 1 else "prompt")
        sampling = self._sampling(body, body.logprobs)
        prompts: list[list[int]] = []
        echoes: list[str] = []
        for index, prompt in enumerate(body.prompt):
            if isinstance(prompt, str):
                prompts.append(await self.prompts.text_ids(prompt))  # with BOS, as vLLM does
                echoes.append(prompt)
            else:
                self.prompts.check_token_ids(prompt, "prompt" if len(body.prompt) == 1 else f"prompt[{index}]")
                prompts.append(list(prompt))
                echoes.append(await self.prompts.decode(prompt) if body.echo else "")
            if scored:
                self.check_prompt_logprobs(len(prompts[-1]), "prompt" if len(body.prompt) == 1 else f"prompt[{index}]")
        envelope = Envelope(f"cmpl-{request.state.completion_id}", model)
        handles = self.submit(prompts, body.token_limit, "prompt", n, sampling=sampling, stop=body.stop,
                              request_id=envelope.id, prompt_logprobs=body.logprobs if scored else None,
                              **self._eos_fields(body))
        fmts = [CompletionFormat(self.prompts, envelope, i, body.logprobs is not None,
                                 echo=echoes[i // n] if body.echo else "", scored=scored) for i in range(len(handles))]
        return await self._respond(request, handles, fmts, n, bool(body.stream), body.include_usage)

    def check_prompt_logprobs(self, prompt_tokens: int, param: str) -> None:
        """A scored prompt (echo with logprobs) is bounded by --max-prompt-logprobs (default: the context)."""
        limit = self.settings.max_prompt_logprobs or self.prompts.model.max_total
        if prompt_tokens > limit:
            raise APIError(400, f"{param}: prompt logprobs (echo with logprobs) are computed for prompts of at most "
                           f"{limit} tokens on this server (--max-prompt-logprobs); this one has {prompt_tokens}",
                           param=param, code="invalid_value")

    # ------------------------------------------------------------------ POST /generate (the seed server's)

    async def generate(self, request: Request) -> Response:
        body = parse(GenerateRequest, await self._body(request))
        ids = await self.prompts.chat_ids([Message(role="user", content=body.prompt)])
        handles = self.submit([ids], body.max_new_tokens, "prompt", 1, sampling=SamplingParams(temperature=0.0),
                              request_id=f"gen-{request.state.completion_id}")

        def whole(done: list[Completion]) -> dict[str, Any]:
            finish = done[0].finish
            return {"prompt": body.prompt, "response": done[0].text, "prompt_tokens": finish.prompt_tokens,
                    "gen_tokens": finish.completion_tokens, "finish_reason": finish.reason}

        return await self.service.answer(request, handles, None, whole)

    # ------------------------------------------------------------------ tokenizer routes and models

    async def tokenize(self, request: Request) -> Response:
        body = parse(TokenizeRequest, await self._body(request))
        self.prompts.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "Give exactly one of `prompt` or `messages`.", param="prompt", code="invalid_value")
        if body.messages is not None:
            # Through the chat path's own rendering: with the same messages, tools and chat_template_kwargs, the count
            # is the prompt a chat request prefills (its usage.prompt_tokens).
            ids = await self.prompts.chat_ids(body.messages, add_generation_prompt=body.add_generation_prompt is not False,
                                              add_special_tokens=bool(body.add_special_tokens), tools=body.tools,
                                              chat_template_kwargs=body.chat_template_kwargs)
        else:
            for field in ("tools", "chat_template_kwargs"):
                if getattr(body, field) is not None:
                    raise APIError(400, f"{field}: only with `messages` (a `prompt` is tokenized as it is)",
                                   param=field, code="invalid_value")
            assert body.prompt is not None
            ids = await self.prompts.text_ids(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.prompts.model.max_total})

    async def detokenize(self, request: Request) -> Response:
        body = parse(DetokenizeRequest, await self._body(request))
        self.prompts.check_model(body.model)
        self.prompts.check_token_ids(body.tokens, "tokens")
        return JSONResponse({"prompt": await self.prompts.decode(body.tokens)})

    def _model_card(self, name: str | None = None) -> dict[str, Any]:
        """The served model's card, under `name` (one of its aliases) when given: `root` is always its id."""
        model = self.prompts.model
        card = {"id": name or model.name, "object": "model", "created": self.prompts.created, "owned_by": "gemma4-optb",
                "root": model.name, "parent": None, "max_model_len": model.max_total, "chat": model.chat,
                # the same limit under OpenRouter's / llama.cpp's key: clients size their context from either
                "context_length": model.max_total,
                # how many generations run at once (KV slots in use together; 0 while the graph loads)
                "max_concurrency": self.service.engine.capacity,
                # image parts are read (issue 27): the chat page offers to attach one
                "images": model.images is not None}
        if model.description is not None:
            card["description"] = model.description
        return card

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        self.prompts.check_model(name)
        return JSONResponse(self._model_card(name))

