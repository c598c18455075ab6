"""python -m vitlab.average: one checkpoint of the mean of several, by timm's rule (avg_checkpoints.py: the
element-wise mean in float64, cast back; vitlab.convert.averaging), or a model soup of a sweep's fine-tunes
(vitlab.evaluation.soups).

    python -m vitlab.average run_dir=<run> top_k=3              # a run's 3 best checkpoints by the metric it monitored
    python -m vitlab.average ckpt_paths=[a.ckpt,b.ckpt]          # any checkpoints of one architecture
    python -m vitlab.average method=greedy_soup sweep_dir=<sweep> # the paper's greedy soup of the sweep's jobs
    python -m vitlab.average method=uniform_soup sweep_dir=<sweep>

The result is a checkpoint as vitlab.train writes one, without the training state (optimizer, loops): vitlab.eval,
predict and export take it, and model.pretrained=<file> fine-tunes from it; its `averaged` entry says what it was made
of. A soup's `soup.json` (beside it) lists the ingredients, their validation accuracy, the greedy steps and the soup's
validation and test scores.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from vitlab.cli.entry import entry_point
from vitlab.utils.errors import UserError


def average(cfg: DictConfig) -> dict:
    import torch

    from vitlab.cli.rundir import check_writable
    from vitlab.convert.averaging import average_checkpoints, best_checkpoints
    from vitlab.evaluation.soups import make_soup
    from vitlab.utils.atomic import atomic_write

    soup = cfg.method != "average"
    out = Path(cfg.output) if cfg.output else Path(cfg.paths.output_dir) / ("soup.ckpt" if soup else "averaged.ckpt")
    if out.suffix != ".ckpt":
        raise UserError(f"output {str(out)!r} must end in .ckpt (a checkpoint as vitlab.train writes one)")
    if out.exists() and not cfg.overwrite:
        raise UserError(f"output {str(out)!r} exists; choose another output or set overwrite=true")
    check_writable(out.parent, "output", out)  # before the checkpoints are read
    record: dict = {"method": cfg.method}
    if soup:
        ckpt, record = make_soup(cfg.method, cfg.sweep_dir, cfg.device)
    else:
        chosen = best_checkpoints(cfg.run_dir, cfg.top_k) if cfg.run_dir else [(p, None, None) for p in cfg.ckpt_paths]
        read = {p: c for p, _, c in chosen if c is not None}  # (run_dir's: read once as they were ranked)
        ckpt = average_checkpoints([p for p, _, _ in chosen], use_ema=cfg.use_ema, read=read)
        record |= {"checkpoints": [{"checkpoint": p, "score": s} for p, s, _ in chosen], "use_ema": cfg.use_ema}
    atomic_write(out, lambda f: torch.save(ckpt, f), what="checkpoint")
    record["output"] = str(out)
    (out.parent / ("soup.json" if soup else "average.json")).write_text(json.dumps(record, indent=2))
    made = f"{len(record['soup']['jobs'])} of {len(record['ingredients'])} jobs" if soup else ""
    made = made or f"{len(record['checkpoints'])} checkpoints"
    scores = {k: round(v, 4) for k, v in record.get("soup", {}).items() if k.startswith(("val/acc", "test/acc"))}
    print(f"wrote {out} ({cfg.method} of {made}){f': {scores}' if scores else ''}", flush=True)
    print(f"evaluate it: python -m vitlab.eval ckpt_path={out}", flush=True)
    return record


def check_average(cfg: DictConfig) -> None:
    """What to average, given one way: run_dir with top_k, or ckpt_paths (method=average); sweep_dir (a soup)."""
    from vitlab.utils.cuda import check_device

    check_device("device", cfg.device)
    given = {k for k in ("run_dir", "ckpt_paths", "sweep_dir") if cfg.get(k) is not None}
    if cfg.method != "average":
        if given != {"sweep_dir"}:
            raise UserError(f"method={cfg.method} soups a sweep's jobs: give sweep_dir=<a -m sweep> (and no run_dir or "
                            "ckpt_paths)")  # fmt: skip
        return
    if given not in ({"run_dir"}, {"ckpt_paths"}):
        raise UserError("method=average averages run_dir=<run> top_k=<N> (its N best checkpoints) or "
                        "ckpt_paths=[a.ckpt,b.ckpt,...]: give one of them (sweep_dir is for method=greedy_soup|"
                        "uniform_soup)")  # fmt: skip
    if cfg.run_dir is not None and cfg.top_k is None:
        raise UserError(f"run_dir={cfg.run_dir} needs top_k=<N>: how many of its best checkpoints to average")
    paths = OmegaConf.to_container(cfg.ckpt_paths) if cfg.ckpt_paths is not None else None
    if (cfg.top_k is not None and cfg.top_k < 2) or (paths is not None and len(paths) < 2):
        raise UserError(f"an average of {cfg.top_k if paths is None else len(paths)} checkpoint is that checkpoint: "
                        "give two or more (top_k >= 2, or a ckpt_paths list of two or more)")  # fmt: skip


@entry_point("average", check=check_average)
def main(cfg: DictConfig) -> dict:
    return average(cfg)


if __name__ == "__main__":
    main()
