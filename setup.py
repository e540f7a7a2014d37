"""Builds dsparallel and its one extension module, dsparallel._C.

Install over an existing torch without build isolation (build isolation would
fetch a second torch):  pip install --no-build-isolation .
"""

import glob
import os

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


ext = CppExtension(
    name="dsparallel._C",
    sources=sources(),
    include_dirs=[os.path.join(ROOT, "csrc")],
    # No -std here: torch's BuildExtension picks the standard its headers
    # need (C++17 for torch 2.13, C++20 from 2.14); csrc/core is plain C++17.
    extra_compile_args={"cxx": ["-O3", "-fvisibility=hidden"]},
    libraries=["rt"],
)

setup(
    name="dsparallel",
    version="0.1.0",
    description="Data, tensor and pipeline parallel training for PyTorch",
    packages=find_packages(include=["dsparallel", "dsparallel.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.9",
    install_requires=["torch>=2.4"],
)
