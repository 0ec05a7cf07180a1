"""`ImageReader`: an image part's URL -> the `ImageInput` the engine encodes (what server.api.given.ImageReader asks).

Bytes and picture come from `decode` (bounded); resizing, patches and the soft-token count from the model's own image
processor, transformers' PIL Gemma-4 one (`Gemma4ImageProcessorPil`, Pillow only: torchvision is not needed), read
from the export's cfg/preprocessor_config.json (or processor_config.json's `image_processor` entry, transformers 5's
processor file: `from_pretrained` reads either) and called at the request's budget (`max_soft_tokens`). The count is
the processor's, per image (it depends on the aspect ratio), never assumed from the budget.

`read` runs on a worker thread of the HTTP layer (decode + resize take milliseconds to a second for a large photo);
the encoder itself runs on the engine's device thread.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from server.engine.types import ImageInput
from server.vision.decode import ImageError, decode_image, image_bytes

DETAIL_LOW = 70  # OpenAI's detail "low": the processor's smallest budget


class ImageReader:
    """Reads image parts for one model: its processor, its media tokens, the budgets its encoder takes."""

    def __init__(self, preprocessor: Path, *, tokens: tuple[str, str, str], budgets: Sequence[int], default_budget: int,
                 max_images: int, max_bytes: int, max_pixels: int, allow_urls: bool) -> None:
        from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

        # The PIL class whatever class the file names (the published one may name the torchvision-backed one).
        self._processor = Gemma4ImageProcessorPil.from_pretrained(str(preprocessor.parent))
        self.boi, self.image_token, self.eoi = tokens
        self.budgets = tuple(sorted(budgets))
        if not self.budgets:
            raise ValueError("the vision encoder takes no budget that fits this graph's prefill chunks")
        # --image-tokens beyond what the encoder (or the graph's chunks) take: the largest that is.
        self.default_budget = max((b for b in self.budgets if b <= default_budget), default=self.budgets[0])
        self.max_images = max_images
        self.max_bytes, self.max_pixels, self.allow_urls = max_bytes, max_pixels, allow_urls

    def budget(self, detail: str | None) -> int:
        """OpenAI's `detail`: low -> 70, auto (or unset) -> --image-tokens, high -> the largest the encoder has."""
        if detail == "low":
            return max((b for b in self.budgets if b <= DETAIL_LOW), default=self.budgets[0])
        if detail == "high":
            return self.budgets[-1]
        return self.default_budget

    def expansion(self, soft_tokens: int) -> str:
        """The prompt text of one image: as Gemma4Processor expands its image token."""
        return self.boi + self.image_token * soft_tokens + self.eoi

    def read(self, url: str, budget: int) -> ImageInput:
        """The image at `url`, prepared at `budget`; ImageError (a ValueError) says what is wrong with it."""
        picture = decode_image(image_bytes(url, max_bytes=self.max_bytes, allow_urls=self.allow_urls),
                               max_pixels=self.max_pixels)
        return self.prepare(picture, budget)

    def prepare(self, picture: Any, budget: int) -> ImageInput:
        try:
            features = self._processor(picture, max_soft_tokens=budget, return_tensors="np")
        except ValueError as exc:  # e.g. a 1 x 5000 strip no resize can fit into whole patches
            raise ImageError(f"the image processor cannot take it ({exc})") from None
        pixels = features["pixel_values"][0]  # [P, D] float32
        positions = features["image_position_ids"][0]  # [P, 2] int64
        count = int(features["num_soft_tokens_per_image"][0])
        digest = hashlib.sha256()
        for part in (str(budget).encode(), str(pixels.shape).encode(), pixels.tobytes(), positions.tobytes()):
            digest.update(part)
        return ImageInput(digest=digest.digest(), budget=budget, soft_tokens=count, pixel_values=pixels,
                          position_ids=positions)
