"""A timm folder published (`vitlab.export format=timm`, convert/timm_dir.py): its model card, README.md in the Hugging
Face Hub's model-card format (YAML metadata, then the architecture, the run's test metrics from its metrics.json, the
training config, the parity check against timm, and the lines that load it), and its upload to the Hub.

The card is written inside the folder before the folder is put in place (timm_dir.save_timm_dir's `card`), so a
folder never lacks it. The upload is one commit of the whole folder (huggingface_hub's upload_folder): the Hub shows
all of it or none; offline or without a token it is refused in one line before anything is exported.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vitlab.utils.errors import OfflineError, UserError

log = logging.getLogger(__name__)
TAGS = ["image-classification", "timm", "vitlab", "vision-transformer"]
# A metric's name in metrics.json (after its split) -> the Hub's metric type (model-index)
METRIC_TYPES = {"acc": "accuracy", "acc_top5": "top_5_accuracy", "loss": "loss"}


@dataclass
class Run:
    """What the training run that made a checkpoint left beside it: metrics.json and config.yaml (none where the
    checkpoint is not in a run's checkpoints/ folder)."""

    run_dir: Path | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of_checkpoint(cls, ckpt_path: str | Path) -> Run:
        import yaml

        ckpt = Path(ckpt_path).resolve()
        run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
        if not (run_dir / "metrics.json").is_file():
            return cls()
        config = run_dir / "config.yaml"
        return cls(
            run_dir,
            json.loads((run_dir / "metrics.json").read_text()),
            yaml.safe_load(config.read_text()) if config.is_file() else {},
        )

    def test_metrics(self) -> dict[str, float]:
        """The run's test metrics (`test/...`), as metrics.json holds them."""
        return {k: v for k, v in self.metrics.items() if k.startswith("test/") and isinstance(v, (int, float))}


def check_can_push(repo_id: str) -> None:
    """Before anything is exported: a repo id of the Hub's form, the network allowed, a token found where
    huggingface_hub looks (HF_TOKEN, or the file `hf auth login` writes)."""
    from huggingface_hub import constants, get_token

    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise UserError(f"push_to_hub {repo_id!r} is not a Hub repo id: give <user or organization>/<name>")
    if constants.is_offline_mode():
        raise OfflineError(
            f"push_to_hub={repo_id}: huggingface_hub is offline (HF_HUB_OFFLINE=1); nothing was exported or uploaded"
        )
    if get_token() is None:
        raise UserError(
            f"push_to_hub={repo_id} needs a Hugging Face token: set HF_TOKEN or run `hf auth login`; nothing was "
            "exported or uploaded"
        )


def card_writer(
    ckpt_path: str | Path, out: Path, repo_id: str | None = None, license: str | None = None, datasets: Any = None
) -> Callable[[dict[str, Any], dict[str, Any]], str]:
    """`card(config, checked)` for timm_dir.save_timm_dir: the model card of the folder `out` exported from
    `ckpt_path` (its run read now), naming the folder as timm loads it: from the Hub where it is pushed to `repo_id`,
    which is checked first (check_can_push: before anything is exported)."""
    if repo_id:
        check_can_push(repo_id)
    run = Run.of_checkpoint(ckpt_path)
    source = f"hf-hub:{repo_id}" if repo_id else f"local-dir:{Path(out).resolve()}"
    datasets = list(datasets or []) or None

    def card(config: dict[str, Any], checked: dict[str, Any]) -> str:
        return model_card(config, checked, run, source=source, license=license, datasets=datasets)

    return card


def push_folder(folder: Path, repo_id: str | None, private: bool = False, revision: str | None = None) -> str | None:
    """Upload `folder` to the Hub model repo `repo_id` (made if missing, `private` then) in one commit on `revision`
    (a branch, made from main if missing); the commit's URL (None: no repo_id, nothing pushed). A failure is one
    line that says nothing was committed and where the folder is: the Hub's refusal (UserError), or a Hub that cannot
    be reached (OfflineError: whichever HTTP stack huggingface_hub runs on, utils.downloads.looks_offline)."""
    if not repo_id:
        return None
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    from vitlab.utils.downloads import looks_offline

    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id, folder_path=folder, revision=revision, commit_message=f"vitlab export of {folder.name}"
        )
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        kept = f"nothing was committed to the Hub, the folder is in {folder}"
        if looks_offline(e):  # (before OSError: requests' ConnectionError is one)
            again = f"hf upload {repo_id} {folder}" + (f" --revision {revision}" if revision else "")
            raise OfflineError(
                f"push_to_hub={repo_id} failed: the Hub ({constants.ENDPOINT}) cannot be reached "
                f"({type(e).__name__}: {first}); {kept}: upload it once online with `{again}`"
            ) from e
        if not isinstance(e, (HfHubHTTPError, OfflineModeIsEnabled, OSError)):
            raise  # (a bug keeps its traceback)
        raise UserError(f"push_to_hub={repo_id} failed ({first or type(e).__name__}); {kept}") from e
    log.info("pushed %s to the Hub: timm.create_model('hf-hub:%s', pretrained=True) (%s)", folder, repo_id,
             commit.commit_url)  # fmt: skip
    return commit.commit_url


