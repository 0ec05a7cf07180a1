"""What `api/` is given by the composition root (server.app): the engine, as the surface the routes use (`EngineAPI`;
server.engine.engine.Engine is one), and the served model's facts and grammar vocabulary (`ModelInfo`). Declared here,
by the side that needs them, so the engine knows nothing of the API and the API nothing of how the host is assembled."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from server.engine.types import GenerationRequest, ImageInput, KVUsage, RequestHandle, Tokenizer
from server.protocol.base import ChatProtocol

if TYPE_CHECKING:
    from server.constraints.vocab import GrammarVocab  # its module loads llguidance: only the type is needed here


class GrammarSource(Protocol):
    """The grammar vocabulary as the API uses it (server.constraints.vocab.VocabLoader is one)."""

    def start(self) -> None: ...
    @property
    def started(self) -> bool: ...
    def wait(self, timeout: float) -> GrammarVocab | None: ...  # None while it builds; RuntimeError if it failed


class ImageReader(Protocol):
    """Image parts as the API reads them (server.vision.reader.ImageReader is one): given, so api/ never loads the
    image processor (transformers, torch) itself. `read` is blocking: call it on a worker thread."""

    budgets: tuple[int, ...]  # soft-token budgets the encoder takes, ascending
    max_images: int  # per request
    image_token: str  # the model's soft-token placeholder (one token), as its tokenizer writes it

    def budget(self, detail: str | None) -> int: ...  # OpenAI's detail (low / auto / high) -> a budget
    def expansion(self, soft_tokens: int) -> str: ...  # the prompt text of one image of that many soft tokens
    def read(self, url: str, budget: int) -> ImageInput: ...  # a ValueError says what is wrong with the image


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    max_total: int  # context: prompt + completion
    vocab_size: int
    generation_defaults: Mapping[str, float]  # generation_config.json's sampling fields
    tokenizer: Tokenizer
    # The model family's chat format (server.protocol), detected once at start-up: the API renders prompts, parses
    # output and plans constraints through it.
    protocol: ChatProtocol
    stop_token_ids: tuple[int, ...] = ()  # eos, the generation config's other stop ids and the protocol's
    # The host's grammar vocabulary, the one its engine builds each run's matcher with (one source for both);
    # None: constrained output answers 500.
    grammar: GrammarSource | None = None
    # False: a base model, which continues text rather than answering chat turns; /v1/models and the chat page say so,
    # since its chat answers look broken to anyone who expects a chat model.
    chat: bool = True
    description: str | None = None  # one line about the model for /v1/models and the chat page; None: nothing to say
    # Other names a request may give as its model (--served-model-name's list after the first): accepted everywhere
    # `name` is, answered as `name` (as vLLM answers with its first served name).
    aliases: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)
    # Image parts (issue 27): None when this server takes none (a text-only model, --vision off); `images_off` says why
    images: ImageReader | None = None
    images_off: str = "this is a text-only model"


class EngineAPI(Protocol):
    @property
    def state(self) -> str: ...
    @property
    def state_reason(self) -> str: ...
    @property
    def queue_depth(self) -> int: ...
    @property
    def running(self) -> int: ...
    @property
    def admitted(self) -> int: ...
    @property
    def capacity(self) -> int: ...  # generations at once (0 until the graph is in)
    @property
    def step_batches(self) -> Mapping[int, int]: ...  # rows per graph call -> how many calls had that many
    @property
    def kv_usage(self) -> KVUsage: ...  # the KV slots' use and the prefixes they keep (server.engine.types)
    def submit_all(self, requests: Sequence[GenerationRequest]) -> list[RequestHandle]: ...
    def start(self) -> None: ...
    def stop(self, timeout: float = 5.0) -> None: ...
    def drain(self) -> None: ...
    def in_flight(self) -> list[RequestHandle]: ...
    def cancel_all(self) -> None: ...
    async def wait_idle(self, timeout: float) -> bool: ...
