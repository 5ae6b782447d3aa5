"""docs/scheduling.md: the crontab command runs under cron's empty environment; the units verify."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from fixtures_models import *  # noqa: F403

from pipeline.inputs.samples import make_text_pdf

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "scheduling.md").read_text()
PREFIX = "/srv/tqpipe"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC, re.DOTALL)


def _project(tmp_path: Path, model: Path) -> Path:
    """A /srv/tqpipe look-alike: a job, documents, and .venv/bin/tqpipe running this checkout."""
    root = tmp_path / "srv"
    (root / "jobs").mkdir(parents=True)
    (root / "logs").mkdir()
    (root / "docs").mkdir()
    make_text_pdf(root / "docs" / "a.pdf", ["Quarterly report. Revenue grew."])
    (root / "jobs" / "summarize.yaml").write_text(
        f"name: cron\ninputs: [../docs/]\nmodel: {{path: '{model}'}}\n"
        "tasks: [{name: s, prompt: 'Summarize.', max_tokens: 2}]\noutput: ../results/out.jsonl\n")
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    tqpipe = bin_dir / "tqpipe"  # what pip's console script does, without installing anything
    tqpipe.write_text(f"#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m pipeline.cli \"$@\"\n")
    tqpipe.chmod(0o755)
    return root


def test_crontab_line_runs_under_crons_minimal_environment(tmp_path, tiny_vlm_dir):
    (line,) = [ln for b in _blocks("crontab") for ln in b.splitlines() if ln and not ln.startswith("#")]
    fields = line.split(None, 5)
    assert len(fields) == 6 and fields[0] == "*/15", line  # five time fields, then the command
    root = _project(tmp_path, tiny_vlm_dir)
    command = fields[5].replace(PREFIX, str(root))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SHELL": "/bin/sh", "LOGNAME": "tqpipe",
           "TQPIPE_HOME": os.environ["TQPIPE_HOME"]}
    for expected in (0, 0):  # the second run finds everything done
        r = subprocess.run(["env", "-i", *(f"{k}={v}" for k, v in env.items()), "/bin/sh", "-c", command],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == expected, (r.stdout, r.stderr, (root / "logs" / "tqpipe.log").read_text())
    log = (root / "logs" / "tqpipe.log").read_text()
    assert "1 record written: 1 ok" in log and "1 document (1 already recorded)" in log  # the second run
    assert "\r" not in log  # plain lines, no bars
    (rec,) = [orjson.loads(x) for x in (root / "results" / "out.jsonl").read_bytes().splitlines()]
    assert rec["status"] == "ok"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_units_verify(tmp_path, tiny_vlm_dir):
    root = _project(tmp_path, tiny_vlm_dir)
    units = {}
    for block in _blocks("ini"):
        desc = re.search(r"Description=tqpipe: (\w+)", block).group(1)
        kind = "timer" if "[Timer]" in block else "service"
        name = {"run": "tqpipe-summarize", "watch": "tqpipe-inbox"}[desc] + f".{kind}"
        # the test machine has no tqpipe user and no /srv: point at the look-alike project
        units[name] = block.replace(PREFIX, str(root)).replace("User=tqpipe\n", "")
    assert set(units) == {"tqpipe-summarize.service", "tqpipe-summarize.timer", "tqpipe-inbox.service"}
    for name, text in units.items():
        (tmp_path / name).write_text(text)
    r = subprocess.run(["systemd-analyze", "verify", *(str(tmp_path / n) for n in units)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("tqpipe-summarize.service", "tqpipe-inbox.service"):
        exec_start = re.search(r"ExecStart=(.*)", units[name]).group(1).split()
        assert Path(exec_start[0]).is_file() and exec_start[1] in ("run", "watch")
    assert "SuccessExitStatus=1" in units["tqpipe-summarize.service"]
    assert "RestartPreventExitStatus=2 3" in units["tqpipe-inbox.service"]
    assert "SuccessExitStatus=143" in units["tqpipe-inbox.service"]  # systemctl stop is not a failure


def test_exit_code_table_lists_every_code_the_cli_documents():
    """The scheduler's table (the page's first) names every exit code ``tqpipe --help`` does."""
    from pipeline.cli import EXIT_CODES_HELP

    page = (REPO / "docs" / "scheduling.md").read_text()
    table = page[page.index("| exit code |"):page.index("## crontab")]
    listed = {c for row in re.findall(r"^\| ([\d, ]+) \|", table, re.M) for c in re.findall(r"\d+", row)}
    documented = {c for line in EXIT_CODES_HELP.splitlines()[2:] for c in re.findall(r"^\s+(\d+(?:, \d+)*)", line)
                  for c in c.split(", ")}
    assert documented == {"0", "1", "2", "3", "4", "130", "143"}
    assert listed == documented
