"""A long PDF through ``tqpipe run``, end to end, with the fp16 and the TurboQuant cache.

    python -m benchmarks.pipeline_run [--pages 300] [--context-tokens 8192] [--chunk 512]
                                      [--task-tokens 16] [--kv-bits 3.5] [--keep DIR] [--json]

Generates a ``--pages``-page text PDF (``pipeline.inputs.samples.make_long_pdf``),
writes two job files that differ only in ``cache.kv_quant_scheme`` (``fp16``
vs ``turboquant`` at ``--kv-bits``), and runs ``tqpipe run`` on each in a
SUBPROCESS: a fresh process per cache, so peak memory is that run's own and
not left over from the other.  The built-in SmolLM2-135M-Instruct reads the
document with ``context.max_tokens`` = its trained limit (8192) and
``overflow: truncate``, so a 300-page document is cut to its
first 19 pages (of ~132k tokens) and the record says how much was dropped.

Where each number comes from (all from the run itself, nothing re-timed):

* ingestion pages/s: ``context.page_count / timing.ingest_s`` of the record
  (the runner times ``ingest`` of the whole PDF - every page is read and
  extracted even when the context later keeps only the first ones);
* prefill tokens and tokens/s: ``tokens.document / timing.prefill_s``;
* decode tokens/s: ``tokens.generated / timing.decode_s`` (one short task);
* KV bytes: ``cache.nbytes_after_prefill`` (bytes the cache holds for the document);
* MLX peak: ``memory.mx_peak_bytes`` (reset before the document: weights +
  cache + prefill temporaries);
* max RSS: the child process's ``ru_maxrss`` from ``os.wait4`` (the whole
  process: Python, tokenizer, PyMuPDF, MLX).

On CPU the "fp16" cache holds float32: the model runs in float32 on CPU
because MLX's CPU float16 matmul has no BLAS path; the baseline cache stores
the model's dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCHEMES = ("fp16", "turboquant")
RATIO_KEYS = ("prefill_tok_s", "decode_tok_s", "kv_bytes", "mx_peak_bytes", "max_rss_bytes")


def job_yaml(scheme: str, *, kv_bits: float, context_tokens: int, chunk: int, task_tokens: int, page: int) -> str:
    """One job file; only the cache block differs between the two runs."""
    cache = "{kv_quant_scheme: fp16" if scheme == "fp16" else f"{{kv_quant_scheme: turboquant, kv_bits: {kv_bits:g}"
    return (
        f"name: pipeline-run-{scheme}\n"
        "inputs: [docs/long.pdf]\n"
        f"cache: {cache}, prefill_chunk: {chunk}}}\n"
        f"context: {{max_tokens: {context_tokens}, overflow: truncate}}\n"
        "tasks:\n"
        f"  - {{name: code_word, prompt: 'What is the code word for page {page}? Answer with the word only.', "
        f"max_tokens: {task_tokens}}}\n"
        f"output: results-{scheme}.jsonl\n"
    )


def run_cli(job: Path, log: Path) -> tuple[int, int, float]:
    """Run ``tqpipe run JOB`` in a fresh process; (exit code, child max RSS bytes, wall s).

    ``os.wait4`` gives this one child's rusage; RUSAGE_CHILDREN would be a max
    over all children, so a smaller second run would hide behind the first.
    """
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)  # keep the caller's (e.g. a --target site)
    env = {**os.environ, "TQPIPE_PROGRESS": "off", "PYTHONPATH": path}
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", str(job), "--no-progress"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=job.parent)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    rss = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return proc.returncode, rss, time.perf_counter() - t0


def row_from_record(scheme: str, rec: dict, child_rss: int, wall_s: float) -> dict:
    """The table row for one run, from its (single) result record."""
    if rec.get("status") != "ok":
        raise RuntimeError(f"{scheme}: the run recorded an error: {rec.get('error')}")
    t, tok, ctx = rec["timing"], rec["tokens"], rec["context"]
    return {
        "scheme": scheme,
        "kv_bits": rec["cache"].get("kv_bits"),
        "pages": ctx["page_count"],
        "pages_in_context": ctx["page_count"] - len(ctx.get("pages_dropped") or []),
        "tokens_dropped": ctx.get("tokens_dropped", 0),
        "ingest_s": t["ingest_s"],
        "ingest_pages_s": ctx["page_count"] / t["ingest_s"],
        "prefill_tokens": tok["document"],
        "prefill_s": t["prefill_s"],
        "prefill_tok_s": tok["document"] / t["prefill_s"],
        "decode_tokens": tok["generated"],
        "decode_tok_s": tok["generated"] / t["decode_s"] if t["decode_s"] > 0 else 0.0,
        "kv_bytes": rec["cache"]["nbytes_after_prefill"],
        "mx_peak_bytes": rec["memory"]["mx_peak_bytes"],
        "max_rss_bytes": child_rss,
        "wall_s": wall_s,
        "answer": rec["output"],
    }


def ratios(rows: dict[str, dict]) -> dict[str, float]:
    """TurboQuant / fp16 for the speed and memory columns."""
    base, tq = rows["fp16"], rows["turboquant"]
    return {k: tq[k] / base[k] for k in RATIO_KEYS if base[k]}


def format_table(rows: dict[str, dict], ratio: dict[str, float]) -> str:
    mib = 2**20
    cols = [
        ("cache", lambda r: r["scheme"] + (f" {r['kv_bits']:g}b" if r["kv_bits"] else " (f32 on CPU)"), None),
        ("pages", lambda r: f"{r['pages']}", None),
        ("in ctx", lambda r: f"{r['pages_in_context']}", None),
        ("ingest p/s", lambda r: f"{r['ingest_pages_s']:.1f}", None),
        ("prefill tok", lambda r: f"{r['prefill_tokens']}", None),
        ("prefill tok/s", lambda r: f"{r['prefill_tok_s']:.1f}", "prefill_tok_s"),
        ("decode tok/s", lambda r: f"{r['decode_tok_s']:.2f}", "decode_tok_s"),
        ("KV MiB", lambda r: f"{r['kv_bytes'] / mib:.1f}", "kv_bytes"),
        ("mx peak MiB", lambda r: f"{r['mx_peak_bytes'] / mib:.0f}", "mx_peak_bytes"),
        ("max RSS MiB", lambda r: f"{r['max_rss_bytes'] / mib:.0f}", "max_rss_bytes"),
    ]
    table = [[name for name, _, _ in cols]]
    table += [[fmt(rows[s]) for _, fmt, _ in cols] for s in SCHEMES if s in rows]
    table.append(["TQ/fp16", "", "", "", ""] + [f"{ratio[k]:.3f}x" if k in ratio else "" for _, _, k in cols[5:]])
    widths = [max(len(r[i]) for r in table) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in table)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=300)
    ap.add_argument("--context-tokens", type=int, default=8192, help="context.max_tokens (SmolLM2's limit is 8192)")
    ap.add_argument("--chunk", type=int, default=512, help="cache.prefill_chunk")
    ap.add_argument("--task-tokens", type=int, default=16, help="the task's max_tokens")
    ap.add_argument("--kv-bits", type=float, default=3.5)
    ap.add_argument("--keep", type=Path, help="work in this folder (kept) instead of a temp dir")
    ap.add_argument("--json", action="store_true", help="print the rows and ratios as JSON on the last line")
    args = ap.parse_args(argv)

    from pipeline.inputs.samples import make_long_pdf

    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        (work / "docs").mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        make_long_pdf(work / "docs" / "long.pdf", args.pages)
        print(f"generated {args.pages}-page PDF in {time.perf_counter() - t0:.1f} s: {work / 'docs' / 'long.pdf'}", flush=True)
        rows: dict[str, dict] = {}
        for scheme in SCHEMES:
            job = work / f"job-{scheme}.yaml"
            job.write_text(job_yaml(scheme, kv_bits=args.kv_bits, context_tokens=args.context_tokens,
                                    chunk=args.chunk, task_tokens=args.task_tokens, page=min(3, args.pages)))
            out = work / f"results-{scheme}.jsonl"
            out.unlink(missing_ok=True)  # a kept folder must not make the run skip its document
            log = work / f"run-{scheme}.log"
            print(f"$ tqpipe run {job} --no-progress", flush=True)
            code, rss, wall = run_cli(job, log)
            print(log.read_text().rstrip(), flush=True)
            if code != 0:
                raise SystemExit(f"{job}: tqpipe run exited {code}; see the log above")
            recs = [json.loads(line) for line in out.read_text().splitlines()]
            if len(recs) != 1:
                raise SystemExit(f"{out}: expected one record, found {len(recs)}")
            rows[scheme] = row_from_record(scheme, recs[0], rss, wall)

    ratio = ratios(rows)
    r0 = rows["fp16"]
    print()
    print(f"{r0['pages']}-page PDF, context cut to {r0['prefill_tokens']} tokens ({r0['pages_in_context']} pages; "
          f"{r0['tokens_dropped']} tokens dropped); one task, max {args.task_tokens} tokens; prefill chunk {args.chunk}")
    print("ingestion pages/s = page_count / the record's timing.ingest_s (the whole PDF is read)")
    print(format_table(rows, ratio))
    for s in SCHEMES:
        print(f"{s} answer: {rows[s]['answer']!r}  (wall {rows[s]['wall_s']:.0f} s incl. model load)")
    result = {"rows": rows, "ratios": ratio, "args": {k: str(v) for k, v in vars(args).items()}}
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
