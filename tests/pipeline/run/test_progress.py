"""Bars on a terminal, rate-limited log lines elsewhere."""

import io
import logging
import sys

import pytest
from tqdm import tqdm

import pipeline.run.progress as progress
from pipeline.run.progress import LogProgress, configure_logging, make_progress


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(progress.time, "monotonic", c)
    return c


class TTY(io.StringIO):
    def isatty(self):
        return True


def test_mode_follows_terminal_and_env(monkeypatch):
    monkeypatch.delenv("TQPIPE_PROGRESS", raising=False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert isinstance(make_progress(3, "documents"), LogProgress)
    monkeypatch.setattr(sys, "stderr", TTY())
    bar = make_progress(3, "documents", unit="doc", position=1, leave=False)
    assert isinstance(bar, tqdm) and bar.total == 3 and bar.unit == "doc"
    bar.close()
    monkeypatch.setenv("TQPIPE_PROGRESS", "log")  # a terminal, but forced to log lines
    assert isinstance(make_progress(3, "documents"), LogProgress)
    monkeypatch.setenv("TQPIPE_PROGRESS", "off")
    assert isinstance(make_progress(3, "documents"), progress.NullProgress)


def test_log_lines_are_rate_limited_and_final_line_summarizes(clock, caplog, monkeypatch):
    monkeypatch.setenv("TQPIPE_PROGRESS_INTERVAL", "5")
    caplog.set_level(logging.INFO, logger="pipeline.run.progress")
    with make_progress(10, "documents") as p:
        assert isinstance(p, LogProgress)
        for _ in range(3):
            clock.t += 1.0  # 3 updates within 5 s: no line yet
            p.update()
        assert caplog.messages == []
        p.set_postfix(failed=1)
        clock.t += 4.5  # 7.5 s elapsed, 3 done -> 0.4/s
        p.update(0)
        assert caplog.messages == ["documents 3/10 (1 failed) 0.4/s eta 0:00:18"]
        p.update(0)  # same instant: rate limit holds
        assert len(caplog.messages) == 1
    assert caplog.messages[-1] == "documents 3/10 (1 failed) 0.4/s done in 0:00:08"
    p.close()  # idempotent
    assert len(caplog.messages) == 2


def test_unknown_total_units_and_string_postfix(clock, caplog):
    caplog.set_level(logging.INFO, logger="pipeline.run.progress")
    p = LogProgress(None, "prefill", unit="tok", interval=0)
    p.set_postfix(doc="a.pdf")
    clock.t += 2
    p.update(100)
    assert caplog.messages == ["prefill 100 tok (doc=a.pdf) 50 tok/s"]


def test_leave_false_logs_final_line_at_debug(clock, caplog):
    caplog.set_level(logging.DEBUG, logger="pipeline.run.progress")
    with make_progress(5, "decode", leave=False) as p:
        p.update(5)
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
    p2 = LogProgress(4, "docs")
    p2.reset(total=8)
    assert (p2.n, p2.total) == (0, 8)


def test_off_mode_counts_but_never_logs(monkeypatch, caplog):
    monkeypatch.setenv("TQPIPE_PROGRESS", "off")
    caplog.set_level(logging.DEBUG, logger="pipeline.run.progress")
    with make_progress(2, "documents") as p:
        p.update(2)
    assert p.n == 2 and caplog.records == []


def test_configure_logging_is_idempotent_and_sets_level(monkeypatch):
    monkeypatch.setenv("TQPIPE_PROGRESS", "log")
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        configure_logging()
        configure_logging(verbose=True)
        ours = [h for h in root.handlers if getattr(h, "_tqpipe_handler", False)]
        assert len(ours) == 1 and root.level == logging.DEBUG
        assert logging.getLogger("filelock").level == logging.WARNING
        configure_logging(verbose=False)
        assert root.level == logging.INFO
    finally:
        for h in list(root.handlers):
            if getattr(h, "_tqpipe_handler", False):
                root.removeHandler(h)
        root.setLevel(saved[1])


def test_decode_rate_counts_from_the_first_token_not_the_prefill(clock, monkeypatch, caplog):
    """A document's decode line reads tokens / decoding time: 121 s of prefill
    before the first token once made it read 0.008 tok/s with a 1 h ETA."""
    from types import SimpleNamespace

    import pipeline.run.runner as runner

    monkeypatch.setenv("TQPIPE_PROGRESS", "log")
    monkeypatch.setenv("TQPIPE_PROGRESS_INTERVAL", "0")

    def process_document(engines, job, ref, *, tasks, digest, on_prefill, on_token, on_prompt):
        on_prompt(SimpleNamespace(n_tokens=5000))
        for _ in range(5):
            clock.t += 24.0  # a 120 s prefill
            on_prefill(1000)
        for _ in range(10):
            clock.t += 0.5  # then 2 tokens/s
            on_token(1)
        return iter(())

    monkeypatch.setattr(runner, "process_document", process_document)
    work = SimpleNamespace(ref=SimpleNamespace(doc_id="long.pdf"), tasks=[SimpleNamespace(max_tokens=40)], digest="d")
    with caplog.at_level(logging.INFO, logger="pipeline.run.progress"):
        runner._run_document(None, None, work, log=None, summary=runner.RunSummary(), progress=True,
                             originals=None)
    decode = [m.getMessage() for m in caplog.records if m.getMessage().startswith("decode long.pdf")]
    # 10 tokens in the 4.5 s since the first (the prefill's 120 s would read 0.08 tok/s, eta 0:06)
    assert decode[-1].startswith("decode long.pdf 10/40 2.22 tok/s eta 0:00:14"), decode


def test_a_bar_left_by_an_exception_says_stopped_not_done(clock, caplog):
    """A SIGTERM (Stopped, a KeyboardInterrupt) mid-run: the last line must
    not read "documents 0/3 ... done"."""
    from pipeline.run.signals import Stopped

    caplog.set_level(logging.INFO, logger="pipeline.run.progress")
    with pytest.raises(Stopped):
        with make_progress(3, "documents") as p:
            clock.t += 2.0
            raise Stopped(15)
    assert caplog.messages[-1] == "documents 0/3 stopped after 0:00:02"
    with make_progress(3, "documents") as p:
        p.update(3)
    assert caplog.messages[-1].endswith("done in 0:00:00")


def test_a_terminal_of_zero_columns_still_gets_a_bar(monkeypatch):
    """A pty opened without a size (docker exec, some CI runners) reports 0
    columns; tqdm's dynamic width took that literally and drew nothing."""
    import os

    main, side = os.openpty()  # a new pty is 0 x 0
    try:
        tty = open(side, "w", buffering=1)
        assert os.get_terminal_size(side).columns == 0
        monkeypatch.setattr(sys, "stderr", tty)
        monkeypatch.delenv("TQPIPE_PROGRESS", raising=False)
        bar = make_progress(4, "documents", "doc")
        assert isinstance(bar, tqdm)
        bar.update(2)
        bar.close()
        tty.flush()
        os.set_blocking(main, False)
        assert b"documents:  50%" in os.read(main, 65536)
    finally:
        tty.close()
        os.close(main)
