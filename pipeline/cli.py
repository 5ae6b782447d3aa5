"""The ``tqpipe`` command line.

Commands: ``run JOB`` (or ``run FILE... --prompt``), ``watch DIR --job JOB``,
``status JOB``, ``validate JOB``, ``export JOB``, ``report JOB``,
``schema record|job``, ``samples [DIR]``, ``ask FILE --prompt ...``,
``cache ls|rm|prune``.

Exit codes (the same for every command, so cron and scripts can branch):

====  ==========================================================
code  meaning
====  ==========================================================
0     success: every document x task is done (or nothing to do)
1     at least one document failed (its error records are written);
      with ``strict: true`` also a record with quality warnings
2     bad job file or bad command line (nothing was run)
3     another run of this job holds its lock (nothing was run)
4     the run could not proceed: the model does not load, the output
      or its folder cannot be written, the disk is full (no document
      is blamed: no error records are written for it)
130   stopped by SIGINT (Ctrl-C); 143: stopped by SIGTERM
====  ==========================================================

``status`` exits 1 on the same rule as ``run`` (failed records, or warned
ones under ``strict``), else 0 (pending work is not a failure).  Errors
print ONE line that names the file and the problem; ``-v`` adds debug
logging and tracebacks.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

import pipeline  # noqa: F401  (fast CPU BLAS before anything imports mlx.core)

from pipeline.errors import JobFileError, LockHeldError, PageRangeError, TqpipeError
from pipeline.schema.paths import shown

if TYPE_CHECKING:
    from pipeline.schema.job import Job
    from pipeline.schema.overrides import Overrides

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_LOCKED, EXIT_RUN = 0, 1, 2, 3, 4
EXIT_CODES_HELP = (
    "\b\nExit codes:\n"
    "  0  all documents x tasks done (status: none failed)\n"
    "  1  at least one document failed (error records written;\n"
    "     with strict: true also records with warnings)\n"
    "  2  bad job file or usage error (nothing run)\n"
    "  3  the job's lock is held by another run (nothing run)\n"
    "  4  the run could not proceed (model, output, disk)\n"
    "  130, 143  stopped by SIGINT, SIGTERM"
)
logger = logging.getLogger("tqpipe")


def _fail(message: str, code: int) -> None:
    click.echo(f"tqpipe: error: {message}", err=True)
    sys.exit(code)


def _load(job_path: str, pages: str | None = None, overrides: Overrides | None = None, *,
          check_inputs: bool = True, paths_exist: bool = False) -> Job:
    """Load and check the job, with ``--pages`` and the other command-line
    overrides applied (exit 2 with one clear line on any problem).  The one
    place overrides enter a run: every command below only sees the returned job."""
    from pipeline.inputs.job_file import load_job
    from pipeline.inputs.oneoff import EXPECTED, JOB_SUFFIXES
    from pipeline.output.target import check_output
    from pipeline.schema.job import with_pages
    from pipeline.schema.overrides import OverrideError, apply_overrides

    try:
        job = with_pages(load_job(job_path, check_inputs=check_inputs, paths_exist=paths_exist), pages)
        if overrides is not None:
            job = apply_overrides(job, overrides)
        check_output(job)
    except JobFileError as e:
        if e.key == "output" and overrides is not None and overrides.output is not None:
            _fail(f"--output: {e.problem}", EXIT_USAGE)  # the flag's value, not the job file's
        hint = "" if Path(job_path).suffix.lower() in JOB_SUFFIXES else f" (tqpipe run expects {EXPECTED})"
        _fail(f"{e}{hint}", EXIT_USAGE)
    except OverrideError as e:
        _fail(str(e), EXIT_USAGE)
    except PageRangeError as e:
        _fail(f"--pages: {e}", EXIT_USAGE)
    return job


@click.group(epilog=EXIT_CODES_HELP)
@click.version_option(package_name="tqpipe")
def main() -> None:
    """Batch long-document VLM pipeline with a TurboQuant-compressed KV cache.

    Each document (PDF or image set) is read into ONE long context, prefilled
    once into a compressed KV cache, and every task of the job is answered from
    that cache.  Results go to the job's JSONL output, one record per
    (document, task); reruns skip what is already there.
    """


def _verbose_option(f):
    return click.option("-v", "--verbose", is_flag=True, help="Debug logging and tracebacks.")(f)


def _config_options(f):
    """The overrides that shape records (their config hash): the runs' own
    flags, so status, export and report can name the config a run used."""
    opts = [
        click.option("--model", default=None, help="Model folder or hub id (overrides model.path)."),
        click.option("--kv-bits", type=float, default=None, help="KV cache bits, e.g. 3.5 (overrides cache.kv_bits)."),
        click.option("--kv-quant-scheme", type=click.Choice(["turboquant", "fp16", "affine"]), default=None,
                     help="KV cache scheme (overrides cache.kv_quant_scheme)."),
        click.option("--kv-key-bits", type=int, default=None, help="TurboQuant key bits (overrides cache.key_bits)."),
        click.option("--kv-value-bits", type=int, default=None, help="TurboQuant value bits (overrides cache.value_bits)."),
        click.option("--max-tokens", type=click.IntRange(min=1), default=None, help="Answer budget of every task."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _override_options(f):
    """The flags mlx-vlm / mlx-lm / olmocr users already type; each overrides the job file."""
    opts = [
        click.option("--prompt", default=None, help="Ask this one question instead of the job's tasks (one-off mode: required)."),
        click.option("--format", "fmt", type=click.Choice(["text", "json"]), default=None, help="Answer format of --prompt."),
        click.option("--fields", default=None, help="JSON keys of the --prompt answer, comma-separated (implies --format json)."),
        click.option("-o", "--output", default=None, help="Results file (overrides output; one-off mode: instead of stdout)."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return _config_options(f)


def _overrides(flags: dict):
    """The parsed ``_config_options`` / ``_override_options`` flags (exit 2 on a bad one)."""
    from pipeline.schema.overrides import OverrideError, Overrides, parse_fields

    try:
        fields, fmt = parse_fields(flags.pop("fields", None)), flags.pop("fmt", None)
        return Overrides(fields=fields, format=fmt, **flags)
    except OverrideError as e:
        _fail(str(e), EXIT_USAGE)


@main.command(epilog=EXIT_CODES_HELP)
@click.argument("targets", metavar="JOB | FILE...", nargs=-1, required=True)
@click.option("--pages", help="Page ranges for every document, e.g. '1-20,35,-5' (overrides the job's context.pages).")
@_override_options
@click.option("--dry-run", is_flag=True, help="Ingest and tokenize only: per document pages, tokens, images, whether it fits, KV bytes. Loads no model, writes nothing.")
@click.option("--retry-failed", is_flag=True, help="Run again (document, task) pairs recorded as failed.")
@click.option("--engine", type=click.Choice(["local", "ray"]), default=None, help="Override the job's engine.kind.")
@click.option("--address", default=None, help="Ray: cluster address ('auto', 'ray://host:10001'); overrides engine.address.")
@click.option("--workers", type=click.IntRange(min=1), default=None, help="Ray: worker actors; overrides engine.workers.")
@click.option("--no-progress", is_flag=True, help="No progress bars or progress log lines.")
@_verbose_option
def run(targets: tuple[str, ...], pages: str | None, dry_run: bool, retry_failed: bool, engine: str | None,
        address: str | None, workers: int | None, no_progress: bool, verbose: bool, **flags) -> None:
    """Process every document of JOB not yet in its results file.

    One-off mode, no job file: ``tqpipe run FILE.pdf [FILE2 ...] --prompt
    "..."`` asks one question of each file; records go to stdout as JSONL
    (or to --output), progress and the summary to stderr.

    Progress: tqdm bars on a terminal, plain log lines otherwise (cron).
    """
    from pipeline.run.progress import configure_logging

    configure_logging(verbose)
    ov = _overrides(flags)
    oneoff = _is_oneoff(targets)
    with _oneoff_output(oneoff and ov.output is None) as scratch:
        job = _load_oneoff(list(targets), ov, scratch, pages) if oneoff else _load(targets[0], pages, ov)
        _run_loaded(job, targets[0], dry_run=dry_run, retry_failed=retry_failed, engine=engine, address=address,
                    workers=workers, no_progress=no_progress, verbose=verbose,
                    summary_err=oneoff, stdout_records=scratch is not None)


def _is_oneoff(targets: tuple[str, ...]) -> bool:
    """Documents on the command line (one-off mode), or exactly one job file."""
    from pipeline.inputs.oneoff import EXPECTED, is_document_arg

    docs = [is_document_arg(t) for t in targets]
    if all(docs):
        return True
    if len(targets) > 1:
        bad = next(t for t, d in zip(targets, docs) if not d)
        _fail(f"{bad}: give one job file, or only documents; tqpipe run expects {EXPECTED}", EXIT_USAGE)
    return False


@contextlib.contextmanager
def _oneoff_output(needed: bool):
    """A scratch results file for one-off records bound for stdout (removed afterwards)."""
    if not needed:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="tqpipe-oneoff-") as d:
        yield Path(d) / "oneoff.jsonl"


def _load_oneoff(files: list[str], ov, scratch: Path | None, pages: str | None) -> Job:
    from pipeline.inputs.oneoff import oneoff_job
    from pipeline.schema.job import with_pages
    from pipeline.schema.overrides import OverrideError

    from pipeline.output.target import check_output

    try:
        job = with_pages(oneoff_job(files, ov, scratch or Path(ov.output)), pages)
        check_output(job)
        return job
    except JobFileError as e:
        _fail(str(e), EXIT_USAGE)
    except OverrideError as e:
        _fail(str(e), EXIT_USAGE)
    except PageRangeError as e:
        _fail(f"--pages: {e}", EXIT_USAGE)


def _check_model_takes_pages(job: Job) -> None:
    """A model that cannot take the pages the job sends (a text-only model
    under images: always) is the job's problem: exit 2 before anything
    runs, in validate, run and --dry-run alike."""
    from pipeline.models.load import images_problem

    problem = images_problem(job.spec.model.path, job.spec.context.images)
    if problem:
        _fail(f"{job.path}: {problem}", EXIT_USAGE)


def _run_loaded(job: Job, job_file: str, *, dry_run: bool, retry_failed: bool, engine: str | None,
                address: str | None, workers: int | None, no_progress: bool, verbose: bool,
                summary_err: bool, stdout_records: bool) -> None:
    kind = engine or job.spec.engine.kind
    if kind != "ray" and (address is not None or workers is not None):
        # Silently ignoring them would run a cluster-sized job on one machine.
        flags = " and ".join(f for f, v in (("--address", address), ("--workers", workers)) if v is not None)
        _fail(f"{flags} only apply to the Ray engine; add --engine ray (or set engine.kind: ray in {job_file})",
              EXIT_USAGE)
    _check_model_takes_pages(job)
    from pipeline.run.signals import stop_on_signals, stopped_from

    with stop_on_signals():
        try:
            if kind == "ray" and not dry_run:
                from pipeline.run import ray_engine  # imported only when asked: Ray is heavy

                summary = ray_engine.run_job_on_ray(job, address=address, workers=workers, retry_failed=retry_failed,
                                                    progress=not no_progress)
            else:
                from pipeline.run.runner import run_job

                summary = run_job(job, retry_failed=retry_failed, dry_run=dry_run,
                                  progress=not no_progress, echo=lambda m: click.echo(m, err=summary_err))
        except KeyboardInterrupt as e:
            stop = stopped_from(e)
            _fail(f"{job.spec.name}: stopped by {stop.name}; every record written is kept, the one in flight "
                  f"was abandoned and the lock released; a plain rerun continues", stop.exit_code)
        except LockHeldError as e:
            _fail(str(e), EXIT_LOCKED)
        except (JobFileError, PageRangeError) as e:
            _fail(str(e), EXIT_USAGE)
        except TqpipeError as e:  # model, output, disk, cluster: the run, not a document
            if verbose:
                logger.exception("run failed")
            _fail(f"{e} (the run could not proceed; no document was marked failed)", EXIT_RUN)
    if stdout_records and job.output_path.exists():
        sys.stdout.buffer.write(job.output_path.read_bytes())
        sys.stdout.flush()
    if not dry_run:
        where = "stdout" if stdout_records else job.output_path
        click.echo(f"{job.spec.name}: {summary.line()} -> {where}", err=summary_err)
    if summary.failed_documents:
        click.echo("failed: " + ", ".join(shown(d) for d in summary.failed_documents), err=True)
    sys.exit(summary.exit_code)


@main.command(epilog=EXIT_CODES_HELP)
@click.argument("inbox", type=click.Path(file_okay=False))
@click.option("--job", "job_file", required=True, type=click.Path(dir_okay=False), help="Job file whose model, tasks and output to use.")
@click.option("--settle", default=2.0, show_default=True, help="Seconds a file's size and mtime must stay unchanged before it is read.")
@click.option("--poll", default=1.0, show_default=True, help="Seconds between inbox scans.")
@click.option("--pages", help="Page ranges, overriding the job's context.pages.")
@click.option("--max-polls", type=int, default=None, help="Stop after this many scans (default: run until interrupted).")
@_verbose_option
def watch(inbox: str, job_file: str, settle: float, poll: float, pages: str | None, max_polls: int | None,
          verbose: bool) -> None:
    """Process each new file (or image folder) dropped into INBOX, exactly once.

    A file is read once its size and mtime have stopped changing for
    --settle seconds and (Linux) no process holds it open for writing.  A
    relative INBOX is relative to the current folder.
    Results are appended to the job's output; a ledger next to it
    (<output>.inbox.jsonl) remembers handled files across restarts.  The
    job's own ``inputs:`` may match nothing: the documents come from INBOX.
    A file that is no document (``notes.txt``) is reported by name once and
    recorded as failed in the ledger, not silently ignored.
    """
    import os

    from pipeline.inference.engines import Engines
    from pipeline.inputs.discover import expand_input
    from pipeline.run.progress import configure_logging
    from pipeline.run.runner import run_job
    from pipeline.run.signals import stop_on_signals, stopped_from
    from pipeline.run.watch import InboxError, InboxWatcher

    configure_logging(verbose)
    job = _load(job_file, pages, check_inputs=False)
    engines = Engines(job)  # one model load for the whole watch session
    inbox_dir = Path(os.path.abspath(inbox))  # relative to the current folder, like any command-line path

    out_dir, ours = job.output_path.resolve().parent, job.output_path.name

    def refs_of(path: Path) -> list:
        try:
            return expand_input(job, str(path))  # absolute: the job's folder plays no part
        except JobFileError:  # "neither a PDF nor an image": the dropped file's fault, not the job file's
            return []

    def handle(path: Path) -> str:
        if path.resolve().parent == out_dir and path.name.startswith(ours):
            return "ignored"  # our own results file (or its .lock) when the output lives in INBOX
        refs = refs_of(path)
        if not refs:
            raise TqpipeError(f"{shown(path)}: not a PDF, an image or a folder of images; skipped")
        summary = run_job(job, refs=refs, engines=engines, progress=False, echo=click.echo)
        return "failed" if summary.exit_code else "ok"

    def same_content(path: Path, original: Path) -> None:
        """Records for a second name of handled bytes, copied from the first (no prefill)."""
        run_job(job, refs=refs_of(original) + refs_of(path), engines=engines, progress=False, echo=click.echo)

    ledger = job.output_path.with_name(job.output_path.name + ".inbox.jsonl")
    # Offer every settled file (temporary names still excluded) so a stray
    # notes.txt gets a message naming it instead of vanishing without a word.
    watcher = InboxWatcher(inbox_dir, ledger, settle_seconds=settle, poll_seconds=poll, patterns=("*",),
                           same_content=same_content)
    with stop_on_signals():
        try:
            outcomes = watcher.run(handle, max_iterations=max_polls)
        except KeyboardInterrupt as e:
            stop = stopped_from(e)
            _fail(f"watch {shown(inbox_dir)}: stopped by {stop.name}; handled files are in the ledger, "
                  f"the one in flight is offered again at the next start", stop.exit_code)
        except LockHeldError as e:
            _fail(f"{e} (is another watcher running on this job?)", EXIT_LOCKED)
        except InboxError as e:
            _fail(str(e), EXIT_USAGE)
        except TqpipeError as e:  # model, ledger, output: the watcher cannot go on
            _fail(f"{e} (the watcher could not proceed)", EXIT_RUN)
    failed = [p for p, status in outcomes.items() if status == "failed"]
    click.echo(f"watch {shown(inbox_dir)}: {len(outcomes)} file(s) handled, {len(failed)} failed"
               + (f": {', '.join(shown(p) for p in failed)}" if failed else ""))
    sys.exit(EXIT_FAILED if failed else EXIT_OK)


@main.command(epilog=EXIT_CODES_HELP)
@click.argument("job_file", metavar="JOB", type=click.Path(dir_okay=False))
@click.option("--pages", help="The --pages the runs used (it is part of each record's key).")
@_override_options
@click.option("--json", "as_json", is_flag=True, help="Print the counts as one JSON object.")
def status(job_file: str, pages: str | None, as_json: bool, **flags) -> None:
    """Progress of JOB from its results file: done, failed, pending.

    Exit 0 when nothing failed (pending pairs are work left, not failures:
    the counts say how many), 1 when something did.

    Pending = (document, task) pairs of the current job and config with no
    record yet; give the override flags the runs used (--kv-bits, --pages,
    ...) to count under their config.  Reads only; safe while a run is going.
    """
    from pipeline.inputs.discover import discover
    from pipeline.output.results_log import read_index, summarize
    from pipeline.run.plan import WorkPlan

    job = _load(job_file, pages, _overrides(flags), check_inputs=False, paths_exist=True)  # a gone input is still an error
    index = read_index(job.output_path)
    refs = discover(job)
    # No documents of its own (inputs: [], or an empty folder): a job tqpipe
    # watch feeds.  Its counts are the results under the current config.
    inbox_job = not refs
    if inbox_job:
        expected, unreadable = WorkPlan(job).recorded_keys(index[0]), 0
    else:
        expected, unreadable = WorkPlan(job, documents=refs).expected_keys(refs, index[0])
    counts = summarize(job.output_path, expected, strict=job.spec.strict, index=index)
    counts["unreadable_documents"] = unreadable
    if as_json:
        import orjson

        click.echo(orjson.dumps(counts).decode())
    else:
        extra = ""
        if counts["warned"]:
            codes = ", ".join(f"{c} {n}" for c, n in counts["warnings"].items())
            extra += f"; {counts['warned']} done with warnings ({codes}){', failing under strict' if job.spec.strict else ''}"
        if counts["retryable"]:
            extra += f"; {counts['retryable']} failed retried by the next run"
        of = "recorded; the job's inputs match no documents" if inbox_job else "document x task"
        click.echo(
            f"{job.spec.name}: done {counts['done']}, failed {counts['failed']}, pending {counts['pending']} "
            f"(of {counts['expected']} {of}; {counts['stale']} stale keys from older configs){extra} "
            f"-> {job.output_path}"
        )
    sys.exit(EXIT_FAILED if counts["failing"] else EXIT_OK)


@main.command(epilog=EXIT_CODES_HELP)
@click.argument("job_file", metavar="JOB", type=click.Path(dir_okay=False))
def validate(job_file: str) -> None:
    """Check JOB (schema, inputs, model path, output file) without running anything."""
    from pipeline.inputs.discover import discover, unread_entries, unsupported_files
    from pipeline.output.target import check_output, unwritable

    job = _load(job_file, check_inputs=False, paths_exist=True)
    if job.spec.inputs:  # inputs: [] is a job tqpipe watch feeds; any other input must match documents
        job = _load(job_file)
    _check_model_takes_pages(job)
    spec = job.spec
    refs = discover(job)
    out = check_output(job, refs)
    problem = unwritable(out)
    if problem:  # what run would meet at its first append (exit 4 there too)
        _fail(f"{job.path}: output: {shown(out)} cannot be written: {problem}", EXIT_RUN)
    cache = spec.cache
    bits = "" if cache.kv_quant_scheme == "fp16" else f" {cache.kv_bits:g} bits"
    click.echo(f"{job.path}: OK")
    click.echo(f"  name:      {spec.name}")
    if spec.inputs:
        click.echo(f"  documents: {len(refs)} ({sum(r.kind == 'pdf' for r in refs)} PDF, {sum(r.kind == 'images' for r in refs)} image sets)")
    else:
        click.echo("  documents: none listed (inputs: []): a job for tqpipe watch INBOX --job JOB")
    passed_over = unsupported_files(job)
    if passed_over:
        names = ", ".join(shown(p) for p in passed_over[:5]) + (", ..." if len(passed_over) > 5 else "")
        click.echo(f"  passed over: {len(passed_over)} file(s) in input folders that are neither PDF nor image: {names}")
    for entry, why in unread_entries(job):
        click.echo(f"  not read:  {shown(entry)}: {why}")
    click.echo(f"  tasks:     {', '.join(t.name + (' (json)' if t.format == 'json' else '') for t in spec.tasks)}")
    click.echo(f"  model:     {spec.model.path or 'built-in (SmolLM2-135M-Instruct; scanned pages are read by OCR)'}")
    click.echo(f"  cache:     {cache.kv_quant_scheme}{bits}, prefill chunk {cache.prefill_chunk}")
    click.echo(f"  context:   max {spec.context.max_tokens} tokens, overflow {spec.context.overflow}, images {spec.context.images}"
               + (f", pages {spec.context.pages}" if spec.context.pages else ""))
    click.echo(f"  output:    {out}" + (" (new)" if not job.output_path.exists() else ""))
    if spec.strict:
        click.echo("  strict:    records with warnings count as failures")
    sys.exit(EXIT_OK)


@main.command(epilog=EXIT_CODES_HELP)
@click.argument("job_file", metavar="JOB", type=click.Path(dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(["markdown", "csv", "parquet"]), required=True,
              help="markdown: one section per document; csv/parquet: one row per document x task.")
@click.option("-o", "--output", default=None, help="File to write (default: the results file with .md/.csv/.parquet).")
@click.option("--pages", help="The --pages the runs used (it is part of each record's key).")
@_config_options
def export(job_file: str, fmt: str, output: str | None, pages: str | None, **flags) -> None:
    """Write JOB's results as Markdown, CSV or Parquet (parquet needs pyarrow: tqpipe[parquet]).

    The records of the job's current tasks and config: give the config
    flags the runs used (--kv-bits, --pages, ...) to export theirs."""
    from pipeline.output.export import SUFFIX, ExportError
    from pipeline.output.export import export as write_export

    job = _load(job_file, pages, _overrides(flags), check_inputs=False)
    out = _derived_output(job, output, SUFFIX[fmt])
    try:
        n = write_export(job.output_path, fmt, out, job_name=job.spec.name, current=_is_current(job),
                         task_order=[t.name for t in job.spec.tasks])
    except ExportError as e:
        _fail(str(e), EXIT_USAGE)
    except OSError as e:
        _fail(f"{shown(out)}: cannot be written: {e.strerror or e}", EXIT_RUN)
    click.echo(f"{n} records -> {out}")
    sys.exit(EXIT_OK)


def _is_current(job):
    """Whether a record key is one of the job's results (``WorkPlan.counts``)."""
    from pipeline.run.plan import WorkPlan

    return WorkPlan(job).counts()


