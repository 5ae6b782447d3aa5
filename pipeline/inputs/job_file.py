"""Job files: read the YAML, validate it against the schema, check the file system.

A job is validated completely before anything expensive happens: schema
(:mod:`pipeline.schema.job`), then the file system (every input must match
something, a local model directory must exist).  Any problem becomes ONE
:class:`~pipeline.errors.JobFileError` whose message names the job file, the
key and the problem, e.g.::

    jobs/x.yaml: tasks[1].max_tokens: must be greater than 0 (got -5)

Paths inside a job file are relative to the job file's folder, so a cron job
behaves the same whatever its working directory.  No mlx import: validating
a job must stay instant.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from pipeline.errors import JobFileError
from pipeline.inputs.discover import expand_input
from pipeline.schema.job import ImageSetInput, Job, JobSpec
from pipeline.schema.model_ref import model_path_problem
from pipeline.schema.reference import models_in


def load_job(path: str | Path, *, check_inputs: bool = True, paths_exist: bool = False) -> Job:
    """Read, validate and check a job file; raise :class:`JobFileError` on any problem.

    ``check_inputs=False`` skips only the "every input matches something"
    check, for ``tqpipe watch``: its documents come from the inbox, so an
    empty (or not yet created) inputs folder is normal there.  Schema,
    output and model checks still apply.  ``paths_exist`` keeps, of that
    check, the refusal of an input path that does not exist (``status`` of a
    job that watch feeds: an empty folder is fine, a gone one is not).
    """
    path = Path(path)
    shown = str(path)
    if not path.is_file():
        raise JobFileError(shown, None, "job file not found" if not path.exists() else "not a file")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader)
    except OSError as e:
        raise JobFileError(shown, None, f"cannot read job file: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise JobFileError(shown, None, f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    except yaml.MarkedYAMLError as e:
        raise JobFileError(shown, None, _yaml_problem(e)) from None
    except yaml.YAMLError as e:
        raise JobFileError(shown, None, f"invalid YAML: {e}") from None
    if data is None:
        raise JobFileError(shown, None, "job file is empty")
    if not isinstance(data, dict):
        raise JobFileError(shown, None, f"top level must be a mapping of keys, got {type(data).__name__}")
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as e:
        key, problem = _first_problem(e)
        raise JobFileError(shown, key, problem) from None
    job = Job(spec=spec, path=path.resolve(), base_dir=path.resolve().parent)
    _check_filesystem(job, shown, check_inputs=check_inputs, paths_exist=paths_exist)
    return job


# -- filesystem checks ------------------------------------------------------

def _check_filesystem(job: Job, shown: str, *, check_inputs: bool = True, paths_exist: bool = False) -> None:
    if check_inputs and not job.spec.inputs:
        raise JobFileError(shown, "inputs", "must name at least 1 file, folder or glob "
                                            "(an empty list is only for tqpipe watch)")
    for i, item in enumerate(job.spec.inputs):
        key = f"inputs[{i}]" if isinstance(item, str) else f"inputs[{i}].images"
        try:
            refs = expand_input(job, item)
        except JobFileError as e:
            raise JobFileError(shown, key, e.problem) from None
        if not refs and (check_inputs or paths_exist):
            raw = _raw(item)
            if any(c in raw for c in "*?[") or job.resolve(raw).exists():
                if check_inputs:
                    raise JobFileError(shown, key, f"{raw!r} matches no PDF or image files")
            else:
                raise JobFileError(shown, key, f"{str(job.resolve(raw))!r} does not exist")
    out = job.output_path
    if out.is_dir():
        raise JobFileError(shown, "output", f"{job.spec.output!r} is a folder; give a .jsonl file path")
    mp = job.spec.model.path
    if mp is not None:
        local = job.resolve(mp)
        problem = model_path_problem(mp, local)
        if problem:
            raise JobFileError(shown, "model.path", problem)
        if not mp.startswith("builtin:") and local.exists():
            job.spec.model.path = str(local)


def _raw(item: str | ImageSetInput) -> str:
    return item if isinstance(item, str) else item.images


# -- error messages ---------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys: YAML keeps the last one silently,
    which turns a copy-paste slip into a job that quietly does the wrong thing."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _yaml_problem(e: yaml.MarkedYAMLError) -> str:
    mark = e.problem_mark or e.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    what = e.problem or e.context or "invalid YAML"
    return f"invalid YAML at {where}{what}"


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "ImageSetInput") or str(part).startswith(("function-", "literal[")):
            continue  # union-branch labels pydantic adds; not keys the user wrote
        else:
            out += f".{part}" if out else str(part)
    return out


def _first_problem(e: ValidationError) -> tuple[str | None, str]:
    errors = e.errors(include_url=False)
    # A union (inputs[i]: str | {images: ...}) reports one error per branch; say it once.
    err = errors[0]
    key = _loc(err["loc"]) or None
    problem = _problem(err, key)
    others = {k for x in errors[1:] if not (k := _loc(x["loc"])).startswith(key or "\0")}
    if others:
        problem += f" (also check: {', '.join(sorted(others)[:3])}{', ...' if len(others) > 3 else ''})"
    return key, problem


def _problem(err: dict, key: str | None) -> str:
    kind, msg, value = err["type"], err["msg"], err.get("input")
    if kind == "extra_forbidden":
        allowed = _allowed_keys(err["loc"][:-1])
        return f"unknown key{f'; allowed keys: {allowed}' if allowed else ''}"
    if kind == "missing":
        return "required key is missing"
    if key and key.startswith("inputs[") and kind in ("string_type", "model_type", "model_attributes_type"):
        return f"an input must be a path/glob string or {{images: folder-or-glob}} (got {value!r})"
    msg = msg.removeprefix("Value error, ")
    msg = re.sub(r"^Input should be", "must be", msg)
    msg = re.sub(r"^String should", "must", msg)
    msg = re.sub(r"^List should", "must", msg)
    if kind not in ("value_error", "assertion_error") and not isinstance(value, (dict, list)):
        msg += f" (got {value!r})"
    return msg


def _allowed_keys(loc: tuple) -> str:
    model: Any = JobSpec
    for part in loc:
        if isinstance(part, int) or part in ("ImageSetInput", "str"):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return ""
        ann = field.annotation
        model = next(iter(models_in(ann)), None)
        if model is None:
            return ""
    return ", ".join(f.alias or name for name, f in model.model_fields.items())

