"""Reading an HTML report back as a person would: its tables (caption, header, rows), its text,
its images and its alert box. Strict about structure: every tag opened is closed."""

from __future__ import annotations

import base64
import html.parser
from dataclasses import dataclass, field
from pathlib import Path

VOID = {"meta", "img", "br", "hr", "link", "input"}


@dataclass
class Table:
    caption: str
    header: list[str]
    rows: list[dict[str, str]]

    def row(self, column: str, value: str) -> dict[str, str]:
        matches = [r for r in self.rows if r.get(column) == value]
        assert len(matches) == 1, f"{self.caption!r}: {len(matches)} rows with {column}={value!r}"
        return matches[0]


@dataclass
class Page:
    tables: list[Table] = field(default_factory=list)
    text: str = ""
    alert: str = ""
    images: list[tuple[str, bytes]] = field(default_factory=list)  # (alt, PNG bytes)
    figure_captions: list[str] = field(default_factory=list)

    def table(self, caption_start: str) -> Table:
        matches = [t for t in self.tables if t.caption.startswith(caption_start)]
        assert len(matches) == 1, f"{len(matches)} tables captioned {caption_start!r}: " \
                                  f"{[t.caption for t in self.tables]}"
        return matches[0]


class _Reader(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.page = Page()
        self.open_tags: list[str] = []
        self.texts: list[str] = []
        self.cell: list[str] | None = None
        self.row: list[str] | None = None
        self.rows: list[list[str]] = []
        self.caption: list[str] | None = None
        self.captions: list[str] = []
        self.alert: list[str] | None = None
        self.figcaption: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            src = attrs["src"]
            assert src.startswith("data:image/png;base64,"), "images are inlined (a self-contained page)"
            self.page.images.append((attrs.get("alt", ""), base64.b64decode(src.split(",", 1)[1])))
        if tag in VOID:
            return
        self.open_tags.append(tag)
        if tag == "table":
            self.rows, self.captions = [], []
        elif tag == "caption":
            self.caption = []
        elif tag == "tr":
            self.row = []
        elif tag in ("td", "th"):
            self.cell = []
        elif tag == "div" and attrs.get("role") == "alert":
            self.alert = []
        elif tag == "figcaption":
            self.figcaption = []

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        assert self.open_tags and self.open_tags.pop() == tag, f"unbalanced </{tag}>"
        if tag in ("td", "th") and self.cell is not None and self.row is not None:
            self.row.append("".join(self.cell).strip())
            self.cell = None
        elif tag == "tr" and self.row is not None:
            self.rows.append(self.row)
            self.row = None
        elif tag == "caption" and self.caption is not None:
            self.captions.append("".join(self.caption).strip())
            self.caption = None
        elif tag == "table":
            header, *body = self.rows
            self.page.tables.append(Table(self.captions[0] if self.captions else "", header,
                                          [dict(zip(header, row, strict=True)) for row in body]))
        elif tag == "div" and self.alert is not None and "div" not in self.open_tags:
            self.page.alert = " ".join(self.alert)
            self.alert = None
        elif tag == "figcaption" and self.figcaption is not None:
            self.page.figure_captions.append("".join(self.figcaption).strip())
            self.figcaption = None

    def handle_data(self, data):
        self.texts.append(data)
        for sink in (self.cell, self.caption, self.alert, self.figcaption):
            if sink is not None:
                sink.append(data)


def read_page(path: Path) -> Page:
    reader = _Reader()
    reader.feed(path.read_text(encoding="utf-8"))
    reader.close()
    assert reader.open_tags == [], f"unclosed tags: {reader.open_tags}"
    reader.page.text = " ".join(reader.texts)
    return reader.page
