"""The wheel carries the compiled native kernels (aqua_export/_native: the loader and one library per instruction-set
variant, plugins/ort/build.sh), so `pip install` of it needs no compiler and no download. Everything else about the
package is in pyproject.toml."""

import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent


class BuildKernels(build_py):
    """build_py, after compiling the kernels into the package (CMake rebuilds only what changed)."""

    def run(self):
        subprocess.run(["bash", str(ROOT / "plugins/ort/build.sh"), str(ROOT / "aqua_export/_native")], check=True,
                       stdout=sys.stderr)
        super().run()


class Kernels(Distribution):
    def has_ext_modules(self):  # a platform wheel: the kernels are machine code
        return True


class PlatformWheel(bdist_wheel):
    def get_tag(self):  # the kernels use ONNX Runtime's C API, not Python's: any Python 3, this platform
        return "py3", "none", super().get_tag()[2]


setup(cmdclass={"build_py": BuildKernels, "bdist_wheel": PlatformWheel}, distclass=Kernels)
