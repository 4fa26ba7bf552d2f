"""Contact sheets: the frames vLLM saw for one episode, read back from the proxy's frame store
(vlm_protocol.frame_store.frame_path) and laid out in a grid, in the order they were sent.

A frame missing from the store (never stored: the store was off, full, or pruned) or unreadable
is drawn as a grey tile saying so, and counted: the sheet never fails because of the store.
Drawn with Pillow (a dependency of matplotlib, so present wherever the report runs)."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

from vlm_protocol.frame_store import frame_path

__all__ = ["Sheet", "contact_sheet"]

THUMB = 112
COLUMNS = 8
GAP = 4
LABEL_H = 14
STILL_BORDER = (230, 140, 0)  # PRIMO's still images (first/last) are framed in orange


@dataclass
class Sheet:
    png: bytes
    frames: int  # tiles drawn (video frames + stills)
    missing: int  # of them, not in the store or unreadable


def _load(root: Path, digest: str):
    from PIL import Image, UnidentifiedImageError

    try:
        path = frame_path(root, digest)
    except ValueError:
        return None
    try:
        with Image.open(path) as image:
            image = image.convert("RGB")
    except (OSError, UnidentifiedImageError):
        return None
    image.thumbnail((THUMB, THUMB))
    return image


def contact_sheet(root: Path, frames: list[str], stills: list[str], *, columns: int = COLUMNS) -> Sheet:
    """The grid for one episode: video frames (labelled by their position) then stills."""
    from PIL import Image, ImageDraw

    tiles = [(f"{i}", h, False) for i, h in enumerate(frames)] + [
        ("still " + ("first" if i == 0 else "last" if i == len(stills) - 1 else str(i)), h, True)
        for i, h in enumerate(stills)]
    columns = max(1, min(columns, len(tiles) or 1))
    rows = max(1, -(-len(tiles) // columns))
    cell_w, cell_h = THUMB + GAP, THUMB + LABEL_H + GAP
    sheet = Image.new("RGB", (columns * cell_w + GAP, rows * cell_h + GAP), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    missing = 0
    for index, (label, digest, still) in enumerate(tiles):
        x = GAP + (index % columns) * cell_w
        y = GAP + (index // columns) * cell_h
        image = _load(root, digest)
        if image is None:
            missing += 1
            draw.rectangle((x, y + LABEL_H, x + THUMB - 1, y + LABEL_H + THUMB - 1), fill=(200, 200, 200))
            draw.text((x + 6, y + LABEL_H + THUMB // 2 - 12), "missing from\nframe store", fill=(120, 0, 0))
        else:
            sheet.paste(image, (x + (THUMB - image.width) // 2, y + LABEL_H + (THUMB - image.height) // 2))
            if still:
                draw.rectangle((x, y + LABEL_H, x + THUMB - 1, y + LABEL_H + THUMB - 1), outline=STILL_BORDER,
                               width=3)
        draw.text((x, y), label, fill=STILL_BORDER if still else (40, 40, 40))
    if not tiles:
        draw.text((GAP, GAP + LABEL_H), "the audit line names no frames", fill=(120, 0, 0))
    buffer = io.BytesIO()
    sheet.save(buffer, format="PNG", optimize=False)
    return Sheet(buffer.getvalue(), len(tiles), missing)
