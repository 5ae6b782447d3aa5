"""Documents per second on the Ray engine with 1 vs 2 workers (same run, same cluster).

    python -m benchmarks.ray_scaling [--docs 24] [--tasks 2] [--max-tokens 8] [--repeats 1] [--json]

Builds ``--docs`` small one-page PDFs and a job over them, starts ONE local
Ray cluster (2 CPUs), then runs the job with the built-in text model on 1
worker and on 2 workers (and the local engine, no Ray, as the reference),
each into a fresh results file.  Reported per run:

- ``ready_s``: actor start + model load (paid once per worker per run);
- ``docs_per_s``: documents / (wall - ready_s), the steady-state rate;
- ``wall_docs_per_s``: documents / wall, start-up included;
- ``model_s_per_doc``: seconds each document spent in the model, from the
  records (grows when workers compete for cores).

The local engine loads its model before the clock's steady-state part too.
Each Ray actor reserves 1 CPU and Ray sets ``OMP_NUM_THREADS=1`` in it, so
one actor's BLAS uses one thread while the local engine's may use all cores.

The ratio 2-vs-1 workers is what this measures; on a 2-core machine shared
with other processes it cannot reach 2 (both actors and the driver compete
for two cores), which the output's load average makes visible.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import pipeline  # noqa: F401  (OpenBLAS before mlx)


def make_job(root: Path, n_docs: int, n_tasks: int, max_tokens: int, name: str) -> Path:
    """The documents (once) and a job file writing to its own results file."""
    from pipeline.inputs.samples import make_text_pdf

    docs = root / "docs"
    if not docs.exists():
        docs.mkdir(parents=True)
        for i in range(n_docs):
            make_text_pdf(
                docs / f"invoice{i:04d}.pdf",
                [f"Invoice {1000 + i}. Customer: Acme Parts {i}. Date: 2026-03-{1 + i % 28:02d}. "
                 f"Total due: {17 * i + 250} euros. Payment within 30 days."],
            )
    questions = ["What is the total due?", "Who is the customer?", "What is the invoice date?"]
    tasks = "".join(
        f"  - {{name: q{t}, prompt: \"{questions[t % len(questions)]}\", max_tokens: {max_tokens}}}\n"
        for t in range(n_tasks)
    )
    job = root / f"{name}.yaml"
    job.write_text(
        f"name: {name}\ninputs: [docs/]\ncontext: {{max_tokens: 1024}}\ntasks:\n{tasks}"
        f"output: out/{name}.jsonl\nengine: {{kind: ray}}\n"
    )
    return job


def model_seconds(results: Path) -> dict:
    """Mean seconds per document spent in the model (prefill + every task),
    from the records' own timing: if it grows with more workers, the workers
    are competing for the same cores."""
    import orjson

    per_doc: dict[str, float] = {}
    for line in results.read_bytes().splitlines():
        r = orjson.loads(line)
        t = r["timing"]
        per_doc.setdefault(r["doc_id"], t.get("prefill_s", 0.0))
        per_doc[r["doc_id"]] += t.get("task_prefill_s", 0.0) + t.get("decode_s", 0.0)
    return {"model_s_per_doc": round(sum(per_doc.values()) / len(per_doc), 3)}


def timed_run(job_path: Path, workers: int | None) -> dict:
    """One run; ``workers=None`` is the local engine."""
    from pipeline.inputs.job_file import load_job

    job = load_job(job_path)
    t0 = time.perf_counter()
    if workers is None:
        from pipeline.inference.engines import Engines
        from pipeline.run.runner import run_job

        engines = Engines(job)
        engines.get(needs_images=False)  # load first, as a Ray worker does before its first document
        ready_s = time.perf_counter() - t0
        summary = run_job(job, progress=False, engines=engines)
    else:
        from pipeline.run.ray_engine import RayRun

        run = RayRun(job, workers=workers, progress=False)
        summary = run.run()
        ready_s = run.ready_s or 0.0
    wall = time.perf_counter() - t0
    n = summary.documents
    assert summary.done == n * len(job.spec.tasks) and summary.failed == 0, summary
    return {
        **model_seconds(job.output_path),
        "engine": "local" if workers is None else "ray",
        "workers": workers or 1,
        "documents": n,
        "wall_s": round(wall, 2),
        "ready_s": round(ready_s, 2),
        "docs_per_s": round(n / (wall - ready_s), 3),
        "wall_docs_per_s": round(n / wall, 3),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=24)
    p.add_argument("--tasks", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1, help="alternate 1/2-worker runs this many times")
    p.add_argument("--no-local", action="store_true", help="skip the local-engine reference run")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = p.parse_args(argv)

    import ray

    from pipeline.models.load import builtin_text_model_dir

    builtin_text_model_dir()  # build once, before the workers look for it
    load_before = os.getloadavg()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="tqpipe-ray-bench-") as tmp:
        root = Path(tmp)
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False)
        try:
            runs = ([] if args.no_local else [None]) + [1, 2] * args.repeats
            for k, workers in enumerate(runs):
                job = make_job(root, args.docs, args.tasks, args.max_tokens, f"bench{k}")
                row = timed_run(job, workers)
                rows.append(row)
                print(f"{row['engine']:5s} workers={row['workers']}  {row['documents']} docs  "
                      f"wall {row['wall_s']:7.2f} s  ready {row['ready_s']:5.2f} s  "
                      f"{row['docs_per_s']:6.3f} docs/s steady  {row['wall_docs_per_s']:6.3f} docs/s wall  "
                      f"model {row['model_s_per_doc']:.2f} s/doc",
                      flush=True)
        finally:
            ray.shutdown()

    def best(w: int, key: str) -> float:
        return max(r[key] for r in rows if r["engine"] == "ray" and r["workers"] == w)

    result = {
        "docs": args.docs,
        "tasks": args.tasks,
        "max_tokens": args.max_tokens,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "runs": rows,
        "ratio_2_vs_1_steady": round(best(2, "docs_per_s") / best(1, "docs_per_s"), 2),
        "ratio_2_vs_1_wall": round(best(2, "wall_docs_per_s") / best(1, "wall_docs_per_s"), 2),
    }
    print(f"2 vs 1 workers: {result['ratio_2_vs_1_steady']}x steady-state, {result['ratio_2_vs_1_wall']}x wall "
          f"(load average before {result['loadavg_before']}, after {result['loadavg_after']}, {result['cpus']} CPUs)")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