def model_card(
    config: dict[str, Any],
    checked: dict[str, Any],
    run: Run,
    *,
    source: str,
    license: str | None = None,
    datasets: list[str] | None = None,
) -> str:
    """README.md of a timm folder. `config`: its config.json; `checked`: timm's read-back (architecture,
    max_abs_diff, atol, parameters); `source`: how timm names the folder (`hf-hub:<repo id>`, `local-dir:<folder>`)."""
    from huggingface_hub import ModelCard, ModelCardData

    name = source.split(":", 1)[1].rstrip("/").rsplit("/", 1)[-1]
    data = ModelCardData(
        library_name="timm",
        license=license,
        tags=TAGS,
        datasets=datasets or None,
        pipeline_tag="image-classification",
        model_name=name,
        eval_results=_eval_results(run, datasets) or None,
    )
    parts = [
        f"# {name}\n\nA Vision Transformer trained with vitlab (PyTorch Lightning + Hydra), saved in timm's format.",
        _architecture(config, checked.get("parameters")),
        _results(run),
        _training(run),
        _parity(config, checked, source),
        _usage(source),
    ]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(parts) + "\n"))


def _eval_results(run: Run, datasets: list[str] | None) -> list[Any]:
    from huggingface_hub import EvalResult

    dataset = (datasets or [_data_name(run.config)])[0]
    return [
        EvalResult(
            task_type="image-classification",
            dataset_type=dataset,
            dataset_name=dataset,
            dataset_split="test",
            metric_type=METRIC_TYPES.get(key.removeprefix("test/"), key.removeprefix("test/")),
            metric_name=key,
            metric_value=value,
        )  # fmt: skip
        for key, value in run.test_metrics().items()
    ]


def _data_name(config: dict[str, Any]) -> str:
    """The data a run trained on, by name: a Hub dataset's id (data=hf), else its module (DigitsDataModule)."""
    data = config.get("data") or {}
    if data.get("name"):
        return str(data["name"])
    return str(data.get("_target_", "unknown")).rsplit(".", 1)[-1]


def _architecture(config: dict[str, Any], params: int | None) -> str:
    args, pre = config["model_args"], config["pretrained_cfg"]
    rows = [
        ("timm architecture", f"`{config['architecture']}` with config.json's `model_args`"),
        ("input", "x".join(map(str, pre["input_size"])) + f", patch {'x'.join(map(str, args['patch_size']))}"),
        ("width, depth, heads", f"{args['embed_dim']}, {args['depth']}, {args['num_heads']}"),
        ("classes", str(config["num_classes"])),
        ("parameters", f"{params:,}" if params is not None else "?"),
        ("eval transform", f"{pre.get('crop_mode', 'center')} crop {pre.get('crop_pct')}, {pre.get('interpolation')}, "
                           f"mean {pre.get('mean')}, std {pre.get('std')}"),
    ]  # fmt: skip
    return "## Architecture\n\n" + _table(("", ""), rows)


