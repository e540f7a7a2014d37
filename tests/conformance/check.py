"""Runs torch's distributed test suite (torch_suite.py) over a backend and
holds "dsp" to gloo: every test that passes over gloo on the CPU at that
world size (the list in expected/) must pass over "dsp", except those named,
with the reason, in DEVIATIONS.md.

    python tests/conformance/check.py --world 2            # dsp, checked
    python tests/conformance/check.py --world 2 --backend gloo --record
                                                           # refresh expected/

The gloo lists are recorded, not re-run in CI: the suite takes minutes per
backend and world size, and gloo's results do not change with our code.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))


def run_suite(backend: str, world: int, extra: list[str]) -> dict[str, str]:
    """test name -> passed / skipped / failed."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "junit.xml")
        env = dict(os.environ, BACKEND=backend, WORLD_SIZE=str(world), TEMP_DIR=tmp)
        cmd = [
            sys.executable, "-m", "pytest", os.path.join(HERE, "torch_suite.py"),
            "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--timeout=600",
            f"--junitxml={xml}", *extra,
        ]  # fmt: skip
        subprocess.run(cmd, env=env, cwd=HERE, check=False)
        results = {}
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = case.get("name")
            if case.find("skipped") is not None:
                results[name] = "skipped"
            elif case.find("failure") is not None or case.find("error") is not None:
                results[name] = "failed"
            else:
                results[name] = "passed"
        return results


def deviations() -> dict[str, str]:
    """Tests "dsp" deliberately does not pass, from DEVIATIONS.md's table."""
    out = {}
    with open(os.path.join(HERE, "DEVIATIONS.md")) as f:
        for line in f:
            m = re.match(r"\|\s*`(test_\w+)`\s*\|\s*(\S.*?)\s*\|", line)
            if m:
                out[m.group(1)] = m.group(2)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--backend", default="dsp")
    p.add_argument("--record", action="store_true", help="write expected/ from this run")
    p.add_argument("pytest_args", nargs="*")
    args = p.parse_args()
    start = time.time()
    results = run_suite(args.backend, args.world, args.pytest_args)
    kinds = ("passed", "skipped", "failed")
    counts = {k: sum(1 for v in results.values() if v == k) for k in kinds}
    print(
        f"conformance: {args.backend} at world {args.world}: {len(results)} tests, "
        f"{counts['passed']} passed, {counts['skipped']} skipped, {counts['failed']} failed "
        f"({time.time() - start:.0f} s)"
    )
    expected_path = os.path.join(HERE, "expected", f"gloo-passes-world{args.world}.txt")
    if args.record:
        os.makedirs(os.path.dirname(expected_path), exist_ok=True)
        with open(expected_path, "w") as f:
            f.write("".join(f"{n}\n" for n in sorted(results) if results[n] == "passed"))
        print(f"conformance: wrote {expected_path}")
        return 0 if counts["failed"] == 0 else 1
    with open(expected_path) as f:
        expected = [line.strip() for line in f if line.strip()]
    allowed = deviations()
    missing = [n for n in expected if results.get(n) != "passed" and n not in allowed]
    failed = [n for n, v in results.items() if v == "failed" and n not in allowed]
    for n in sorted(set(missing) | set(failed)):
        print(f"conformance: {n}: {results.get(n, 'not run')} over {args.backend}")
    passed = sum(1 for n in expected if results.get(n) == "passed")
    print(
        f"conformance: {len(expected)} tests pass over gloo; over {args.backend} "
        f"{passed} of them pass, the other {len(expected) - passed} are listed deviations"
        if not missing
        else f"conformance: {len(missing)} tests that pass over gloo do not pass over "
        f"{args.backend} and are not listed in DEVIATIONS.md"
    )
    return 1 if missing or failed else 0


if __name__ == "__main__":
    sys.exit(main())
