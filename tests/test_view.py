"""`crr view` in a real browser: Debian's Chromium (scripts/setup.sh installs it), headless, driven by Playwright
through `executable_path` (no browser download). The page of a one-update `crr train` run and two committed
evaluations of the CPU comparison: a trajectory and a fork clicked open, the advantage filter, an evaluation's
transcript, and a screenshot that is not blank."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from PIL import Image
from test_trainer import SMALL, run_train
from typer.testing import CliRunner

from crr.cli import app
from crr.train.records import read_records

CHROMIUM = shutil.which("chromium")
EVALS = Path(__file__).resolve().parents[1] / "results" / "reference" / "cpu-main" / "evals" / "crr"



def test_view_in_a_browser(ran_tasks_file, tmp_path):
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH: scripts/setup.sh installs Debian's (apt-get install chromium), as root")

    _, run = run_train(["--method", "crr", "--out", str(tmp_path), "--max-updates", "1", f"tasks={ran_tasks_file}",
                        *SMALL], tmp_path)
    check_page(run, tmp_path, CHROMIUM)


def check_page(run: Path, tmp_path: Path, chromium: str) -> None:
    """The page of `run` and two committed evaluations, in the browser."""
    from playwright.sync_api import sync_playwright

    evals = sorted(p for p in EVALS.iterdir() if "checkpoint" not in p.name)[:2]
    result = CliRunner().invoke(app, ["view", str(run), *map(str, evals), "--out", str(tmp_path / "v.html")])
    assert result.exit_code == 0, result.output
    assert str(tmp_path / "v.html") in result.output.replace("\n", "")
    html = (tmp_path / "v.html").read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)   # nothing fetched: assets inlined

    recs = read_records(run)
    trajs = [r for r in recs if r["kind"] == "trajectory"]
    forked = next(t for t in trajs
                  if any(b["kind"] == "branch" and b["row"] == t["row"] and b["proposal"] for b in recs))
    branch = next(b for b in recs if b["kind"] == "branch" and b["row"] == forked["row"] and b["proposal"])
    differing = sum(any(s["advantage"] != s["grpo_advantage"] for s in t["steps"]) for t in trajs)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium)
        page = browser.new_page(viewport={"width": 1300, "height": 850})
        errors, urls = [], []
        page.on("pageerror", lambda e: errors.append(e))
        page.on("request", lambda r: urls.append(r.url))
        page.goto((tmp_path / "v.html").as_uri())
        page.wait_for_function("window.crrRendered !== undefined", timeout=20_000)
        assert page.locator(".traj").count() == len(trajs)
        assert page.locator("svg.curve").count() >= 5

        page.locator(f'.traj[data-row="{forked["row"]}"]').click()
        detail = page.locator("#detail")
        assert f"sibling {forked['sibling']}" in detail.inner_text()
        assert page.locator("#detail > .step").count() == len(forked["steps"])   # its own, not its forks'
        fork = detail.locator(f'.fork[data-t="{branch["t"]}"]').first
        assert "return" in fork.locator(".head").inner_text() and not fork.locator(".branch-steps").is_visible()
        fork.locator(".head").click()
        assert fork.locator(".branch-steps").is_visible() and "proposal" in fork.inner_text()
        first = branch["steps"][0]["call"]["name"] if branch["steps"] and "call" in branch["steps"][0] else None
        assert first is None or first in fork.locator(".branch-steps").inner_text()

        page.locator(".differs-filter").check()
        assert page.locator(".traj").count() == differing
        page.locator(".differs-filter").uncheck()

        page.locator("td.cell").first.click()
        text = detail.inner_text()
        assert "patch" in text and "error mode" in text and "transcript" in text
        page.locator(".disagree-filter").check()
        assert page.locator("table.tasks tr").count() - 1 < 64
        shot = tmp_path / "view.png"
        page.screenshot(path=str(shot))
        browser.close()
    assert not errors, errors
    assert all(u.startswith("file://") for u in urls), urls
    colours = Image.open(shot).convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50   # text, the tables' colours, the timeline: not blank
