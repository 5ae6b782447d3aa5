"""``tqpipe ask FILE --prompt ...``: one question about one document, from its stored cache when there is one.

A one-off job of one document and one task, run through the same
``process_document`` as every job, so with the same document-cache key: a
document a job has read is answered without a prefill, and a document asked
about first is stored for later.  Nothing else is written: the answer goes
to the caller, not to a results file, and no job lock is taken.  ``base`` (a
job) supplies the model, cache, context and store settings, so an ask hits
the caches that job's runs stored.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import JobFileError, TqpipeError
from pipeline.schema.job import Job, JobSpec, TaskSpec
from pipeline.schema.model_ref import command_line_model


class AskUsageError(TqpipeError):
    """FILE is not one document (several, none, neither a PDF nor an image):
    the command line's fault, not a document's or a job file's (exit 2)."""


def ask_job(file: Path, prompt: str, *, base: Job | None = None, model: str | None = None,
            max_tokens: int = 256, pages: str | None = None) -> Job:
    """The one-off job: ``base``'s settings (or the defaults), one input, one task named ``ask``."""
    spec = base.spec if base is not None else JobSpec(name="ask", inputs=["."], tasks=[TaskSpec(name="ask", prompt=".")],
                                                      output="-")
    update: dict = {"name": "ask", "inputs": [str(Path(file).resolve())],
                    "tasks": [TaskSpec(name="ask", prompt=prompt, max_tokens=max_tokens)]}
    if model is not None:  # relative to the working directory, as --model on run
        try:
            update["model"] = spec.model.model_copy(update={"path": command_line_model(model, Path.cwd())})
        except ValueError as e:
            raise AskUsageError(f"--model: {e}") from None
    if pages is not None:
        update["context"] = spec.context.model_copy(update={"pages": pages})
    spec = spec.model_copy(update=update)
    if base is not None:
        return Job(spec=spec, path=base.path, base_dir=base.base_dir)
    cwd = Path.cwd()
    return Job(spec=spec, path=cwd / "ask", base_dir=cwd)


def ask(job: Job) -> dict:
    """Run the one-off job's single (document, task); returns its record (ok or error)."""
    from pipeline.inference.engines import Engines
    from pipeline.inputs.discover import expand_input
    from pipeline.run.document import process_document

    try:
        refs = expand_input(job, job.spec.inputs[0])
    except JobFileError as e:  # raised against job.path, which for ask is no file the user wrote
        raise AskUsageError(e.problem) from None
    if len(refs) != 1:
        raise AskUsageError(f"{job.spec.inputs[0]}: names {len(refs)} documents; ask takes one PDF or one image folder")
    (record,) = process_document(Engines(job), job, refs[0])
    return record
