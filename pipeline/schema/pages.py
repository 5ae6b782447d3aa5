"""Page ranges: ``pages: "1-20,35,-5"`` in a job file or ``--pages`` on the CLI.

Syntax (comma-separated items, spaces ignored, page numbers 1-based):

=========  ==============================================================
``7``      page 7
``3-9``    pages 3 to 9, inclusive
``12-``    page 12 to the last page
``-1``     the last page (negative numbers count from the end, like
           Python indices and ``qpdf``: -1 is the last page, -5 the fifth
           page from the end)
``-5--1``  the last five pages
``1--2``   every page except the last
=========  ==============================================================

A single negative number is ONE page, never "the last N pages"; write
``-N--1`` for that.  The result is sorted and de-duplicated, so overlapping
items are harmless.  Syntax is checked when the job file is loaded
(:func:`parse_page_ranges`); bounds can only be checked per document, since
each document has its own page count (:func:`select_pages`).
"""

from __future__ import annotations

import re
from pathlib import Path

from pipeline.errors import PageRangeError

_ITEM = re.compile(r"^(-?\d+)(?:-(-?\d+)?)?$")

#: End marker of an open range such as ``12-``; resolves to the last page.
LAST = -1


def parse_page_ranges(spec: str) -> list[tuple[int, int]]:
    """Parse ``spec`` into ``(first, last)`` pairs, unresolved.

    Numbers keep their sign (negative = from the end); an open end (``12-``)
    becomes ``LAST`` (-1).  Raises :class:`PageRangeError` naming the bad item.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise PageRangeError(str(spec), "empty page range; write e.g. '1-20,35,-5'")
    ranges = []
    for raw in spec.split(","):
        item = raw.replace(" ", "")
        m = _ITEM.match(item)
        if not m:
            raise PageRangeError(
                spec, f"cannot parse {raw.strip()!r}; use N, A-B, N- or negative numbers from the end"
            )
        first = int(m.group(1))
        last = first if "-" not in item.lstrip("-") else (LAST if m.group(2) is None else int(m.group(2)))
        if first == 0 or last == 0:
            raise PageRangeError(spec, f"{raw.strip()!r}: page numbers start at 1 (or -1 for the last page)")
        # Same-sign bounds can be checked without knowing the page count.
        if (first > 0) == (last > 0) and first > last and m.group(2) is not None:
            raise PageRangeError(spec, f"{raw.strip()!r}: range is reversed (first page after last page)")
        ranges.append((first, last))
    return ranges


def select_pages(spec: str | None, page_count: int, *, document: str | Path | None = None) -> list[int]:
    """Return the selected 1-based page numbers of a ``page_count``-page document.

    ``None`` selects every page.  A page beyond the document, or a range whose
    resolved ends are reversed, raises :class:`PageRangeError` naming
    ``document`` and its page count, so a job over many files says which one
    is too short.
    """
    if spec is None:
        return list(range(1, page_count + 1))
    selected: set[int] = set()
    for first, last in parse_page_ranges(spec):
        lo, hi = _resolve(first, page_count, spec, document), _resolve(last, page_count, spec, document)
        if lo > hi:
            raise PageRangeError(
                spec, f"{first}-{last} resolves to pages {lo}-{hi} of {page_count}, which is reversed", document
            )
        selected.update(range(lo, hi + 1))
    return sorted(selected)


def clip_pages(spec: str | None, page_count: int, *, document: str | Path | None = None) -> tuple[list[int], str | None]:
    """Like :func:`select_pages`, but parts of ``spec`` beyond the document are
    clipped instead of failing it: one spec serves a job over documents of
    any length (``1-20,35,-5`` on a 12-page file is pages 1-12).

    Returns the pages and a note saying what was clipped (None if nothing).
    A range is cut to the document; a single page outside it is dropped.
    Raises :class:`PageRangeError` only when nothing at all is left.
    """
    if spec is None:
        return list(range(1, page_count + 1)), None
    selected: set[int] = set()
    clipped: list[str] = []
    for first, last in parse_page_ranges(spec):
        lo, hi = _position(first, page_count), _position(last, page_count)
        text = str(first) if first == last else (f"{first}-" if last == LAST else f"{first}-{last}")
        a, b = max(lo, 1), min(hi, page_count)
        if a > b:
            clipped.append(f"{text} (none left)")
            continue
        if (a, b) != (lo, hi):
            clipped.append(f"{text} (kept {a}-{b})" if a != b else f"{text} (kept {a})")
        selected.update(range(a, b + 1))
    if not selected:
        raise PageRangeError(spec, f"selects no page of this {page_count}-page document", document)
    note = None
    if clipped:
        note = f"pages {spec!r} reach past this {page_count}-page document: " + ", ".join(clipped)
    return sorted(selected), note


def _position(n: int, page_count: int) -> int:
    return n if n > 0 else page_count + 1 + n


def _resolve(n: int, page_count: int, spec: str, document: str | Path | None) -> int:
    page = n if n > 0 else page_count + 1 + n
    if not 1 <= page <= page_count:
        raise PageRangeError(spec, f"page {n} is out of range: the document has {page_count} page(s)", document)
    return page
