"""One document through the pipeline: ingest, prompt, prefill once, every task, records.

:func:`process_document` turns ONE document into records and writes
nothing, so the local runner appends them itself and a Ray actor returns
them to the driver, which appends them through the same results log.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterator, Sequence

from pipeline.errors import IngestError, RunError, TqpipeError
from pipeline.inference.engines import Engines
from pipeline.inference.memory import reset_peak_memory
from pipeline.inference.prompt import DocumentPrompt, PromptBuilder, effective_context
from pipeline.inputs.discover import DocumentRef, content_hash, unreadable_digest
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

    A document that can't be read, doesn't fit, or fails in the model
    becomes error records for its tasks; the caller goes on with the next.
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
    t0 = time.perf_counter()
    try:
        doc = ingest(ref, job.spec.context, model_reads_images=engines.reads_images())
    except (IngestError, OSError) as e:
        yield from error_records(job, ref, digest, names, keys, error_info(e, stage="ingest"))
        return  # an OSError here (EIO, vanished) is marked transient: a plain rerun retries it
    ingest_s = time.perf_counter() - t0
    pending = list(tasks)
    stage, model_name, prompt, config = "model", None, None, None
    try:
        engine = engines.get(doc.needs_images)
        loaded = engine.loaded
        model_name, config = loaded.name, loaded.config
        stage = "context"
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
