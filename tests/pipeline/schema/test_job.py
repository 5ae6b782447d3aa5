"""Job files: schema, error messages, path resolution (pipeline.schema.job)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.errors import JobFileError
from pipeline.inputs.job_file import load_job
from pipeline.inputs.samples import make_image_set, make_text_pdf, write_samples
from pipeline.schema.job import CacheSpec, ContextSpec, JobSpec

REPO = Path(__file__).resolve().parents[3]

BASE = """\
name: t
inputs: [docs/a.pdf]
tasks:
  - {name: a, prompt: hi}
output: out/results.jsonl
"""


@pytest.fixture
def jobdir(tmp_path):
    make_text_pdf(tmp_path / "docs" / "a.pdf", ["alpha"])
    make_text_pdf(tmp_path / "docs" / "b10.pdf", ["b10"])
    make_text_pdf(tmp_path / "docs" / "b9.pdf", ["b9"])
    make_image_set(tmp_path / "docs" / "scans", {"p1.png": "one", "p2.png": "two"})
    (tmp_path / "notes.txt").write_text("not a document")
    return tmp_path


def write(d: Path, text: str, name: str = "job.yaml") -> Path:
    p = d / name
    p.write_text(text)
    return p


def test_minimal_job_defaults(jobdir):
    job = load_job(write(jobdir, BASE))
    s = job.spec
    assert s.cache.kv_quant_scheme == "turboquant" and s.cache.kv_bits == 3.5
    assert s.context == ContextSpec() and s.context.overflow == "truncate"
    assert s.context.page_retries == 1 and s.context.max_failed_page_fraction == 0.25
    assert s.tasks[0].max_tokens == 256 and s.tasks[0].format == "text"
    assert s.model.path is None and s.engine.kind == "local"
    assert job.path == (jobdir / "job.yaml").resolve() and job.base_dir == jobdir.resolve()


def test_paths_relative_to_job_file_not_cwd(jobdir, tmp_path_factory, monkeypatch):
    elsewhere = tmp_path_factory.mktemp("cwd")
    monkeypatch.chdir(elsewhere)
    job = load_job(write(jobdir, BASE))  # docs/a.pdf exists only relative to the job
    assert job.output_path == jobdir.resolve() / "out" / "results.jsonl"
    assert job.output_path.is_absolute()


def test_local_model_path_is_made_absolute(jobdir):
    (jobdir / "models" / "m").mkdir(parents=True)
    job = load_job(write(jobdir, BASE + "model: {path: models/m}\n"))
    assert job.spec.model.path == str(jobdir.resolve() / "models" / "m")
    hub = load_job(write(jobdir, BASE + "model: {path: HuggingFaceTB/SmolLM2-135M-Instruct}\n"))
    assert hub.spec.model.path == "HuggingFaceTB/SmolLM2-135M-Instruct"  # hub id left alone


def test_full_job_round_trip(jobdir):
    text = BASE.replace("[docs/a.pdf]", "[docs/, {images: docs/scans}]") + """\
model: {path: org/model}
cache: {kv_quant_scheme: affine, kv_bits: 8, window: 0, prefill_chunk: 64}
context: {max_tokens: 4096, overflow: error, images: always, dpi: 100, pages: "1-2,-1",
          page_retries: 3, max_failed_page_fraction: 0.5, page_markers: false}