def _derived_output(job, output: str | None, suffix: str) -> Path:
    """The file ``export`` / ``report`` writes: ``-o``, else the results file
    with ``suffix``; exit 2 where writing it would destroy something else."""
    from pipeline.output.target import derived_output_problem

    out = Path(output) if output else job.output_path.with_suffix(suffix)
    problem = derived_output_problem(job, out, suffix)
    if problem:
        _fail(f"{'-o/--output: ' if output else ''}{shown(out)}: {problem}", EXIT_USAGE)
    return out


@main.command(epilog=EXIT_CODES_HELP)
@click.argument("job_file", metavar="JOB", type=click.Path(dir_okay=False))
@click.option("-o", "--output", default=None, help="HTML file to write (default: the results file with .html).")
@click.option("--pages", help="The --pages the runs used (it is part of each record's key).")
@_config_options
def report(job_file: str, output: str | None, pages: str | None, **flags) -> None:
    """Write one self-contained HTML page for JOB's results: counts, a KV-bytes plot, every document.

    The records of the job's current tasks and config: give the override
    flags the runs used (--kv-bits, --pages, ...) to report theirs."""
    from pipeline.output.export import ExportError
    from pipeline.output.report import write_report

    job = _load(job_file, pages, _overrides(flags), check_inputs=False)
    out = _derived_output(job, output, ".html")
    try:
        n = write_report(job.output_path, out, job_name=job.spec.name, current=_is_current(job),
                         task_order=[t.name for t in job.spec.tasks])
    except ExportError as e:
        _fail(str(e), EXIT_USAGE)
    except OSError as e:
        _fail(f"{shown(out)}: cannot be written: {e.strerror or e}", EXIT_RUN)
    click.echo(f"{n} records -> {out}")
    sys.exit(EXIT_OK)


