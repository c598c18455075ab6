"""The wheel carries the configs: build_py copies the repository's conf/ (the one source) into the package as
vitlab/conf/, where vitlab.cli.config_tree.config_dir finds them once installed. An editable install reads conf/ in
place (no copy). Everything else about the package is in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CONF = Path(__file__).resolve().parent / "conf"


class BuildWithConfigs(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        into = Path(self.build_lib) / "vitlab" / "conf"
        shutil.rmtree(into, ignore_errors=True)
        shutil.copytree(CONF, into, ignore=_not_shipped)


def _not_shipped(folder: str, names: list[str]) -> list[str]:
    """conf/local/*.yaml are one machine's own settings (git ignores them), never shipped; nor are caches."""
    local = Path(folder).resolve() == CONF / "local"
    return [n for n in names if (local and n.endswith(".yaml")) or n == "__pycache__"]


setup(cmdclass={"build_py": BuildWithConfigs})
