"""objective=mae (vitlab.training.objectives.mae): pretraining runs from the command line and resumes exactly, its
checkpoint's encoder loads into model.pretrained with only the decoder left out, `objective=mae model.pretrained=<file>`
goes on with the file's decoder (a vitlab checkpoint, or one exported to MAE's format and back), labels are never read
(an unlabeled folder trains), and vitlab.visualize draws its reconstructions."""

import json

import pytest
import torch

from tests.helpers.commands import run_cli
from tests.helpers.runs import assert_same_run, interrupt, resume
from vitlab.convert.source import load_timm_weights
from vitlab.model import ViT, ViTConfig
from vitlab.training.module import ViTModule
from vitlab.training.objectives.mae import MAE
from vitlab.utils.errors import UserError

PRETRAIN = [
    "experiment=mae_pretrain_digits",
    "objective.decoder_depth=1",
    "trainer.max_epochs=2",
    "data.batch_size=128",
    "trainer.deterministic=true",
    "trainer.log_every_n_steps=5",
    "trainer.accelerator=cpu",
    "progress_bar=none",
]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    run = tmp_path_factory.mktemp("mae") / "full"
    r = run_cli("train", *PRETRAIN, f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def test_pretraining_logs_reconstruction_losses_and_keeps_the_best(pretrained):
    metrics = json.loads((pretrained / "metrics.json").read_text())
    assert {"train/loss", "val/loss", "val/loss_best", "test/loss"} <= set(metrics)
    assert not any(k.endswith("acc") for k in metrics)
    assert metrics["val/loss_best"] <= metrics["val/loss"] + 1e-9
    ckpt = torch.load(metrics["best_checkpoint"], weights_only=True, map_location="cpu")
    assert ckpt["hyper_parameters"]["objective"]["decoder_depth"] == 1
    assert any(k.startswith("decoder.decoder_blocks.0.") for k in ckpt["state_dict"])


def test_pretraining_resumes_exactly(pretrained, tmp_path):
    command = interrupt(PRETRAIN, tmp_path, "SIGTERM", 5)
    assert_same_run(pretrained, resume(command, tmp_path))


def test_the_encoder_loads_into_model_pretrained_with_only_the_decoder_left_out(pretrained, caplog):
    best = json.loads((pretrained / "metrics.json").read_text())["best_checkpoint"]
    sd = torch.load(best, weights_only=True, map_location="cpu")["state_dict"]
    encoder = {k.removeprefix("model."): v for k, v in sd.items() if k.startswith("model.")}
    module = ViTModule.load_from_checkpoint(best, weights_only=True)
    network = {f"{p}.{k}" for p, m in (("model", module.model), ("decoder", module.decoder)) for k in m.state_dict()}
    left_out_weights = sorted({k for k in sd if k in network and not k.startswith("model.")})
    assert left_out_weights and all(k.startswith("decoder.") for k in left_out_weights)

    cfg = ViTConfig.from_dict(module.model.cfg.to_dict() | {"num_classes": 10})  # a classifier to fine-tune
    model = ViT(cfg)
    with caplog.at_level("INFO"):
        load_timm_weights(model, best)
    assert "left out its MAE decoder (mask_token, decoder_embed.*, decoder_blocks.*" in caplog.text
    mine = model.state_dict()
    assert set(mine) - set(encoder) == {"head.weight", "head.bias"}  # the new head, nothing else
    assert all(torch.equal(mine[k], v) for k, v in encoder.items())


@pytest.mark.parametrize("via", ["vitlab checkpoint", "exported to MAE's format"])
def test_objective_mae_with_model_pretrained_goes_on_with_the_decoder(pretrained, compose_cfg, tmp_path, via, caplog):
    """`objective=mae model.pretrained=<file>`: the encoder and the decoder are the file's (the run's own .ckpt, or
    `vitlab.export format=mae`'s MAE-named .pth of it), the step where pretraining goes on from."""
    from vitlab import export
    from vitlab.cli.plans import train_plan
    from vitlab.training.run import build, resume

    best = json.loads((pretrained / "metrics.json").read_text())["best_checkpoint"]
    source = best
    if via != "vitlab checkpoint":
        source = str(tmp_path / "mae.pth")
        report = export.export(compose_cfg("export", [f"ckpt_path={best}", "format=mae", f"output={source}"]))
        assert report["format"] == "mae" and list(torch.load(source, weights_only=True)) == ["model"]
    cfg = compose_cfg("train", [*PRETRAIN, f"model.pretrained={source}"], output_dir=tmp_path / "run")
    plan = train_plan(cfg)
    with caplog.at_level("INFO"):
        module = build.build_module(plan, build.fit_datamodule(plan))  # the weights it starts from loaded
    assert resume.starting_point(plan, module) is None  # a new run, not a resumption
    assert "with its MAE decoder" in caplog.text
    trained = ViTModule.load_from_checkpoint(best, weights_only=True)
    for mine, theirs in ((module.model, trained.model), (module.decoder, trained.decoder)):
        assert mine.state_dict().keys() == theirs.state_dict().keys()
        assert all(torch.equal(v, theirs.state_dict()[k]) for k, v in mine.state_dict().items())


def test_a_token_pooled_encoder_fine_tunes_with_average_pooling_as_mae_does(pretrained):
    best = json.loads((pretrained / "metrics.json").read_text())["best_checkpoint"]
    module = ViTModule.load_from_checkpoint(best, weights_only=True)
    cfg = ViTConfig.from_dict(module.model.cfg.to_dict() | {"num_classes": 10, "global_pool": "avg", "fc_norm": True})
    model = ViT(cfg)
    fresh = model.fc_norm.weight.clone()
    load_timm_weights(model, best)
    assert torch.equal(model.blocks[0].attn.qkv.weight, module.model.blocks[0].attn.qkv.weight)
    assert torch.equal(model.fc_norm.weight, fresh)  # MAE's main_finetune: the final norm dropped, fc_norm new


def test_labels_are_never_read():
    module = ViTModule(
        model=ViTConfig(img_size=8, patch_size=2, in_chans=1, num_classes=0, embed_dim=16, depth=1, num_heads=2),
        objective={"name": "mae", "decoder_embed_dim": 8, "decoder_depth": 1, "decoder_num_heads": 2},
    )
    x = torch.randn(4, 1, 8, 8)
    losses = []
    for labels in (torch.zeros(4, dtype=torch.long), None):
        torch.manual_seed(0)
        losses.append(module.loss(x, labels)[0].item())
    assert losses[0] == losses[1]
    with pytest.raises(UserError, match="model.num_classes is 10"):
        ViTModule(
            model=ViTConfig(img_size=8, patch_size=2, in_chans=1, num_classes=10, embed_dim=16, depth=1, num_heads=2),
            objective={"name": "mae"},
        )


def test_compile_compiles_the_blocks_the_pretraining_step_runs():
    tiny = ViTConfig(img_size=8, patch_size=2, in_chans=1, num_classes=0, embed_dim=16, depth=2, num_heads=2)
    mae = {"name": "mae", "decoder_embed_dim": 8, "decoder_depth": 1, "decoder_num_heads": 2}
    module = ViTModule(model=tiny, compile=True, objective=mae)
    assert isinstance(module.objective, MAE)
    module.objective.compile(module.model, module.compile_mode)
    blocks = [*module.model.blocks, *module.decoder.decoder_blocks]
    assert len(blocks) == 3 and all(b._compiled_call_impl is not None for b in blocks)
    assert set(module.state_dict()) == set(ViTModule(model=tiny, objective=mae).state_dict())


def test_an_unlabeled_folder_pretrains_and_is_refused_for_classification(tmp_path):
    from PIL import Image

    for split, n in (("train", 6), ("val", 3)):
        for i in range(n):
            folder = tmp_path / "photos" / split / ("nested/deeper" if i % 2 else "")
            folder.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (20, 16), (40 * i, 10, 200)).save(folder / f"{i}.png")
    data = [
        "data=imagefolder",
        f"data.data_dir={tmp_path / 'photos'}",
        "data.unlabeled=true",
        "data.num_classes=0",
        "data.batch_size=2",
        "data.num_workers=0",
    ]
    small = ["model.img_size=16", "model.patch_size=4", "model.embed_dim=16", "model.depth=1", "model.num_heads=2"]
    r = run_cli(
        "train",
        "experiment=mae_pretrain_digits",
        *data,
        *small,
        "trainer.max_epochs=1",
        f"hydra.run.dir={tmp_path / 'r'}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "6 train, 3 val images unlabeled" in r.stdout + r.stderr
    assert "val/loss_best" in json.loads((tmp_path / "r" / "metrics.json").read_text())
    refused = run_cli("train", *data, f"hydra.run.dir={tmp_path / 'c'}")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        "error: data.unlabeled=true has no labels to learn from: pretrain on it with objective=mae or dino"
    )


def test_visualize_draws_the_reconstructions(pretrained, tmp_path):
    best = json.loads((pretrained / "metrics.json").read_text())["best_checkpoint"]
    r = run_cli("visualize", f"ckpt_path={best}", "num_images=3", f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"wrote {tmp_path / 'mae_reconstructions.png'}" in r.stdout
    assert (tmp_path / "mae_reconstructions.png").stat().st_size > 5000
