"""One-off runs: ``tqpipe run FILE.pdf [FILE2 ...] --prompt "..."`` with no job file.

``marker_single FILE`` and ``mlx_vlm.generate --image X --prompt Q`` need no
config; neither should one question about one file.  The command line is
turned into an ordinary :class:`~pipeline.schema.job.Job` (every default of
the job schema, the files as its inputs, the prompt as its one task), so a
one-off run goes through exactly the pipeline a job does: same records, same
keys, same checks.  Paths are relative to the working directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.errors import JobFileError
from pipeline.inputs.discover import IMAGE_SUFFIXES, PDF_SUFFIXES
from pipeline.schema.job import Job, JobSpec
from pipeline.schema.overrides import OverrideError, Overrides, apply_overrides

JOB_SUFFIXES = (".yaml", ".yml")
ONEOFF_NAME = "oneoff"
EXPECTED = "a job file (.yaml) or documents (PDF files, image files, folders of images)"


def is_document_arg(arg: str) -> bool:
    """Whether a ``tqpipe run`` argument names documents rather than a job file."""
    p = Path(arg)
    return p.is_dir() or p.suffix.lower() in PDF_SUFFIXES | IMAGE_SUFFIXES


def oneoff_job(files: list[str], ov: Overrides, output: Path, *, cwd: Path | None = None) -> Job:
    """A job over ``files`` asking ``ov.prompt``, writing to ``output``.

    Raises :class:`OverrideError` when there is no prompt or a file is no
    document; the message says what ``tqpipe run`` expected.
    """
    cwd = Path.cwd() if cwd is None else cwd
    if ov.prompt is None:
        raise OverrideError(f"{files[0]}: one-off mode needs --prompt \"...\" (or give a job file: .yaml)")
    for f in files:
        p = cwd / f
        if not p.exists():
            raise OverrideError(f"{f}: no such file or folder")
        if not is_document_arg(str(p)):
            raise OverrideError(f"{f}: tqpipe run expects {EXPECTED}")
    spec = JobSpec(
        name=ONEOFF_NAME,
        inputs=[os.path.abspath(cwd / f) for f in files],
        tasks=[{"name": "prompt", "prompt": ov.prompt}],
        output=str(output),
    )
    job = Job(spec=spec, path=cwd / "<command line>", base_dir=cwd)
    job = apply_overrides(job, ov, cwd=cwd)
    if not any(True for _ in _refs(job)):
        raise OverrideError(f"{' '.join(files)}: no PDF or image files there")
    return job


def _refs(job: Job):
    from pipeline.inputs.discover import discover

    try:
        return discover(job)
    except JobFileError as e:
        raise OverrideError(e.problem) from None
