"""Command-line overrides of a job, under the names mlx-vlm, mlx-lm and olmocr users type.

``--model``, ``--kv-bits``, ``--kv-quant-scheme``, ``--kv-key-bits`` /
``--kv-value-bits``, ``--max-tokens``, ``--prompt`` (with ``--format`` /
``--fields``) and ``--output`` replace the job file's settings.  They are
applied to the job spec itself and the result is validated again, as if the
file had said so: the same checks (``--kv-bits 3.3`` is refused with the
allowed widths), and everything that shapes an answer enters the record's
config hash, so a run with ``--kv-bits 4`` never counts as done for a 3.5-bit
run.  ``--output`` only moves the results file; it is no part of the hash.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pipeline.errors import TqpipeError
from pipeline.schema.job import Job, JobSpec
from pipeline.schema.model_ref import command_line_model

#: The task ``--prompt`` makes (it replaces the job's tasks).
PROMPT_TASK = "prompt"

#: Flag of each overridable job key, for error messages.
FLAGS = {
    ("model", "path"): "--model",
    ("cache", "kv_bits"): "--kv-bits",
    ("cache", "kv_quant_scheme"): "--kv-quant-scheme",
    ("cache", "key_bits"): "--kv-key-bits",
    ("cache", "value_bits"): "--kv-value-bits",
    ("output",): "--output",
}


class OverrideError(TqpipeError):
    """A command-line override the job cannot take (names the flag)."""


@dataclass(frozen=True)
class Overrides:
    """Command-line values; None leaves the job's own setting."""

    model: str | None = None
    kv_bits: float | None = None
    kv_quant_scheme: str | None = None
    kv_key_bits: int | None = None
    kv_value_bits: int | None = None
    output: str | None = None
    max_tokens: int | None = None
    prompt: str | None = None
    format: str | None = None
    fields: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.prompt is None and (self.format is not None or self.fields is not None):
            raise OverrideError("--format and --fields describe the --prompt task; add --prompt")
        if self.fields and self.format not in (None, "json"):
            raise OverrideError("--fields needs --format json")

    def prompt_task(self) -> dict[str, Any]:
        """The one task ``--prompt`` asks (``--fields`` implies ``--format json``)."""
        task: dict[str, Any] = {"name": PROMPT_TASK, "prompt": self.prompt}
        fmt = self.format or ("json" if self.fields else None)
        if fmt is not None:
            task["format"] = fmt
        if self.fields:
            task["fields"] = list(self.fields)
        if self.max_tokens is not None:
            task["max_tokens"] = self.max_tokens
        return task


def parse_fields(value: str | None) -> tuple[str, ...] | None:
    """``--fields title,author,total`` -> ``("title", "author", "total")``."""
    if value is None:
        return None
    names = tuple(f.strip() for f in value.split(",") if f.strip())
    if not names:
        raise OverrideError("--fields: give comma-separated names, e.g. --fields title,date,total")
    return names


def apply_overrides(job: Job, ov: Overrides, *, cwd: Path | None = None) -> Job:
    """``job`` with the command-line values in place, validated again.

    Paths on the command line are relative to the working directory (not the
    job file's folder): ``--output out.jsonl`` lands where the user is.
    """
    cwd = Path.cwd() if cwd is None else cwd
    data = job.spec.model_dump(by_alias=True, exclude_unset=False)
    if ov.model is not None:  # the job file's rule (schema.model_ref), paths from the working directory
        try:
            data["model"]["path"] = command_line_model(ov.model, cwd)
        except ValueError as e:
            raise OverrideError(f"--model: {e}") from None
    cache = data["cache"]
    if ov.kv_quant_scheme is not None:
        if ov.kv_quant_scheme != cache["kv_quant_scheme"] and ov.kv_bits is None:
            cache["kv_bits"] = None  # the job's width was for its own scheme: the new scheme's default
        cache["kv_quant_scheme"] = ov.kv_quant_scheme
        if ov.kv_quant_scheme != "turboquant":  # turboquant-only keys would be refused
            for k in ("key_bits", "value_bits", "quantizer"):
                cache.pop(k, None)
    if ov.kv_bits is not None and cache["kv_quant_scheme"] == "fp16":
        raise OverrideError("--kv-bits: only applies to kv_quant_scheme turboquant or affine (this job's is fp16)")
    for key, value in (("kv_bits", ov.kv_bits), ("key_bits", ov.kv_key_bits), ("value_bits", ov.kv_value_bits)):
        if value is not None:
            cache[key] = value
    if ov.output is not None:
        data["output"] = os.path.abspath(cwd / Path(ov.output).expanduser())
    if ov.prompt is not None:
        data["tasks"] = [ov.prompt_task()]
    elif ov.max_tokens is not None:
        for task in data["tasks"]:
            task["max_tokens"] = ov.max_tokens
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = tuple(str(p) for p in err["loc"])
        flag = FLAGS.get(loc[:2]) or FLAGS.get(loc[:1]) or ("--max-tokens" if "max_tokens" in loc else None)
        where = flag or ".".join(loc)
        raise OverrideError(f"{where}: {err['msg'].removeprefix('Value error, ')}") from None
    return dataclasses.replace(job, spec=spec)
