"""The Python API: what ``tqpipe run`` does, callable from a notebook or a service.

marker users write ``PdfConverter(...)(path)``; here it is::

    from pipeline import load_job, run_job, read_results, ask_files

    job = load_job("jobs/extract.yaml", kv_bits=4)          # same overrides as the CLI flags
    summary = run_job(job)                                   # exactly-once, checkpointed, locked
    records = read_results(job)                              # the record that counts per (document, task)

    records = ask_files(["invoice.pdf"], "Who issued it?", fields=["issuer", "total"])

Everything goes through the same functions as the command line (job loading
and checks, overrides into the config hash, the runner and its results log),
so a record written from Python is the record the CLI would write.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any, Sequence

from pipeline.inputs.job_file import load_job as _load_job_file
from pipeline.output.results_log import latest_records
from pipeline.run.runner import RunSummary
from pipeline.run.runner import run_job as _run_job
from pipeline.schema.job import Job, with_pages
from pipeline.schema.overrides import OverrideError, Overrides, apply_overrides


def load_job(path: str | Path, *, pages: str | None = None, **overrides: Any) -> Job:
    """Read and check a job file, with the CLI's overrides as keyword arguments
    (``model``, ``kv_bits``, ``kv_quant_scheme``, ``kv_key_bits``, ``kv_value_bits``,
    ``max_tokens``, ``prompt``, ``format``, ``fields``, ``output``).

    Raises :class:`~pipeline.errors.JobFileError` or
    :class:`~pipeline.schema.overrides.OverrideError` with the same one-line
    messages the CLI prints.
    """
    known = {f.name for f in dataclasses.fields(Overrides)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise OverrideError(f"load_job: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not a job "
                            f"override; they are {', '.join(sorted(known))} (engine, workers and address "
                            f"are the job file's engine: settings)")
    job = with_pages(_load_job_file(path), pages)
    if overrides:
        fields = overrides.pop("fields", None)
        job = apply_overrides(job, Overrides(fields=tuple(fields) if fields else None, **overrides))
    return job


def run_job(job: Job, *, retry_failed: bool = False, progress: bool = False) -> RunSummary:
    """Process every document of ``job`` not yet in its results file (see :func:`pipeline.run.runner.run_job`)."""
    return _run_job(job, retry_failed=retry_failed, progress=progress)


def read_results(job: Job) -> list[dict]:
    """The record that counts for each (document, task) of ``job`` as loaded
    (its tasks, config and overrides), in file order: records of an edited
    task or an older config (or a watched file's superseded result) stay in
    the file but are not ``job``'s results, as in ``tqpipe export``."""
    from pipeline.run.plan import WorkPlan

    current = WorkPlan(job).counts()
    return [r for k, r in latest_records(job.output_path).items() if current(k)]


def ask_files(files: Sequence[str | Path], prompt: str, *, format: str | None = None,
              fields: Sequence[str] | None = None, output: str | Path | None = None,
              **overrides: Any) -> list[dict]:
    """One question of each file, no job file: the one-off mode of ``tqpipe run FILE... --prompt``.

    Returns the records; with ``output`` they are also kept there (and a
    repeated call skips what is done), without it nothing is left behind.
    """
    from pipeline.inputs.oneoff import oneoff_job

    ov = Overrides(prompt=prompt, format=format, fields=tuple(fields) if fields else None,
                   output=None if output is None else str(output), **overrides)
    with tempfile.TemporaryDirectory(prefix="tqpipe-ask-") as scratch:
        target = Path(output) if output is not None else Path(scratch) / "oneoff.jsonl"
        job = oneoff_job([str(f) for f in files], ov, target)
        _run_job(job, progress=False)
        return read_results(job)


__all__ = ["Job", "RunSummary", "ask_files", "load_job", "read_results", "run_job"]
