"""How a result shows itself: a one-line ``repr`` and a compact HTML table for notebooks. Pure Python.

Every public result type's ``__repr__`` is a summary on one line of at most
:data:`REPR_LIMIT` characters (:func:`summary`), never a dump of its arrays;
its ``_repr_html_`` (which Jupyter and an HTML export show) is a caption, the
lines that judge it (a step's dropped micro-batches, a failed check's cause)
and a table (:func:`html`), every text escaped, at most :data:`ROWS` rows
(the first and last halves, the rows between counted).
"""

from __future__ import annotations

import html as _html
import math
import numbers
from collections.abc import Mapping, Sequence

__all__ = ["REPR_LIMIT", "ROWS", "ends", "fields", "html", "number", "shortened", "summary"]

#: The most characters a result's ``repr`` has.
REPR_LIMIT = 200
#: The most rows an HTML table shows: its first and last halves.
ROWS = 20


def number(value) -> str:
    """``value`` as a table or a summary shows it: 4 significant digits for a float, an int as
    it is, "" for None; anything else as ``str``."""
    if value is None:
        return ""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return str(int(value))
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        value = float(value)
        return str(value) if not math.isfinite(value) else f"{value:.4g}"
    return str(value)


def shortened(text: str, limit: int = REPR_LIMIT) -> str:
    """``text`` on one line, cut to ``limit`` characters (the last one "…" where cut)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def fields(values: Mapping) -> str:
    """``key=value, ...`` of the values that are not None: text quoted, numbers as
    :func:`number` shows them."""
    return ", ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={number(v)}"
                     for k, v in values.items() if v is not None)


def summary(name: str, values: Mapping) -> str:
    """``name(key=value, ...)`` of :func:`fields`, cut to :data:`REPR_LIMIT`."""
    return shortened(f"{name}({fields(values)})")


def ends(items: Sequence) -> tuple[list, int]:
    """(the first and last halves of :data:`ROWS` of ``items``, how many lie between)."""
    if len(items) <= ROWS:
        return list(items), 0
    half = ROWS // 2
    return [*items[:half], *items[-half:]], len(items) - ROWS


def html(caption: str, columns: Sequence[str], rows: Sequence[Sequence], lines: Sequence[str] = (),
         hidden: int = 0) -> str:
    """An HTML block: ``caption`` in bold, each of ``lines`` (verdicts) on its own line, then a
    table of ``rows`` under ``columns`` (the first column as row headers), at most
    :data:`ROWS` rows shown (:func:`ends`; ``hidden``: rows the caller left out already,
    between the halves). Every text is escaped; numbers as :func:`number`."""
    shown, cut = ends(rows)
    hidden += cut
    if hidden:
        gap = [f"… {hidden} more rows …"] + [""] * (len(columns) - 1)
        shown.insert(ROWS // 2, gap)
    head = "".join(f"<th>{_html.escape(str(c))}</th>" for c in columns)
    body = "".join("<tr>" + "".join(_cell(v, j == 0) for j, v in enumerate(row))
                   + "</tr>" for row in shown)
    said = "".join(f"<div>{_html.escape(line)}</div>" for line in lines)
    table = (f'<table class="hostavg"><thead><tr>{head}</tr></thead><tbody>{body}</tbody>'
             f"</table>") if columns else ""
    return f"<div><b>{_html.escape(caption)}</b>{said}{table}</div>"


def _cell(value, header: bool) -> str:
    tag = "th" if header else "td"
    align = "" if header or isinstance(value, str) else ' style="text-align: right"'
    return f"<{tag}{align}>{_html.escape(number(value))}</{tag}>"
