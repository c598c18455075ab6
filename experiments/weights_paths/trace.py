"""Which vitlab source files a command passes through on its way to the weights, in order (issue 52, point 2).

PYTHONPATH=<checkout>/src:<checkout> python experiments/weights_paths/trace.py eval|train|predict

Records every call into a vitlab file (sys.setprofile) with the nearest vitlab file up the stack as its caller, and
prints the path through the weights code: the files of convert/ and the files above them that call into them (model/,
data/ and utils/, which they rest on, left out), consecutive repeats folded; import-time module bodies are left out.
`entries` counts the calls into convert/ from above it (the goal: one to resolve the source, one to load the value
into the model built from it). timm's download is replaced by random weights of timm's model without a head
(timm_pretrained_state_dict replaced where the weights code calls it).
"""

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[2]
SRC = ""  # the vitlab package imported (PYTHONPATH): this tree's, or another checkout's to measure it
WEIGHTS = ("convert/",)  # the weights code: where a source is resolved and read
BELOW = ("model/", "data/", "utils/")
NAME = "vit_tiny_patch16_224.augreg_in21k"


def is_weights(f: str) -> bool:
    return f.startswith(WEIGHTS)


class Tracer:
    def __init__(self):
        self.edges: list[tuple[str, str]] = []

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        f = frame.f_code.co_filename
        if not f.startswith(SRC):
            return
        here = f[len(SRC) :]
        up = frame.f_back
        while up is not None and not up.f_code.co_filename.startswith(SRC):
            up = up.f_back
        caller = up.f_code.co_filename[len(SRC) :] if up is not None else "<top>"
        if frame.f_code.co_name == "<module>" or (up is not None and up.f_code.co_name == "<module>"):
            return  # an import's module body: not the call's path
        below = here.startswith(BELOW) or caller.startswith(BELOW)  # what the weights code rests on (model, data)
        if caller != here and not below and (is_weights(here) or is_weights(caller)):
            self.edges.append((caller, here))


def report(edges):
    path: list[str] = []
    returns = 0  # steps back up to a caller (and down again, unless it is the last)
    for caller, callee in edges:
        if not path or path[-1] != caller:
            returns += bool(path)
            path.append(caller)
        path.append(callee)
    folded = [f for i, f in enumerate(path) if i == 0 or path[i - 1] != f]
    entries = [(c, f) for c, f in edges if is_weights(f) and not is_weights(c)]
    print(" -> ".join(folded))
    print(f"{len(set(folded))} files, {len(folded)} steps, {returns} returns up; entries into convert/: {len(entries)}")
    for c, f in entries:
        print(f"  {c} -> {f}")


def compose(name, overrides, tmp):
    """As the entry points see it (tests/conftest.py's compose_cfg): HydraConfig set, writing under `tmp`."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from vitlab.cli.config_tree import config_dir, register_resolvers

    register_resolvers()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = hydra_compose(name, [*overrides, f"paths.root_dir={tmp}", f"paths.output_dir={tmp}"], True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def main(which: str) -> None:
    import importlib

    import timm

    import vitlab

    random = timm.create_model(NAME, pretrained=False, num_classes=0).state_dict()  # timm's "download"
    for module in ("vitlab.convert.weights", "vitlab.convert.source"):
        try:
            found = importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(found, "timm_pretrained_state_dict"):
            real = found.timm_pretrained_state_dict
            found.timm_pretrained_state_dict = lambda name, real=real: real(name) if ":" in name else random
    tmp = Path(tempfile.mkdtemp())
    if which == "eval":
        from vitlab.eval import evaluate as run

        cfg = compose("eval", ["task=knn", "model=vit_ti16", f"model.pretrained={NAME}", "data=digits",
                               "model.img_size=16", "knn.k=[5]"], tmp)  # fmt: skip
    elif which == "train":
        from vitlab.train import train as run

        cfg = compose("train", [f"model.pretrained={NAME}", "model.img_size=16", "data=digits", "trainer.max_epochs=1",
                                "debug=limit", "progress_bar=none"], tmp)  # fmt: skip
    else:
        import timm
        from PIL import Image
        from timm.models._hub import save_for_hf

        from vitlab.predict import predict as run

        model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
                                  num_classes=7)  # fmt: skip
        save_for_hf(model, str(tmp / "model"), safe_serialization=True)
        Image.new("RGB", (40, 30), (10, 200, 30)).save(tmp / "a.png")
        cfg = compose("predict", [f"model.pretrained=local-dir:{tmp / 'model'}", f"images=[{tmp / 'a.png'}]",
                                  "top_k=3"], tmp)  # fmt: skip
    global SRC
    SRC = str(Path(vitlab.__file__).parent) + os.sep
    tracer = Tracer()
    sys.setprofile(tracer)
    try:
        run(cfg)
    finally:
        sys.setprofile(None)
    report(tracer.edges)


if __name__ == "__main__":
    main(sys.argv[1])
