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


def test_a_result_is_stale_once_the_files_it_measured_change():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import report
        from sources import paths, sources_hash
    finally:
        sys.path.pop(0)

    def git(*args):
        done = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True)
        return done.stdout.strip()

    def result(benchmark, commit, **more):
        return {"benchmark": benchmark, "machine": {"commit": commit}, **more}

    # Each benchmark hashes its own files only.
    assert "csrc/backend" in paths("collectives") and "csrc/backend" not in paths("grouped_mlp")
    # At a commit: held against that commit's files.
    first = git("rev-list", "--max-parents=0", "HEAD")[:7]
    why = report.stale(result("collectives", first))
    assert why.startswith("`") and f"more changed since {first}" in why, why
    head = git("rev-parse", "--short", "HEAD")
    measured = [p.lstrip("!") for p in paths("floor")]
    if not git("status", "--porcelain", "--", *measured):
        assert report.stale(result("floor", head)) is None
    # On uncommitted code: held against the hash it recorded, if any.
    now = sources_hash("floor")
    assert report.stale(result("floor", f"{head}+changes", sources=now)) is None
    assert "changed since" in report.stale(result("floor", f"{head}+changes", sources=now[::-1]))
    assert "uncommitted" in report.stale(result("floor", f"{head}+changes"))


def test_the_site_check_finds_what_is_clipped_or_too_small(tmp_path, capsys):
    """scripts/check_site.py, which the docs stage runs on the built site,
    fails a page whose table is cut off or whose figure is shrunk past
    reading, and passes the same page fixed."""
    from dist_utils import require

    require(os.path.exists("/usr/bin/chromedriver"), "chromium-driver is not installed")
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import check_site
    finally:
        sys.path.pop(0)
    from PIL import Image

    Image.new("RGB", (3000, 300), "white").save(tmp_path / "wide.png")
    cells = "".join(f"<td>column{i}</td>" for i in range(40))

    def check(table_box: str, figure: str) -> str:
        (tmp_path / "index.html").write_text(
            "<html><body><div class='md-content__inner' style='width:600px'>"
            f"<div style='{table_box}'><table><tr>{cells}</tr></table></div>"
            f"{figure}</div></body></html>"
        )
        code = check_site.main([str(tmp_path), "--shots", str(tmp_path / "shots")])
        return f"{code} {capsys.readouterr().out}"

    out = check("overflow-x:hidden", "<img src='wide.png' style='width:100%'>")
    assert out.startswith("1 "), out
    assert "clipped, wider than the column: table" in out, out
    assert "figure wide.png shown at 0.20: its text 2.8 px high" in out, out
    # The table scrolls; the figure at 0.6 of its width, in a box that scrolls.
    fixed = "<div style='overflow-x:auto'><img src='wide.png' style='width:1800px'></div>"
    out = check("overflow-x:auto", fixed)
    assert out.startswith("0 "), out
