"""vitlab as a package (issue 66): the wheel built from the repository, installed with --no-deps into a folder outside
the checkout, run from another directory as a user of it runs it: the `vitlab` console script and `python -m
vitlab.train`, a user's own tree with --config-dir, the export's model card; a package without its configs is one
line. The wheel is built once (the `installed` fixture), from a copy of the files a build reads, so nothing is
written into the checkout; the venv's own libraries are used (--no-deps, --no-build-isolation: no network)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from tests.helpers.commands import ROOT

BUILD_FILES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "src", "conf")
TINY = ("trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1", "progress_bar=none")  # fmt: skip


def _pip(*args: str, cwd: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


@pytest.fixture(scope="session")
def installed(tmp_path_factory) -> Path:
    """The folder the wheel was installed into (`pip install --no-deps --target`): vitlab/, hydra_plugins/, bin/."""
    root = tmp_path_factory.mktemp("package")
    source = root / "source"
    source.mkdir()
    for name in BUILD_FILES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(ROOT / name, source / name)
    (source / "conf" / "local" / "default.yaml").write_text("# one machine's own settings: never in a wheel\n")
    _pip("wheel", str(source), "--no-deps", "--no-build-isolation", "-q", "-w", str(root / "wheels"), cwd=root)
    (wheel,) = (root / "wheels").glob("vitlab-*.whl")
    _pip("install", "--no-deps", "-q", "--target", str(root / "site"), str(wheel), cwd=root)
    return root / "site"


def _user_env(site: Path) -> dict:
    """The environment of a project that installed vitlab: its packages on the path, not the checkout."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR")}
    return env | {"PYTHONPATH": str(site), "PYTHONUNBUFFERED": "1"}


def _run(argv: list[str], site: Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=_user_env(site), capture_output=True, text=True, timeout=300)


def _run_dir(r: subprocess.CompletedProcess, cwd: Path) -> Path:
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("run directory: ")]
    run = Path(line.removeprefix("run directory: "))
    assert run.parent == cwd / "outputs" / "train" / "runs"  # where the user started it, not the package
    return run


def test_the_wheel_carries_the_configs_and_the_console_script(installed):
    conf = installed / "vitlab" / "conf"
    shipped = {p.relative_to(conf) for p in conf.rglob("*.yaml")}
    ours = {p.relative_to(ROOT / "conf") for p in (ROOT / "conf").rglob("*.yaml") if p.parent.name != "local"}
    assert shipped == ours  # every config, and no machine's own conf/local/*.yaml
    assert (conf / "local" / "README.md").is_file() and not (conf / "local" / "default.yaml").exists()
    assert all((conf / p).read_bytes() == (ROOT / "conf" / p).read_bytes() for p in ours)
    assert (installed / "hydra_plugins" / "vitlab_user_configs.py").is_file() and (
        installed / "bin" / "vitlab"
    ).is_file()


def test_vitlab_train_and_export_from_another_directory(installed, tmp_path, compose_cfg):
    """`vitlab train` (the console script) for one epoch where a user works; then format=timm of its best checkpoint:
    the model card's test metrics are the run's metrics.json's."""
    from vitlab import export

    r = _run([str(installed / "bin" / "vitlab"), "train", *TINY], installed, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    run = _run_dir(r, tmp_path)
    assert str(installed / "vitlab" / "conf") in (run / ".hydra" / "hydra.yaml").read_text()  # the package's configs
    metrics = json.loads((run / "metrics.json").read_text())
    out = tmp_path / "timm"
    export.export(compose_cfg("export", [f"ckpt_path={metrics['best_checkpoint']}", "format=timm", f"output={out}"]))
    card = ModelCard.load(out / "README.md")
    tested = {k: v for k, v in metrics.items() if k.startswith("test/")}
    assert tested and {e.metric_name: e.metric_value for e in card.data.eval_results} == tested
    assert all(f"| `{k}` | {v!r} |" in card.text for k, v in tested.items())


def test_python_m_vitlab_train_with_a_users_experiment(installed, tmp_path):
    """`python -m vitlab.train --config-dir <theirs> experiment=<theirs>` from another directory: their experiment
    and model (built on ours) train for one epoch; their file named as ours takes its place, said in one line."""
    mine = tmp_path / "my_configs"
    (mine / "experiment").mkdir(parents=True)
    (mine / "model").mkdir()
    (mine / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: my_digits\ntags: [mine]\ntrainer:\n  max_epochs: 1\n"
    )
    (mine / "model" / "my_digits.yaml").write_text("defaults:\n  - vit_digits\n  - _self_\nembed_dim: 32\ndepth: 2\n")
    (mine / "model" / "vit_b16.yaml").write_text("defaults:\n  - vit_digits\n")  # named as ours
    work = tmp_path / "work"
    work.mkdir()
    argv = [sys.executable, "-m", "vitlab.train", "--config-dir", str(mine), "experiment=mine", "test=false", *TINY]
    r = _run(argv, installed, work)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"note: --config-dir {mine}: your model/vit_b16.yaml takes the place of vitlab's" in r.stderr.splitlines()
    config = (_run_dir(r, work) / "config.yaml").read_text()
    assert "embed_dim: 32\n  depth: 2\n" in config and "tags:\n- mine\n" in config


def test_a_package_without_its_configs_is_one_line(installed, tmp_path):
    broken = tmp_path / "site"
    shutil.copytree(installed / "vitlab", broken / "vitlab", ignore=shutil.ignore_patterns("conf"))
    r = _run([sys.executable, "-m", "vitlab.train"], broken, tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: vitlab's configs are neither in the package ({broken / 'vitlab' / 'conf'}) nor in a checkout "
        f"({tmp_path / 'conf'}): install vitlab from its wheel or repository (pip install <wheel or folder>), which "
        "carries them"
    ]
