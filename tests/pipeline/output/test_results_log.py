"""The results file survives kill -9, torn lines and full disks."""

import errno
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import orjson
import pytest

import pipeline.output.results_log as checkpoint
from pipeline.errors import CheckpointError
from pipeline.output.render import make_record
from pipeline.output.results_log import ResultLog, latest_records, summarize
from pipeline.schema.record import error_info

REPO = Path(__file__).resolve().parents[3]


def rec(i: int, status: str = "ok", size: int = 20) -> dict:
    return make_record(
        job="j", doc_id=f"doc{i}", source=f"/in/doc{i}.pdf", content_hash=f"{i:08x}", task="t",
        config_hash="cfg", status=status, output="x" * size,
        error=error_info(RuntimeError("boom")) if status == "error" else None,
    )


def lines(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n")
    return data.splitlines()


def test_append_reopen_and_done_keys(tmp_path):
    path = tmp_path / "sub" / "out.jsonl"  # parent created
    with ResultLog(path) as log:
        for i in range(3):
            log.append(rec(i))
        log.append(rec(3, "error"))
        assert log.is_done(rec(0)["key"])
    with ResultLog(path) as log:
        assert log.done_keys == {rec(i)["key"] for i in range(3)}
        assert log.failed_keys == {rec(3)["key"]}
        assert log.is_done(rec(3)["key"]) and not log.is_done(rec(3)["key"], include_failed=False)
        assert not log.is_done(rec(9)["key"])
        log.append(rec(3))  # retry succeeds
        assert log.is_done(rec(3)["key"], include_failed=False) and not log.failed_keys
        assert len(list(log.records())) == 5
    assert all(orjson.loads(line) for line in lines(path))
    assert latest_records(path)[rec(3)["key"]]["status"] == "ok"


@pytest.mark.parametrize("how", ["editor save", "removed"])
def test_a_results_file_replaced_mid_run_stops_the_appends(tmp_path, how):
    """An editor's save (copy, rename over) or a removal while a run appends:
    the next record is refused (CheckpointError: the run exits 4) instead of
    going to the unlinked old file while the run reports success."""
    path = tmp_path / "out.jsonl"
    with ResultLog(path) as log:
        log.append(rec(0))
        if how == "editor save":
            tmp = tmp_path / "out.jsonl.tmp"
            tmp.write_bytes(path.read_bytes())
            os.replace(tmp, path)
        else:
            path.unlink()
        with pytest.raises(CheckpointError, match="was replaced or removed while this run appended"):
            log.append(rec(1))
        with pytest.raises(CheckpointError):  # and every later one
            log.append(rec(2))
    if how == "editor save":
        assert [orjson.loads(x)["key"] for x in lines(path)] == [rec(0)["key"]]
        with ResultLog(path) as log:  # a rerun appends to the file as it now is
            log.append(rec(1))
        assert len(lines(path)) == 2


def test_append_requires_open_and_a_key(tmp_path):
    log = ResultLog(tmp_path / "o.jsonl")
    with pytest.raises(CheckpointError, match="before open"):
        log.append(rec(0))
    with log, pytest.raises(CheckpointError, match="o.jsonl.*key"):
        log.append({"status": "ok"})
    with log, pytest.raises(CheckpointError, match="cannot be serialized"):
        log.append({**rec(1), "output": object()})
    assert (tmp_path / "o.jsonl").read_bytes() == b""


def test_torn_last_line_is_moved_aside_and_recomputed(tmp_path, caplog):
    path = tmp_path / "out.jsonl"
    good = checkpoint.dumps_line(rec(0)) + checkpoint.dumps_line(rec(1))
    half = checkpoint.dumps_line(rec(2))[:37]
    path.write_bytes(good + half)
    with caplog.at_level(logging.WARNING), ResultLog(path) as log:
        assert log.done_keys == {rec(0)["key"], rec(1)["key"]}
        log.append(rec(2))
    torn = list(tmp_path.glob("out.jsonl.torn-*"))
    assert len(torn) == 1 and torn[0].read_bytes() == half
    assert [orjson.loads(x)["key"] for x in lines(path)] == [rec(i)["key"] for i in range(3)]
    assert "torn" in caplog.text and str(path) in caplog.text


def test_complete_record_missing_only_its_newline_is_kept(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(checkpoint.dumps_line(rec(0)) + checkpoint.dumps_line(rec(1))[:-1])
    with ResultLog(path) as log:
        assert log.done_keys == {rec(0)["key"], rec(1)["key"]}
    assert len(lines(path)) == 2 and not list(tmp_path.glob("*.torn-*"))


def test_garbage_line_in_the_middle_is_skipped_not_trusted(tmp_path, caplog):
    path = tmp_path / "out.jsonl"
    path.write_bytes(checkpoint.dumps_line(rec(0)) + b"\x00\x00garbage\n" + checkpoint.dumps_line(rec(1)))
    with caplog.at_level(logging.WARNING), ResultLog(path) as log:
        assert log.done_keys == {rec(0)["key"], rec(1)["key"]}
    assert "line 2" in caplog.text


def test_enospc_mid_write_restores_previous_content(tmp_path, monkeypatch):
    path = tmp_path / "out.jsonl"
    with ResultLog(path) as log:
        log.append(rec(0))
        before = path.read_bytes()
        real_write = os.write

        def half_then_full_disk(fd, data):
            real_write(fd, bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(checkpoint.os, "write", half_then_full_disk)
        with pytest.raises(CheckpointError, match=r"out\.jsonl.*No space left on device.*restored"):
            log.append(rec(1, size=5000))
        monkeypatch.setattr(checkpoint.os, "write", real_write)
        assert path.read_bytes() == before
        assert not log.is_done(rec(1)["key"])
        log.append(rec(1))  # space freed: the log is still usable
    assert [orjson.loads(x)["key"] for x in lines(path)] == [rec(0)["key"], rec(1)["key"]]


def test_short_write_is_completed_not_left_torn(tmp_path, monkeypatch):
    path = tmp_path / "out.jsonl"
    real_write = os.write
    monkeypatch.setattr(checkpoint.os, "write", lambda fd, data: real_write(fd, bytes(data[:100])))
    with ResultLog(path) as log:
        log.append(rec(0, size=1000))
        log.append(rec(1, size=10))
    assert [orjson.loads(x)["output"] for x in lines(path)] == ["x" * 1000, "x" * 10]


def test_failed_rollback_refuses_further_appends_until_reopen(tmp_path, monkeypatch):
    path = tmp_path / "out.jsonl"
    log = ResultLog(path).open()
    log.append(rec(0))
    real_write = os.write

    def partial_then_eio(fd, data):
        real_write(fd, bytes(data[:10]))
        raise OSError(errno.EIO, "I/O error")

    def eio(fd, size):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(checkpoint.os, "write", partial_then_eio)
    monkeypatch.setattr(checkpoint.os, "ftruncate", eio)
    with pytest.raises(CheckpointError):
        log.append(rec(1))
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="reopen"):
        log.append(rec(2))  # would glue onto the partial line
    log.close()
    with ResultLog(path) as log:  # repair moves the partial line aside
        assert log.done_keys == {rec(0)["key"]}
        log.append(rec(1))
    assert len(lines(path)) == 2 and len(list(tmp_path.glob("out.jsonl.torn-*"))) == 1


def test_summarize_counts_against_expected_keys(tmp_path):
    path = tmp_path / "out.jsonl"
    with ResultLog(path) as log:
        log.append(rec(0))
        log.append(rec(1, "error"))
        log.append(rec(7))  # from an old config: stale
    expected = {rec(i)["key"] for i in range(4)}
    s = summarize(path, expected)
    assert (s["done"], s["failed"], s["pending"], s["stale"], s["records"]) == (1, 1, 2, 1, 3)
    assert summarize(tmp_path / "missing.jsonl", expected)["pending"] == 4


CHILD = textwrap.dedent(
    """
    import random, sys, time
    from pipeline.output.render import make_record
    from pipeline.output.results_log import ResultLog
    path, n, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    with ResultLog(path) as log:
        print("ready", flush=True)
        for i in range(n):
            r = make_record(job="crash", doc_id=f"d{i}", source=f"/in/{i}.pdf", content_hash=f"{i:08x}",
                            task="t", config_hash="cfg", status="ok", output="y" * rng.choice([10, 3000, 70000]))
            if not log.is_done(r["key"]):
                log.append(r)
                time.sleep(0.002)  # the "model work" between records; keeps kills mid-run
    print("finished", flush=True)
    """
)


def test_sigkill_at_random_moments_then_rerun_gives_each_record_exactly_once(tmp_path):
    """A real process is SIGKILLed mid-run several times; each rerun repairs
    and appends only the missing keys; in the end every key is there once."""
    path, n = tmp_path / "out.jsonl", 400
    rng = random.Random(1234)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    kills = 0
    for attempt in range(6):
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(n), str(attempt)],
                                stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.02, 0.25))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait(timeout=30)
        proc.stdout.close()
    assert kills >= 3, "the child finished too fast to be killed; make it write more"
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), str(n), "99"], capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=120)
    assert out.returncode == 0 and "finished" in out.stdout, out.stderr
    keys = Counter(orjson.loads(line)["key"] for line in lines(path))  # every line valid JSON
    assert set(keys) == {f"{i:08x}/t/cfg" for i in range(n)}
    assert max(keys.values()) == 1
    # Torn tails (if a kill landed inside a large write) were saved, not dropped.
    for torn in tmp_path.glob("out.jsonl.torn-*"):
        assert torn.stat().st_size > 0


def test_repair_that_cannot_save_the_torn_bytes_fails_clearly_and_changes_nothing(tmp_path, monkeypatch):
    path = tmp_path / "out.jsonl"
    content = checkpoint.dumps_line(rec(0)) + b'{"key": "half'
    path.write_bytes(content)
    # e.g. a full or read-only disk: the .torn copy cannot be written.
    monkeypatch.setattr(ResultLog, "_torn_path", lambda self: tmp_path / "no-such-dir" / "out.jsonl.torn-x")
    with pytest.raises(CheckpointError, match=r"out\.jsonl: has a torn last line \(13 bytes\).*rerun"):
        ResultLog(path).open()
    assert path.read_bytes() == content  # nothing cut without a saved copy
