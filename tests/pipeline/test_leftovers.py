"""Issue 27, smaller items: no half-built model folder, no empty owner .tmp, short dry-run lines."""

from __future__ import annotations

import errno
from pathlib import Path


from pipeline.models.store import cached_build
from pipeline.output.lock import JobLock
from pipeline.run.dry_run import dry_line


def test_build_folders_left_by_a_killed_builder_are_removed(tmp_path):
    leftover = tmp_path / ".m.build-abc123"  # what kill -9 during a build leaves
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")
    stale = tmp_path / ".m.stale-xyz"
    stale.mkdir()

    def build(out: Path) -> None:
        (out / "config.json").write_text("{}")

    target = cached_build(tmp_path / "m", {"v": 1}, build)
    assert (target / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock", "m"]


def test_full_disk_leaves_no_empty_owner_tmp(tmp_path, monkeypatch):
    def full(self, data):
        open(self, "wb").close()  # the file is created, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    lock = JobLock(tmp_path / "results.jsonl")
    with lock:
        assert not list(tmp_path.glob("*.tmp"))
    assert not list(tmp_path.glob("*.tmp"))


def test_dry_run_line_of_a_2000_page_truncation_is_short():
    row = {"doc_id": "big.pdf", "pages": 2000, "page_count": 2000, "images": 0, "tokens": 900000, "fits": False,
           "truncate": {"tokens_dropped": 890000, "pages_dropped": list(range(20, 2001)), "partial_page": 19}}
    line = dry_line(row)
    assert len(line) < 160 and "pages 20-2000" in line, line
