"""Builds dsparallel's one extension module, dsparallel._C (the package's
metadata is in pyproject.toml).

Install over an existing torch without build isolation (build isolation would
fetch a second torch, and the extension must be built against the torch it
will run with):  pip install --no-build-isolation .
"""

import glob
import os

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def sources():
    patterns = [
        "csrc/core/**/*.cpp",
        "csrc/backend/*.cpp",
        "csrc/ddp/*.cpp",
        "csrc/ops/*.cpp",
        "csrc/pipeline/*.cpp",
        "csrc/bindings.cpp",
    ]
    found = []
    for p in patterns:
        found += sorted(glob.glob(os.path.join(ROOT, p), recursive=True))
    return [os.path.relpath(f, ROOT) for f in found]


def record_torch_version():
    """The torch this build is against: dsparallel refuses to load under
    another one with a clear ImportError (dsparallel/_loader.py)."""
    with open(os.path.join(ROOT, "dsparallel", "_build_info.py"), "w") as f:
        f.write(
            f'"""Written by setup.py at build time."""\n\nTORCH_VERSION = {torch.__version__!r}\n'
        )


record_torch_version()


# DSP_SANITIZE=address,undefined (scripts/asan.sh) builds the extension
# instrumented, in objects of its own: never a package to install.
SANITIZE = os.environ.get("DSP_SANITIZE", "")


class BuildExt(BuildExtension):
    """torch's BuildExtension with one object folder per source tree
    (build/ext): the editable install the tests use and the wheel CI packages
    share it, so ninja compiles each source once and the wheel only links.
    An explicit --build-temp still wins."""

    def initialize_options(self):
        super().initialize_options()
        folder = "ext-" + SANITIZE.replace(",", "-") if SANITIZE else "ext"
        self.build_temp = os.path.join(ROOT, "build", folder)


if SANITIZE:
    flags = [f"-fsanitize={SANITIZE}", "-fno-omit-frame-pointer", "-O1", "-g1"]
    compile_args, link_args = flags + ["-fvisibility=hidden"], flags[:1]
else:
    compile_args, link_args = ["-O3", "-fvisibility=hidden"], []

ext = CppExtension(
    name="dsparallel._C",
    sources=sources(),
    include_dirs=[os.path.join(ROOT, "csrc")],
    # No -std here: torch's BuildExtension picks the standard its headers
    # need (C++17 for torch 2.13, C++20 from 2.14); csrc/core is plain C++17.
    extra_compile_args={"cxx": compile_args},
    extra_link_args=link_args,
    libraries=["rt"],
)

setup(
    packages=find_packages(include=["dsparallel", "dsparallel.*"]),
    py_modules=["dsparallel_autoload"],
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExt.with_options(use_ninja=True)},
)
