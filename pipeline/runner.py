"""Run a job: discover documents, skip finished work, read, prefill, answer, record.

The runner is the only place that writes results, and it writes each
(document, task) record the moment that task finishes, through the durable
``ResultLog``.  A kill at any point therefore loses at most the record in
flight, and a rerun skips every key already written (the key covers the
document's content hash and everything that shapes that task's output, so
editing one task reruns only that task).

Reading and computing are kept apart from writing: :func:`process_document`
turns ONE document into records and writes nothing, so the Ray engine can
call it inside a remote actor while the driver appends the records.

Model choice when the job names none: each document gets the built-in text
model (SmolLM2) unless it has page images to read, in which case it gets the
built-in VLM; each is loaded at most once per run, and only when a document
actually needs it (a rerun with nothing to do loads no model).  The config
hash uses the job's model setting, not the resolved model, so the key is
known before any document is read; the resolved model is a deterministic
function of the document and the context spec, both already in the key, and
every record names the model that actually ran.
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from .context import DocumentPrompt, PromptBuilder
from .errors import ContextOverflowError, IngestError, TqpipeError
from .extract import check_citations, cited_pages, missing_fields, pages_in_text, parse_json_output
from .ingest import Document, DocumentRef, content_hash, discover, ingest
from .records import error_info, make_record, record_key, task_config_hash

logger = logging.getLogger(__name__)

AUTO_MODEL = "builtin:auto"


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


# -- keys -------------------------------------------------------------------


def model_setting(job: Any) -> str:
    """The model identity used in config hashes: the job's path, or ``builtin:auto``."""
    return job.spec.model.path or AUTO_MODEL


def with_pages(job: Any, pages: str | None) -> Any:
    """``job`` with ``context.pages`` replaced by a ``--pages`` override.

    The override must be part of the job's context (not a side argument) so
    it enters the config hash: output from pages 1-2 must not count as done
    for a later run over the whole document.
    """
    if pages is None:
        return job
    import dataclasses

    context = job.spec.context.model_copy(update={"pages": pages})
    return dataclasses.replace(job, spec=job.spec.model_copy(update={"context": context}))


def task_keys(job: Any, digest: str, tasks: Sequence[Any] | None = None) -> dict[str, str]:
    """``{task name: record key}`` for one document content hash."""
    spec = job.spec
    out = {}
    for task in tasks if tasks is not None else spec.tasks:
        chash = task_config_hash(task, model=model_setting(job), cache=spec.cache, context=spec.context)
        out[task.name] = record_key(digest, task.name, chash)
    return out


def _config_hash(key: str) -> str:
    return key.rsplit("/", 1)[1]


# -- models -----------------------------------------------------------------


class Engines:
    """Lazily loaded engines for a job: one for the named model, or up to two
    built-ins (text, VLM) chosen per document.  ``loads`` counts model loads."""

    def __init__(self, job: Any, *, loader: Callable[..., Any] | None = None):
        self.job = job
        self._loader = loader
        self._engines: dict[bool, Any] = {}
        self._errors: dict[bool, Exception] = {}
        self.loads = 0

    def get(self, needs_images: bool) -> Any:
        from .engine import Engine
        from pipeline.inference.doc_cache import store_for_job

        path = self.job.spec.model.path
        slot = bool(needs_images) if path is None else False
        if slot in self._errors:  # don't retry a failed load for every document
            raise self._errors[slot]
        if slot not in self._engines:
            loader = self._loader
            if loader is None:
                from .models import load_model as loader
            try:
                loaded = loader(path, needs_images=slot)
            except Exception as e:
                self._errors[slot] = e
                raise
            self.loads += 1
            logger.info("loaded model %s (%s)", loaded.name, loaded.kind)
            self._engines[slot] = Engine(loaded, self.job.spec.cache, store=store_for_job(self.job))
        return self._engines[slot]


def model_context_limit(config: dict | None) -> int | None:
    """The model's trained context length (``max_position_embeddings``), if it says."""
    config = config or {}
    limit = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    return int(limit) if limit else None


