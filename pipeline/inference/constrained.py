"""Constrained decoding: a ``format: json`` answer that is valid JSON by construction.

A small model asked for JSON writes prose, forgets a brace or runs past
``max_tokens`` in the middle of a string.  Instead of parsing whatever comes
out, each decode step masks the logits to the tokens that keep the answer a
prefix of valid JSON (llguidance compiles the JSON Schema into a token-level
matcher).  The mask is applied with plain ``mx.where`` on a boolean vector, so
it runs wherever MLX runs (CPU, CUDA, Metal), not only where llguidance's
Metal kernel does.

The constraint is a *per-row logits processor* with mlx-lm's signature
``processor(tokens, logits) -> logits``: ``tokens`` are the ids generated so
far for that row, ``logits`` that row's next-token logits.  The processor
consumes the tokens it has not seen yet and masks the logits, so it fits a
per-task decode loop and a batched loop (one processor per row) alike.

Budget: every token is at least one byte, so an answer of at most
``max_tokens`` bytes always completes.  When a task names its fields, string
values get a ``maxLength`` that keeps the whole object inside the budget
(exact for ASCII text; wider characters can still run out, which the
json-repair fallback in :mod:`pipeline.inference.extract` then handles).
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np

logger = logging.getLogger(__name__)

#: ``processor(tokens generated so far, logits [1, V] or [V]) -> logits``
LogitsProcessor = Callable[[Sequence[int], mx.array], mx.array]

_MAX_INT = 10**15 - 1
_NUMBER_BYTES = 24  # room for one number/boolean value: "-1234567.891e+10" and a margin
_ll_tokenizers: dict[int, tuple[Any, Any]] = {}


def task_json_schema(task: Any) -> dict:
    """The JSON Schema a ``format: json`` task's answer must satisfy.

    ``schema:`` wins as written.  ``fields:`` as a list asks for an object with
    exactly those keys, each a string or null; as a mapping ``{name: type}``
    each key gets that JSON type (or null).  Neither: any JSON object.
    """
    if getattr(task, "schema_", None) is not None:
        return copy.deepcopy(task.schema_)
    fields = getattr(task, "fields", None)
    if not fields:
        return {"type": "object"}
    types = dict(fields) if isinstance(fields, dict) else {name: "string" for name in fields}
    props = {name: {"type": [t, "null"]} for name, t in types.items()}
    for p in props.values():
        if p["type"][0] in ("integer", "number"):  # bounded digits (a "number" may still have long decimals)
            p.update(minimum=-_MAX_INT, maximum=_MAX_INT)
    _bound_strings(props, getattr(task, "max_tokens", 0))
    return {"type": "object", "properties": props, "required": list(types), "additionalProperties": False}


def _bound_strings(props: dict[str, dict], max_tokens: int) -> None:
    """Give string values a ``maxLength`` so the whole object fits ``max_tokens`` bytes."""
    fixed = 2 + sum(len(name) + 4 for name in props)  # {} + "name": + commas
    strings = [p for p in props.values() if "string" in p["type"]]
    others = len(props) - len(strings)
    budget = max_tokens - fixed - _NUMBER_BYTES * others - 2 * len(strings)  # 2 quotes per string
    if not strings or budget < len(strings):
        return  # too tight to bound usefully; the repair fallback covers a cut-off answer
    for p in strings:
        p["maxLength"] = budget // len(strings)


def _ll_tokenizer(tokenizer: Any) -> Any:
    """An llguidance tokenizer for ``tokenizer`` (an HF fast tokenizer, possibly
    wrapped by mlx-lm), built once per tokenizer object: it takes about a second."""
    import llguidance

    hit = _ll_tokenizers.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    hf = tokenizer
    if not hasattr(hf, "backend_tokenizer"):
        hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper holds the HF tokenizer
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"{type(hf).__name__} is not a fast (Rust) tokenizer; constrained decoding needs one")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    eos = getattr(hf, "eos_token_id", None)
    ll = llguidance.LLTokenizer(backend.to_str(), eos_token=eos)
    _ll_tokenizers[id(tokenizer)] = (tokenizer, ll)
    return ll


class JsonConstraint:
    """Masks one row's logits so its tokens stay a prefix of JSON matching ``schema``.

    Call it as an mlx-lm logits processor; ``done`` turns True once the JSON
    value is complete (then only end-of-sequence is allowed).
    """

    def __init__(self, tokenizer: Any, schema: dict):
        import llguidance

        self._ll = _ll_tokenizer(tokenizer)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}  # compact JSON: no budget spent on blanks
        )
        self.matcher = llguidance.LLMatcher(self._ll, grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"cannot compile the JSON schema: {self.matcher.get_error()}")
        self._seen = 0
        self._words = np.empty((self._ll.vocab_size + 31) // 32, dtype=np.int32)

    @property
    def done(self) -> bool:
        return self.matcher.is_accepting()

    @property
    def failed(self) -> str | None:
        """Why the matcher gave up (a token it could not accept), else None."""
        return self.matcher.get_error() if self.matcher.is_error() else None

    def __call__(self, tokens: Sequence[int], logits: mx.array) -> mx.array:
        for tok in list(tokens)[self._seen:]:
            self.matcher.consume_token(int(tok))
        self._seen = len(tokens)
        if self.matcher.is_error():
            return logits  # never mask everything away; the answer is parsed (and repaired) afterwards
        self.matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        allowed = np.unpackbits(self._words.view(np.uint8), bitorder="little").astype(bool)
        vocab = logits.shape[-1]
        if allowed.size < vocab:  # model rows beyond the tokenizer's vocabulary are padding
            allowed = np.concatenate([allowed, np.zeros(vocab - allowed.size, dtype=bool)])
        return mx.where(mx.array(allowed[:vocab]), logits, mx.array(-np.inf, dtype=logits.dtype))


def json_processor(task: Any, tokenizer: Any) -> LogitsProcessor | None:
    """The logits processor for ``task``, or None (text tasks; a tokenizer
    llguidance cannot read, which is logged and decodes unconstrained)."""
    if getattr(task, "format", "text") != "json":
        return None
    try:
        return JsonConstraint(tokenizer, task_json_schema(task))
    except (TypeError, ImportError) as e:
        logger.warning("task %s: JSON decoding is not constrained (%s)", task.name, e)
        return None
