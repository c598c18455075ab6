"""The config tree: where conf/ is (vitlab's, and a user's `--config-dir` searched before it), and the resolvers its
files use (`${run_id:}`, `${cwd:}`, `${class_folders:...}`, `${shard_classes:...}`, and the Slurm job's
`${slurm_gpus:...}`/`${slurm_cpus:...}`), registered before Hydra composes a config."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from vitlab.utils.errors import MissingFileError, UserError


def config_dir() -> Path:
    """vitlab's config tree, the one lookup: the package's own conf/ (vitlab/conf/, where a wheel installs the
    repository's conf/: setup.py), else conf/ at the repository root beside src/ (a checkout, an editable install);
    whatever the working directory. A user's own tree goes beside it with `--config-dir` (`user_config_dir`)."""
    package, checkout = Path(__file__).resolve().parents[1] / "conf", Path(__file__).resolve().parents[3] / "conf"
    for here in (package, checkout):
        if (here / "train.yaml").is_file():
            return here
    raise MissingFileError(
        f"vitlab's configs are neither in the package ({package}) nor in a checkout ({checkout}): install vitlab "
        "from its wheel or repository (pip install <wheel or folder>), which carries them"
    )


# `--config-dir <dir>` of the command line (read_user_config_dir): a user's tree whose files come before ours.
_user_dir: list[Path] = []


def user_config_dir() -> Path | None:
    """The user's config tree the command line named (`--config-dir`), searched before vitlab's own by Hydra
    (hydra_plugins/vitlab_user_configs.py), or None."""
    return _user_dir[0] if _user_dir else None


def read_user_config_dir(argv: list[str]) -> Path | None:
    """`--config-dir <dir>` (`--config-dir=<dir>`, `-cd <dir>`) of `argv`, Hydra's flag, made the tree searched
    before vitlab's; a folder that is not there refused in one line. Hydra itself would put the folder after ours (a
    file of the same name as ours never read) and report a missing one with a traceback."""
    given = None
    _user_dir.clear()
    for i, arg in enumerate(argv):
        if arg in ("--config-dir", "-cd") and i + 1 < len(argv):
            given = argv[i + 1]
        elif arg.startswith("--config-dir="):
            given = arg.partition("=")[2]
        if given == "" or arg in ("--config-dir", "-cd") and i + 1 == len(argv):  # (Hydra's argparse: its usage)
            raise UserError(f"{arg.partition('=')[0]} needs a folder: --config-dir <dir>, the folder of your config "
                            "files (experiment/, model/, data/, ... as in vitlab's conf/)")  # fmt: skip
    if given is None:
        return None
    path = Path(given).expanduser().resolve()
    if not path.is_dir():
        raise MissingFileError(
            f"--config-dir {given!r} is not a folder; give the folder of your config files (experiment/, model/, "
            "data/, ... as in vitlab's conf/)"
        )
    _user_dir.append(path)
    return path


def without_config_dir(argv: list[str]) -> list[str]:
    """`argv` less `--config-dir <dir>` (`--config-dir=<dir>`, `-cd <dir>`): its overrides and other flags."""
    rest, skip = [], False
    for arg in argv:
        if skip or arg.startswith("--config-dir="):
            skip = False
            continue
        skip = arg in ("--config-dir", "-cd")
        if not skip:
            rest.append(arg)
    return rest


def shadowing_note() -> str | None:
    """One line naming the files of the user's --config-dir that take the place of vitlab's of the same name
    (`model/vit_b16.yaml`), or None."""
    user = user_config_dir()
    if user is None:
        return None
    ours = config_dir()
    names = sorted(str(p.relative_to(user)) for p in user.rglob("*.yaml") if (ours / p.relative_to(user)).is_file())
    if not names:
        return None
    return f"note: --config-dir {user}: your {', '.join(names)} take{'s' * (len(names) == 1)} the place of vitlab's"


def yaml_error(e: Exception) -> UserError:
    """A YAML file that does not parse (an unclosed `[`, a tab in the indent) as one line naming the file, the line and
    the column (1-based, as an editor counts them), instead of PyYAML's traceback from inside Hydra."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    if mark is None:
        return UserError(f"a config file is not valid YAML: {' '.join(str(e).split())}")
    problem = getattr(e, "problem", None) or "not valid YAML"
    if r"'\t'" in problem:  # (PyYAML's words: "found character '\t' that cannot start any token")
        problem = "a tab, which YAML does not take where it reads indentation or a token: indent with spaces"
    context, at = getattr(e, "context", None), getattr(e, "context_mark", None)
    opened = (
        f" ({context} begun at line {at.line + 1}, column {at.column + 1})" if context and at and at != mark else ""
    )
    return UserError(f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}: {problem}{opened}")


def _new_run_id() -> str:
    return f"{os.getpid()}-{secrets.token_hex(3)}"


def register_resolvers() -> None:
    """`${run_id:}`: process id + random hex, cached per config (a sweep's jobs share it, as `now`).
    `${cwd:}`: the directory the command was started in. Hydra's `${hydra:runtime.cwd}` says the same
    but only inside a job: a sweep resolves hydra.sweep.dir before any job exists."""
    if not OmegaConf.has_resolver("run_id"):
        OmegaConf.register_new_resolver("run_id", _new_run_id, use_cache=True)
    if not OmegaConf.has_resolver("cwd"):
        OmegaConf.register_new_resolver("cwd", os.getcwd)
    if not OmegaConf.has_resolver("class_folders"):
        OmegaConf.register_new_resolver("class_folders", class_folders)
    named = (("slurm_gpus", slurm_gpus), ("slurm_cpus", slurm_cpus), ("shard_classes", shard_classes),
             ("data_classes", data_classes))  # fmt: skip
    for name, resolver in named:
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)


def shard_classes(data_dir: str) -> int:
    """`${shard_classes:<data_dir>}`: the number of classes of the shards `python -m vitlab.pack` wrote there."""
    from vitlab.data.streaming import shard_classes as count

    return count(data_dir)


def data_classes(*, _parent_) -> int:
    """`${data_classes:}`: the number of classes of the data a data=hf, list or wds config names, so the model's head
    is sized from the data: counted by vitlab.data.indexes (before torch and Lightning are imported: a missing list or
    shard is refused within a second), or by the `count_classes` of another target's module, given the config's keys
    each takes."""
    import inspect

    from vitlab.data.formats import class_count
    from vitlab.utils.errors import UserError

    if missing := [str(k) for k in _parent_ if OmegaConf.is_missing(_parent_, k)]:  # (before the module's import)
        raise UserError(
            f"data.{missing[0]} must be given: this data config ({_parent_._target_}) has no default for it "
            f"(data.{missing[0]}=...)"
        )
    count = class_count(str(_parent_._target_))
    if count is None:
        from hydra.utils import get_object

        count = inspect.getmodule(get_object(str(_parent_._target_))).count_classes
    keys = [k for k in inspect.signature(count).parameters if k in _parent_]
    return count(**{k: _parent_[k] for k in keys})


def class_folders(data_dir: str) -> int:
    """`${class_folders:<data_dir>}`: the number of class folders in data_dir/train, as torchvision's
    ImageFolder will find them, so the model's head is sized from the data without a count to type. A data_dir of
    class folders alone (no train/ nor val/: ImageNet's val/ as timm's validate.py takes it, on which `vitlab.eval
    task=test` scores timm's weights) counts its own; training on one stops when its train/ is looked for."""
    root, train = Path(data_dir), Path(data_dir) / "train"
    if not root.is_dir():
        raise MissingFileError(f"data.data_dir {str(data_dir)!r} does not exist")
    if not train.is_dir() and not (root / "val").is_dir() and any(e.is_dir() for e in os.scandir(root)):
        return sum(1 for entry in os.scandir(root) if entry.is_dir())
    if not train.is_dir():
        raise MissingFileError(
            f"image folder split {str(train)!r} does not exist (expected {data_dir}/train/<class>/... "
            f"and {data_dir}/val/<class>/...)"
        )
    return sum(1 for entry in os.scandir(train) if entry.is_dir())


# ---- the resources of a Slurm job (conf/hydra/launcher/slurm.yaml) ----


def _gpus_in_cluster() -> bool:
    """Whether any node of the cluster has GPUs (sinfo's generic resources), asked from the submitting machine."""
    if not shutil.which("sinfo"):
        return False
    out = subprocess.run(["sinfo", "-h", "-o", "%G"], capture_output=True, text=True, timeout=30).stdout
    return "gpu" in out


def slurm_gpus(accelerator: str, devices: Any) -> int | None:
    """`${slurm_gpus:<accelerator>,<devices>}`: the GPUs a job asks for per node. The trainer's devices when it
    trains on GPUs, none on the CPU (a gres request for GPUs fails on a cluster without them); with `auto`, GPUs
    when the cluster has any."""
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and _gpus_in_cluster())
    return devices if on_gpu and isinstance(devices, int) and devices > 0 else None


def slurm_cpus(num_workers: int | None) -> int:
    """`${slurm_cpus:<data.num_workers>}`: a task's CPUs, its loader workers and itself. Workers left to vitlab
    (null) take the CPUs the task gets, less one: 8 CPUs then, a usual share of a GPU node per GPU."""
    return 8 if num_workers is None else int(num_workers) + 1


def groups_read(config_name: str) -> list[str]:
    """The config groups `config_name`'s defaults list names (conf/<command>.yaml): those its command reads."""
    defaults = OmegaConf.load(config_dir() / f"{config_name}.yaml").get("defaults") or []
    named = [next(iter(d)) for d in defaults if OmegaConf.is_dict(d)]
    return sorted({n.split()[-1] for n in named} - {"hydra"})


def refuse_unread_groups(config_name: str, overrides: list[str]) -> None:
    """A config group the command does not read (`+optim=sgd`, `+hparams_search=...` on vitlab.eval), with or without
    `+`, refused in one line: Hydra would add it unread (or, without `+`, advise adding it)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from vitlab.utils.errors import fail

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return  # Hydra reports a malformed override itself
    groups = {p.name for p in config_dir().iterdir() if p.is_dir()}
    read = groups_read(config_name)
    for o in parsed:
        group = o.key_or_group.split("/")[0]
        if group in groups and group not in read and "." not in o.key_or_group:
            fail(f"{o.input_line}: vitlab.{config_name} does not read the {group} group (the groups it reads: {read})")
