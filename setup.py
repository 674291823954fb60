"""Only here to ship ``sglang_oasis_startup.pth`` at the top of site-packages (pyproject.toml has the rest).

The .pth makes every Python process in the environment run ``sglang_oasis._startup``, which provides
the CPU stand-in for ``sgl_kernel`` before SGLang imports it (see platform/cpu/import_hook.py).
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "sglang_oasis_startup.pth"


class BuildPyWithStartupHook(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(os.path.join("python", PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithStartupHook})
