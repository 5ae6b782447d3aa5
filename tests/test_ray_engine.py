"""The Ray engine on a real local Ray cluster (loopback, 2 CPUs).

One cluster per module (Ray startup costs seconds on 2 cores).  Workers import
this file for the fake-processing helpers, so the tests directory is put on
the workers' PYTHONPATH.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pipeline  # noqa: F401  (OpenBLAS before mlx, also in Ray workers)
import pytest

ray = pytest.importorskip("ray")

from pipeline.ray_engine import Dispatcher, DocumentWorker, WorkItem  # noqa: E402

TESTS_DIR = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def cluster():
    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=100 * 2**20,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": f"{TESTS_DIR}:${{PYTHONPATH}}"}},
        )
    yield
    if started:
        ray.shutdown()


# --- fake processing, run inside the Ray workers --------------------------------


def fake_setup(job):
    """Stands in for loading a model: nothing to load."""
    return {"pid": os.getpid()}


def fake_process(state, job, payload, pages):
    """Echo the payload; the hooks in it let a test kill or fail the worker."""
    name, hooks = payload
    if hooks.get("die"):
        os.kill(os.getpid(), signal.SIGKILL)
    if hooks.get("raise"):
        raise ValueError(f"bad document {name}")
    stall_once(hooks.get("stall_once"))
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
    n, workers, per_worker = 3000, 2, 2
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


def test_dispatcher_charges_only_the_running_document_and_gives_up(cluster):
    """A document whose worker always dies is tried max_retries + 1 times, then
    given up; the documents queued behind it on the same actor are not charged."""
    hooks = {"doc00003": {"die": True}, "doc00007": {"raise": True}}
    d = Dispatcher(fake_actor_factory(), workers=2, max_in_flight_per_worker=3, max_retries=2)
    results, errors, gave_up = drive(d, items(12, hooks))

    assert [g.doc_id for g in gave_up] == ["doc00003"]
    assert gave_up[0].attempts == 3 and len(gave_up[0].errors) == 3
    assert d.stats.worker_deaths == 3
    # Deterministic failures inside processing are reported once, not retried.
    [(doc, exc)] = errors
    assert doc == "doc00007" and isinstance(exc, ValueError) and "bad document doc00007" in str(exc)
    assert sorted(r["doc"] for r in results) == sorted(
        f"doc{i:05d}" for i in range(12) if i not in (3, 7)
    )
    assert d.stats.completed == 12


def test_dispatcher_retries_a_killed_worker_document_once(cluster, tmp_path):
    """SIGKILL from outside while a document runs: it is resubmitted to a new
    worker process and finishes there; nothing is lost or duplicated."""
    marker = tmp_path / "victim.pid"
    hooks = {"doc00002": {"stall_once": str(marker)}}
    d = Dispatcher(fake_actor_factory(), workers=2, max_in_flight_per_worker=2, max_retries=1)
    killer = kill_when_marked(marker)
    results, errors, gave_up = drive(d, items(8, hooks))
    killer.join()

    assert not errors and not gave_up
    assert sorted(r["doc"] for r in results) == [f"doc{i:05d}" for i in range(8)]
    assert d.stats.worker_deaths == 1
    killed_pid = int(marker.read_text())
    [victim] = [r for r in results if r["doc"] == "doc00002"]
    assert victim["pid"] != killed_pid
