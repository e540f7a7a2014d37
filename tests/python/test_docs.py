"""The docs and the performance report stay true to the repository: every
file under docs/ is used by a page, and docs/performance.md and the README's
table are exactly what benchmarks/report.py makes of the committed results."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs")


def test_every_file_under_docs_is_used_by_a_page():
    files = {os.path.relpath(os.path.join(d, f), DOCS) for d, _, fs in os.walk(DOCS) for f in fs}
    with open(os.path.join(ROOT, "mkdocs.yml")) as f:
        used = set(re.findall(r":\s*([\w/.-]+\.md)\s*$", f.read(), re.M))  # the pages in nav
    for page in [p for p in files if p.endswith(".md")]:
        with open(os.path.join(DOCS, page)) as f:
            for link in re.findall(r"\]\(([^)#\s]+)", f.read()):
                target = os.path.normpath(os.path.join(os.path.dirname(page), link))
                used.add(target)
    assert files - used == set(), f"files under docs/ that no page uses: {sorted(files - used)}"


def test_performance_page_and_readme_table_are_the_report_of_the_results():
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "report.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_readme_stays_a_five_minute_read():
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = f.read().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/"


def test_a_result_is_stale_once_the_files_it_measured_change(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import report
        from sources import paths, sources_hash
    finally:
        sys.path.pop(0)
    machine = {"commit": "0000000"}
    now = sources_hash("collectives")
    assert report.stale({"benchmark": "collectives", "machine": machine, "sources": now}) is None
    # The hash changes with any file a benchmark measures, and only with those.
    assert "csrc/backend" in paths("collectives") and "csrc/backend" not in paths("grouped_mlp")
    changed = {"benchmark": "collectives", "machine": machine, "sources": now[::-1]}
    assert "changed since 0000000" in report.stale(changed)
    # Without a recorded hash, uncommitted code cannot be told apart.
    dirty = {"benchmark": "collectives", "machine": {"commit": "0000000+changes"}}
    assert "uncommitted" in report.stale(dirty)
    # A commit's files hash as the tree's do when nothing measured changed.
    head = subprocess.run(
        ["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    clean = subprocess.run(
        [
            "git",
            "-C",
            ROOT,
            "status",
            "--porcelain",
            "--",
            *[p.lstrip("!") for p in paths("floor")],
        ],
        capture_output=True,
        text=True,
    ).stdout
    if not clean:
        assert sources_hash("floor", head) == sources_hash("floor")