@main.command(epilog=EXIT_CODES_HELP)
@click.argument("what", type=click.Choice(["record", "job"]))
@click.option("--markdown", is_flag=True, help="job: the reference page (docs/job-file.md) instead of JSON Schema.")
def schema(what: str, markdown: bool) -> None:
    """Print the JSON Schema of a result record or of a job file."""
    import json

    from pipeline.schema.record_model import record_json_schema
    from pipeline.schema.reference import job_json_schema, job_reference_markdown

    if markdown:
        if what != "job":
            _fail("--markdown is only for 'schema job'", EXIT_USAGE)
        click.echo(job_reference_markdown(), nl=False)
    else:
        click.echo(json.dumps(record_json_schema() if what == "record" else job_json_schema(), indent=2))
    sys.exit(EXIT_OK)


@main.command(epilog=EXIT_CODES_HELP)
@click.argument("directory", default="samples", type=click.Path(file_okay=False))
def samples(directory: str) -> None:
    """Write sample documents (text PDFs, a scanned PDF, an image set) into DIRECTORY."""
    from pipeline.inputs.samples import write_samples

    t0 = time.perf_counter()
    paths = write_samples(Path(directory))
    for p in paths:
        click.echo(str(p))
    click.echo(f"{len(paths)} sample documents in {directory} ({time.perf_counter() - t0:.1f} s)", err=True)
    sys.exit(EXIT_OK)


