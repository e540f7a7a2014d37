"""The frameworks people launch with, each on 2 ranks under torchrun over
"dsp" and over gloo (``frameworks_job.py``): the weights after the same
steps are equal, and the framework's group is the backend asked for. How
each takes "dsp" is the frameworks guide's one line (docs/guides/frameworks.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "frameworks_job.py")
EXIT_ABORT = "terminate called without an active exception"

FRAMEWORKS = {
    "ddp": None,
    "env": None,
    "fsdp2": None,
    "tp": None,
    "compile": None,
    "accelerate": "accelerate",
    "hf_trainer": "transformers",
    "lightning": "lightning",
    "lightning_mp": "lightning",
}


def _run(framework: str, backend: str, out: str) -> dict:
    from dsparallel.spawn import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("DSPARALLEL_DEFAULT_BACKEND", None)
    if framework == "env" and backend == "dsp":
        env["DSPARALLEL_DEFAULT_BACKEND"] = "1"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        JOB,
        framework,
        backend,
        out,
    ]
    for attempt in range(3):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        # torch 2.13's gloo aborts a process at exit now and then ("terminate
        # called without an active exception"; 1 run in 8 of a plain gloo
        # DDP script here, with dsparallel not even autoloaded): such a run
        # is run again, anything else fails.
        if done.returncode == 0 or EXIT_ABORT not in done.stderr:
            break
        warnings.warn(
            f"{framework} over {backend}: aborted at exit, run again ({attempt + 1})", stacklevel=2
        )
    assert done.returncode == 0, f"{framework} over {backend}:\n{done.stderr[-4000:]}"
    return torch.load(out)


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_a_framework_trains_over_dsp_as_over_gloo(framework, tmp_path):
    if FRAMEWORKS[framework]:
        pytest.importorskip(FRAMEWORKS[framework])
    ours = _run(framework, "dsp", str(tmp_path / "dsp.pt"))
    theirs = _run(framework, "gloo", str(tmp_path / "gloo.pt"))
    assert "dsp" in ours["backend"] and "gloo" not in ours["backend"], ours["backend"]
    assert "gloo" in theirs["backend"], theirs["backend"]
    assert ours["weights"].keys() == theirs["weights"].keys()
    for key, w in theirs["weights"].items():
        torch.testing.assert_close(ours["weights"][key], w, rtol=0, atol=1e-6, msg=key)
