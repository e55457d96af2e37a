"""Multimodal: count shapes in a generated picture (image + question items, images the project draws).

Each item is a PNG drawn with PIL from a seed: a few circles, squares and triangles in a few colours; the
question asks how many shapes of one kind (and colour) there are. The picture travels two ways, the same
bytes: as an OpenAI-style content part in the user message (`{"type": "image_url", "image_url": {"url":
"data:image/png;base64,..."}}`, then the text part), and in the group's `images` field (a list of base64 PNG
strings, one per picture of the prompt), which the store, the batching API and `groups.jsonl` keep byte for
byte. Text-only policies (the local CPU server, `/generate` with token ids) see an `<image>` placeholder where
the picture is (`tasks.generate.prompt_ids` flattens content parts). Reward 1.0 for the right count in
`<answer></answer>`, 0 for a wrong or missing one.
"""

from __future__ import annotations

import base64
import io
import random
import re
from typing import Any

from pydantic import Field

from environments.base import BaseEnv, EnvConfig, Item

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 40, 40), "blue": (40, 80, 220), "green": (40, 160, 60)}
_ANSWER = re.compile(r"<answer>\s*(\d+)\s*</answer>")


class ShapeCountConfig(EnvConfig):
    """The `env.` section for shape counting."""

    size: int = Field(128, ge=32, le=1024, description="Picture width and height in pixels.")
    max_shapes: int = Field(6, ge=1, le=20, description="Most shapes in a picture.")
    by_colour: bool = Field(True, description="Ask for shapes of one kind and colour (else: of one kind).")
    system_prompt: str | None = Field("Look at the picture and put the count in <answer></answer>.",
                                      description="System message put before every question.")
    max_tokens: int = Field(16, ge=1, description="Most new tokens per completion.")


def draw(rng: random.Random, size: int, count: int) -> tuple[bytes, list[tuple[str, str]]]:
    """A PNG with `count` non-overlapping shapes (on a grid), and the (shape, colour) of each."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), "white")
    pen = ImageDraw.Draw(image)
    cells = 4
    cell = size // cells
    placed = []
    for slot in rng.sample(range(cells * cells), count):
        shape, colour = rng.choice(SHAPES), rng.choice(sorted(COLOURS))
        x, y = (slot % cells) * cell, (slot // cells) * cell
        box = (x + cell // 6, y + cell // 6, x + cell - cell // 6, y + cell - cell // 6)
        fill = COLOURS[colour]
        if shape == "circle":
            pen.ellipse(box, fill=fill)
        elif shape == "square":
            pen.rectangle(box, fill=fill)
        else:
            pen.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=fill)
        placed.append((shape, colour))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=False)
    return buffer.getvalue(), placed


def image_part(png: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}


class ShapeCountEnv(BaseEnv):
    name = "shape_count"
    config_cls = ShapeCountConfig
    scoring = "inline"  # one regex
    config: ShapeCountConfig

    def get_item(self, index: int) -> Item:
        rng = random.Random(f"{self.config.seed}:{index}")
        png, placed = draw(rng, self.config.size, rng.randint(1, self.config.max_shapes))
        shape, colour = rng.choice(placed)
        if self.config.by_colour:
            answer, question = placed.count((shape, colour)), f"How many {colour} {shape}s are in the picture?"
        else:
            answer, question = sum(s == shape for s, _ in placed), f"How many {shape}s are in the picture?"
        system = [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []
        user = {"role": "user", "content": [image_part(png), {"type": "text", "text": question}]}
        return Item(key=f"shapes:{self.config.seed}:{index}", messages=[*system, user], answer=answer,
                    info={"images": [base64.b64encode(png).decode()], "question": question})

    def score(self, item: Item, completion: str) -> float:
        found = _ANSWER.findall(completion)
        return 1.0 if found and int(found[-1]) == item.answer else 0.0


if __name__ == "__main__":
    from flows.datagen import cli

    raise SystemExit(cli("environments.shape_count:ShapeCountEnv"))
