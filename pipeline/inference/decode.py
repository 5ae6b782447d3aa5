"""The decode loop: one or many task rows, asynchronous like mlx-lm's ``generate_step``.

Step ``n + 1`` is queued (``mx.async_eval``) before the host reads the
tokens of step ``n``, so the device never waits for Python between steps.
The one host sync per step is reading that step's token ids (one int per
row), which stopping needs: a row stops at EOS or at its ``max_tokens``.
A stopped row leaves the batch at the next step (the token already queued
for it is dropped with it), so the other rows never wait for it and never
carry it.  The step queued speculatively before an EOS is seen is the price
of never stalling (mlx-lm pays the same).

A row with a logits processor (``format: json``: the mask depends on every
token so far) or a repetition penalty cannot be sampled before its previous
token is known, so a batch holding one reads each step's tokens before
queueing the next: the same tokens, without the overlap.

Sampling per row matches a task run alone: greedy rows take the argmax,
sampled rows draw from their own key (``mx.random.key(seed)``, split once
per step), so a row's tokens do not depend on which other rows share its
batch.  The filters (top-p, min-p, top-k) and the repetition penalty are
mlx-lm's, in its order; the penalty reads the answer's own tokens (the
document is not "repetition").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx

CLEAR_EVERY = 256  # steps between MLX buffer-cache clears (as mlx-lm's generate_step)
REPETITION_CONTEXT = 20  # answer tokens a repetition penalty reads unless told (mlx-lm's default)


@dataclass
class Row:
    """One task being decoded: its limits, sampling state and output so far."""

    max_tokens: int
    temperature: float = 0.0
    key: Optional[mx.array] = None
    tokens: list[int] = field(default_factory=list)
    finish: Optional[str] = None  # "stop" (EOS) or "length" (max_tokens)
    done_at: float = 0.0  # perf_counter when the row finished
    processor: Optional[Callable[[list[int], mx.array], mx.array]] = None  # (tokens so far, logits) -> logits
    penalty: Optional[Callable[[list[int], mx.array], mx.array]] = None  # mlx-lm's repetition penalty processor
    filters: tuple[Callable[[mx.array], mx.array], ...] = ()  # on log-probabilities, before the draw

    @classmethod
    def for_task(cls, task: Any, seed: int, processor: Optional[Callable] = None) -> "Row":
        temp = float(task.temperature)
        return cls(max_tokens=int(task.max_tokens), temperature=temp,
                   key=mx.random.key(seed) if temp > 0 else None, processor=processor,
                   penalty=repetition_penalty(task), filters=sampling_filters(task) if temp > 0 else ())

    @property
    def reads_tokens(self) -> bool:
        """Whether sampling this row needs the token just sampled (no step ahead)."""
        return self.processor is not None or self.penalty is not None

    def logits_for(self, logits: mx.array) -> mx.array:
        """This row's logits [V] after its processor and repetition penalty."""
        if self.processor is not None:
            logits = self.processor(self.tokens, logits)
        if self.penalty is not None:  # mlx-lm's processors take [1, V]
            logits = self.penalty(self.tokens, logits[None])[0]
        return logits


def repetition_penalty(task: Any) -> Optional[Callable[[list[int], mx.array], mx.array]]:
    """mlx-lm's repetition penalty processor for a task that sets one, else None."""
    penalty = getattr(task, "repetition_penalty", None)
    if penalty is None or penalty == 1.0:
        return None
    from mlx_lm.sample_utils import make_repetition_penalty

    return make_repetition_penalty(float(penalty), int(getattr(task, "repetition_context_size", None)
                                                        or REPETITION_CONTEXT))


