"""Inbox pickup: settled files only, exactly once, across restarts."""

import threading
import time
from pathlib import Path

import orjson
import pytest

from pipeline.errors import LockHeldError, TqpipeError
from pipeline.output.lock import JobLock
from pipeline.run.watch import InboxWatcher

SETTLE = 0.4


def watcher(tmp_path, **kw) -> InboxWatcher:
    kw = {"settle_seconds": SETTLE, "poll_seconds": 0.05, **kw}
    return InboxWatcher(tmp_path / "inbox", tmp_path / "state" / "ledger.jsonl", **kw)


def poll_until(w: InboxWatcher, seconds: float) -> list[Path]:
    """Poll repeatedly for ``seconds``; everything that became ready, once."""
    found: list[Path] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for p in w.poll():
            if p not in found:
                found.append(p)
        time.sleep(0.05)
    return found


def ledger(tmp_path) -> list[dict]:
    path = tmp_path / "state" / "ledger.jsonl"
    return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


@pytest.fixture
def inbox(tmp_path):
    d = tmp_path / "inbox"
    d.mkdir()
    return d


def test_slowly_written_file_is_picked_up_once_complete_and_never_again(tmp_path, inbox):
    chunks = [b"%PDF-1.4\n" + bytes([i]) * 2000 for i in range(6)]
    target = inbox / "scan.pdf"
    written = threading.Event()

    def slow_copy():
        with open(target, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                f.flush()
                time.sleep(SETTLE * 0.3)  # pauses well under the settle time
        written.set()

    seen: list[tuple[Path, bytes, bool]] = []

    def handle(path: Path) -> str:
        seen.append((path, path.read_bytes(), written.is_set()))
        return "ok"

    stop = threading.Event()
    w = watcher(tmp_path)
    loop = threading.Thread(target=w.run, args=(handle,), kwargs={"stop": stop})
    writer = threading.Thread(target=slow_copy)
    loop.start()
    writer.start()
    writer.join()
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(SETTLE * 2)  # more polls: must not pick it up a second time
    stop.set()
    loop.join(timeout=5)
    assert not loop.is_alive()
    assert len(seen) == 1
    path, data, was_complete = seen[0]
    assert path == target and was_complete and data == b"".join(chunks)
    entries = ledger(tmp_path)
    assert [(e["path"], e["status"]) for e in entries] == [("scan.pdf", "ok")]
    assert entries[0]["content_hash"].startswith("sha256:")

    # "Restart": a new watcher on the same ledger never offers it again.
    calls = []
    watcher(tmp_path).run(lambda p: calls.append(p), max_iterations=int(3 * SETTLE / 0.05))
    assert calls == []


def test_recopied_same_content_is_not_redone_but_changed_content_is(tmp_path, inbox):
    (inbox / "a.pdf").write_bytes(b"%PDF one")
    w = watcher(tmp_path)
    assert poll_until(w, SETTLE * 2) == [inbox / "a.pdf"]
    w.mark_done(inbox / "a.pdf", w._hashes[inbox / "a.pdf"][1], "ok")
    w.close()

    w = watcher(tmp_path)  # restart
    (inbox / "copy of a.pdf").write_bytes(b"%PDF one")
    (inbox / "b.pdf").write_bytes(b"%PDF two")
    assert poll_until(w, SETTLE * 2) == [inbox / "b.pdf"]
    assert [(e["path"], e["status"]) for e in ledger(tmp_path)][-1] == ("copy of a.pdf", "duplicate")

    (inbox / "a.pdf").write_bytes(b"%PDF one, edited")  # same name, new content: new document
    assert set(poll_until(w, SETTLE * 2)) == {inbox / "a.pdf", inbox / "b.pdf"}  # b: still unhandled


def test_file_vanishing_before_handle_is_skipped_not_marked(tmp_path, inbox, caplog):
    (inbox / "gone.pdf").write_bytes(b"%PDF gone")
    (inbox / "stays.pdf").write_bytes(b"%PDF stays")
    w = watcher(tmp_path)
    ready = poll_until(w, SETTLE * 2)
    assert ready == [inbox / "gone.pdf", inbox / "stays.pdf"]
    (inbox / "gone.pdf").unlink()
    handled = []

    def handle(path: Path) -> str:
        handled.append(path.name)
        path.read_bytes()  # FileNotFoundError for the vanished one
        return "ok"

    assert [w.handle_one(handle, p) for p in ready] == [None, "ok"]
    assert handled == ["gone.pdf", "stays.pdf"]
    assert [e["path"] for e in ledger(tmp_path)] == ["stays.pdf"]
    assert "gone.pdf vanished" in caplog.text
    # A file that disappears before it settles is simply forgotten.
    (inbox / "brief.pdf").write_bytes(b"%PDF brief")
    w.poll()
    (inbox / "brief.pdf").unlink()
    assert poll_until(w, SETTLE * 2) == []


def test_failures_are_marked_once_and_transient_errors_retried(tmp_path, inbox):
    (inbox / "broken.pdf").write_bytes(b"not a pdf")
    (inbox / "later.pdf").write_bytes(b"%PDF later")
    attempts: dict[str, int] = {}

    def handle(path: Path) -> str:
        attempts[path.name] = attempts.get(path.name, 0) + 1
        if path.name == "broken.pdf":
            raise ValueError("no PDF header")
        if attempts[path.name] == 1:
            raise LockHeldError("results.jsonl.lock", "pid 1 on cron")  # a cron run holds the job
        return "ok"

    w = watcher(tmp_path, retry_seconds=0.2)
    w.run(handle, max_iterations=int(4 * SETTLE / 0.05))
    assert attempts == {"broken.pdf": 1, "later.pdf": 2}
    entries = {e["path"]: e for e in ledger(tmp_path)}
    assert entries["broken.pdf"]["status"] == "failed" and "no PDF header" in entries["broken.pdf"]["error"]
    assert entries["later.pdf"]["status"] == "ok" and len(ledger(tmp_path)) == 2
    watcher(tmp_path).run(handle, max_iterations=int(2 * SETTLE / 0.05))  # restart: nothing redone
    assert attempts == {"broken.pdf": 1, "later.pdf": 2}


def test_image_folder_settles_as_one_document_and_temp_names_wait(tmp_path, inbox):
    scans = inbox / "scans"
    scans.mkdir()
    (scans / "p1.png").write_bytes(b"png1")
    (inbox / "upload.pdf.part").write_bytes(b"%PDF partial")
    (inbox / "notes.txt").write_bytes(b"ignored")
    w = watcher(tmp_path)
    w.poll()
    time.sleep(SETTLE * 0.5)
    (scans / "p2.png").write_bytes(b"png2")  # folder still filling: settle clock restarts
    time.sleep(SETTLE * 0.6)
    assert w.poll() == []
    assert poll_until(w, SETTLE * 1.5) == [scans]
    (inbox / "upload.pdf.part").rename(inbox / "upload.pdf")
    assert poll_until(w, SETTLE * 2) == [scans, inbox / "upload.pdf"]  # natural name order


def test_empty_file_waits_for_content(tmp_path, inbox):
    (inbox / "empty.pdf").write_bytes(b"")
    w = watcher(tmp_path)
    assert poll_until(w, SETTLE * 1.5) == []
    (inbox / "empty.pdf").write_bytes(b"%PDF now")
    assert poll_until(w, SETTLE * 2) == [inbox / "empty.pdf"]


def test_missing_inbox_and_second_watcher_are_clear_errors(tmp_path, inbox):
    with pytest.raises(TqpipeError, match="nope.*does not exist"):
        InboxWatcher(tmp_path / "nope", tmp_path / "l.jsonl").run(lambda p: "ok", max_iterations=1)
    with JobLock(tmp_path / "state" / "ledger.jsonl"):
        with pytest.raises(LockHeldError):
            watcher(tmp_path).run(lambda p: "ok", max_iterations=1)


def test_file_replaced_while_being_handled_is_offered_again(tmp_path, inbox):
    target = inbox / "a.pdf"
    target.write_bytes(b"%PDF version 1")
    w = watcher(tmp_path)
    [path] = poll_until(w, SETTLE * 2)

    def handle(p: Path) -> str:
        p.write_bytes(b"%PDF version 2, longer")  # the user re-copies a fixed file meanwhile
        return "ok"

    assert w.handle_one(handle, path) == "ok"
    assert poll_until(w, SETTLE * 2) == [target]
