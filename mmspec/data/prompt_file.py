"""Your own prompts for `python -m mmspec.train vlm-answers --prompts FILE`: a JSON Lines file, one conversation
per line, that the target answers to make a drafter's distillation set for your VLM.

Each line is a JSON object with:
- `"prompt"`: the question (a one-turn conversation: the images first, then the text), or `"messages"`: a
  conversation in the processor's chat format (`[{"role": "user", "content": [{"type": "image"}, {"type": "text",
  "text": "..."}]}, ...]`), one `{"type": "image"}` item per image; the target answers its last turn;
- `"image"` (one path) or `"images"` (a list of paths), relative to the file's folder or absolute; none for a
  text-only line.

    {"image": "photos/cat.jpg", "prompt": "What is the cat doing?"}
    {"images": ["a.png", "b.png"], "prompt": "What changed between the two?"}

`read_prompt_file` checks every line (keys, types, that each image file opens as an image and that a conversation
holds one image item per image) and raises a ValueError naming the file and line, so that a bad file fails before
any model loads. The answers file records each image's path and sha256 (`Row.image_files` / `image_sha256`), not
its pixels; the trainers check them once (`check_images`: a file that changed since is refused) and reopen them
(`open_images`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path


__all__ = ["Row", "check_images", "open_images", "read_prompt_file", "read_prompts"]

KEYS = {"prompt", "messages", "image", "images"}


@dataclass(frozen=True)
class Row:
    """One line: its conversation (`messages`, the chat format), its images' absolute paths and their sha256."""

    messages: list
    image_files: tuple[str, ...]
    image_sha256: tuple[str, ...]

    @property
    def question(self) -> str:
        """The text of the last user turn."""
        content = self.messages[-1]["content"]
        if isinstance(content, str):
            return content
        return " ".join(c.get("text", "") for c in content if c.get("type") == "text")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _image_items(messages) -> int:
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for c in m["content"] if isinstance(c, dict) and c.get("type") == "image")  # fmt: skip


def _check_messages(messages, where):
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of turns")
    for i, turn in enumerate(messages):
        if not isinstance(turn, dict) or turn.get("role") not in ("system", "user", "assistant"):
            raise ValueError(f"{where}: messages[{i}] must be an object with a role (system / user / assistant)")
        content = turn.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list) or not all(isinstance(c, dict) and c.get("type") in ("image", "text")
                                                    for c in content):  # fmt: skip
            raise ValueError(f"{where}: messages[{i}].content must be a string or a list of "
                             "{'type': 'image'} / {'type': 'text', 'text': ...} items")  # fmt: skip
        for c in content:
            if c["type"] == "text" and not isinstance(c.get("text"), str):
                raise ValueError(f"{where}: messages[{i}] has a text item without a 'text' string")
    if messages[-1]["role"] != "user":
        raise ValueError(f"{where}: the last turn must be the user's (the target answers it)")


def _check_image(path: Path, where):
    import PIL.Image

    if not path.is_file():
        raise ValueError(f"{where}: image {str(path)!r} does not exist")
    try:
        with PIL.Image.open(path) as image:
            image.verify()
    except (OSError, SyntaxError, ValueError) as err:
        raise ValueError(f"{where}: {str(path)!r} is not a readable image ({err})") from err


def read_prompt_file(path) -> list[Row]:
    """Every line of the JSON Lines file `path` as a `Row` (blank lines skipped); ValueError naming `path:line` and
    what is wrong (module docstring), or the file when it holds no line."""
    return read_prompts(path)[0]


def read_prompts(path) -> tuple[list[Row], str]:
    """`read_prompt_file(path)` and the sha256 of what was read, from one read of the file: its bytes' sha256, then
    each image's sha256 in order (a changed image changes it as a changed line does). What a resumable run records,
    so the rows it answers are the ones its record names."""
    path = Path(path)
    try:
        data = path.read_bytes()
        lines = data.decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{str(path)!r}: cannot read it as UTF-8 text ({err})") from err
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except ValueError as err:
            raise ValueError(f"{where}: not a JSON object ({err})") from err
        if not isinstance(item, dict):
            raise ValueError(f"{where}: not a JSON object")
        unknown = sorted(set(item) - KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; a line holds {sorted(KEYS)}")
        if ("prompt" in item) == ("messages" in item):
            raise ValueError(f"{where}: give exactly one of 'prompt' and 'messages'")
        if "image" in item and "images" in item:
            raise ValueError(f"{where}: give 'image' or 'images', not both")
        files = item.get("images", [item["image"]] if "image" in item else [])
        if not isinstance(files, list) or not all(isinstance(f, str) and f for f in files):
            raise ValueError(f"{where}: 'image' must be a path, 'images' a list of paths")
        resolved = [(path.parent / f).resolve() for f in files]
        for image in resolved:
            _check_image(image, where)
        if "prompt" in item:
            if not isinstance(item["prompt"], str) or not item["prompt"].strip():
                raise ValueError(f"{where}: 'prompt' must be a non-empty string")
            content = [{"type": "image"} for _ in resolved] + [{"type": "text", "text": item["prompt"]}]
            messages = [{"role": "user", "content": content}]
        else:
            messages = item["messages"]
            _check_messages(messages, where)
            if _image_items(messages) != len(resolved):
                raise ValueError(f"{where}: the messages hold {_image_items(messages)} image item(s) for "
                                 f"{len(resolved)} image file(s)")  # fmt: skip
        rows.append(Row(messages, tuple(map(str, resolved)), tuple(_sha256(f) for f in resolved)))
    if not rows:
        raise ValueError(f"{str(path)!r} holds no prompt (one JSON object per line)")
    digests = [hashlib.sha256(data).hexdigest(), *(d for row in rows for d in row.image_sha256)]
    return rows, hashlib.sha256("\n".join(digests).encode()).hexdigest()


def check_images(files, sha256) -> None:
    """ValueError naming the first of `files` that is missing or whose bytes no longer hash to its recorded
    `sha256` (changed since the answers were made). Run once per answers file, before its images are used."""
    for file, digest in zip(files, sha256, strict=True):
        path = Path(file)
        if not path.is_file():
            raise ValueError(f"image {file!r} of the answers file does not exist (moved since vlm-answers?)")
        if _sha256(path) != digest:
            raise ValueError(f"image {file!r} changed since its answers were made (sha256 differs): rerun "
                             "vlm-answers")  # fmt: skip


def open_images(files) -> list:
    """The images at `files` as RGB PIL images (checked beforehand: `read_prompt_file` or `check_images`)."""
    import PIL.Image

    images = []
    for file in files:
        with PIL.Image.open(file) as image:
            images.append(image.convert("RGB"))
    return images
