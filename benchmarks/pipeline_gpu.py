"""Long PDFs through ``tqpipe run`` at GPU scale, per cache: the job of ``jobs/long_pdfs.yaml``.

    python -m benchmarks.pipeline_gpu --json OUT.json [--work DIR] [--model DIR] [--shape 8b]
        [--pages 300,1000] [--caches turboquant-3.5,bf16] [--context-tokens 131072] [--chunk 2048] [--tokens 64]
    python -m benchmarks.pipeline_gpu --tiny --json OUT.json      # CPU smoke of the plumbing

In ``--work`` (default: a temp dir) it writes the sample PDFs
(``pipeline.inputs.samples.make_long_pdf``: ``--pages`` pages each), builds the model
directory once if ``--model`` is not given (``scripts/build_model.py
--shape``), and writes one job file per cache that differs from
``jobs/long_pdfs.yaml`` only in paths and the cache block.  Each job runs in
a fresh ``tqpipe run`` process (``benchmarks.pipeline_run.run_cli``: its own
peak memory and max RSS), all four tasks of a document as one batch.

Per (cache, document) row, from the records: ``doc_wall_s`` (ingest + prefill +
the tasks: their shared suffix pass and the longest row's decode when the
tasks ran as one batch (``timing.batch_rows``), else the sum of each task's),
``prefill_tok_s`` (document tokens / prefill_s), ``decode_tok_s`` (all tasks'
generated tokens / the tasks' decode wall), ``kv_bytes``, ``mx_peak_bytes``
(MLX's peak during the document), plus the process's ``max_rss_bytes`` and
``process_wall_s`` (model load included).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from benchmarks.pipeline_run import REPO, run_cli

TASKS = [
    ("summary", "Summarize this document in 3 sentences.", 64),
    ("code_word", "What is the code word for page 2? Answer with the word only.", 16),
    ("pages", "How many pages does this document have? Answer with a number.", 16),
    ("title", "Give this document a short title.", 32),
]
CACHE_BLOCKS = {
    "bf16": "{kv_quant_scheme: fp16, prefill_chunk: %d}",
    "turboquant-2.5": "{kv_quant_scheme: turboquant, kv_bits: 2.5, prefill_chunk: %d}",
    "turboquant-3.5": "{kv_quant_scheme: turboquant, kv_bits: 3.5, prefill_chunk: %d}",
    "turboquant-4": "{kv_quant_scheme: turboquant, kv_bits: 4, prefill_chunk: %d}",
    "affine-4": "{kv_quant_scheme: affine, kv_bits: 4, prefill_chunk: %d}",
}


def job_yaml(cache: str, *, model: Path, docs: Path, context_tokens: int, chunk: int, tokens: int) -> str:
    """``jobs/long_pdfs.yaml`` with this run's paths, cache and task lengths."""
    tasks = "".join(f"  - {{name: {n}, prompt: '{p}', max_tokens: {min(t, tokens)}}}\n" for n, p, t in TASKS)
    return (
        f"name: long-pdfs-{cache}\n"
        f"inputs: ['{docs}/']\n"
        f"model: {{path: '{model}'}}\n"
        f"cache: {CACHE_BLOCKS[cache] % chunk}\n"
        f"context: {{max_tokens: {context_tokens}, overflow: truncate, images: never}}\n"
        f"tasks:\n{tasks}"
        f"output: results-{cache}.jsonl\n"
    )


def doc_rows(cache: str, records: list[dict]) -> list[dict]:
    """One row per document from its task records."""
    by_doc: dict[str, list[dict]] = {}
    for r in records:
        if r.get("status") != "ok":
            raise RuntimeError(f"{cache}: {r.get('doc_id')}/{r.get('task')} recorded an error: {r.get('error')}")
        by_doc.setdefault(r["doc_id"], []).append(r)
    rows = []
    for doc, recs in sorted(by_doc.items()):
        t0 = recs[0]["timing"]
        batched = t0.get("batch_rows", 1) > 1
        if batched:
            tasks_s = t0["task_prefill_s"] + max(r["timing"]["decode_s"] for r in recs)
            decode_s = max(r["timing"]["decode_s"] for r in recs)
        else:
            tasks_s = sum(r["timing"]["task_prefill_s"] + r["timing"]["decode_s"] for r in recs)
            decode_s = sum(r["timing"]["decode_s"] for r in recs)
        generated = sum(r["tokens"]["generated"] for r in recs)
        rows.append({
            "cache": cache,
            "doc_id": doc,
            "pages": recs[0]["context"]["page_count"],
            "document_tokens": recs[0]["tokens"]["document"],
            "tasks": len(recs),
            "batched": batched,
            "doc_wall_s": round(t0.get("ingest_s", 0.0) + t0["prefill_s"] + tasks_s, 3),
            "prefill_tok_s": round(recs[0]["tokens"]["document"] / t0["prefill_s"], 2),
            "decode_tok_s": round(generated / decode_s, 3) if decode_s > 0 else 0.0,
            "generated": generated,
            "kv_bytes": recs[0]["cache"]["nbytes_after_prefill"],
            "mx_peak_bytes": max(r["memory"]["mx_peak_bytes"] for r in recs),
        })
    return rows


