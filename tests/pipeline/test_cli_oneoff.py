"""Command-line overrides (mlx-vlm / mlx-lm / olmocr names) and the one-off mode."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner
from fixtures_models import *  # noqa: F403

from pipeline.cli import main
from pipeline.inputs.job_file import load_job
from pipeline.inputs.samples import make_text_pdf
from pipeline.run.plan import task_keys
from pipeline.schema.overrides import OverrideError, Overrides, apply_overrides

from test_cli import lines, make_job


def test_overrides_replace_job_settings_and_change_the_config_hash(tmp_path):
    job = load_job(make_job(tmp_path, tmp_path, docs=1))
    tuned = apply_overrides(job, Overrides(kv_bits=4, max_tokens=9, model="org/other", output="o.jsonl"), cwd=tmp_path)
    assert tuned.spec.cache.kv_bits == 4 and {t.max_tokens for t in tuned.spec.tasks} == {9}
    assert tuned.spec.model.path == "org/other" and tuned.output_path == tmp_path / "o.jsonl"
    key = task_keys(job, "sha256:x")["t0"]
    assert task_keys(tuned, "sha256:x")["t0"] != key
    moved = apply_overrides(job, Overrides(output="elsewhere.jsonl"), cwd=tmp_path)
    assert task_keys(moved, "sha256:x")["t0"] == key  # --output moves the file, not the answers
    split = apply_overrides(job, Overrides(kv_key_bits=2, kv_value_bits=4), cwd=tmp_path).spec.cache
    assert (split.key_bits, split.value_bits) == (2, 4)
    fp16 = apply_overrides(job, Overrides(kv_quant_scheme="fp16"), cwd=tmp_path).spec.cache
    assert fp16.kv_quant_scheme == "fp16" and task_keys(job, "sha256:x") != {}
    asked = apply_overrides(job, Overrides(prompt="Who?", fields=("a", "b")), cwd=tmp_path).spec.tasks
    assert [(t.name, t.prompt, t.format, t.fields) for t in asked] == [("prompt", "Who?", "json", ["a", "b"])]


@pytest.mark.parametrize(
    ("ov", "message"),
    [
        (dict(kv_bits=3.3), "--kv-bits: 3.3 is not allowed with turboquant"),
        (dict(kv_quant_scheme="affine", kv_bits=7), "--kv-bits: 7 is not allowed with affine"),
        (dict(kv_quant_scheme="fp16", kv_bits=3), "--kv-bits: only applies to kv_quant_scheme turboquant or affine"),
        (dict(kv_key_bits=7), "--kv-key-bits: 7 is not allowed"),
        (dict(kv_quant_scheme="fp16", kv_value_bits=4), "--kv-value-bits: only applies to kv_quant_scheme: turboquant"),
        (dict(model="nonsense"), "--model: local model folder .*nonsense' does not exist, and 'nonsense' is neither a hub id"),
    ],
)
def test_bad_overrides_name_the_flag(tmp_path, ov, message):
    job = load_job(make_job(tmp_path, tmp_path, docs=1))
    with pytest.raises(OverrideError, match=message.replace("(", r"\(")):
        apply_overrides(job, Overrides(**ov), cwd=tmp_path)


def test_a_scheme_override_takes_that_schemes_default_width(tmp_path):
    """--kv-quant-scheme without --kv-bits: the job's width belonged to its
    own scheme (turboquant 3.5 has no affine form; affine 8 no turboquant one)."""
    job = load_job(make_job(tmp_path, tmp_path, docs=1))
    affine = apply_overrides(job, Overrides(kv_quant_scheme="affine"), cwd=tmp_path)
    assert (affine.spec.cache.kv_quant_scheme, affine.spec.cache.kv_bits) == ("affine", 4)
    eight = apply_overrides(job, Overrides(kv_quant_scheme="affine", kv_bits=8), cwd=tmp_path)
    back = apply_overrides(eight, Overrides(kv_quant_scheme="turboquant"), cwd=tmp_path)
    assert (back.spec.cache.kv_quant_scheme, back.spec.cache.kv_bits) == ("turboquant", 3.5)


@pytest.mark.parametrize("name", ["builtin:tiny-qwen2-vl", "builtin:smollm2-135m-instruct"])
def test_model_override_takes_a_builtin_name_as_the_job_file_does(tmp_path, name):
    job = apply_overrides(load_job(make_job(tmp_path, tmp_path, docs=1)), Overrides(model=name), cwd=tmp_path)
    assert job.spec.model.path == name


def test_format_without_prompt_is_refused():
    with pytest.raises(OverrideError, match="add --prompt"):
        Overrides(format="json")


def test_run_flags_reach_the_records_and_the_skip_rule(tmp_path, tiny_vlm_dir, monkeypatch):
    job = make_job(tmp_path, tmp_path / "nowhere", docs=1, tasks=1)  # the job's model does not exist...
    monkeypatch.chdir(tmp_path)
    args = ["run", str(job), "--model", str(tiny_vlm_dir), "--kv-bits", "4", "--max-tokens", "2",
            "--output", "flags.jsonl", "--no-progress"]
    r = CliRunner().invoke(main, args)  # ...--model replaces it before the job is checked further
    assert r.exit_code == 2 and "model.path" in r.output  # the job file itself must be valid
    job.write_text(job.read_text().replace(f"'{tmp_path / 'nowhere'}'", "null"))
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    (rec,) = lines(tmp_path / "flags.jsonl")
    assert rec["cache"]["kv_bits"] == 4 and rec["tokens"]["generated"] <= 2 and rec["model"] == str(tiny_vlm_dir)
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0 and "(1 already recorded); 0 records written" in again.output
    other = CliRunner().invoke(main, [*args[:5], "3", *args[6:]])
    assert other.exit_code == 0 and "1 record written: 1 ok" in other.output  # another width is another config
    assert [r["cache"]["kv_bits"] for r in lines(tmp_path / "flags.jsonl")] == [4, 3]


def test_oneoff_run_writes_jsonl_to_stdout_and_the_rest_to_stderr(tmp_path, tiny_vlm_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("a.pdf", "b.pdf"):
        make_text_pdf(tmp_path / name, [f"This is {name}. The total is 42 EUR."])
    r = CliRunner().invoke(main, ["run", "a.pdf", "b.pdf", "--prompt", "What is the total?", "--model",
                                  str(tiny_vlm_dir), "--max-tokens", "3", "--no-progress"])
    assert r.exit_code == 0, r.stderr
    records = [orjson.loads(x) for x in r.stdout.splitlines()]
    assert [(x["doc_id"], x["task"], x["status"], x["job"]) for x in records] == [
        ("a.pdf", "prompt", "ok", "oneoff"), ("b.pdf", "prompt", "ok", "oneoff")]
    assert "2 done" in r.stderr and "-> stdout" in r.stderr
    assert not list(tmp_path.glob("*.jsonl"))  # nothing left behind
    out = CliRunner().invoke(main, ["run", "a.pdf", "--prompt", "Total?", "--fields", "total", "-o", "res/a.jsonl",
                                    "--model", str(tiny_vlm_dir), "--max-tokens", "24", "--no-progress"])
    assert out.exit_code == 0 and out.stdout == ""
    (rec,) = lines(tmp_path / "res" / "a.jsonl")
    assert rec["json"]["decoding"] == "constrained" and rec["json"]["status"] in ("valid", "repaired")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["a.pdf"], 'one-off mode needs --prompt "..." (or give a job file: .yaml)'),
        (["missing.pdf", "--prompt", "q"], "missing.pdf: no such file or folder"),
        (["notes.txt"], "tqpipe run expects a job file (.yaml) or documents"),
        (["a.pdf", "job.yaml"], "give one job file, or only documents"),
        (["a.pdf", "--prompt", "q", "--fields", " , "], "--fields: give comma-separated names"),
    ],
)
def test_run_says_what_it_expected(tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    make_text_pdf(tmp_path / "a.pdf", ["text"])
    (tmp_path / "notes.txt").write_text("a note\n")
    r = CliRunner().invoke(main, ["run", *argv])
    assert r.exit_code == 2 and message in r.stderr, r.stderr


def test_a_refused_output_flag_is_named_as_the_flag(tmp_path, tiny_vlm_dir, monkeypatch):
    job = make_job(tmp_path, tiny_vlm_dir, docs=1, tasks=1)
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, ["run", str(job), "--output", "docs", "--no-progress"])
    assert r.exit_code == 2
    [line] = r.output.strip().splitlines()
    assert line.startswith(f"tqpipe: error: --output: {tmp_path / 'docs'}: is a folder"), line
