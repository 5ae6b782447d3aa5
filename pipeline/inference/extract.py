"""Pull JSON out of model output and check the pages it cites.

Models rarely emit bare JSON: they wrap it in code fences, put a sentence
before it, or keep talking after the closing brace.  We therefore scan for the
first position where a complete JSON value decodes (``raw_decode`` stops at the
end of the value, so trailing text is fine) instead of ``json.loads`` on the
whole string.  When nothing decodes, the record carries a parse error that
quotes where decoding failed, so a user can see *why* an extract task failed
without re-running it.

Citations make an answer traceable to pages: an extract task may ask the model
to cite page numbers (``"page": 3``, ``"pages": [2, 5]``, ``"[Page 7]"`` in a
string).  ``check_citations`` compares them with the pages that actually went
into the context, so a hallucinated "page 40" of a 12-page file is flagged.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_FENCE = re.compile(r"```(?:json|JSON)?\s*\n?(.*?)```", re.DOTALL)
_PAGE_IN_TEXT = re.compile(r"\[\s*(?:page|p\.)\s*(\d+)\s*\]|\bpages?\s+(\d+)\b", re.IGNORECASE)
_CITATION_KEYS = {"page", "pages", "cited_pages", "source_page", "source_pages", "citations"}
_decoder = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedOutput:
    """Result of parsing one model answer: exactly one of value/error is meaningful.

    ``repaired``: the text was not valid JSON and ``value`` is what json-repair
    made of it (closed a cut-off string, dropped a trailing comma...);
    ``repaired`` then holds what was wrong with the text as written.
    """

    value: Any = None
    error: str | None = None
    repaired: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _candidates(text: str) -> list[str]:
    """Fenced blocks first (the model marked them as the answer), then the raw text."""
    return [m.group(1) for m in _FENCE.finditer(text)] + [text]


def parse_json_output(text: str) -> ParsedOutput:
    """Return the first JSON object or array found in ``text``.

    Scalars are not accepted: an extract task asks for structured fields, and
    a lone number found inside prose is almost surely not the answer.
    """
    first_error: str | None = None
    for chunk in _candidates(text):
        for match in re.finditer(r"[\[{]", chunk):
            try:
                value, _ = _decoder.raw_decode(chunk, match.start())
            except json.JSONDecodeError as exc:
                if first_error is None:
                    snippet = chunk[match.start() : match.start() + 60].replace("\n", " ")
                    first_error = f"invalid JSON at char {exc.pos}: {exc.msg} (near {snippet!r})"
                continue
            if isinstance(value, (dict, list)):
                return ParsedOutput(value=value)
    if first_error is None:
        first_error = "no JSON object or array in the model output"
    return ParsedOutput(error=first_error)


_INT64 = 2**63


def _storable(value: Any) -> Any:
    """``value`` with integers beyond 64 bits as strings (digits kept exactly):
    a record must always serialize, whatever number a model writes."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and not -_INT64 <= value < _INT64:
        return str(value)
    if isinstance(value, dict):
        return {k: _storable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_storable(v) for v in value]
    return value


def parse_or_repair(text: str) -> ParsedOutput:
    """:func:`parse_json_output`, and when that fails json-repair's reading of
    the text (an object or array only; the original parse error is kept if
    repair finds none).  Constrained decoding makes repair rare: it is the
    fallback for unconstrained answers and ones cut off by ``max_tokens``."""
    parsed = parse_json_output(text)
    if parsed.ok:
        return ParsedOutput(value=_storable(parsed.value))
    from json_repair import repair_json

    start = min((i for i in (text.find("{"), text.find("[")) if i >= 0), default=-1)
    if start < 0:
        return parsed
    try:
        value = repair_json(text[start:], return_objects=True)
    except Exception:  # json-repair raises assorted errors on hopeless input
        return parsed
    if isinstance(value, (dict, list)) and value:
        return ParsedOutput(value=_storable(value), repaired=parsed.error)
    return parsed


def missing_fields(value: Any, fields: list[str] | None) -> list[str]:
    """Expected keys absent from a parsed object (all of them if it isn't an object)."""
    if not fields:
        return []
    if not isinstance(value, dict):
        return list(fields)
    return [f for f in fields if f not in value]


def _as_pages(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, float) and value.is_integer():
        return [int(value)]
    if isinstance(value, str):
        return [int(n) for n in re.findall(r"\d+", value)]
    if isinstance(value, (list, tuple)):
        return [p for v in value for p in _as_pages(v)]
    if isinstance(value, dict):
        return cited_pages(value)
    return []


def cited_pages(value: Any) -> list[int]:
    """Page numbers a parsed answer cites, in order of appearance, deduplicated.

    Looks at citation-like keys at any depth and at ``[Page N]`` mentions in
    string values (the same marker the prompt uses, so models copy it).
    """
    found: list[int] = []

    def walk(v: Any) -> None:
        if isinstance(v, dict):
            for k, sub in v.items():
                if str(k).lower() in _CITATION_KEYS:
                    found.extend(_as_pages(sub))
                else:
                    walk(sub)
        elif isinstance(v, list):
            for sub in v:
                walk(sub)
        elif isinstance(v, str):
            found.extend(pages_in_text(v))

    walk(value)
    return list(dict.fromkeys(found))


def pages_in_text(text: str) -> list[int]:
    """``[Page N]`` / ``page N`` mentions in free text."""
    return [int(a or b) for a, b in _PAGE_IN_TEXT.findall(text)]


def check_citations(cited: list[int], included_pages: list[int]) -> dict:
    """Which cited pages exist in the context; ``valid`` is False if any don't."""
    included = set(included_pages)
    unknown = [p for p in cited if p not in included]
    return {"cited": cited, "unknown": unknown, "valid": not unknown}
