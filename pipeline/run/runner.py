"""Run a job locally: plan, then per document process and append each record.

The runner is the only local writer of results, and it writes each
(document, task) record the moment that task finishes, through the durable
:class:`~pipeline.output.results_log.ResultLog` under the job's lock.  A kill
at any point therefore loses at most the record in flight, and a rerun skips
every key already written (:mod:`pipeline.run.plan`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Sequence

from pipeline.inference.engines import Engines
from pipeline.inference.prompt import DocumentPrompt
from pipeline.inputs.discover import DocumentRef, discover
from pipeline.output.lock import JobLock
from pipeline.output.results_log import ResultLog
from pipeline.run.document import process_document
from pipeline.run.plan import DocumentWork, WorkPlan
from pipeline.run.progress import make_progress
from pipeline.schema.job import Job

logger = logging.getLogger(__name__)


@dataclass
class RunSummary:
    """What one run did; ``exit_code`` is what ``tqpipe run`` exits with."""

    documents: int = 0
    done: int = 0  # ok records written by this run
    failed: int = 0  # error records written by this run, plus failed keys not retried
    skipped: int = 0  # documents whose every task was already recorded
    records_written: int = 0
    failed_documents: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0


def run_job(
    job: Job,
    *,
    retry_failed: bool = False,
    dry_run: bool = False,
    progress: bool = True,
    engines: Engines | None = None,
    refs: Sequence[DocumentRef] | None = None,
    echo: Callable[[str], None] = print,
) -> RunSummary:
    """Process every document of ``job`` (or ``refs``) not yet recorded.

    Holds the job's lock for the whole run (``LockHeldError`` if another run
    has it).  ``dry_run`` ingests and tokenizes only: no model, no results,
    no lock.  A ``--pages`` override is already in ``job`` (see
    :func:`pipeline.schema.job.with_pages`).
    """
    refs = list(discover(job) if refs is None else refs)
    summary = RunSummary(documents=len(refs))
    if dry_run:
        from pipeline.run.dry_run import dry_run as dry_run_job

        failed = dry_run_job(job, refs, echo)
        summary.failed += len(failed)
        summary.failed_documents.extend(failed)
        return summary

    engines = engines or Engines(job)
    plan = WorkPlan(job, retry_failed=retry_failed)
    with JobLock(job.output_path, job=job.spec.name), ResultLog(job.output_path).open() as log:
        docs_bar = make_progress(len(refs), "documents", "doc", position=0) if progress else None
        try:
            for ref in refs:
                work = plan.document(ref, log)
                summary.failed += work.failed_before  # failures from earlier runs still count for the exit code
                if not work.tasks:
                    summary.skipped += 1
                else:
                    _run_document(engines, job, work, log, summary, progress)
                if docs_bar is not None:
                    docs_bar.update(1)
                    docs_bar.set_postfix(failed=len(summary.failed_documents))
        finally:
            if docs_bar is not None:
                docs_bar.close()
    logger.info(
        "%s: %d documents, %d records written (%d ok, %d failed), %d documents already done",
        job.spec.name, summary.documents, summary.records_written, summary.done, summary.failed, summary.skipped,
    )
    return summary


def _run_document(engines: Engines, job: Job, work: DocumentWork, log: ResultLog, summary: RunSummary,
                  progress: bool) -> None:
    """Process one document's pending tasks, appending each record as it comes."""
    ref, todo = work.ref, work.tasks

    bars = []
    on_prefill = on_token = on_prompt = None
    if progress:
        prefill_bar = make_progress(None, f"prefill {ref.doc_id}", "tok", position=1, leave=False)
        decode_bar = make_progress(sum(t.max_tokens for t in todo), f"decode {ref.doc_id}", "tok", position=2, leave=False)
        bars = [prefill_bar, decode_bar]
        on_prefill, on_token = prefill_bar.update, decode_bar.update

        def on_prompt(prompt: DocumentPrompt) -> None:
            prefill_bar.reset(total=prompt.n_tokens)
    failed = False
    ok: list[dict] = []
    try:
        for record in process_document(engines, job, ref, tasks=todo, digest=work.digest,
                                       on_prefill=on_prefill, on_token=on_token, on_prompt=on_prompt):
            log.append(record)
            summary.records_written += 1
            if record["status"] == "ok":
                summary.done += 1
                ok.append(record)
            else:
                summary.failed += 1
                failed = True
                logger.warning("%s [%s]: %s", ref.doc_id, record["task"], record["error"]["message"])
    finally:
        for bar in bars:
            bar.close()
    if failed:
        summary.failed_documents.append(ref.doc_id)
    if ok:  # one plain line per document, terminal or cron
        t, mem = ok[0]["timing"], ok[-1]["memory"]
        logger.info(
            "%s: %d tokens prefilled in %.1f s, %d tasks, %d tokens generated in %.1f s, KV cache %.1f MiB (%s), "
            "peak memory %.0f MiB MLX / %.0f MiB max RSS",
            ref.doc_id, ok[0]["tokens"]["document"], t["prefill_s"], len(ok),
            sum(r["tokens"]["generated"] for r in ok), sum(r["timing"]["decode_s"] for r in ok),
            ok[0]["cache"]["nbytes_after_prefill"] / 2**20, ok[0]["cache"]["scheme"],
            mem["mx_peak_bytes"] / 2**20, mem["max_rss_bytes"] / 2**20,
        )


__all__ = ["RunSummary", "run_job"]
