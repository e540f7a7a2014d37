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
