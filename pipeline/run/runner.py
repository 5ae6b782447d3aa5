"""Run a job locally: plan, then per document process and append each record.

The runner is the only local writer of results, and it writes each
(document, task) record the moment that task finishes, through the durable
:class:`~pipeline.output.results_log.ResultLog` under the job's lock.  A kill
at any point therefore loses at most the record in flight, and a rerun skips
every key already written (:mod:`pipeline.run.plan`).
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Sequence

from pipeline.inference.engines import Engines
from pipeline.inference.kv_size import describe
from pipeline.inference.prompt import DocumentPrompt
from pipeline.inputs.discover import DocumentRef, discover, unread_entries, unsupported_files
from pipeline.output.lock import JobLock
from pipeline.output.render import same_content_record
from pipeline.output.target import check_output
from pipeline.output.results_log import ResultLog, latest_records
from pipeline.run.document import process_document
from pipeline.run.plan import DocumentWork, WorkPlan
from pipeline.run.progress import counted, make_progress
from pipeline.schema.job import Job
from pipeline.schema.paths import shown, text_safe

logger = logging.getLogger(__name__)


@dataclass
class RunSummary:
    """What one run did; ``exit_code`` is what ``tqpipe run`` exits with.

    ``warned`` counts ok records with quality warnings (written now, or
    skipped as already done: like ``failed``, the whole job's state counts),
    ``warnings`` per code.  Under ``strict`` warned records are failures.
    """

    documents: int = 0
    done: int = 0  # ok records written by this run
    failed: int = 0  # error records written by this run, plus failed keys not retried
    failed_before: int = 0  # of ``failed``: keys earlier runs recorded as failed, not retried
    skipped: int = 0  # documents whose every task was already recorded
    records_written: int = 0
    failed_documents: list[str] = field(default_factory=list)
    warned: int = 0
    warnings: dict[str, int] = field(default_factory=dict)
    strict: bool = False

    @property
    def exit_code(self) -> int:
        return 1 if self.failed or (self.strict and self.warned) else 0

    def count(self, record: dict) -> bool:
        """Account for one written record; True if it is an error."""
        self.records_written += 1
        if record["status"] != "ok":
            self.failed += 1
            return True
        self.done += 1
        self._warned(record.get("warnings") or ())
        return False

    @property
    def failed_now(self) -> int:
        """Error records this run wrote."""
        return self.failed - self.failed_before

    def count_before(self, work: DocumentWork) -> None:
        """Account for the tasks of ``work`` an earlier run already recorded."""
        self.failed += work.failed_before
        self.failed_before += work.failed_before
        for found in work.warned_before:
            self._warned(found)

    def _warned(self, codes: Sequence[str]) -> None:
        if codes:
            self.warned += 1
            for code in codes:
                self.warnings[code] = self.warnings.get(code, 0) + 1

    def line(self) -> str:
        """The one summary line of ``tqpipe run``."""
        warned = ""
        if self.warned:
            codes = ", ".join(f"{c} {n}" for c, n in sorted(self.warnings.items()))
            warned = (f"; {self.warned} done with warnings{' (' + codes + ')' if codes else ''}"
                      f"{', failing under strict' if self.strict else ''}")
        # documents and records are counted apart: a document has one record per task
        docs = f"{counted(self.documents, 'document')} ({self.skipped} already recorded)"
        records = f"{counted(self.records_written, 'record')} written: {self.done} ok, {self.failed_now} failed"
        before = (f"; {self.failed_before} failed in earlier runs (--retry-failed redoes them)"
                  if self.failed_before else "")
        return f"{docs}; {records}{before}{warned}"


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
    has it).  A failure of the run itself - the model does not load, the
    results file cannot be written - raises a
    :class:`~pipeline.errors.RunError` and writes no record for any
    document; a document's own failure becomes its error records.  ``dry_run`` ingests and tokenizes only: no model, no results,
    no lock.  A ``--pages`` override is already in ``job`` (see
    :func:`pipeline.schema.job.with_pages`).
    """
    discovered = refs is None  # the job's whole document set: a recorded name outside it is not a first name
    if discovered:
        refs = discover(job)
        passed_over = unsupported_files(job)
        if passed_over:
            logger.info("%s: %d file(s) in input folders are neither PDF nor image, passed over: %s", job.spec.name,
                        len(passed_over), ", ".join(shown(p) for p in passed_over[:10]))
        for entry, why in unread_entries(job):
            logger.warning("%s: not read: %s: %s", job.spec.name, shown(entry), why)
    refs = list(refs)
    summary = RunSummary(documents=len(refs), strict=job.spec.strict)
    if dry_run:
        from pipeline.run.dry_run import dry_run as dry_run_job

        failed = dry_run_job(job, refs, echo)
        summary.failed += len(failed)
        summary.failed_documents.extend(failed)
        return summary

    check_output(job, refs)  # never append to an input, the job file or a foreign file
    engines = engines or Engines(job)
    plan = WorkPlan(job, retry_failed=retry_failed, documents=refs if discovered else None)
    with JobLock(job.output_path, job=job.spec.name), ResultLog(job.output_path).open() as log, \
            (make_progress(len(refs), "documents", "doc", position=0) if progress else nullcontext()) as docs_bar:

        def advance() -> None:
            if docs_bar is not None:
                docs_bar.update(1)
                docs_bar.set_postfix(failed=len(summary.failed_documents))

        originals = SameContent(log)
        second_names = []  # copied once every first name of the run is recorded (it may come later)
        for ref in refs:
            work = plan.document(ref, log)
            summary.count_before(work)  # failures from earlier runs still count for the exit code
            if not work.tasks:
                summary.skipped += 1
            elif work.same_as is not None:
                second_names.append(work)
                continue
            else:
                _run_document(engines, job, work, log, summary, progress, originals)
            advance()
        for work in second_names:
            originals.write(job, work, summary)
            advance()
    logger.info(
        "%s: %s, %s written (%d ok, %d failed), %d already done",
        job.spec.name, counted(summary.documents, "document"), counted(summary.records_written, "record"),
        summary.done, summary.failed_now, summary.skipped,
    )
    return summary


class SameContent:
    """Second names of one content: their records are copies of the first
    name's (:func:`~pipeline.output.render.same_content_record`).  The first
    name is a document of the same run, copied from once the run's first
    names are done, so its records are in the log; those of this run are
    kept here, older ones read back from the file."""

    def __init__(self, log: ResultLog):
        self.log = log
        self.latest: dict[str, dict] = {}
        self._read = False

    def note(self, record: dict) -> None:
        self.latest[record["key"]] = record

    def original(self, key: str) -> dict | None:
        if key not in self.latest and not self._read:
            self._read = True
            for k, r in latest_records(self.log.path).items():
                self.latest.setdefault(k, r)
        return self.latest.get(key)

    def write(self, job: Job, work: DocumentWork, summary: RunSummary) -> None:
        """Append the copies for ``work``'s pending tasks; log one line naming both documents."""
        written = 0
        failed = False
        for task in work.tasks:
            original = self.original(work.original_keys[task.name])
            if original is None:  # the first name's task is not recorded (the run was interrupted): next run
                logger.warning("%s [%s]: same content as %s, which has no record yet; left pending",
                               shown(work.ref.doc_id), task.name, shown(work.same_as.doc_id))
                continue
            record = same_content_record(original, job, work.ref, work.keys[task.name])
            self.log.append(record)
            failed |= summary.count(record)
            written += 1
        if failed:
            summary.failed_documents.append(text_safe(work.ref.doc_id))
        logger.info("%s: same content as %s; %s copied, no second prefill",
                    shown(work.ref.doc_id), shown(work.same_as.doc_id), counted(written, "record"))


def _run_document(engines: Engines, job: Job, work: DocumentWork, log: ResultLog, summary: RunSummary,
                  progress: bool, originals: SameContent) -> None:
    """Process one document's pending tasks, appending each record as it comes."""
    ref, todo = work.ref, work.tasks

    bars = []
    on_prefill = on_token = on_prompt = None
    if progress:
        prefill_bar = make_progress(None, f"prefill {ref.doc_id}", "tok", position=1, leave=False)
        bars = [prefill_bar]
        on_prefill = prefill_bar.update

        def on_prompt(prompt: DocumentPrompt) -> None:
            prefill_bar.reset(total=prompt.n_tokens)

        def on_token(n: int = 1) -> None:
            # The decode bar starts at the first token, so its rate and ETA
            # count decoding only, not the prefill before it.
            if len(bars) == 1:
                bars.append(make_progress(sum(t.max_tokens for t in todo), f"decode {ref.doc_id}", "tok",
                                          position=2, leave=False))
            bars[1].update(n)
    failed = False
    ok: list[dict] = []
    try:
        for record in process_document(engines, job, ref, tasks=todo, digest=work.digest,
                                       on_prefill=on_prefill, on_token=on_token, on_prompt=on_prompt):
            log.append(record)
            originals.note(record)
            if summary.count(record):
                failed = True
                logger.warning("%s [%s]: %s", shown(ref.doc_id), record["task"], record["error"]["message"])
            else:
                ok.append(record)
                if record["warnings"]:
                    logger.warning("%s [%s]: warnings: %s", shown(ref.doc_id), record["task"],
                                   ", ".join(record["warnings"]))
    finally:
        for bar in bars:
            bar.close()
    if failed:
        summary.failed_documents.append(text_safe(ref.doc_id))
    if ok:  # one plain line per document, terminal or cron
        t, mem = ok[0]["timing"], ok[-1]["memory"]
        stored = ok[0]["cache"].get("doc_cache") or {}
        how = (f"loaded from the document cache in {stored.get('load_s', 0):.1f} s"
               + (" (document not read)" if stored.get("ingest") == "skipped" else "")
               if stored.get("hit") else f"prefilled in {t['prefill_s']:.1f} s")
        logger.info(
            "%s: %s %s, %s, %s generated in %.1f s, KV cache %s, "
            "peak memory %.0f MiB MLX / %.0f MiB max RSS",
            shown(ref.doc_id), counted(ok[0]["tokens"]["document"], "token"), how, counted(len(ok), "task"),
            counted(sum(r["tokens"]["generated"] for r in ok), "token"), _decode_wall_s(ok),
            describe(ok[0]["cache"]), mem["mx_peak_bytes"] / 2**20, mem["max_rss_bytes"] / 2**20,
        )



def _decode_wall_s(records: list[dict]) -> float:
    """The time the document's answers took to decode: tasks decoded side by
    side as one batch of rows (``timing.batch_rows``) overlap, so the batch
    took its slowest row's time, not the sum; one after another, the sum."""
    times = [r["timing"]["decode_s"] for r in records]
    return max(times) if any(r["timing"].get("batch_rows") for r in records) else sum(times)


__all__ = ["RunSummary", "SameContent", "run_job"]
