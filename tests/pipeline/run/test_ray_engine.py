"""The Ray engine on a real local Ray cluster (loopback, 2 CPUs).

One cluster per module (Ray startup costs seconds on 2 cores).  Ray workers
import this file for the test hooks (fake processing, stalling a document),
so the tests directory is on PYTHONPATH while the cluster runs; the built-in
model is built once (``smollm2_dir``) before the workers start, so they find
it in the same ``TQPIPE_HOME``.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import orjson
import pipeline  # noqa: F401  (OpenBLAS before mlx, also in Ray workers)
import pytest

ray = pytest.importorskip("ray")

from fixtures_models import smollm2_dir, tqpipe_models_home  # noqa: E402,F401
from pipeline.inputs.job_file import load_job  # noqa: E402
from pipeline.run.ray_engine import (  # noqa: E402
    Dispatcher,
    DocumentTask,
    DocumentWorker,
    RayRun,
    WorkItem,
    _process_document,
)
from pipeline.inputs.samples import make_text_pdf  # noqa: E402
from pipeline.output.render import make_record  # noqa: E402

# Workers unpickle this module's fakes by name and import the shared model fixtures:
# they need this folder and tests/ on their path.
WORKER_PATH = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]


@pytest.fixture(scope="module")
def cluster(smollm2_dir):
    """A local head with 2 CPUs; workers inherit PYTHONPATH and TQPIPE_HOME."""
    assert not ray.is_initialized(), "another test left Ray running; this module needs its own cluster"
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(WORKER_PATH + ([old] if old else []))
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


def write_job(root: Path, n_docs: int, *, tasks: str, workers: int = 2, max_retries: int = 2,
              per_worker: int = 2, pdf: bool = True) -> Path:
    """``n_docs`` one-page invoices (or, with ``pdf=False``, tiny stand-in files
    that only a fake engine can "read") and a Ray job over them."""
    docs = root / "docs"
    docs.mkdir(parents=True)
    for i in range(n_docs):
        path = docs / f"doc{i:05d}.pdf"
        if pdf:
            make_text_pdf(path, [f"Invoice {i}. Customer: Acme {i}. Total due: {7 * i} euros."])
        else:
            path.write_bytes(b"%%PDF stand-in %d\n" % i)
    job = root / "job.yaml"
    job.write_text(
        "name: raytest\n"
        "inputs: [docs/]\n"
        "context: {max_tokens: 512}\n"
        "tasks:\n" + textwrap.indent(tasks, "  ") + "\n"
        "output: out/results.jsonl\n"
        f"engine: {{kind: ray, workers: {workers}, max_retries: {max_retries}, "
        f"max_in_flight_per_worker: {per_worker}}}\n"
        "cache_store: {path: store}\n"  # this test's own store, shared by its workers
    )
    return job


def read_records(path: Path) -> list[dict]:
    lines = path.read_bytes().splitlines()
    return [orjson.loads(line) for line in lines]  # every line must be valid JSON


def assert_exactly_once(records: list[dict], job) -> None:
    """Every (document, task) of the job has exactly one record."""
    from pipeline.inputs.discover import content_hash, discover
    from pipeline.run.plan import task_keys

    expected = Counter(k for ref in discover(job) for k in task_keys(job, content_hash(ref)).values())
    assert Counter(r["key"] for r in records) == expected


# --- fake processing, run inside the Ray workers --------------------------------


def fake_setup(job):
    """Stands in for loading a model: nothing to load."""
    return {"pid": os.getpid()}


def fake_process(state, job, payload):
    """Echo the payload; the hooks in it let a test kill or fail the worker."""
    name, hooks = payload
    if hooks.get("die"):
        os.kill(os.getpid(), signal.SIGKILL)
    if hooks.get("raise"):
        raise ValueError(f"bad document {name}")
    return [{"doc": name, "pid": state["pid"]}]


def stall_once(marker: str | None) -> None:
    """The first worker to get here records its pid and hangs, to be killed by
    the test (``kill_when_marked``); a retry finds the marker and goes on."""
    if marker is None:
        return
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    time.sleep(120)
    raise AssertionError("the test should have killed this worker")


def kill_when_marked(marker: Path, timeout: float = 60.0) -> threading.Thread:
    """SIGKILL the worker process whose pid appears in ``marker``."""

    def watch() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if marker.exists() and marker.read_text():
                os.kill(int(marker.read_text()), signal.SIGKILL)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def failing_setup(job):
    from pipeline.errors import ModelLoadError

    raise ModelLoadError("/models/missing: no such model directory")


def fake_records(state, job, task: DocumentTask, *, die_on: str | None = None, delay: float = 0.0):
    """A fake engine that returns valid records (no model): one per pending task."""
    if task.ref.doc_id == die_on:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(delay)
    return [
        make_record(job=job.spec.name, doc_id=task.ref.doc_id, source=str(task.ref.source),
                    content_hash=task.digest, task=name, config_hash=key.rsplit("/", 1)[1],
                    status="ok", output=f"fake {name}")
        for name, key in zip(task.tasks, task.keys)
    ]


def stalling_process(state, job, task: DocumentTask, *, victim: str, marker: str):
    """The real engine, except that the first worker to get ``victim`` hangs
    until the test kills its process."""
    if task.ref.doc_id == victim:
        stall_once(marker)
    return _process_document(state, job, task)


def fake_actor_factory(num_cpus: float = 0.5):
    remote = ray.remote(num_cpus=num_cpus, max_restarts=0)(DocumentWorker)
    return lambda index: remote.remote(None, setup=fake_setup, process=fake_process)


def items(n: int, hooks: dict | None = None, pulled: list | None = None):
    for i in range(n):
        if pulled is not None:
            pulled.append(i)
        name = f"doc{i:05d}"
        yield WorkItem(name, (name, (hooks or {}).get(name, {})))


def drive(dispatcher, source):
    results, errors, gave_up = [], [], []
    dispatcher.run(
        source,
        on_result=lambda item, recs: results.extend(recs),
        on_error=lambda item, exc: errors.append((item.doc_id, exc)),
        on_give_up=gave_up.append,
    )
    return results, errors, gave_up


# --- the dispatcher on its own ----------------------------------------------------


def test_dispatcher_bounds_in_flight_and_pulls_lazily(cluster):
    """Back-pressure with thousands of trivial documents (a fake engine: the point is
    the driver's queue bound, not the model)."""
    n, workers, per_worker = 1000, 2, 2
    pulled: list[int] = []
    done_when_pulled: list[int] = []
    d = Dispatcher(fake_actor_factory(), workers=workers, max_in_flight_per_worker=per_worker, max_retries=0)

    def source():
        for item in items(n, pulled=pulled):
            done_when_pulled.append(len(pulled) - 1 - len(results))
            yield item

    results: list[dict] = []
    d.run(source(), on_result=lambda i, r: results.extend(r), on_error=pytest.fail, on_give_up=pytest.fail)
    assert sorted(r["doc"] for r in results) == [f"doc{i:05d}" for i in range(n)]
    assert d.stats.max_in_flight == workers * per_worker
    assert d.stats.max_outstanding <= workers * per_worker
    # The source is consumed lazily: never more than the bound ahead of the results.
    assert max(done_when_pulled) <= workers * per_worker
    assert len({r["pid"] for r in results}) == workers  # both actors worked


@pytest.mark.slow
def test_dispatcher_charges_only_the_document_that_kills_and_gives_up(cluster):
    """A document whose worker always dies is charged max_retries + 1 deaths
    and given up; the documents queued with it on the same actor are retried
    but never charged, even when the kill loses the reply of the call before."""
    hooks = {"doc00003": {"die": True}, "doc00007": {"raise": True}}
    d = Dispatcher(fake_actor_factory(), workers=2, max_in_flight_per_worker=3, max_retries=2)
    seen: list[WorkItem] = []
    results, errors, gave_up = drive(d, (seen.append(i) or i for i in items(12, hooks)))

    assert [g.doc_id for g in gave_up] == ["doc00003"]
    assert gave_up[0].attempts == 3 and len(gave_up[0].errors) == 3
    assert [i.doc_id for i in seen if i.attempts] == ["doc00003"]
    # 3 charged deaths, plus the first one if others were queued on that actor.
    assert 3 <= d.stats.worker_deaths <= 4
    # Deterministic failures inside processing are reported once, not retried.
    [(doc, exc)] = errors
    assert doc == "doc00007" and isinstance(exc, ValueError) and "bad document doc00007" in str(exc)
    assert sorted(r["doc"] for r in results) == sorted(
        f"doc{i:05d}" for i in range(12) if i not in (3, 7)
    )
    assert d.stats.completed == 12


# --- whole runs -------------------------------------------------------------------

TWO_TASKS = """\
- {name: total, prompt: "What is the total due?", max_tokens: 2}
- {name: customer, prompt: "Who is the customer?", max_tokens: 2}"""
ONE_TASK = '- {name: echo, prompt: "Say something.", max_tokens: 1}'


@pytest.mark.slow
def test_real_model_on_two_workers_survives_a_killed_worker(cluster, tmp_path):
    """20 PDFs, 2 tasks, the built-in model on 2 actors; the worker that takes
    doc00005 is SIGKILLed mid-document.  Every (document, task) record appears
    exactly once and the killed document was redone by another process."""
    job = load_job(write_job(tmp_path, 20, tasks=TWO_TASKS))
    marker = tmp_path / "victim.pid"
    victim = "docs/doc00005.pdf"
    run = RayRun(job, progress=False,
                 process=functools.partial(stalling_process, victim=victim, marker=str(marker)))
    killer = kill_when_marked(marker)
    summary = run.run()
    killer.join()

    records = read_records(job.output_path)
    assert_exactly_once(records, job)
    assert all(r["status"] == "ok" and r["model"] == "builtin:smollm2-135m-instruct" for r in records)
    assert summary.done == 40 and summary.failed == 0 and summary.exit_code == 0
    assert run.stats.worker_deaths == 1
    killed = int(marker.read_text())
    assert {r["worker"]["pid"] for r in records if r["doc_id"] == victim} - {killed}
    assert killed not in {r["worker"]["pid"] for r in records if r["doc_id"] == victim}
    # Both actors did real work, each document's tasks came from one worker (one prefill).
    assert len({r["worker"]["pid"] for r in records}) >= 2
    for doc in {r["doc_id"] for r in records}:
        assert len({r["worker"]["pid"] for r in records if r["doc_id"] == doc}) == 1


@pytest.mark.slow
def test_workers_share_the_document_cache_store(cluster, tmp_path):
    """A task added to a finished Ray job: the caches the workers stored in the
    first run are loaded by whichever worker gets each document in the second
    (one store folder for every worker), so no document is prefilled again."""
    job_path = write_job(tmp_path, 4, tasks=TWO_TASKS.splitlines()[0])
    assert RayRun(load_job(job_path), progress=False).run().done == 4
    first = read_records(load_job(job_path).output_path)
    assert all(not r["cache"]["doc_cache"]["hit"] and r["cache"]["doc_cache"]["saved"] for r in first)
    assert len(list((tmp_path / "store").glob("*.safetensors"))) == 4

    job_path.write_text(job_path.read_text().replace(TWO_TASKS.splitlines()[0], TWO_TASKS.replace("\n", "\n  ")))
    job = load_job(job_path)
    summary = RayRun(job, progress=False).run()
    records = read_records(job.output_path)
    assert_exactly_once(records, job)
    added = records[4:]
    assert summary.done == 4 and {r["task"] for r in added} == {"customer"}
    assert all(r["cache"]["doc_cache"]["hit"] and r["timing"]["prefill_s"] == 0.0 for r in added)


@pytest.mark.slow
def test_document_that_keeps_killing_its_worker_is_recorded_failed(cluster, tmp_path, monkeypatch, caplog):
    """After max_retries resubmissions the document gets error records naming
    the cause; the other documents are unaffected (fake engine).  Without a
    terminal, progress is log lines counting documents and failures."""
    job = load_job(write_job(tmp_path, 8, tasks=TWO_TASKS, max_retries=1, pdf=False))
    monkeypatch.setenv("TQPIPE_PROGRESS", "log")
    run = RayRun(job, progress=True, num_cpus_per_worker=0.5, setup=fake_setup,
                 process=functools.partial(fake_records, die_on="docs/doc00003.pdf"))
    with caplog.at_level("INFO"):
        summary = run.run()
    assert any(m.startswith("documents 8/8 (1 failed)") for m in caplog.messages), caplog.messages

    records = read_records(job.output_path)
    assert_exactly_once(records, job)
    failed = [r for r in records if r["status"] == "error"]
    assert {r["doc_id"] for r in failed} == {"docs/doc00003.pdf"} and len(failed) == 2
    assert all("died 2 times" in r["error"]["message"] and r["error"]["type"] == "WorkerDied" for r in failed)
    assert summary.failed_documents == ["docs/doc00003.pdf"] and summary.exit_code == 1
    assert 2 <= run.stats.worker_deaths <= 3  # + 1 if the first death was ambiguous
    # A rerun has nothing to do: error records count as done unless retried.
    again_run = RayRun(job, progress=False, num_cpus_per_worker=0.5, setup=fake_setup, process=fake_records)
    again = again_run.run()
    assert again.skipped == 8 and again.records_written == 0 and again.failed == 2
    assert again_run.stats is None  # nothing to do: no actor started, no model loaded
    # --retry-failed redoes only the failed document; its ok records supersede the errors.
    retried = RayRun(job, progress=False, retry_failed=True, num_cpus_per_worker=0.5, setup=fake_setup,
                     process=fake_records).run()
    assert (retried.skipped, retried.done, retried.records_written) == (7, 2, 2)
    final = read_records(job.output_path)
    assert [r["status"] for r in final if r["doc_id"] == "docs/doc00003.pdf"] == ["error", "error", "ok", "ok"]


@pytest.mark.slow
@pytest.mark.parametrize("n", [2_000, 10_000])
def test_back_pressure_on_many_documents(cluster, tmp_path, n):
    """Thousands of tiny documents through the whole driver (discovery, skip
    check, writing) with a FAKE engine: the point is the driver's bound, not
    the model.  At most workers * max_in_flight_per_worker documents are ever
    submitted or pulled from the document generator and not yet written, at
    any job size (the 10,000-document case is marked slow: ~20 s here)."""
    workers, per_worker = 2, 2
    job = load_job(write_job(tmp_path, n, tasks=ONE_TASK, workers=workers, per_worker=per_worker, pdf=False))
    run = RayRun(job, progress=False, num_cpus_per_worker=0.5, setup=fake_setup, process=fake_records)
    summary = run.run()

    assert summary.done == n and summary.records_written == n
    assert run.stats.max_in_flight == workers * per_worker
    assert run.stats.max_outstanding == workers * per_worker
    assert_exactly_once(read_records(job.output_path), job)


DRIVER = """
import functools, sys
import test_ray_engine as t
from pipeline.inputs.job_file import load_job
from pipeline.run.ray_engine import run_job_on_ray
run_job_on_ray(load_job(sys.argv[2]), address=sys.argv[1], progress=False, num_cpus_per_worker=0.5,
               setup=t.fake_setup, process=functools.partial(t.fake_records, delay=0.1))
"""


@pytest.mark.slow
def test_killed_driver_resumes_from_the_checkpoint(cluster, tmp_path):
    """A driver process (joining the cluster by its address, as
    ``--address`` does) SIGKILLed mid-run, then a second run on the same
    results file: every record exactly once, nothing redone (fake engine)."""
    job = load_job(write_job(tmp_path, 60, tasks=TWO_TASKS, pdf=False))
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, cluster, str(job.path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if job.output_path.exists() and job.output_path.read_bytes().count(b"\n") >= 20:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the driver finished (or failed) before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = job.output_path.read_bytes().count(b"\n")
    assert 20 <= first < 120

    summary = RayRun(job, progress=False, num_cpus_per_worker=0.5, setup=fake_setup, process=fake_records).run()
    records = read_records(job.output_path)
    assert_exactly_once(records, job)
    assert summary.records_written == 120 - first
    assert summary.skipped >= first // 2 - 1  # whole documents written before the kill


def test_importing_the_ray_engine_does_not_import_ray():
    """The local engine's CLI path may import this module's names cheaply;
    Ray itself loads only when a Ray run starts."""
    code = "import sys, pipeline.run.ray_engine, pipeline.run.runner; sys.exit('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.slow
def test_pages_override_is_part_of_the_keys(cluster, tmp_path):
    """``--pages`` changes the record keys as in the local runner, so output
    for pages 1-1 never counts as done for a run over whole documents."""
    from pipeline.schema.job import with_pages

    job = load_job(write_job(tmp_path, 2, tasks=TWO_TASKS, pdf=False))
    first = RayRun(with_pages(job, "1"), progress=False, num_cpus_per_worker=0.5, setup=fake_setup,
                   process=fake_records).run()
    assert first.records_written == 4
    assert_exactly_once(read_records(job.output_path), with_pages(job, "1"))
    whole = RayRun(job, progress=False, num_cpus_per_worker=0.5, setup=fake_setup, process=fake_records).run()
    assert (whole.skipped, whole.records_written) == (0, 4)


@pytest.mark.slow
def test_cli_engine_ray_on_a_private_cluster(smollm2_dir, tmp_path):
    """``tqpipe run JOB --engine ray`` end to end in a fresh process: it starts
    its own local Ray, runs the built-in model on one worker, writes through
    the checkpoint and exits 0 (a job file saying ``kind: local``)."""
    job_path = write_job(tmp_path, 2, tasks=ONE_TASK, workers=1)
    job_path.write_text(job_path.read_text().replace("kind: ray", "kind: local"))
    env = {**os.environ, "TQPIPE_PROGRESS": "log"}
    env.pop("PYTHONPATH", None)  # the real code path needs nothing from tests/
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", str(job_path), "--engine", "ray"],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 documents (0 already recorded); 2 records written: 2 ok, 0 failed" in proc.stdout
    records = read_records(load_job(job_path).output_path)
    assert_exactly_once(records, load_job(job_path))
    assert all(r["status"] == "ok" and "worker" in r for r in records)  # written by the Ray path


def test_worker_that_cannot_load_its_model_stops_the_run_clearly(cluster, tmp_path):
    """A model that fails to load in the actors is one clear error, not a
    stream of 'worker died' records; the lock is released for the next run."""
    from pipeline.errors import TqpipeError

    job = load_job(write_job(tmp_path, 2, tasks=ONE_TASK, pdf=False))
    with pytest.raises(TqpipeError, match="failed to start.*no such model directory"):
        RayRun(job, progress=False, num_cpus_per_worker=0.5, setup=failing_setup, process=fake_records).run()
    assert not job.output_path.exists() or job.output_path.read_bytes() == b""
    summary = RayRun(job, progress=False, num_cpus_per_worker=0.5, setup=fake_setup, process=fake_records).run()
    assert summary.records_written == 2