def _results(run: Run) -> str:
    metrics = run.test_metrics()
    if not metrics:
        why = "its run was not tested" if run.run_dir else "no run directory (metrics.json) beside the checkpoint"
        return f"## Results\n\nNo test metrics: {why}."
    split = (run.metrics.get("splits") or {}).get("test")
    on = f" on the test split ({split})" if split else ""
    rows = [(f"`{k}`", repr(v)) for k, v in metrics.items()]
    return f"## Results\n\nThe run's test metrics{on}, from its metrics.json:\n\n" + _table(("metric", "value"), rows)


def _training(run: Run) -> str:
    c = run.config
    if not c:
        return "## Training\n\nThe run's config.yaml was not found beside the checkpoint."
    model, optim, trainer, data = (c.get(k) or {} for k in ("model", "optim", "trainer", "data"))
    rows = [
        ("objective", (c.get("objective") or {}).get("name")),
        ("data", f"{_data_name(c)}, {data.get('img_size')} px, batch {data.get('batch_size')}"),
        ("started from", model.get("pretrained") or "scratch"),
        *_adapted(c.get("peft") or {}),
        ("optimizer", f"{optim.get('name')}, lr {optim.get('lr')}, weight decay {optim.get('weight_decay')}"),
        ("schedule", (c.get("scheduler") or {}).get("name")),
        ("epochs", trainer.get("max_epochs")),
        ("precision", trainer.get("precision")),
        ("seed", c.get("seed")),
    ]  # fmt: skip
    return "## Training\n\n" + _table(("", ""), [(k, str(v)) for k, v in rows])


def _adapted(peft: dict[str, Any]) -> list[tuple[str, str]]:
    """A peft= run's row: what trained beside the frozen base "started from" names, merged into these weights."""
    method, whole = peft.get("method", "none"), ", ".join(peft.get("trainable") or []) or "nothing"
    if method in ("lora", "dora"):
        extra = " (rsLoRA scaling)" if peft.get("use_rslora") else ""
        what = (f"{method.replace('dora', 'DoRA').replace('lora', 'LoRA')} rank {peft.get('rank')}, alpha "
                f"{peft.get('alpha')}{extra} on {', '.join(peft.get('targets') or [])}")  # fmt: skip
    elif method == "bitfit":
        what = "BitFit: the biases and norms"
    elif method == "partial":
        what = ", ".join([f"the last {peft.get('blocks')} blocks and the final norm", *(peft.get("names") or [])])
    else:
        return []
    return [("fine-tuned (peft)", f"{what}; trained whole: {whole}; merged into these weights, the rest the base's")]


def _parity(config: dict[str, Any], checked: dict[str, Any], source: str) -> str:
    return (
        f"## Parity with timm\n\n`timm.create_model('{source}', pretrained=True)` builds timm's own "
        f"`{config['architecture']}` with these weights; at export its logits were "
        f"{checked['max_abs_diff']:.3g} at most from vitlab's (tolerance {checked['atol']:g})."
    )


def _usage(source: str) -> str:
    return (
        "## Use\n\n```python\nimport timm\n\n"
        f'model = timm.create_model("{source}", pretrained=True).eval()\n'
        "transform = timm.data.create_transform(**timm.data.resolve_data_config(model=model))\n```\n\n"
        "```python\nimport vitlab\n\n"
        f'model = vitlab.create_model("{source}", pretrained=True).eval()\n```\n\n'
        f"```\npython -m vitlab.predict model.pretrained={source} images=[photo.jpg]\n```"
    )


def _table(header: tuple[str, str], rows: list[tuple[str, str]]) -> str:
    lines = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    return "\n".join(lines + [f"| {a} | {b} |" for a, b in rows])