def effective_context(context: Any, config: dict | None) -> Any:
    """``context`` with ``max_tokens`` capped at the model's own limit.

    A job may ask for 32k tokens of a model trained on 8k; past its limit a
    model's positions are out of distribution and answers degrade silently,
    so the cap applies the job's overflow policy at the model's limit instead
    (the record's ``context.model_max_tokens`` says so).
    """
    limit = model_context_limit(config)
    if limit is None or limit >= context.max_tokens:
        return context
    return context.model_copy(update={"max_tokens": limit})


def needs_images(doc: Document) -> bool:
    return any(p.image is not None for p in doc.pages)


def max_rss_bytes() -> int:
    """This process's peak resident set size so far (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def memory_record() -> dict:
    """Peak memory for the record: MLX's peak since the document started (the
    runner resets it before each document, so this is the document's own
    working set: weights, cache, prefill temporaries) and the process max RSS
    (never resets: it includes earlier documents and everything Python holds)."""
    import mlx.core as mx

    return {"mx_peak_bytes": int(mx.get_peak_memory()), "max_rss_bytes": max_rss_bytes()}


# -- one document -------------------------------------------------------------


def _base(job: Any, ref: DocumentRef, digest: str, task: Any, key: str) -> dict:
    return dict(
        job=job.spec.name,
        doc_id=ref.doc_id,
        source=str(ref.source),
        content_hash=digest,
        task=task.name,
        config_hash=_config_hash(key),
    )


def _context_record(job: Any, prompt: DocumentPrompt | None, doc: Document | None, config: dict | None = None) -> dict:
    ctx = job.spec.context
    rec: dict = {"max_tokens": ctx.max_tokens, "overflow": ctx.overflow, "images": ctx.images}
    limit = model_context_limit(config)
    if limit is not None and limit < ctx.max_tokens:
        rec["model_max_tokens"] = limit
    if prompt is not None:
        rec.update(prompt.truncation)
        rec["n_images"] = prompt.n_images
    if doc is not None:
        rec["page_count"] = doc.page_count
        if doc.notes:
            rec["notes"] = doc.notes
    return rec


def _error_records(job, ref, digest, tasks, keys, exc, stage, **fields) -> Iterator[dict]:
    for task in tasks:
        yield make_record(
            **_base(job, ref, digest, task, keys[task.name]),
            status="error",
            error=error_info(exc, stage=stage),
            **fields,
        )


def _ok_record(job, ref, digest, task, key, result, prompt, doc, model_name, config=None, ingest_s=None) -> dict:
    parsed = parse_error = None
    extra: dict = {"finish_reason": result.finish_reason, "memory": memory_record()}
    if task.format == "json":
        p = parse_json_output(result.text)
        parsed, parse_error = p.value, p.error
        if parse_error and result.finish_reason == "length":
            parse_error += f" (the answer hit max_tokens={task.max_tokens} and may be cut off)"
        if p.ok:
            extra["missing_fields"] = missing_fields(p.value, task.fields)
            extra["citations"] = check_citations(cited_pages(p.value), prompt.included_pages)
    else:
        cited = pages_in_text(result.text)
        if cited:
            extra["citations"] = check_citations(list(dict.fromkeys(cited)), prompt.included_pages)
    return make_record(
        **_base(job, ref, digest, task, key),
        status="ok",
        output=result.text,
        parsed=parsed,
        parse_error=parse_error,
        tokens=result.tokens,
        timing=result.timing if ingest_s is None else {"ingest_s": round(ingest_s, 4), **result.timing},
        cache=result.cache,
        model=model_name,
        context=_context_record(job, prompt, doc, config),
        pages=prompt.pages_record(),
        **extra,
    )


def process_document(
    engines: Engines,
    job: Any,
    ref: DocumentRef,
    *,
    tasks: Sequence[Any] | None = None,
    pages: str | None = None,
    digest: str | None = None,
    on_prefill: Callable[[int], None] | None = None,
    on_token: Callable[[int], None] | None = None,
    on_prompt: Callable[[DocumentPrompt], None] | None = None,
) -> Iterator[dict]:
    """Yield one record per task of ``ref`` (ok or error); writes nothing.

    ``on_prompt`` sees the tokenized document before prefill (progress bars
    use it for their totals); ``on_prefill``/``on_token`` get token counts.

    A document that can't be read, doesn't fit, or fails in the model
    becomes error records for its tasks; the caller goes on with the next.
    """
    job = with_pages(job, pages)  # an override changes the keys too
    tasks = list(tasks if tasks is not None else job.spec.tasks)
    try:
        digest = digest or content_hash(ref)
    except OSError as e:
        digest = "sha256:unreadable"
        keys = task_keys(job, digest, tasks)
        yield from _error_records(job, ref, digest, tasks, keys, IngestError(ref.source, str(e)), "ingest")
        return
    keys = task_keys(job, digest, tasks)
    _reset_peak_memory()
    t0 = time.perf_counter()
    try:
        doc = ingest(ref, job.spec.context)
    except (IngestError, OSError) as e:
        yield from _error_records(job, ref, digest, tasks, keys, e, "ingest")
        return
    ingest_s = time.perf_counter() - t0
    pending = list(tasks)
    stage, model_name, prompt, config = "model", None, None, None
    try:
        engine = engines.get(needs_images(doc))
        model_name, config = engine.loaded.name, engine.loaded.config
        stage = "context"
        loaded = engine.loaded
        prompt = PromptBuilder(loaded.tokenizer, processor=loaded.processor, kind=loaded.kind).build(
            doc, effective_context(job.spec.context, loaded.config), tasks
        )
        if on_prompt is not None:
            on_prompt(prompt)
        stage = "prefill"
        key = engine.document_key(digest, job.spec.context, prompt)
        info = {"doc_id": ref.doc_id, "source": str(ref.source)}
        for result in engine.iter_process(prompt, tasks, on_prefill=on_prefill, on_token=on_token, key=key, info=info):
            task = pending.pop(0)
            yield _ok_record(job, ref, digest, task, keys[task.name], result, prompt, doc, model_name, loaded.config,
                             ingest_s)
            stage = "decode"
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # one bad document must not stop the job
        if not isinstance(e, TqpipeError):
            logger.exception("%s: %s failed", ref.doc_id, stage)
        yield from _error_records(
            job, ref, digest, pending, keys, e, stage,
            model=model_name,
            context=_context_record(job, prompt, doc, config),
            pages=prompt.pages_record() if prompt is not None else None,
        )


def _reset_peak_memory() -> None:
    import mlx.core as mx

    mx.reset_peak_memory()


# -- dry run ------------------------------------------------------------------


class _Tokenizers:
    """Tokenizer (and processor, for VLMs) without weights, for ``--dry-run``."""

    def __init__(self, job: Any):
        self.job = job
        self._builders: dict[bool, PromptBuilder] = {}

    def get(self, images: bool) -> PromptBuilder:
        path = self.job.spec.model.path
        slot = bool(images) if path is None else False
        if slot not in self._builders:
            self._builders[slot] = _tokenizer_only(path, slot)
        return self._builders[slot]


def _tokenizer_only(path: str | None, images: bool) -> PromptBuilder:
    import importlib

    from .models import builtin_text_model_dir, builtin_vlm_dir, is_vlm_config, read_config, resolve_model_dir

    model_dir = (builtin_vlm_dir() if images else builtin_text_model_dir()) if path is None else resolve_model_dir(path)
    config = read_config(model_dir)
    if is_vlm_config(config):
        importlib.import_module(f"mlx_vlm.models.{config['model_type'].replace('-', '_')}")  # registers its processor
        from mlx_vlm.utils import load_processor

        processor = load_processor(model_dir, add_detokenizer=False)
        builder = PromptBuilder(getattr(processor, "tokenizer", processor), processor=processor, kind="vlm")
    else:
        from transformers import AutoTokenizer

        builder = PromptBuilder(AutoTokenizer.from_pretrained(str(model_dir)), kind="text")
    builder.model_config = config  # for the model's own context limit
    return builder


def dry_run_document(tokenizers: _Tokenizers, job: Any, ref: DocumentRef, *, pages: str | None = None) -> dict:
    """Ingest and tokenize one document; say whether it fits the context limit."""
    row: dict = {"doc_id": ref.doc_id, "source": str(ref.source)}
    try:
        doc = ingest(ref, job.spec.context, pages=pages)
    except (IngestError, OSError) as e:
        return {**row, "error": str(e)}
    row.update(pages=len(doc.pages), page_count=doc.page_count, skipped_pages=len(doc.skipped_pages),
               images=sum(p.image is not None for p in doc.pages))
    try:
        builder = tokenizers.get(needs_images(doc))
        context = effective_context(job.spec.context, getattr(builder, "model_config", None))
        prompt = builder.build(doc, context, job.spec.tasks)
    except ContextOverflowError as e:
        return {**row, "fits": False, "error": str(e)}
    except TqpipeError as e:
        return {**row, "error": str(e)}
    trunc = prompt.truncation
    row.update(tokens=prompt.n_tokens + trunc.get("tokens_dropped", 0), fits=not trunc["truncated"])
    if trunc["truncated"]:
        row["truncate"] = {k: trunc[k] for k in ("tokens_dropped", "pages_dropped", "partial_page")}
    return row


# -- the job ------------------------------------------------------------------


def run_job(
    job: Any,
    *,
    retry_failed: bool = False,
    pages: str | None = None,
    dry_run: bool = False,
    progress: bool = True,
    engines: Engines | None = None,
    refs: Sequence[DocumentRef] | None = None,
    echo: Callable[[str], None] = print,
) -> RunSummary:
    """Process every document of ``job`` (or ``refs``) not yet recorded.

    Holds the job's lock for the whole run (``LockHeldError`` if another run
    has it).  ``pages`` overrides the job's ``context.pages``.  ``dry_run``
    ingests and tokenizes only: no model, no results, no lock.
    """
    from .checkpoint import ResultLog
    from .lock import JobLock
    from .progress import make_progress

    job, pages = with_pages(job, pages), None  # the override is now in job.spec.context (and the keys)
    refs = list(discover(job) if refs is None else refs)
    summary = RunSummary(documents=len(refs))
    if dry_run:
        toks = _Tokenizers(job)
        for ref in refs:
            row = dry_run_document(toks, job, ref, pages=pages)
            echo(_dry_line(row))
            if "error" in row and row.get("fits") is not False:
                summary.failed += 1
                summary.failed_documents.append(ref.doc_id)
        return summary

    engines = engines or Engines(job)
    tasks = job.spec.tasks
    with JobLock(job.output_path, job=job.spec.name), ResultLog(job.output_path).open() as log:
        docs_bar = make_progress(len(refs), "documents", "doc", position=0) if progress else None
        try:
            for ref in refs:
                try:
                    digest = content_hash(ref)
                except OSError:
                    digest = None  # process_document records the read error
                if digest is not None:
                    keys = task_keys(job, digest)
                    todo = [t for t in tasks if not log.is_done(keys[t.name], include_failed=not retry_failed)]
                    if not retry_failed:  # failures from earlier runs still count for the exit code
                        summary.failed += sum(
                            1 for t in tasks if not log.is_done(keys[t.name], include_failed=False) and t not in todo
                        )
                else:
                    todo = list(tasks)
                if not todo:
                    summary.skipped += 1
                else:
                    _run_document(engines, job, ref, todo, pages, digest, log, summary, progress)
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


def _run_document(engines, job, ref, todo, pages, digest, log, summary, progress) -> None:
    from .progress import make_progress

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
        for record in process_document(engines, job, ref, tasks=todo, pages=pages, digest=digest,
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


def _dry_line(row: dict) -> str:
    if "pages" not in row:
        return f"{row['doc_id']}: ERROR {row['error']}"
    head = f"{row['doc_id']}: pages={row['pages']}/{row['page_count']} images={row['images']}"
    if "tokens" not in row:
        return f"{head} fits=no ({row['error']})" if row.get("fits") is False else f"{head} ERROR {row['error']}"
    line = f"{head} tokens={row['tokens']} fits={'yes' if row['fits'] else 'no'}"
    if "truncate" in row:
        t = row["truncate"]
        line += f" (truncate would drop {t['tokens_dropped']} tokens, pages {t['pages_dropped']})"
    return line


__all__ = [
    "Engines",
    "RunSummary",
    "dry_run_document",
    "model_setting",
    "process_document",
    "run_job",
    "task_keys",
    "with_pages",
]
