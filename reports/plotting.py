"""What every report draws with: matplotlib (imported on first use), figures as PNG bytes, and
self-contained HTML pages (images inlined, tables escaped, a red alert box when something must
not be missed)."""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["MissingDependencyError", "alert", "figure_png", "fmt", "html_page", "image_tag", "pyplot", "save_figure",
           "table", "write_page"]


class MissingDependencyError(ImportError):
    """A report needs a package that is not installed; the message says which."""


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise MissingDependencyError("reports draw with matplotlib: pip install matplotlib "
                                     "(or pip install 'vlm-reward-proxy[reports]')") from err
    return plt


def figure_png(figure: Any, *, title: str, description: str, dpi: int = 110) -> bytes:
    """The figure as PNG bytes, with its title and description in the PNG's text chunks; closes it."""
    plt = pyplot()
    try:
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=dpi, metadata={"Title": title, "Description": description})
        return buffer.getvalue()
    finally:
        plt.close(figure)


def save_figure(figure: Any, path: Path, *, title: str, description: str) -> bytes:
    """Write the figure to `path` as a PNG (see figure_png) and return the bytes, for inlining."""
    png = figure_png(figure, title=title, description=description)
    path.write_bytes(png)
    return png


def image_tag(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'


def fmt(value: Any, kind: str = "g") -> str:
    """A number as a person reads it: "—" for none; kind "%" (a rate), "3" (3 decimals), "int", or "g"."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if kind == "%":
        return f"{value:.1%}"
    if kind == "int":
        return f"{value:,.0f}"
    if kind.isdigit():
        return f"{value:.{kind}f}"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def cell(value: Any) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return f"<td>{html.escape(text)}</td>"


def table(keys: Sequence[str], rows: Iterable[dict[str, Any]], *, caption: str | None = None) -> str:
    head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
    body = "".join("<tr>" + "".join(cell(row.get(k, "")) for k in keys) + "</tr>" for row in rows)
    caption_html = f"<caption>{html.escape(caption)}</caption>" if caption else ""
    return f"<table>{caption_html}<tr>{head}</tr>{body}</table>"


def alert(title: str, lines: Sequence[str], footer: str = "") -> str:
    """A red box at the top of a page; empty when there is nothing to say."""
    if not lines:
        return ""
    items = "".join(f"<li>{html.escape(line)}</li>" for line in lines)
    return (f'<div class="alert" role="alert"><strong>{html.escape(title)}</strong><ul>{items}</ul>'
            f"{html.escape(footer)}</div>")


STYLE = """body{font-family:sans-serif;margin:2em;max-width:1400px}
table{border-collapse:collapse;margin:1em 0;font-size:.92em}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
caption{text-align:left;font-weight:bold;margin-bottom:.3em}img{max-width:100%}
.alert{background:#fdd;border:3px solid #c00;color:#900;padding:1em;font-size:1.2em;margin-bottom:1em}
.number{font-size:1.4em;font-weight:bold}
h2{border-bottom:2px solid #ddd;margin-top:1.6em}td.num{text-align:right}
.note{color:#555}figure{margin:1em 0}figcaption{font-size:.95em;margin-bottom:.3em}"""


def html_page(title: str, body: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{STYLE}</style></head><body>\n{body}\n</body></html>\n")


def write_page(path: Path, title: str, body: str) -> Path:
    """A self-contained page (see html_page) written as UTF-8."""
    path.write_text(html_page(title, body), encoding="utf-8")
    return path