@main.command(epilog=EXIT_CODES_HELP)
@click.argument("file", type=click.Path(exists=True))
@click.option("--prompt", required=True, help="The question.")
@click.option("--job", "job_file", type=click.Path(dir_okay=False), help="Take model, cache, context and cache_store from this job (to reuse the caches its runs stored).")
@click.option("--model", default=None, help="Model path or hub id (default: the job's, else the built-in one).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--pages", help="Page ranges, e.g. '1-20,-5'.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole record as JSON instead of the answer.")
@_verbose_option
def ask(file: str, prompt: str, job_file: str | None, model: str | None, max_tokens: int, pages: str | None,
        as_json: bool, verbose: bool) -> None:
    """Ask one question about FILE (a PDF or an image folder), reusing its stored document cache.

    The first question about a document prefills it and stores the cache;
    later ones (and jobs with the same settings) load it instead.  Prints the
    answer; no results file is written.
    """
    from pipeline.run.ask import AskUsageError, ask_job
    from pipeline.run.ask import ask as ask_document
    from pipeline.run.progress import configure_logging

    configure_logging(verbose)
    base = _load(job_file, check_inputs=False) if job_file else None
    try:
        job = ask_job(Path(file), prompt, base=base, model=model, max_tokens=max_tokens, pages=pages)
        record = ask_document(job)
    except (JobFileError, PageRangeError, AskUsageError) as e:
        _fail(str(e), EXIT_USAGE)
    except TqpipeError as e:
        _fail(str(e), EXIT_FAILED)
    if as_json:
        import orjson

        from pipeline.schema.record import json_default

        click.echo(orjson.dumps(record, default=json_default).decode())
    elif record["status"] == "ok":
        click.echo(record["output"])
    if record["status"] != "ok":
        _fail(f"{file}: {record['error']['message']}", EXIT_FAILED)
    store = record["cache"].get("doc_cache")
    if store is not None:
        how = (f"cache loaded in {store['load_s']:.2f} s"
               + (" (document not read)" if store.get("ingest") == "skipped" else "") if store["hit"]
               else f"prefilled in {record['timing']['prefill_s']:.1f} s" + (", cache stored" if store.get("saved") else ""))
        click.echo(f"{record['tokens']['document']} document tokens, {how}", err=True)
    others = [w for w in record.get("warnings") or [] if w != "answer_truncated"]
    if record.get("finish_reason") == "length":
        click.echo(f"the answer stopped at --max-tokens {max_tokens}; raise it for the rest", err=True)
    if others:
        click.echo(f"warnings: {', '.join(others)}", err=True)
    sys.exit(EXIT_OK)


def _store(job_file: str | None, path: str | None):
    """The store named by --path, else by JOB's cache_store, else the default one."""
    from pipeline.inference.doc_cache import DocCacheStore, store_for_job

    if path is not None:
        if not Path(path).expanduser().is_dir():  # a mistyped --path would read as an empty store
            _fail(f"--path: {path!r} is not a folder (no document-cache store there)", EXIT_USAGE)
        return DocCacheStore(path)
    if job_file is not None:
        store = store_for_job(_load(job_file, check_inputs=False))
        if store is None:
            _fail(f"{job_file}: cache_store.max_gb is 0 (no document-cache store)", EXIT_USAGE)
        return store
    return DocCacheStore()


def _store_options(f):
    f = click.option("--job", "job_file", type=click.Path(dir_okay=False), help="Use this job's cache_store.")(f)
    return click.option("--path", type=click.Path(file_okay=False), help="The store folder (default: $TQPIPE_HOME/doc-caches).")(f)


@main.group()
def cache() -> None:
    """The document-cache store: prefilled KV caches kept between runs."""


@cache.command("ls")
@_store_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object per entry.")
def cache_ls(job_file: str | None, path: str | None, as_json: bool) -> None:
    """List stored document caches, least recently used first."""
    import orjson

    store = _store(job_file, path)
    entries = store.entries()
    for e in entries:
        row = {"entry": e.name, "bytes": e.nbytes, "last_used": time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used)),
               "tokens": e.info.get("length"), "model": (e.key.get("model") or {}).get("name"),
               "scheme": (e.key.get("cache") or {}).get("kv_quant_scheme"), "source": e.info.get("source"),
               "reusable": e.info.get("reusable"), "error": e.error}
        if as_json:
            click.echo(orjson.dumps(row).decode())
        else:
            what = f"ERROR {e.error}" if e.error else f"{row['tokens']} tok  {row['scheme']}  {row['model']}  {row['source']}"
            click.echo(f"{e.name[:25]}  {e.nbytes / 2**20:9.1f} MiB  {row['last_used']}  {what}")  # content-key
    if not as_json:
        total = sum(e.nbytes for e in entries)
        click.echo(f"{len(entries)} entries, {total / 2**30:.2f} of {store.max_bytes / 2**30:.2f} GiB in {store.root}", err=True)
    sys.exit(EXIT_OK)


