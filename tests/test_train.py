"""vitlab.train, eval and predict end to end on the embedded digits data (short runs, CPU)."""

import json

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from sklearn.datasets import load_digits

from tests.helpers.callbacks import FirstStep
from tests.helpers.commands import run_cli
from tests.helpers.configs import extra_callback
from vitlab.train import train
from vitlab.training.module import ViTModule

SHORT = ["debug=limit", "progress_bar=none"]
METRICS = ["train/loss", "train/acc", "val/loss", "val/acc", "val/acc_best", "test/loss", "test/acc", "test/acc_top5"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One short training run through the real command line, shared by the tests below."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    # As `make train > log` runs it: progress_bar left to `auto`, output not a terminal.
    r = run_cli("train", "trainer.max_epochs=3", "trainer.limit_test_batches=1.0", f"hydra.run.dir={run_dir}")
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir, json.loads((run_dir / "metrics.json").read_text()), r.stdout + r.stderr


def test_train_writes_config_metrics_checkpoints_and_logs(trained):
    run_dir, metrics, output = trained
    assert all(k in metrics for k in METRICS), sorted(metrics)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["num_classes"] == 10 and saved["model"]["in_chans"] == 1  # resolved wiring
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    header = (run_dir / "csv" / "metrics.csv").read_text().splitlines()[0].split(",")
    for col in (
        "train/loss_step",
        "val/acc_best",
        "lr-AdamW/pg1",
        "train/device/samples_per_sec",
        "train/device/flops_per_sec",
    ):
        assert col in header, col


def test_a_log_file_shows_each_epoch_and_ends_with_where_the_results_are(trained):
    run_dir, metrics, output = trained
    lines = output.strip().splitlines()
    epochs = [line for line in lines if "[vitlab.training.callbacks.standard][INFO] - epoch " in line]
    assert [line.split(" - ")[1].split(" (")[0] for line in epochs] == ["epoch 1/3", "epoch 2/3", "epoch 3/3"]
    assert all("val/acc " in line and "train/loss " in line for line in epochs)
    assert lines[-2:] == [f"run directory: {run_dir}", f"best checkpoint: {metrics['tested_checkpoint']}"]
    assert len(lines) < 30  # no config tree (it is in config.yaml), no model-summary table
    # No warning but those the user can act on (3 epochs are shorter than the default warmup of 5).
    warnings = [line for line in lines if "warn" in line.lower() or "Tip:" in line]
    assert all("warmup of 95 steps is longer than the 57 training steps" in line for line in warnings), warnings
    assert not any("available: False" in line for line in lines)  # Lightning's "no GPU, no TPU" on a CPU run


def test_checkpoint_rebuilds_without_hydra(trained):
    run_dir, metrics, _ = trained
    module = ViTModule.load_from_checkpoint(metrics["tested_checkpoint"], weights_only=True)
    hp = module.hparams
    assert hp["model"]["embed_dim"] == 64 and hp["model"]["num_classes"] == 10
    assert hp["class_names"] == [str(i) for i in range(10)]
    assert hp["data"]["_target_"] == "vitlab.data.DigitsDataModule"
    assert all(type(v) in (dict, list, str, int, float, bool, type(None)) for v in hp.values())


def test_eval_reproduces_the_test_accuracy(trained, tmp_path):
    run_dir, metrics, _ = trained
    r = run_cli(
        "eval", f"ckpt_path={metrics['tested_checkpoint']}", "progress_bar=none", f"hydra.run.dir={tmp_path / 'e'}"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    again = json.loads((tmp_path / "e" / "metrics.json").read_text())
    # (rel 1e-4: on a GPU, TF32 matmuls in two processes differ by ~1e-5 in the loss)
    assert again["test/acc"] == metrics["test/acc"] and again["test/loss"] == pytest.approx(
        metrics["test/loss"], rel=1e-4
    )


def test_predict_prints_top_k(trained, tmp_path):
    _, metrics, _ = trained
    digits = load_digits()
    paths = []
    for i in (0, 1):
        path = tmp_path / f"digit{i}.png"
        Image.fromarray((digits.images[i] * 255 / 16).astype("uint8")).resize((32, 32)).save(path)
        paths.append(str(path))
    r = run_cli(
        "predict",
        f"ckpt_path={metrics['tested_checkpoint']}",
        f"images=[{','.join(paths)}]",
        "top_k=3",
        f"hydra.run.dir={tmp_path / 'p'}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith(str(tmp_path))]
    assert len(lines) == 2 and all(line.count("(") == 3 for line in lines)
    preds = json.loads((tmp_path / "p" / "predictions.json").read_text())
    assert [len(p["top_k"]) for p in preds] == [3, 3] and sum(t["prob"] for t in preds[0]["top_k"]) <= 1.0 + 1e-6


def test_export_onnx_as_typed_predicts_as_the_checkpoint(trained, tmp_path):
    """`python -m vitlab.export ckpt_path=...` from a user's folder: model.onnx in the run directory, whose
    onnxruntime output on a prepared image is the checkpoint's, with the preprocessing in its metadata; a
    second export to the same file is refused."""
    import onnxruntime

    from vitlab.training.run import inference

    _, metrics, _ = trained
    r = run_cli("export", f"ckpt_path={metrics['tested_checkpoint']}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    (path,) = tmp_path.glob("outputs/export/runs/*/model.onnx")
    assert f"wrote {path} (onnx); checked on inputs 2x1x8x8, 1x1x8x8: max |diff|" in r.stdout
    assert "WARN" not in r.stdout + r.stderr and "INFO" not in r.stdout + r.stderr
    module = inference.load_for_inference(metrics["tested_checkpoint"]).eval()
    data = inference.inference_datamodule(module, metrics["tested_checkpoint"])
    images = torch.from_numpy(load_digits().images[:3] * 255 / 16).to(torch.uint8)[:, None]
    x = torch.cat([data.predict_tensor(img) for img in images])
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        torch.testing.assert_close(
            torch.from_numpy(session.run(None, {"images": x.numpy()})[0]), module(x), atol=1e-4, rtol=0
        )
    meta = {k: json.loads(v) for k, v in session.get_modelmeta().custom_metadata_map.items()}
    assert meta["class_names"] == [str(i) for i in range(10)] and meta["preprocessing"]["input_size"] == [1, 8, 8]
    again = run_cli("export", f"ckpt_path={metrics['tested_checkpoint']}", f"output={path}", cwd=tmp_path)
    assert (
        again.returncode == 2
        and again.stderr.strip() == f"error: output '{path}' exists; choose another output or set overwrite=true"
    )


@pytest.mark.parametrize("logger", ["csv", "tensorboard", "wandb"])
def test_loggers(compose_cfg, tmp_path, monkeypatch, logger):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = compose_cfg("train", [*SHORT, f"logger={logger}", "callbacks=none"])
    value = train(cfg)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert value == metrics["val/acc_best"]
    if logger == "csv":
        assert (tmp_path / "csv" / "metrics.csv").is_file()
    elif logger == "tensorboard":
        assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    else:
        import wandb

        assert wandb.run is None  # finished after the job
        (run,) = (tmp_path / "wandb").glob("offline-run-*")
        assert list(run.glob("run-*.wandb"))


def test_ema_checkpoint_tests_and_reloads(compose_cfg, tmp_path):
    cfg = compose_cfg("train", [*SHORT, "callbacks=ema", "callbacks.ema.update_starting_at_step=0"])
    train(cfg)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    ckpt = torch.load(metrics["tested_checkpoint"], weights_only=True)
    assert "current_model_state" in ckpt  # Lightning's EMA callback keeps the raw weights for resuming
    assert not torch.equal(ckpt["state_dict"]["model.head.weight"], ckpt["current_model_state"]["model.head.weight"])


def test_mixup_label_smoothing_layer_decay_and_drop_path_options_train(compose_cfg, tmp_path):
    """Each option reaches the step that trains: the first step's loss is timm's Mixup (MixUp 0.8 / CutMix 1.0, its
    targets smoothed by 0.1) then SoftTargetCrossEntropy, on the same draws, through blocks that drop their paths at
    timm's rates (0 rising to 0.1, each sample's by its row of the global batch); the optimizer's groups have layer
    decay's rates (0.75 a block down from the head); and the run trains to its end."""
    from timm.data import Mixup
    from timm.loss import SoftTargetCrossEntropy

    from vitlab.model.draws import rows_for
    from vitlab.training.objectives.classification import share_seed

    FirstStep.seen.clear()
    cfg = compose_cfg(
        "train",
        [
            *SHORT,
            "objective.mixup.mixup_alpha=0.8",
            "objective.mixup.cutmix_alpha=1.0",
            "objective.label_smoothing=0.1",
            "optim.layer_decay=0.75",
            "model.drop_path_rate=0.1",
            "callbacks=none",
            "logger=csv",
            *extra_callback("first", "FirstStep"),
        ],
    )
    assert 0.0 <= train(cfg) <= 1.0
    seen = FirstStep.seen
    model, depth = seen["model"], cfg.model.depth
    rates = [b.drop_path1.p if hasattr(b.drop_path1, "p") else 0.0 for b in model.blocks]
    assert rates == pytest.approx([0.1 * i / (depth - 1) for i in range(depth)])  # timm's linspace(0, rate, depth)

    torch.set_rng_state(seen["torch"])
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=cfg.model.num_classes)
    with seen["rows"]:  # each sample's stochastic depth by its row of the global batch, as the step drew it
        np.random.seed(share_seed(rows_for(len(seen["x"])).seed, 0))  # MixUp's draws: one process, one share
        x, target = mixup(seen["x"].clone(), seen["y"].clone())
        expected = SoftTargetCrossEntropy()(model.train()(x), target)
    assert not torch.equal(x, seen["x"])  # mixed
    assert seen["loss"].item() == pytest.approx(expected.item(), rel=1e-6)

    lr = {name: rate for names, rate in seen["groups"] for name in names}
    head = lr["head.weight"]
    assert lr["norm.weight"] == pytest.approx(head)
    for i in range(depth):  # timm's layer ids: the embeddings 0, block i is i + 1, the head depth + 1
        assert lr[f"blocks.{i}.mlp.fc1.weight"] == pytest.approx(head * 0.75 ** (depth - i))
    assert lr["patch_embed.proj.weight"] == pytest.approx(head * 0.75 ** (depth + 1))


def test_visualize_a_trained_run(trained, tmp_path):
    run_dir, metrics, _ = trained
    digit = tmp_path / "digit.png"
    Image.fromarray((load_digits().images[7] * 255 / 16).astype("uint8")).save(digit)
    r = run_cli(
        "visualize",
        f"ckpt_path={metrics['tested_checkpoint']}",
        f"image={digit}",
        f"run_dir={run_dir}",
        f"hydra.run.dir={tmp_path / 'v'}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    expected = {
        "learning_curves.png": (1500, 400),
        "patch_grid.png": (400, 400),
        "attention_heads.png": (1200, 300),
        "attention_rollout.png": (600, 300),
        "pos_embed_similarity.png": (300, 300),
        "patch_filters.png": (700, 400),
    }
    for name, size in expected.items():
        with Image.open(tmp_path / "v" / name) as img:
            assert img.format == "PNG" and img.size == size, name
    r = run_cli("visualize", f"run_dir={tmp_path}", f"hydra.run.dir={tmp_path / 'w'}")
    assert r.returncode == 2 and "has no csv/metrics.csv" in r.stderr


def test_any_timm_vit_fine_tunes_from_its_name(compose_cfg, tmp_path, monkeypatch, caplog):
    """model.pretrained=<timm name>: the model is timm's architecture at the run's size and classes, the
    data takes the weights' normalisation and eval crop where the config leaves them null, and the weights
    load (timm's download replaced by random weights of the same model: no network in tests)."""
    import timm

    import vitlab.convert.source as ct
    from vitlab.convert.timm_args import config_from_timm

    name = "vit_small_patch14_reg4_dinov2.lvd142m"
    weights = timm.create_model(name, pretrained=False, img_size=28, num_classes=0).state_dict()
    monkeypatch.setattr(ct, "timm_pretrained_state_dict", lambda source: weights)
    cfg = compose_cfg(
        "train",
        [
            *SHORT,
            "trainer.max_epochs=1",
            "data.batch_size=16",
            "data=fake",
            "data.channels=1",
            f"model.pretrained={name}",
        ]
        + ["model.img_size=28"],  # one epoch of 3 small batches: the wiring is the claim
    )
    assert cfg.data.mean is None and cfg.data.eval_transform.crop_pct is None
    with caplog.at_level("INFO"):
        train(cfg)
    expected = config_from_timm(name, img_size=28, in_chans=1, num_classes=10).to_dict()
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert {k: saved["model"][k] for k in expected} == {**expected, "img_size": 28}
    assert saved["model"]["timm_name"] == "vit_small_patch14_reg4_dinov2" and saved["model"]["reg_tokens"] == 4
    mean, std = timm.models.get_pretrained_cfg(name).mean, timm.models.get_pretrained_cfg(name).std
    assert saved["data"]["mean"] == pytest.approx([sum(mean) / 3]) and saved["data"]["std"] == pytest.approx(
        [sum(std) / 3]
    )
    assert saved["data"]["eval_transform"] == {"crop_pct": 1.0, "crop_mode": "center", "interpolation": "bicubic"}
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("model.pretrained=")]
    assert "timm's architecture (model." in line and "preprocessing of vit_small_patch14_reg4_dinov2.lvd142m" in line
    ckpt = torch.load(json.loads((tmp_path / "metrics.json").read_text())["tested_checkpoint"], weights_only=True)
    assert ckpt["hyper_parameters"]["model"]["embed_dim"] == 384


def test_timm_names_that_cannot_be_fine_tuned_are_named(compose_cfg):
    from vitlab.cli.plans import train_plan
    from vitlab.utils.errors import UserError

    cfg = compose_cfg("train", ["model.pretrained=resnet18", "model.img_size=32"])
    with pytest.raises(
        UserError,
        match="'resnet18' is not an architecture of timm's vision_transformer, deit, eva or naflexvit modules",
    ):
        train_plan(cfg)
    cfg = compose_cfg("train", ["model.pretrained=vit_small_patch14_dinov2.lvd142m"])  # the digits' 8 px
    with pytest.raises(UserError, match=r"model.img_size 8 is not a multiple of the patch size 14 of timm's "):
        train_plan(cfg)


def test_fine_tunes_from_a_folder_as_timm_saves_one(compose_cfg, tmp_path):
    """model.pretrained=local-dir:<folder> (config.json + weights, as timm's save_for_hf or a Hugging Face
    download leaves them): the architecture, its saved arguments and its preprocessing come from the folder,
    offline, and the weights load."""
    import timm
    from omegaconf import OmegaConf
    from timm.models._hub import save_for_hf

    from vitlab.cli.plans import train_plan
    from vitlab.convert.source import load_timm_weights
    from vitlab.convert.timm_args import config_from_timm
    from vitlab.training.run import build

    folder = tmp_path / "siglip"
    theirs = timm.create_model("vit_base_patch16_siglip_224", depth=1, embed_dim=64, num_heads=2, img_size=32)
    save_for_hf(theirs, str(folder), safe_serialization=True)
    overrides = [f"model.pretrained=local-dir:{folder}", "model.img_size=32", "data=fake"]
    plan = train_plan(compose_cfg("train", overrides))
    cfg = OmegaConf.create(plan.config)  # the config as the run saves it
    assert cfg.model.timm_name == "vit_base_patch16_siglip_224" and cfg.model.global_pool == "map"
    expected = config_from_timm("vit_base_patch16_siglip_224", depth=1, embed_dim=64, num_heads=2, img_size=32)
    run_fields = ("img_size", "num_classes")  # the run's: 32 px (a list in timm's), the data's 10 classes
    assert {k: cfg.model[k] for k in expected.to_dict() if k not in run_fields} == {
        k: v for k, v in expected.to_dict().items() if k not in run_fields
    }
    assert cfg.data.mean == [0.5, 0.5, 0.5] and cfg.data.eval_transform.crop_pct == 0.9
    model = build.build_module(plan, build.fit_datamodule(plan)).model
    load_timm_weights(model, cfg.model.pretrained)
    body = {k: v for k, v in model.state_dict().items() if not k.startswith("head.")}  # a new 10-class head
    assert body and all(torch.equal(v, theirs.state_dict()[k]) for k, v in body.items())
    assert model.pretrained_cfg["tag"] == f"local-dir:{folder}"