def sampling_filters(task: Any) -> tuple[Callable[[mx.array], mx.array], ...]:
    """mlx-lm's filters a task asks for, in mlx-lm's order (top-p, min-p, top-k)."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    out: list[Callable[[mx.array], mx.array]] = []
    top_p, min_p, top_k = (getattr(task, k, None) for k in ("top_p", "min_p", "top_k"))
    if top_p is not None and top_p < 1.0:
        out.append(lambda x: apply_top_p(x, float(top_p)))
    if min_p is not None:
        out.append(lambda x: apply_min_p(x, float(min_p)))
    if top_k is not None:
        out.append(lambda x: apply_top_k(x, int(top_k)) if int(top_k) < x.shape[-1] else x)
    return tuple(out)


def sample(logits: mx.array, rows: Sequence[Row]) -> mx.array:
    """Next token per row, int32 [len(rows)], unevaluated."""
    if all(r.temperature <= 0 and not r.reads_tokens for r in rows):
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    out = []
    for i, r in enumerate(rows):
        row_logits = r.logits_for(logits[i])
        if r.temperature <= 0:
            out.append(mx.argmax(row_logits, axis=-1))
        else:
            # the filters read log-probabilities; a plain draw is shift-invariant
            # and keeps the logits (the tokens sampled tasks always had)
            if r.filters:
                row_logits = row_logits - mx.logsumexp(row_logits, axis=-1, keepdims=True)
                for keep in r.filters:
                    row_logits = keep(row_logits)
            r.key, sub = mx.random.split(r.key)
            out.append(mx.random.categorical(row_logits * (1.0 / r.temperature), key=sub))
    return mx.stack(out).astype(mx.int32)


def decode_rows(
    rows: Sequence[Row],
    logits: mx.array,
    step: Callable[[mx.array], mx.array],
    eos_ids: set[int],
    *,
    keep: Callable[[list[int]], None] | None = None,
    on_token: Callable[[int], None] | None = None,
) -> int:
    """Decode every row from ``logits [B, V]`` (the rows' last prompt position).

    ``step(tokens [b])`` forwards one token per live row and returns their
    logits ``[b, V]``; ``keep(positions)`` tells the caches which batch
    positions stay after rows finished.  Fills each row's ``tokens``,
    ``finish`` and ``done_at``; returns the number of ``step`` calls.
    """
    now = time.perf_counter()
    live = []
    for i, r in enumerate(rows):
        if r.max_tokens <= 0:
            r.finish, r.done_at = "length", now
        else:
            live.append(i)
    if not live:
        return 0
    if len(live) < len(rows):
        logits = logits[mx.array(live)]
        if keep is not None:
            keep(live)
    y = sample(logits, [rows[i] for i in live])
    mx.async_eval(y)
    steps = 0
    while True:
        batch = [rows[i] for i in live]
        next_y = None
        ahead = not any(r.reads_tokens for r in batch)  # a processor or penalty needs this step's tokens first
        if not ahead:
            tokens = y.tolist()
        if any(len(r.tokens) + 1 < r.max_tokens for r in batch):
            next_logits = step(y)
            if not ahead:  # the processors see the token just sampled
                for r, tok in zip(batch, tokens):
                    r.tokens.append(tok)
                next_y = sample(next_logits, batch)
                for r in batch:
                    r.tokens.pop()
            else:
                next_y = sample(next_logits, batch)
            mx.async_eval(next_y)
            steps += 1
            if steps % CLEAR_EVERY == 0:
                mx.clear_cache()
        if ahead:
            tokens = y.tolist()  # the step's one host sync
        now = time.perf_counter()
        stay = []
        for pos, (r, tok) in enumerate(zip(batch, tokens)):
            if tok in eos_ids:
                r.finish = "stop"
            else:
                r.tokens.append(tok)
                if on_token is not None:
                    on_token(1)
                if len(r.tokens) >= r.max_tokens:
                    r.finish = "length"
            if r.finish is None:
                stay.append(pos)
            else:
                r.done_at = now
        if not stay:
            return steps
        # a row still running had room for one more token, so next_y exists
        if len(stay) < len(batch):
            next_y = next_y[mx.array(stay)]
            if keep is not None:
                keep(stay)
            live = [live[p] for p in stay]
        y = next_y
