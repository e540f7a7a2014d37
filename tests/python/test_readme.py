"""Every Python example in README.md runs as it says: each block's first
line names its launcher (``# torchrun ... --nproc-per-node N`` or
``# python``), and the block is run from a file that way (torchrun's ranks
as forked ones: dist_utils.run_script)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from dist_utils import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _examples():
    """(launcher line, code) of each example, named by the bold title above it."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    out = []
    for m in re.finditer(r"```python\n(# (?:torchrun|python)[^\n]*)\n(.*?)```", text, re.S):
        title = re.findall(r"\*\*([^*]+)\*\*", text[: m.start()])[-1]
        out.append(pytest.param(m.group(1), m.group(2), id=title.lower()))
    return out


def test_the_readme_has_an_example_per_strategy():
    assert len(_examples()) >= 7


@pytest.mark.parametrize("launcher,code", _examples())
def test_readme_example_runs(tmp_path, launcher, code):
    script = tmp_path / "example.py"
    script.write_text(code)
    if launcher.startswith("# torchrun"):
        nproc = int(re.search(r"--nproc-per-node (\d+)", launcher).group(1))
        run_script(str(script), nproc=nproc)
        return
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr
