import re

import pytest
import torch
from PIL import Image

from tests.helpers.configs import tiny
from vitlab.evaluation.figures import attention_rollout, plot_attention, plot_embeddings
from vitlab.model import ViT


def _png_size(path):
    with Image.open(path) as img:
        assert img.format == "PNG"
        return img.size


def test_attention_maps_and_rollout_are_distributions_over_keys():
    torch.manual_seed(0)
    model = ViT(tiny(depth=3, reg_tokens=2)).eval()
    maps = model.attention_maps(torch.randn(2, 3, 32, 32))
    for a in maps:
        torch.testing.assert_close(a.sum(-1), torch.ones(a.shape[:-1]))
    rollout = attention_rollout(maps)
    assert rollout.shape == (2, 19, 19) and (rollout >= 0).all()
    torch.testing.assert_close(rollout.sum(-1), torch.ones(2, 19))
    # One block of uniform attention: rollout is 0.5 * uniform + 0.5 * identity.
    uniform = [torch.full((1, 1, 4, 4), 0.25)]
    torch.testing.assert_close(attention_rollout(uniform)[0], 0.125 + 0.5 * torch.eye(4))


@pytest.mark.parametrize("class_token", [True, False])
def test_figures_are_pngs_of_the_expected_size(tmp_path, class_token):
    torch.manual_seed(0)
    cfg = tiny(class_token=class_token, global_pool="token" if class_token else "avg", in_chans=1)
    model = ViT(cfg).eval()
    files = plot_attention(model, torch.randn(1, 1, 32, 32), (0.5,), (0.5,), tmp_path)
    files |= plot_embeddings(model, tmp_path)
    sizes = {name: _png_size(path) for name, path in files.items()}
    assert sizes == {
        "patch_grid": (400, 400),
        "attention_heads": (1200, 300),
        "attention_rollout": (600, 300),
        "pos_embed_similarity": (480, 480),
        "patch_filters": (700, 400),
    }


def test_a_run_dir_that_is_missing_or_a_file_or_has_no_log_is_said_so_in_one_line(tmp_path):
    """vitlab.visualize run_dir=<...>: a path that does not exist is not "a run without csv/metrics.csv" (issue 53)."""
    from vitlab.evaluation.figures import read_csv_log
    from vitlab.utils.errors import UserError

    (tmp_path / "a_file").write_text("")
    for path, said in [
        (tmp_path / "nowhere", "does not exist: give the run directory a training run printed"),
        (tmp_path / "a_file", "is a file, not a run directory"),
        (tmp_path, "has no csv/metrics.csv (train with logger=csv or many)"),
    ]:
        with pytest.raises(UserError, match=re.escape(f"run_dir {str(path)!r} {said}")):
            read_csv_log(path)
