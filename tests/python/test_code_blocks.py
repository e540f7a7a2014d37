"""Every code block in README.md and docs/ runs, or says why it does not, so
that a page cannot contradict the code.

A page's blocks run in order, in one fresh directory per page, as a reader
would run them one after another; that directory holds what the pages name
as a reader's own files (``path/to/hf``, ``path/to/checkpoint`` and
``my-llama``: one tiny random Llama in Hugging Face's format) and links to
the repository's ``examples/`` and ``docs/``. How a block runs:

- ``python``: its first line says how, ``# torchrun ... --nproc-per-node N``
  (N ranks, forked as torchrun would start them: dist_utils.run_script) or
  ``# python`` (one process); a block whose first line is
  ``# (continues the block above)`` is appended to the block before it and
  the two run as one program.
- ``bash``: run by ``bash -euo pipefail``.
- Any block preceded by ``<!-- not run: WHY -->`` is not run here, and WHY
  says what runs or checks it instead (an install, a server, several
  hosts); one preceded by ``<!-- the file: PATH -->`` must equal that file.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import subprocess
import sys

import pytest
from dist_utils import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = ["README.md"] + sorted(
    os.path.relpath(p, ROOT)
    for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
)
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
TORCHRUN = re.compile(r"# torchrun\b.*--nproc-per-node (\d+)")
CONTINUES = "# (continues the block above)"
# What a page calls a reader's own Hugging Face checkpoint.
CHECKPOINT_NAMES = ("path/to/hf", "path/to/checkpoint", "my-llama")


@dataclasses.dataclass
class Block:
    page: str
    line: int
    lang: str
    code: str
    notes: list[str]  # the HTML comments right above the fence

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def note(self, kind: str) -> str | None:
        for n in self.notes:
            if m := re.fullmatch(rf"<!-- {kind}: (.+?) -->", n.strip(), re.S):
                return m.group(1)
        return None


def blocks(page: str) -> list[Block]:
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    out = []
    for m in FENCE.finditer(text):
        above = text[: m.start()].rstrip("\n").splitlines()
        notes = []
        while above and above[-1].strip().startswith("<!--") and above[-1].strip().endswith("-->"):
            notes.append(above.pop())
        line = text[: m.start()].count("\n") + 1
        out.append(Block(page, line, m.group(1), m.group(2), notes))
    return out


def programs(page: str) -> list[tuple[str, object, str, str]]:
    """(how, argument, code, where) for each program of the page, in order:
    ("python", ranks or None for one process, ...), ("bash", None, ...),
    ("file", path, ...); blocks not run are left out."""
    out: list[tuple[str, object, str, str]] = []
    for b in blocks(page):
        first = b.code.split("\n", 1)[0]
        if b.note("not run"):
            continue
        if path := b.note("the file"):
            out.append(("file", path, b.code, b.where))
        elif b.lang == "python" and first == CONTINUES:
            assert out and out[-1][0] == "python", f"{b.where}: no python block above to continue"
            how, ranks, code, where = out.pop()
            out.append((how, ranks, code + b.code, f"{where}+{b.line}"))
        elif b.lang == "python" and (m := TORCHRUN.match(first)):
            out.append(("python", int(m.group(1)), b.code, b.where))
        elif b.lang == "python" and first.startswith("# python"):
            out.append(("python", None, b.code, b.where))
        elif b.lang in ("bash", "sh"):
            out.append(("bash", None, b.code, b.where))
        else:
            raise AssertionError(
                f"{b.where}: a ```{b.lang} block that neither says how it runs "
                "(a first line '# torchrun ... --nproc-per-node N', '# python' or "
                f"'{CONTINUES}') nor why not ('<!-- not run: WHY -->' above it)"
            )
    return out


def test_every_block_runs_or_says_why_not():
    for page in PAGES:
        programs(page)


def test_the_readme_has_an_example_per_strategy():
    assert sum(how == "python" for how, *_ in programs("README.md")) >= 7


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("hf") / "llama"
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _reader_dir(tmp_path, hf_checkpoint):
    for name in CHECKPOINT_NAMES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).symlink_to(hf_checkpoint)
    for name in ("examples", "docs"):
        (tmp_path / name).symlink_to(os.path.join(ROOT, name))
    return tmp_path


RUNNABLE = [p for p in PAGES if any(not b.note("not run") for b in blocks(p))]


@pytest.mark.parametrize("page", RUNNABLE)
def test_page_runs(page, tmp_path, hf_checkpoint):
    cwd = _reader_dir(tmp_path, hf_checkpoint)
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    for i, (how, arg, code, where) in enumerate(programs(page)):
        if how == "file":
            with open(os.path.join(ROOT, arg)) as f:
                assert code == f.read(), f"{where} is not {arg} as it is"
        elif how == "python" and arg:
            script = cwd / f"block{i}.py"
            script.write_text(code)
            try:
                run_script(str(script), nproc=arg, cwd=str(cwd))
            except Exception as e:
                raise AssertionError(f"{where} failed:\n{e}") from None
        else:
            args = (
                [sys.executable, "-c", code]
                if how == "python"
                else ["bash", "-euo", "pipefail", "-c", code]
            )
            done = subprocess.run(
                args, capture_output=True, text=True, timeout=300, cwd=cwd, env=env
            )
            assert done.returncode == 0, f"{where} failed:\n{done.stdout}{done.stderr}"
