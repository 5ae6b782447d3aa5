"""One document, 4 tasks: decoded as one batch of rows vs one task at a time.

    python -m benchmarks.engine_batch --json [--out OUT.json] [--model PATH|--shape 8b]
        [--context 2048] [--tokens 24] [--cache turboquant-3.5]

Both modes prefill the same document once through ``Engine.prefill`` (not
timed here) and then run the 4 tasks: batched (``Engine.run_batch``: one
forward for all suffixes, then one per step for all live rows, the document
cache read once per step) or sequential (``Engine.run_task`` per task, the
cache rewound in between).  Greedy, EOS as the tokenizer says.

Keys: ``tasks``, ``forward_passes_batched`` / ``forward_passes_sequential``
(suffix passes + decode steps), ``seconds_batched`` / ``seconds_sequential``
(task suffixes + decode, wall), ``seconds_one_task`` (the first task alone:
the goal compares 4 batched tasks with it), ``identical`` (every token
sequence equal), ``agreement`` (equal tokens / positions, over the longer of
each pair), and ``max_logit_diff``: the largest |difference| of the
last-position logits of the same token sequences (suffix + tokens up to the
first disagreement, or all of them) through the two paths, which shows a
difference is float summation order (goal: <= 1e-3).

Model: the built-in SmolLM2 (default, CPU), a model directory (``--model``,
e.g. from ``scripts/build_model.py``), or ``--shape`` built in memory with
random weights (``benchmarks.whole_model.build_model``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Sequence

import turboquant  # noqa: F401  (fast CPU BLAS before mlx.core)
import mlx.core as mx

QUESTIONS = {
    "summary": "Summarize the document in one sentence.",
    "code_word": "What is the code word for page 2? Answer with the word only.",
    "pages": "How many pages does the document have?",
    "title": "Give the document a short title, then list three topics it covers.",
}


def load(args) -> Any:
    from pipeline.models.load import load_model

    if args.shape:
        from types import SimpleNamespace

        from benchmarks.whole_model import _NoTextTokenizer, build_model

        model, _ = build_model(args.shape, mx.bfloat16 if args.shape != "tiny" else mx.float32)
        return SimpleNamespace(model=model, tokenizer=_NoTextTokenizer(), kind="text", name=f"shape:{args.shape}")
    return load_model(args.model)


def document_prompt(loaded: Any, context: int, tasks: Sequence[Any]):
    """A ``context``-token document and each task's suffix ids: the long
    sample PDF's page texts through the pipeline's own ``PromptBuilder`` (the
    model's chat template), or plain ids for a random-weight shape."""
    from pipeline.inference.prompt import DocumentPrompt

    if isinstance(loaded.tokenizer, _no_text_tokenizer()):
        ids = [(7 * i + 3) % 4000 + 100 for i in range(context)]
        suffix = {t.name: [(11 * j + 5 * k) % 4000 + 100 for j in range(6 + 3 * k)] for k, t in enumerate(tasks)}
        return DocumentPrompt(prefix_ids=ids, task_ids=suffix, page_offsets={1: 0}, included_pages=[1],
                              skipped_pages=[])
    from pathlib import Path as _P

    from pipeline.inference.prompt import PromptBuilder
    from pipeline.inputs.discover import DocumentRef
    from pipeline.inputs.document import Document, Page
    from pipeline.schema.job import ContextSpec
    from pipeline.inputs.samples import _WORDS, long_pdf_code_word

    words = _WORDS.split()
    pages = [Page(n, f"This is page {n}. The code word for page {n} is {long_pdf_code_word(n)}.\n\n"
                     + " ".join(words[(n * 7 + i) % len(words)] for i in range(250)), None, False)
             for n in range(1, context // 100 + 2)]
    doc = Document(ref=DocumentRef(source=_P("/bench/long.pdf"), kind="pdf", doc_id="long.pdf"),
                   content_hash="sha256:0", page_count=len(pages), pages=pages)
    builder = PromptBuilder(loaded.tokenizer, kind="text")
    return builder.build(doc, ContextSpec(max_tokens=context + 256, overflow="truncate", images="never"), tasks)


def _no_text_tokenizer():
    from benchmarks.whole_model import _NoTextTokenizer

    return _NoTextTokenizer


def agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
    equal = total = 0
    for x, y in zip(a, b):
        n = max(len(x), len(y))
        total += n
        equal += sum(1 for i in range(min(len(x), len(y))) if x[i] == y[i])
    return equal / total if total else 1.0


def last_logits_diff(engine, state, prompt, tasks, seqs: list[list[int]]) -> float:
    """max |logits| difference at the last position of ``suffix + seq`` per task,
    sequential cache vs shared-document rows (teacher-forced, one pass each)."""
    from turboquant.shared_prefix import SharedPrefixCache

    ids = [list(prompt.task_ids[t.name]) + s for t, s in zip(tasks, seqs)]
    seq_logits = []
    for row in ids:
        for c in engine.cache:
            if hasattr(c, "hold"):
                c.hold = True
        seq_logits.append(engine._forward(mx.array([row], dtype=mx.int32), None, None, logits=True)[0])
        mx.eval(seq_logits[-1])
        engine._rewind(state)
    S = max(len(r) for r in ids)
    pads = [S - len(r) for r in ids]
    rows = [SharedPrefixCache(c, pads) for c in engine.cache]
    x = mx.array([[0] * p + r for p, r in zip(pads, ids)], dtype=mx.int32)
    batched = engine._forward(x, None, None, logits=True, cache=rows)
    diff = mx.abs(batched.astype(mx.float32) - mx.stack(seq_logits).astype(mx.float32)).max()
    return float(diff.item())


def run(loaded: Any, cache: str, context: int, tokens: int) -> dict:
    from benchmarks.whole_model import cache_spec
    from pipeline.inference.engine import Engine
    from pipeline.schema.job import TaskSpec

    tasks = [TaskSpec(name=k, prompt=q, max_tokens=tokens) for k, q in QUESTIONS.items()]
    prompt = document_prompt(loaded, context, tasks)
    spec = cache_spec(cache, 512)
    reserve = max(len(v) for v in prompt.task_ids.values()) + tokens

    batched = Engine(loaded, spec)
    state = batched.prefill(prompt, reserve=reserve)
    batched.settle(state)
    ids = [prompt.task_ids[t.name] for t in tasks]
    t0 = time.perf_counter()
    b_res = batched.run_batch(state, tasks, ids)
    seconds_batched = time.perf_counter() - t0
    passes_batched = 1 + batched.decode_forwards

    seq = Engine(loaded, spec, batch_tasks=False)
    s_state = seq.prefill(prompt, reserve=reserve)
    seq.settle(s_state)
    s_res, per_task = [], []
    for t in tasks:
        t0 = time.perf_counter()
        s_res.append(seq.run_task(s_state, t, prompt.task_ids[t.name]))
        per_task.append(time.perf_counter() - t0)
    passes_sequential = len(tasks) + seq.decode_forwards

    a, b = [r.token_ids for r in b_res], [r.token_ids for r in s_res]
    common = []  # tokens up to the first disagreement per task
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        common.append(y[:n])
    diff = last_logits_diff(seq, s_state, prompt, tasks, common)
    return {
        "tasks": len(tasks),
        "context": len(prompt.prefix_ids),
        "cache": cache,
        "forward_passes_batched": passes_batched,
        "forward_passes_sequential": passes_sequential,
        "seconds_batched": round(seconds_batched, 4),
        "seconds_sequential": round(sum(per_task), 4),
        "seconds_one_task": round(per_task[0], 4),
        "generated": [len(x) for x in a],
        "identical": a == b,
        "agreement": round(agreement(a, b), 6),
        "max_logit_diff": diff,
        "device": str(mx.default_device()),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the result as JSON on the last line")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--model", default=None, help="model.path (default: the built-in SmolLM2)")
    ap.add_argument("--shape", default=None, help="a random-weight llama shape instead: 8b, 1b or tiny")
    ap.add_argument("--context", type=int, default=2048, help="document tokens")
    ap.add_argument("--tokens", type=int, default=24, help="max_tokens per task")
    ap.add_argument("--cache", default="turboquant-3.5", help="bf16, turboquant-B or affine-B")
    a = ap.parse_args(argv)
    result = run(load(a), a.cache, a.context, a.tokens)
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))
    if a.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:26s} {v}")
    return result


if __name__ == "__main__":
    main()
