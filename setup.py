"""Packs the suites and LLM configs into the wheel, so that an installed gacbench finds them without a checkout.

The YAML files stay where they are (tasks/suites, tasks/llm, tasks/math: the one copy); building copies them into
``gacbench/_tasks/`` of the wheel, where :func:`gacbench.bench.validate.suites_dir` looks when no checkout's
tasks/suites sits beside the package. Everything else is declared in pyproject.toml."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
#: the task files packed, relative to tasks/
PACKED = ("suites/*.yaml", "llm/*.yaml", "math/*.jsonl")


class BuildWithTasks(build_py):
    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "gacbench" / "_tasks"
        for pattern in PACKED:
            for src in sorted((HERE / "tasks").glob(pattern)):
                dst = target / src.relative_to(HERE / "tasks")
                dst.parent.mkdir(parents=True, exist_ok=True)
                self.copy_file(str(src), str(dst))


setup(cmdclass={"build_py": BuildWithTasks})