def prepare(work: Path, pages: list[int], model: Path | None, shape: str) -> tuple[Path, Path]:
    """The sample PDFs and the model directory (built once, kept in ``work``)."""
    from pipeline.inputs.samples import make_long_pdf

    docs = work / "docs"
    docs.mkdir(parents=True, exist_ok=True)
    for n in pages:
        pdf = docs / f"long-{n}.pdf"
        if not pdf.exists():
            make_long_pdf(pdf, n)
    if model is None:
        model = work / "models" / f"llama-{shape}-shape"
        if not (model / "config.json").exists():
            sys.path.insert(0, str(REPO / "scripts"))
            from build_model import build

            build(model, shape)
    return docs, model


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, help="write the result here")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke: tiny model, 3- and 5-page PDFs, short context")
    ap.add_argument("--work", type=Path, help="work folder (kept); default a temp dir")
    ap.add_argument("--model", type=Path, help="a model directory (default: build --shape into the work folder)")
    ap.add_argument("--shape", default=None, help="8b (default), 1b or tiny")
    ap.add_argument("--pages", default=None, help="comma-separated page counts (default 300,1000)")
    ap.add_argument("--caches", default="turboquant-3.5,bf16")
    ap.add_argument("--context-tokens", type=int, default=None, help="context.max_tokens (default 131072)")
    ap.add_argument("--chunk", type=int, default=2048, help="cache.prefill_chunk")
    ap.add_argument("--tokens", type=int, default=64, help="the longest task's max_tokens")
    a = ap.parse_args(argv)
    shape = a.shape or ("tiny" if a.tiny else "8b")
    pages = [int(x) for x in (a.pages or ("3,5" if a.tiny else "300,1000")).split(",")]
    context = a.context_tokens or (1024 if a.tiny else 131072)
    chunk = min(a.chunk, 256) if a.tiny else a.chunk
    tokens = min(a.tokens, 4) if a.tiny else a.tokens
    caches = [c for c in a.caches.split(",") if c]
    bad = set(caches) - set(CACHE_BLOCKS)
    if bad:
        ap.error(f"unknown caches {sorted(bad)}; choose from {', '.join(CACHE_BLOCKS)}")

    with tempfile.TemporaryDirectory() as tmp:
        work = (a.work or Path(tmp)).resolve()
        docs, model = prepare(work, pages, a.model, shape)
        rows, processes = [], {}
        for cache in caches:
            job = work / f"job-{cache}.yaml"
            job.write_text(job_yaml(cache, model=model.resolve(), docs=docs, context_tokens=context,
                                    chunk=chunk, tokens=tokens))
            out = work / f"results-{cache}.jsonl"
            out.unlink(missing_ok=True)
            log = work / f"run-{cache}.log"
            print(f"$ tqpipe run {job} --no-progress", flush=True)
            code, rss, wall = run_cli(job, log)
            print(log.read_text().rstrip()[-4000:], flush=True)
            if code != 0:
                raise SystemExit(f"{job}: tqpipe run exited {code}; see the log above")
            recs = [json.loads(line) for line in out.read_text().splitlines()]
            rows += doc_rows(cache, recs)
            processes[cache] = {"max_rss_bytes": rss, "process_wall_s": round(wall, 2)}
    result = {"rows": rows, "processes": processes,
              "meta": {"shape": shape if a.model is None else str(a.model), "pages": pages,
                       "context_tokens": context, "prefill_chunk": chunk, "max_tokens": tokens}}
    for r in rows:
        print(json.dumps(r), flush=True)
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
