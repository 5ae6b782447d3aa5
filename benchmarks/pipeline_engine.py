"""Measure what prefill-once buys on a long document, and what chunking costs in memory.

    python -m benchmarks.pipeline_engine [--pages 12] [--tasks 3] [--max-tokens 16] [--json]

On the built-in SmolLM2-135M-Instruct (float32 on CPU) with a generated
multi-page PDF (``pipeline.inputs.samples.make_long_pdf``), reports for the fp16 and
TurboQuant 3.5-bit caches:

* prefill seconds for the document (once) and decode seconds per task;
* the same tasks with a fresh prefill each (what a naive loop does) - total
  seconds, so the reuse speed-up is measured, not assumed;
* KV-cache bytes after prefill (tokens held) and MLX peak memory of the
  prefill step with the job's chunk size vs the whole document in one step;
* whether the answer to "what is the code word for page N?" contains it
  (a 135M model is weak; this is a smoke check, not a quality benchmark).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import pipeline  # noqa: F401  (OpenBLAS before mlx.core)

import mlx.core as mx

from pipeline.inference.engine import Engine
from pipeline.inference.prompt import PromptBuilder
from pipeline.inputs.discover import DocumentRef
from pipeline.inputs.ingest import ingest
from pipeline.inputs.samples import long_pdf_code_word, make_long_pdf
from pipeline.models.load import load_model
from pipeline.schema.job import CacheSpec, ContextSpec, TaskSpec


def _prefill_peak(loaded, prompt, spec) -> tuple[float, float]:
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    engine = Engine(loaded, spec)
    t0 = time.perf_counter()
    engine.prefill(prompt)
    dt = time.perf_counter() - t0
    peak = mx.get_peak_memory() - base
    engine.cache = None
    return dt, peak / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=12)
    ap.add_argument("--tasks", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    loaded = load_model(None)
    with tempfile.TemporaryDirectory() as tmp:
        pdf = make_long_pdf(Path(tmp) / "long.pdf", pages=args.pages)
        t0 = time.perf_counter()
        doc = ingest(DocumentRef(source=pdf, kind="pdf", doc_id="long.pdf"), ContextSpec())
        ingest_s = time.perf_counter() - t0
    asked = list(dict.fromkeys([1, max(1, args.pages // 2), args.pages]))[: args.tasks]
    tasks = [
        TaskSpec(name=f"code{p}", prompt=f"What is the code word for page {p}? Answer with the word only.",
                 max_tokens=args.max_tokens)
        for p in asked
    ]
    t0 = time.perf_counter()
    prompt = PromptBuilder(loaded.tokenizer, kind="text").build(doc, ContextSpec(max_tokens=32768), tasks)
    tokenize_s = time.perf_counter() - t0

    report: dict = {
        "model": loaded.name, "pages": args.pages, "document_tokens": prompt.n_tokens,
        "ingest_s": round(ingest_s, 3), "tokenize_s": round(tokenize_s, 3), "chunk": args.chunk, "schemes": {},
    }
    for scheme, bits in (("fp16", 16), ("turboquant", 3.5)):
        spec = CacheSpec(kv_quant_scheme=scheme, kv_bits=3.5 if scheme == "turboquant" else 3.5, prefill_chunk=args.chunk)
        engine = Engine(loaded, spec)
        t0 = time.perf_counter()
        results = engine.process(prompt, tasks)
        shared_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for task in tasks:  # the naive way: one fresh prefill per task
            Engine(loaded, spec).process(prompt, [task])
        fresh_s = time.perf_counter() - t0
        chunk_s, chunk_peak = _prefill_peak(loaded, prompt, spec)
        whole = CacheSpec(**{**spec.model_dump(), "prefill_chunk": prompt.n_tokens})
        whole_s, whole_peak = _prefill_peak(loaded, prompt, whole)
        report["schemes"][scheme] = {
            "prefills": engine.prefill_count,
            "prefill_s": results[0].timing["prefill_s"],
            "decode_s": [r.timing["decode_s"] for r in results],
            "all_tasks_one_prefill_s": round(shared_s, 2),
            "all_tasks_fresh_prefill_each_s": round(fresh_s, 2),
            "speedup": round(fresh_s / shared_s, 2),
            "kv_bytes_after_prefill": results[0].cache["nbytes_after_prefill"],
            "prefill_peak_mib_chunked": round(chunk_peak, 1),
            "prefill_peak_mib_one_step": round(whole_peak, 1),
            "prefill_s_chunked": round(chunk_s, 2),
            "prefill_s_one_step": round(whole_s, 2),
            "answers": {r.task: r.text.strip()[:40] for r in results},
            "answers_correct": sum(long_pdf_code_word(p) in r.text for p, r in zip(asked, results)),
        }
    if args.json:
        print(json.dumps(report))
        return
    print(f"{report['model']}: {args.pages}-page PDF, {report['document_tokens']} document tokens "
          f"(ingest {ingest_s:.2f} s, tokenize {tokenize_s:.2f} s), {len(tasks)} tasks x {args.max_tokens} tokens")
    for scheme, r in report["schemes"].items():
        print(f"\n[{scheme}]")
        for k, v in r.items():
            print(f"  {k:32s} {v}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
