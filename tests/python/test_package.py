"""dsparallel as an installed package: "dsp" without ``import dsparallel``
(torch's backend entry point), the autoload switch, and the clear error when
the extension was built against another torch. (CI also installs the wheel
into a fresh virtual environment, runs tests/package/smoke.py there, and
checks that the sdist holds every source the wheel was built from:
scripts/package_check.sh.)"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python(code, env=None, cwd="/"):
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, **(env or {})),
        cwd=cwd,
        timeout=180,
    )


def test_dsp_works_without_importing_dsparallel():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "package", "smoke.py")],
        capture_output=True,
        text=True,
        cwd="/",
        timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "smoke: OK" in out.stdout


def test_autoload_is_cheap_and_can_be_turned_off():
    code = (
        "import sys, torch.distributed as dist; "
        "print('DSP' in dist.Backend._plugins, 'dsparallel' in sys.modules)"
    )
    assert _python(code).stdout.split() == ["True", "False"]  # registered, not loaded
    off = _python(code, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert off.stdout.split() == ["False", "False"]


def test_extension_built_for_another_torch_raises_a_clear_import_error():
    code = (
        "import sys, types\n"
        "m = types.ModuleType('dsparallel._build_info')\n"
        "m.TORCH_VERSION = '1.0.0+other'\n"
        "sys.modules['dsparallel._build_info'] = m\n"
        "try:\n"
        "    import dsparallel\n"
        "except ImportError as e:\n"
        "    print('IMPORT ERROR:', e)\n"
    )
    out = _python(code)
    assert "IMPORT ERROR: dsparallel was built against torch 1.0.0+other" in out.stdout, out
    import torch

    assert torch.__version__ in out.stdout and "pip install --no-build-isolation" in out.stdout
