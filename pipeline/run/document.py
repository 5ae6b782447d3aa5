"""One document through the pipeline: ingest, prompt, prefill once, every task, records.

:func:`process_document` turns ONE document into records and writes
nothing, so the local runner appends them itself and a Ray actor returns
them to the driver, which appends them through the same results log.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterator, Sequence

from pipeline.errors import IngestError, RunError, TqpipeError
from pipeline.inference.engines import Engines
from pipeline.inference.memory import reset_peak_memory
from pipeline.inference.prompt import DocumentPrompt, PromptBuilder, effective_context, task_budget
from pipeline.inputs.discover import DocumentRef, content_hash, unreadable_digest
from pipeline.inputs.document import Document
from pipeline.inputs.ingest import ingest
from pipeline.output.render import context_field, error_records, ok_record
from pipeline.run.plan import task_keys
from pipeline.schema.job import Job, TaskSpec
from pipeline.schema.paths import shown
from pipeline.schema.record import error_info

logger = logging.getLogger(__name__)


def process_document(
    engines: Engines,
    job: Job,
    ref: DocumentRef,
    *,
    tasks: Sequence[TaskSpec] | None = None,
    digest: str | None = None,
    on_prefill: Callable[[int], None] | None = None,
    on_token: Callable[[int], None] | None = None,
    on_prompt: Callable[[DocumentPrompt], None] | None = None,
) -> Iterator[dict]:
    """Yield one record per task of ``ref`` (ok or error); writes nothing.

    ``on_prompt`` sees the tokenized document before prefill (progress bars
    use it for their totals); ``on_prefill``/``on_token`` get token counts.

    With a document-cache store that holds this document's content, read
    the way this job would read it, the stored cache is loaded and the
    document is not read at all (:func:`reuse_stored`); otherwise it is
    read, prefilled and stored.  A document that can't be read, doesn't
    fit, or fails in the model becomes error records for its tasks; the
    caller goes on with the next.
    """
    tasks = list(tasks if tasks is not None else job.spec.tasks)
    names = [t.name for t in tasks]
    try:
        digest = digest or content_hash(ref)
    except IngestError as e:
        digest = unreadable_digest(ref)
        keys = task_keys(job, digest, tasks)
        yield from error_records(job, ref, digest, names, keys, error_info(e, stage="ingest"))
        return
    keys = task_keys(job, digest, tasks)
    reset_peak_memory()
    pending = list(tasks)
    stage, model_name, prompt, config, doc = "model", None, None, None, None
    try:
        reused = reuse_stored(engines, job, ref, digest, tasks)
    except (KeyboardInterrupt, SystemExit, RunError):
        raise
    except Exception:  # the store only saves time: read the document instead
        logger.exception("%s: the stored document cache could not be used; reading the document", shown(ref.doc_id))
        reused = None
    if reused is not None:
        engine, prompt, doc, state = reused
        ingest_s, key, info = 0.0, None, None
    else:
        reads_images = engines.reads_images()  # once per run (it may import the model library): not reading time
        t0 = time.perf_counter()
        try:
            doc = ingest(ref, job.spec.context, model_reads_images=reads_images, digest=digest)
        except (IngestError, OSError) as e:
            yield from error_records(job, ref, digest, names, keys, error_info(e, stage="ingest"))
            return  # an OSError here (EIO, vanished) is marked transient: a plain rerun retries it
        ingest_s = time.perf_counter() - t0
        state = None
    try:
        if state is None:
            engine = engines.get(doc.needs_images)
        loaded = engine.loaded
        model_name, config = loaded.name, loaded.config
        if state is None:
            stage = "context"
            builder = PromptBuilder(loaded.tokenizer, processor=loaded.processor, kind=loaded.kind)
            prompt = builder.build(doc, effective_context(job.spec.context, loaded.config), tasks)
            key = engine.document_key(digest, job.spec.context, reads_images=reads_images)
            info = stored_info(ref, doc, prompt, builder, tasks) if key is not None else None
        if on_prompt is not None:
            on_prompt(prompt)
        stage = "prefill"
        if state is not None and on_prefill is not None:
            on_prefill(state.length)
        for result in engine.iter_process(prompt, tasks, on_prefill=on_prefill, on_token=on_token, key=key,
                                          info=info, state=state):
            task = pending.pop(0)
            yield ok_record(job, ref, digest, task, keys[task.name], result, prompt, doc, model_name, loaded.config,
                            ingest_s, random_weights=getattr(loaded, "random_weights", False))
            stage = "decode"
    except (KeyboardInterrupt, SystemExit, RunError):
        raise  # a model that cannot load is no document's fault: no records, the run stops (exit 4)
    except Exception as e:  # one bad document must not stop the job
        if not isinstance(e, TqpipeError):
            logger.exception("%s: %s failed", shown(ref.doc_id), stage)
        yield from error_records(
            job, ref, digest, [t.name for t in pending], keys, error_info(e, stage=stage),
            model=model_name,
            context=context_field(job, prompt, doc, config),
            pages=prompt.pages_record() if prompt is not None else None,
        )


def stored_info(ref: DocumentRef, doc: Document, prompt: DocumentPrompt, builder: PromptBuilder,
                tasks: Sequence[TaskSpec]) -> dict:
    """What a new document-cache entry keeps besides the cache: the listing's
    fields, and what :func:`reuse_stored` needs to answer from it without
    reading the document.  ``reusable`` only for a whole reading (nothing
    cut, no page skipped) whose task suffixes do not depend on the document."""
    reusable = (not prompt.truncation.get("truncated") and not prompt.skipped_pages and not doc.skipped_pages
                and builder.task_ids(tasks) == prompt.task_ids)
    return {"doc_id": ref.doc_id, "source": str(ref.source), "needs_images": doc.needs_images,
            "reusable": reusable, "document": doc.stored_fields(), "prompt": prompt.stored_fields()}


def reuse_stored(engines: Engines, job: Job, ref: DocumentRef, digest: str,
                 tasks: Sequence[TaskSpec]) -> tuple[Any, DocumentPrompt, Document, Any] | None:
    """``(engine, prompt, document, loaded state)`` from a stored document
    cache, without reading the document; None when the store has none to use.

    The store is searched by content hash first (file names; no model is
    loaded for a document the store has never seen).  An entry qualifies
    when its key equals this job's (same reading settings, reader, model
    and cache spec), it was stored ``reusable`` and its document still fits
    the context beside this run's tasks; the document would then be read
    into exactly the stored tokens, so the answers are a fresh run's.
    """
    if job.spec.cache_store.max_gb <= 0:
        return None
    from pipeline.inference.doc_cache import store_for_job
    from pipeline.inference.engine import reserve_for

    store = store_for_job(job)
    reads_images = engines.reads_images()  # before a model load, as when the document is read
    t0 = time.perf_counter()
    for entry in store.candidates(digest):
        if not entry.info.get("reusable"):
            continue
        if entry.info.get("needs_images") and not reads_images:
            continue  # made by a model that read page images: never this job's (no such model is loaded)
        t_model = time.perf_counter()
        engine = engines.get(bool(entry.info.get("needs_images")))
        t0 += time.perf_counter() - t_model  # a model load is no part of the lookup (nor of a reading)
        key = engine.document_key(digest, job.spec.context, reads_images=reads_images)
        if key is None or store.path_for(key) != entry.path:
            continue
        loaded = engine.loaded
        builder = PromptBuilder(loaded.tokenizer, processor=loaded.processor, kind=loaded.kind)
        task_ids = builder.task_ids(tasks)
        if entry.info["prompt"]["tokens"] > task_budget(effective_context(job.spec.context, loaded.config),
                                                         tasks, task_ids):
            continue
        lookup_s = time.perf_counter() - t0
        hit = store.load(key)
        if hit is None:
            continue
        try:
            prompt = DocumentPrompt.from_stored(hit.prefix_ids, hit.info["prompt"], task_ids)
            doc = Document.from_stored(ref, digest, hit.info["document"])
        except (KeyError, TypeError, ValueError) as e:  # checksummed, yet not what this tqpipe wrote
            store.discard(key, f"its stored prompt is unusable: {type(e).__name__}: {e}")
            continue
        state = engine.load_cached(prompt, key, reserve=reserve_for(prompt, tasks), hit=hit)
        if state is None:
            continue
        state.doc_cache.update(ingest="skipped", lookup_s=round(lookup_s, 4))
        return engine, prompt, doc, state
    return None
