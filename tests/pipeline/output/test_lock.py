"""Two runs of one job never overlap; a killed holder never blocks the next."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import orjson
import pytest

from pipeline.errors import LockHeldError
from pipeline.output.lock import JobLock

REPO = Path(__file__).resolve().parents[3]

HOLDER = textwrap.dedent(
    """
    import sys, time
    from pipeline.output.lock import JobLock
    with JobLock(sys.argv[1], job="nightly"):
        print("locked", flush=True)
        time.sleep(60)
    """
)

CONTENDER = textwrap.dedent(
    """
    import sys
    from pipeline.errors import LockHeldError
    from pipeline.output.lock import JobLock
    try:
        with JobLock(sys.argv[1]):
            print("acquired", flush=True)
    except LockHeldError as e:
        print(e, flush=True)
        sys.exit(3)
    """
)


def _env():
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _contend(target: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CONTENDER, str(target)], capture_output=True, text=True,
                          env=_env(), cwd=REPO, timeout=30)


def test_second_process_fails_at_once_naming_holder_then_succeeds_after_kill9(tmp_path):
    target = tmp_path / "results.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(target)], stdout=subprocess.PIPE, text=True,
                              env=_env(), cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        out = _contend(target)
        elapsed = time.monotonic() - t0
        assert out.returncode == 3, out.stderr
        assert elapsed < 10  # did not wait for the holder (it sleeps 60 s)
        msg = out.stdout
        assert "results.jsonl.lock" in msg and f"pid {holder.pid}" in msg and "'nightly'" in msg
        assert "another run" in msg
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        holder.stdout.close()
    # The kernel dropped the flock with the process; the stale sidecar is harmless.
    out = _contend(target)
    assert out.returncode == 0 and "acquired" in out.stdout, out.stdout + out.stderr


def test_in_process_contention_release_and_owner_sidecar(tmp_path):
    target = tmp_path / "out" / "results.jsonl"  # parent folder created on acquire
    first = JobLock(target, job="j")
    with first:
        owner = orjson.loads(first.owner_path.read_bytes())
        assert owner["pid"] == os.getpid() and owner["job"] == "j"
        with pytest.raises(LockHeldError, match=f"pid {os.getpid()}"):
            JobLock(target).acquire()
    assert not first.owner_path.exists()
    with JobLock(target):  # released: can be taken again
        pass


def test_holder_unknown_when_sidecar_missing(tmp_path):
    target = tmp_path / "r.jsonl"
    with JobLock(target) as lock:
        lock.owner_path.unlink()
        with pytest.raises(LockHeldError) as info:
            JobLock(target).acquire()
    assert info.value.holder is None and "r.jsonl.lock: locked; another run" in str(info.value)