engine: {kind: ray, address: auto, workers: 4, max_retries: 1, max_in_flight_per_worker: 1}
"""
    s = load_job(write(jobdir, text)).spec
    assert s.cache.kv_bits == 8 and s.context.pages == "1-2,-1" and s.context.dpi == 100
    assert s.engine.kind == "ray" and s.inputs[1].images == "docs/scans"
    assert JobSpec.model_validate(s.model_dump(by_alias=True)) == s  # the keys as a job file writes them


@pytest.mark.parametrize(
    "edit, key, fragment",
    [
        (BASE + "bogus: 1\n", "bogus", "unknown key; allowed keys: name, inputs, model"),
        (BASE + "context: {max_token: 5}\n", "context.max_token", "unknown key; allowed keys: max_tokens,"),
        (BASE.replace("prompt: hi}", "prompt: hi, colour: red}"), "tasks[0].colour", "unknown key"),
        (BASE.replace("{name: a, prompt: hi}", "{name: a, prompt: hi}\n  - {name: b, prompt: x, max_tokens: -5}"),
         "tasks[1].max_tokens", "must be greater than 0 (got -5)"),
        (BASE + "context: {max_tokens: lots}\n", "context.max_tokens", "valid integer"),
        (BASE.replace("output: out/results.jsonl\n", ""), "output", "required key is missing"),
        (BASE.replace("tasks:\n  - {name: a, prompt: hi}\n", "tasks: []\n"), "tasks", "at least 1"),
        (BASE.replace("{name: a, prompt: hi}", "{name: a, prompt: hi}\n  - {name: a, prompt: x}"),
         "tasks", "task name 'a' is used twice"),
        (BASE.replace("prompt: hi}", "prompt: hi, temperature: -1}"), "tasks[0].temperature",
         "greater than or equal to 0 (got -1)"),
        (BASE.replace("prompt: hi}", "prompt: hi, fields: [x]}"), "tasks[0].fields", "format: json"),
        (BASE.replace("prompt: hi}", "prompt: hi, format: yaml}"), "tasks[0].format", "'text' or 'json'"),
        (BASE + "cache: {kv_bits: 5}\n", "cache.kv_bits", "choose one of 2, 2.5, 3, 3.5, 4"),
        (BASE + "cache: {kv_bits: 1.5}\n", "cache.kv_bits", "not allowed with turboquant"),
        (BASE + "cache: {kv_quant_scheme: affine, kv_bits: 3.5}\n", "cache.kv_bits", "choose one of 2, 3, 4, 5, 6, 8"),
        (BASE + "cache: {kv_quant_scheme: affine, kv_bits: 4, key_bits: 2}\n", "cache.key_bits", "turboquant"),
        (BASE + "cache: {key_bits: 7}\n", "cache.key_bits", "7 is not allowed"),
        (BASE + "cache: {quantizer: lattice}\n", "cache.quantizer", "scalar"),
        (BASE + "cache: {kv_quant_scheme: fp16, quantizer: tcq}\n", "cache.quantizer", "turboquant"),
        (BASE + "cache: {kv_quant_scheme: int4}\n", "cache.kv_quant_scheme", "'turboquant', 'fp16' or 'affine'"),
        (BASE + "context: {overflow: drop}\n", "context.overflow", "'error' or 'truncate'"),
        (BASE + "context: {pages: '1-x'}\n", "context.pages", "cannot parse '1-x'"),
        (BASE + "context: {pages: '0'}\n", "context.pages", "start at 1"),
        (BASE + "context: {max_failed_page_fraction: 1.5}\n", "context.max_failed_page_fraction",
         "less than or equal to 1 (got 1.5)"),
        (BASE + "context: {dpi: 5000}\n", "context.dpi", "less than or equal to 600"),
        (BASE + "engine: {workers: 0}\n", "engine.workers", "greater than or equal to 1 (got 0)"),
        (BASE.replace("[docs/a.pdf]", "[{pictures: x}]"), "inputs[0]", "path/glob string or {images:"),
        (BASE.replace("[docs/a.pdf]", "[5]"), "inputs[0]", "(got 5)"),
        (BASE.replace("[docs/a.pdf]", "[]"), "inputs", "at least 1"),
        # wrong types are refused, not converted (strict): true is no count, "yes" no boolean
        (BASE.replace("prompt: hi}", "prompt: hi, max_tokens: true}"), "tasks[0].max_tokens",
         "must be a valid integer (got True)"),
        (BASE + "strict: 'yes'\n", "strict", "must be a valid boolean (got 'yes')"),
        (BASE + "context: {page_markers: 1}\n", "context.page_markers", "must be a valid boolean (got 1)"),
        (BASE + "context: {dpi: 72.5}\n", "context.dpi", "must be a valid integer (got 72.5)"),
        (BASE + "context: {max_tokens: 10}\n", "tasks",
         "tasks[0].max_tokens (256) leaves no room for a document within context.max_tokens (10)"),
        # the key is `schema`; the attribute behind it is no key
        (BASE.replace("prompt: hi}", "prompt: hi, format: json, schema_: {}}"), "tasks[0].schema_",
         "unknown key; allowed keys: name, prompt, max_tokens, temperature, top_p, min_p, top_k, repetition_penalty, repetition_context_size, format, fields, schema"),
    ],
)
def test_schema_errors_name_file_key_problem(jobdir, edit, key, fragment):
    p = write(jobdir, edit)
    with pytest.raises(JobFileError) as e:
        load_job(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: {key}: "), msg
    assert fragment in msg, msg
    assert e.value.key == key and e.value.path == str(p)


@pytest.mark.parametrize(
    "inputs, key, fragment",
    [
        ("[docs/missing.pdf]", "inputs[0]", "missing.pdf' does not exist"),
        ("[docs/a.pdf, 'docs/*.docx']", "inputs[1]", "'docs/*.docx' matches no PDF or image files"),
        ("[notes.txt]", "inputs[0]", "neither a PDF nor an image"),
        ("[{images: docs/nothing}]", "inputs[0].images", "does not exist"),
        ("[{images: 'docs/scans/*.jpg'}]", "inputs[0].images", "matches no PDF or image files"),
        ("[{images: docs/a.pdf}]", "inputs[0].images", "not a folder or a glob of images"),
    ],
)
def test_inputs_must_match_something(jobdir, inputs, key, fragment):
    p = write(jobdir, BASE.replace("[docs/a.pdf]", inputs))
    with pytest.raises(JobFileError) as e:
        load_job(p)
    assert str(e.value).startswith(f"{p}: {key}: ") and fragment in str(e.value), str(e.value)


def test_missing_local_model_dir(jobdir):
    p = write(jobdir, BASE + "model: {path: ./models/nope}\n")
    with pytest.raises(JobFileError, match=r"model\.path: local model folder .*models/nope' does not exist"):
        load_job(p)


def test_output_must_not_be_a_folder(jobdir):
    (jobdir / "out").mkdir()
    with pytest.raises(JobFileError, match=r"output: 'out' is a folder"):
        load_job(write(jobdir, BASE.replace("out/results.jsonl", "out")))


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("", "job file is empty"),
        ("- a\n- b\n", "top level must be a mapping"),
        (BASE + "context: {max_tokens: 5\n", "invalid YAML at line 7"),
        (BASE + "name: twice\n", "invalid YAML at line 6, column 1: duplicate key 'name'"),
        ("name: [unclosed\n", "invalid YAML at line 2"),
    ],
)
def test_whole_file_errors(jobdir, text, fragment):
    p = write(jobdir, text)
    with pytest.raises(JobFileError) as e:
        load_job(p)
    assert str(e.value).startswith(f"{p}: ") and fragment in str(e.value), str(e.value)
    assert e.value.key is None


def test_missing_and_binary_job_files(tmp_path):
    with pytest.raises(JobFileError, match=r"nope\.yaml: job file not found"):
        load_job(tmp_path / "nope.yaml")
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(JobFileError, match="not UTF-8"):
        load_job(tmp_path / "bin.yaml")


def test_cache_spec_accepts_every_allowed_width():
    for bits in (2, 2.5, 3, 3.5, 4):
        assert CacheSpec(kv_bits=bits).kv_bits == bits
    assert CacheSpec(kv_quant_scheme="fp16", kv_bits=16).kv_bits == 16  # ignored by fp16
    assert CacheSpec(key_bits=2, value_bits=4).value_bits == 4


def test_integer_pages_are_accepted_as_strings(jobdir):
    job = load_job(write(jobdir, BASE + "context: {pages: 3}\n"))
    assert job.spec.context.pages == "3"


def test_shipped_example_jobs_validate(tmp_path):
    shutil.copytree(REPO / "jobs", tmp_path / "jobs")
    write_samples(tmp_path / "samples")
    names = {}
    for name in ("summarize", "extract", "qa"):
        job = load_job(tmp_path / "jobs" / f"{name}.yaml")
        names[name] = job
        assert job.output_path.parent == tmp_path / "results"
    extract = names["extract"].spec.tasks[0]
    assert extract.format == "json" and extract.fields == ["title", "author", "date", "total"]
    assert len(names["qa"].spec.tasks) >= 3


def test_validation_imports_no_model_code(jobdir):
    """Validating a job must stay instant: no mlx (or pymupdf) import."""
    code = (
        "import sys; from pipeline.inputs.job_file import load_job; load_job(sys.argv[1]); "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'mlx_vlm', 'pymupdf', 'fitz')); "
        "assert not bad, bad"
    )
    r = subprocess.run([sys.executable, "-c", code, str(write(jobdir, BASE))], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_unknown_key_message_names_written_keys_only(jobdir):
    p = write(jobdir, BASE.replace("prompt: hi}", "prompt: hi, colour: red}"))
    with pytest.raises(JobFileError) as e:
        load_job(p)
    assert str(e.value).endswith("allowed keys: name, prompt, max_tokens, temperature, top_p, min_p, top_k, repetition_penalty, repetition_context_size, format, fields, schema")


def test_kv_bits_defaults_by_scheme():
    """kv_quant_scheme: affine alone used to keep turboquant's 3.5, which affine
    has no form of: the run failed where the job file had looked valid."""
    from pipeline.schema.job import CacheSpec

    assert CacheSpec().kv_bits == 3.5 and CacheSpec(kv_quant_scheme="fp16").kv_bits == 3.5
    assert CacheSpec(kv_quant_scheme="affine").kv_bits == 4
    assert CacheSpec(kv_quant_scheme="affine", kv_bits=2).kv_bits == 2  # every width the policy takes