@cache.command("rm")
@click.argument("entries", nargs=-1)
@click.option("--all", "remove_all", is_flag=True, help="Remove every entry.")
@_store_options
def cache_rm(entries: tuple[str, ...], remove_all: bool, job_file: str | None, path: str | None) -> None:
    """Remove the entries named (by their id or a prefix of it, as `cache ls` shows)."""
    if not entries and not remove_all:
        _fail("name the entries to remove, or give --all", EXIT_USAGE)
    store = _store(job_file, path)
    gone = store.remove([e.name for e in store.entries()] if remove_all else entries)
    click.echo(f"removed {len(gone)} entries from {store.root}", err=True)
    unmatched = [e for e in entries if not any(g.startswith(e) for g in gone)]
    if unmatched and not remove_all:  # an id that names nothing is the command line's fault (exit 2)
        _fail(f"no entry matches: {', '.join(unmatched)} (tqpipe cache ls lists them)", EXIT_USAGE)
    sys.exit(EXIT_OK)


@cache.command("prune")
@click.option("--max-gb", type=click.FloatRange(min=0), default=None, help="Evict least recently used entries down to this size (default: the store's cap).")
@click.option("--older-than", "older_than_days", type=click.FloatRange(min=0), default=None, help="Also remove entries unused for this many days.")
@_store_options
def cache_prune(max_gb: float | None, older_than_days: float | None, job_file: str | None, path: str | None) -> None:
    """Evict down to the cap, drop stale entries and dead writers' temporary files."""
    store = _store(job_file, path)
    gone = store.prune(None if max_gb is None else int(max_gb * 2**30),
                       older_than_s=None if older_than_days is None else older_than_days * 86400)
    click.echo(f"removed {len(gone)} files; {store.total_bytes() / 2**30:.2f} GiB left in {store.root}", err=True)
    sys.exit(EXIT_OK)


if __name__ == "__main__":  # pragma: no cover
    main()
