"""python -m vitlab.visualize [ckpt_path=<ckpt>] [image=<file>] [run_dir=<run>]: PNG figures.

- ckpt_path + image: the patch grid over the image, the last block's class-token attention per
  head, and attention rollout over all blocks (Abnar & Zuidema 2020), overlaid on the image;
- ckpt_path: the cosine similarity of each patch's position embedding with all others (ViT paper,
  Figure 7) and the principal components of the patch-embedding filters (Figure 7, left);
- ckpt_path of an MAE pretraining run (objective=mae): its reconstructions of `num_images` test images (original,
  masked input, prediction, prediction with the visible patches);
- run_dir: the learning curves (loss, accuracy, learning rate) from the run's CSV log;
- what=views data=<name> model=<name> objective=<dino|classify|distill|mae>: what training shows the model, the views of
  `num_images` training images (each drawn `draws` times): views.png and views.json (evaluation/views.py).
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from vitlab.cli.entry import entry_point


def check_views(cfg: DictConfig) -> None:
    """what=views: an objective whose views are drawn, named before the data is read."""
    from vitlab.evaluation.views import view_kind

    name = cfg.objective.get("name") if cfg.what == "views" else None
    if name is not None:
        view_kind(name)


@entry_point("visualize", check=check_views)
def main(cfg: DictConfig) -> None:
    from vitlab.data.images import read_image
    from vitlab.evaluation.figures import plot_attention, plot_embeddings, plot_learning_curves, plot_reconstructions
    from vitlab.model.config import vit_config
    from vitlab.training.objectives.mae import MAE
    from vitlab.training.run import build, inference

    out = Path(cfg.paths.output_dir)
    written = []
    if cfg.what == "views":
        from vitlab.evaluation.views import draw_views, view_kind
        from vitlab.model.config import vit_config

        objective = OmegaConf.to_container(cfg.objective, resolve=True)
        dm = build.build_datamodule(cfg.data, **build.data_views(cfg.data, objective, vit_config(cfg.model)))
        masked = view_kind(cfg.objective.name) == "masked"  # MAE's: the patches its encoder does not see
        # (patch_size from the model's variant where the group leaves it null: model=vit_s16, eva02_ti14)
        mae = (vit_config(cfg.model).patch_hw, cfg.objective.mask_ratio) if masked else None
        written += draw_views(dm, cfg.objective.name, cfg.num_images, cfg.draws, out, mae=mae)
    if cfg.ckpt_path:
        module = inference.load_for_inference(cfg.ckpt_path).eval()
        img = read_image(cfg.image, module.model.cfg.in_chans) if cfg.image else None  # before any figure
        written += plot_embeddings(module.model, out).values()
        if img is not None:
            dm = inference.inference_datamodule(module, cfg.ckpt_path)
            x = dm.predict_tensor(img)
            written += plot_attention(module.model, x, dm.mean, dm.std, out).values()
        if isinstance(module.objective, MAE):  # an MAE pretraining run's checkpoint
            dm = inference.inference_datamodule(module, cfg.ckpt_path)
            x = dm.first_images("test", cfg.num_images)
            written.append(
                plot_reconstructions(
                    module.model, module.objective, x, dm.mean, dm.std, out / "mae_reconstructions.png"
                )
            )
    if cfg.run_dir:
        written.append(plot_learning_curves(cfg.run_dir, out / "learning_curves.png"))
    for path in written:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
