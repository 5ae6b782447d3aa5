"""One task added to a finished job: the rerun loads the stored document cache instead of prefilling.

    python -m benchmarks.document_cache [--pages 18] [--chunk 512] [--kv-bits 3.5] [--task-tokens 16]
                                        [--model PATH] [--context-tokens 8192] [--keep DIR] [--tiny] [--json]

Generates a ``--pages``-page text PDF (``pipeline.inputs.samples.make_long_pdf``,
~430 tokens a page, so 18 pages fill most of the built-in SmolLM2's 8192-token
context) and runs ``tqpipe run`` four times, each in a fresh process, with
the store in the work folder (``cache_store.path``):

1. **first**: the job with one task; the document is prefilled and its cache stored;
2. **added**: the same job with a second task appended; only that task runs,
   and its record must say ``cache.doc_cache.hit`` with ``timing.prefill_s == 0``;
3. **fresh**: the second task alone with the store off (``max_gb: 0``), the
   reference a loaded cache must reproduce (greedy, so the text must be equal);
4. **again**: the fresh job once more, the control: where two fresh prefills already
   answer differently (GPU decode is not bit-reproducible), a loaded cache's
   differing answer says nothing against the cache.

Where each key comes from (the records, nothing re-timed):

* ``prefill_s``: the storing run's ``timing.prefill_s`` (chunked prefill of the document);
* ``save_s`` / ``load_s``: ``cache.doc_cache.save_s`` of the storing run / ``load_s`` of the added-task run
  (load = CRC-32 of every tensor on the file + reading it + rebuilding the layer caches);
* ``ttft_fresh_s`` = the reference run's ``ingest_s + prefill_s + task_prefill_s``;
  ``ttft_cached_s`` = the added-task run's ``ingest_s + lookup_s + load_s + task_prefill_s``
  (``ingest_s`` 0 and ``cache.doc_cache.ingest == "skipped"`` when the store was used without
  reading the document; ``lookup_s``: finding the entry and checking it fits): from the
  start of the document to its first generated token, model load excluded
  (it is the same in both) and so is tokenization (not in the records);
* ``bytes_on_disk``: the store entry's file size; ``bytes_in_memory``: the storing run's
  ``cache.nbytes_after_prefill`` (the bytes the cache holds for its tokens);
* ``identical``: the added-task run's answer == the reference run's answer;
  ``repeatable``: the reference run's answer == the **again** run's (the same job);
* ``records_timing``: each run's ``timing`` and ``cache.doc_cache`` fields, as recorded.

``--tiny`` is the CPU smoke test: 2 pages, chunks of 128, 4 new tokens.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.pipeline_run import run_cli

TASKS = (("first_task", "What is the code word for page 2? Answer with the word only."),
         ("added_task", "What is the code word for page 1? Answer with the word only."))


def job_yaml(name: str, tasks: tuple, *, store: str | None, kv_bits: float, chunk: int,
             task_tokens: int, output: str, model: str | None = None, context_tokens: int = 8192) -> str:
    lines = "".join(f"  - {{name: {t}, prompt: '{q}', max_tokens: {task_tokens}}}\n" for t, q in tasks)
    store_line = f"cache_store: {{path: {store}}}\n" if store else "cache_store: {max_gb: 0}\n"
    return (
        f"name: {name}\n"
        "inputs: [docs/long.pdf]\n"
        + (f"model: {{path: '{model}'}}\n" if model else "")
        + f"cache: {{kv_quant_scheme: turboquant, kv_bits: {kv_bits:g}, prefill_chunk: {chunk}}}\n"
        f"context: {{max_tokens: {context_tokens}, overflow: truncate}}\n"
        f"tasks:\n{lines}"
        f"output: {output}\n"
        f"{store_line}"
    )


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def measure(work: Path, *, pages: int, chunk: int, kv_bits: float, task_tokens: int,
            model: str | None = None, context_tokens: int = 8192, echo=print) -> dict:
    """Run the three jobs in ``work`` and return the result keys."""
    from pipeline.inputs.samples import make_long_pdf

    (work / "docs").mkdir(parents=True, exist_ok=True)
    make_long_pdf(work / "docs" / "long.pdf", pages)
    opts = dict(kv_bits=kv_bits, chunk=chunk, task_tokens=task_tokens, model=model, context_tokens=context_tokens)
    store = work / "store"
    runs = {
        "first": job_yaml("doc-cache", TASKS[:1], store=str(store), output="results.jsonl", **opts),
        "added": job_yaml("doc-cache", TASKS, store=str(store), output="results.jsonl", **opts),
        "fresh": job_yaml("doc-cache-fresh", TASKS[1:], store=None, output="fresh.jsonl", **opts),
        "again": job_yaml("doc-cache-again", TASKS[1:], store=None, output="again.jsonl", **opts),
    }
    for name in ("results.jsonl", "fresh.jsonl", "again.jsonl"):
        (work / name).unlink(missing_ok=True)
    walls = {}
    for name, text in runs.items():
        job = work / f"job-{name}.yaml"
        job.write_text(text)
        echo(f"$ tqpipe run {job.name} --no-progress")
        log = work / f"job-{name}.log"
        code, _, walls[name] = run_cli(job, log)
        echo(log.read_text().rstrip())
        if code != 0:
            raise SystemExit(f"{job}: tqpipe run exited {code}")
    first, added = _records(work / "results.jsonl")
    (fresh,) = _records(work / "fresh.jsonl")
    (again,) = _records(work / "again.jsonl")
    for r in (first, added, fresh, again):
        if r["status"] != "ok":
            raise SystemExit(f"run recorded an error: {r['error']}")
    entries = list(store.glob("*.safetensors"))
    if len(entries) != 1:
        raise SystemExit(f"{store}: expected one entry, found {len(entries)}")
    hit = added["cache"]["doc_cache"]
    tf, ta, tr = first["timing"], added["timing"], fresh["timing"]
    tokens = first["tokens"]["document"]
    bytes_on_disk = entries[0].stat().st_size
    bytes_in_memory = first["cache"]["nbytes_after_prefill"]
    return {
        "tokens": tokens,
        "pages": pages,
        "truncated": bool(first["context"].get("truncated")),
        "prefill_s": tf["prefill_s"],
        "save_s": first["cache"]["doc_cache"]["save_s"],
        "load_s": hit.get("load_s"),
        "cache_hit": bool(hit["hit"]),
        "rerun_prefill_s": ta["prefill_s"],
        "ttft_fresh_s": round(tr["ingest_s"] + tr["prefill_s"] + tr["task_prefill_s"], 4),
        "ttft_cached_s": round(ta["ingest_s"] + (hit.get("lookup_s") or 0) + (hit.get("load_s") or 0)
                               + ta["task_prefill_s"], 4),
        "ingest_skipped": hit.get("ingest") == "skipped",
        "bytes_on_disk": bytes_on_disk,
        "bytes_in_memory": bytes_in_memory,
        "disk_per_token": bytes_on_disk / tokens,
        "memory_per_token": bytes_in_memory / tokens,
        "identical": added["output"] == fresh["output"],
        "repeatable": fresh["output"] == again["output"],
        "answer_cached": added["output"],
        "answer_fresh": fresh["output"],
        "answer_again": again["output"],
        "wall_s": {k: round(v, 1) for k, v in walls.items()},
        "records_timing": {name: {**r["timing"], **(r["cache"].get("doc_cache") or {})}
                           for name, r in (("first", first), ("added", added), ("fresh", fresh))},
    }


def report(r: dict) -> str:
    return "\n".join([
        f"document: {r['pages']} pages, {r['tokens']} tokens (TurboQuant cache)"
        + (" -- CUT TO FIT the context: a cut document is read again on every run; use fewer pages"
           if r["truncated"] else ""),
        f"storing run (one task): prefill {r['prefill_s']:.2f} s, store write {r['save_s']:.2f} s",
        f"reference run (added task, store off): time to first token {r['ttft_fresh_s']:.2f} s",
        f"added-task run: load {r['load_s']:.3f} s (hit={r['cache_hit']}, prefill {r['rerun_prefill_s']} s, "
        f"reading skipped: {r['ingest_skipped']}), "
        f"time to first token {r['ttft_cached_s']:.3f} s = {100 * r['ttft_cached_s'] / r['prefill_s']:.2f}% of the storing run's prefill",
        f"bytes: {r['bytes_on_disk']} on disk vs {r['bytes_in_memory']} in memory "
        f"({r['disk_per_token']:.1f} vs {r['memory_per_token']:.1f} per token, {r['bytes_on_disk'] / r['bytes_in_memory']:.4f}x)",
        f"identical answers: {r['identical']} ({r['answer_cached']!r} vs {r['answer_fresh']!r}); "
        f"control, the reference run again: {'same' if r['repeatable'] else 'DIFFERENT'} answer"
        + ("" if r["repeatable"] else f" ({r['answer_again']!r}: decode is not reproducible here)"),
    ])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=18, help="~430 tokens a page; SmolLM2's context is 8192 tokens")
    ap.add_argument("--chunk", type=int, default=512, help="cache.prefill_chunk")
    ap.add_argument("--kv-bits", type=float, default=3.5)
    ap.add_argument("--task-tokens", type=int, default=16)
    ap.add_argument("--model", help="model.path (default: the built-in SmolLM2-135M-Instruct)")
    ap.add_argument("--context-tokens", type=int, default=8192,
                    help="context.max_tokens (capped at the model's own limit: 8192 for SmolLM2)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: 2 pages, chunks of 128, 4 tokens")
    ap.add_argument("--keep", type=Path, help="work in this folder (kept) instead of a temp dir")
    ap.add_argument("--json", action="store_true", help="print the result as JSON on the last line")
    args = ap.parse_args(argv)
    if args.tiny:
        args.pages, args.chunk, args.task_tokens = 2, 128, 4
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        result = measure(work, pages=args.pages, chunk=args.chunk, kv_bits=args.kv_bits,
                         task_tokens=args.task_tokens, model=args.model, context_tokens=args.context_tokens)
    result["args"] = {k: str(v) for k, v in vars(args).items()}
    print(report(result))
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
