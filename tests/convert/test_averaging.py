"""Checkpoint averaging (issue 67, point 1): the element-wise mean of the files in float64, cast back (timm's
avg_checkpoints.py), EMA sets, sharded checkpoints, mismatched checkpoints refused in one line."""

import pytest
import torch

from vitlab.convert.averaging import average_checkpoints, mean_state_dict
from vitlab.utils.errors import UserError


def _ckpt(path, seed: int, ema: str | None = None, shape=(4, 3), dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    weights = {
        "model.head.weight": torch.randn(shape, generator=g).to(dtype),
        "model.head.bias": torch.randn(4, generator=g),
    }
    sd = weights | {"val_metrics.acc.tp": torch.tensor([seed]), "val_acc_best.max_value": torch.tensor(0.5)}
    ckpt = {"state_dict": sd, "hyper_parameters": {"model": {"num_classes": 4}}, "epoch": seed,
            "optimizer_states": [{}], "loops": {}, "callbacks": {}}  # fmt: skip
    other = {k: v + 100 for k, v in weights.items()}
    if ema == "beside":  # the monitor kept the raw weights, the EMA travels beside them
        ckpt |= {"average_model_state": other, "averaging_state": {"n_averaged": torch.tensor(3)}}
    elif ema == "kept":  # the monitor kept the EMA; the raw weights travel beside
        ckpt |= {"current_model_state": other, "averaging_state": {"n_averaged": torch.tensor(3)}}
    torch.save(ckpt, path)
    return ckpt


def test_the_average_is_the_element_wise_mean_of_the_files_and_drops_the_training_state(tmp_path):
    paths = [tmp_path / f"{i}.ckpt" for i in range(3)]
    ckpts = [_ckpt(p, i) for i, p in enumerate(paths)]
    out = average_checkpoints([str(p) for p in paths])
    for key in ("model.head.weight", "model.head.bias"):
        want = torch.stack([c["state_dict"][key].double() for c in ckpts]).mean(0)
        assert out["state_dict"][key].dtype == torch.float32
        torch.testing.assert_close(out["state_dict"][key].double(), want, atol=1e-6, rtol=0)
    assert set(out["state_dict"]) == {"model.head.weight", "model.head.bias"}  # metric bookkeeping left out
    assert not {"optimizer_states", "loops", "callbacks"} & set(out) and out["hyper_parameters"]["model"]
    assert out["averaged"]["checkpoints"] == [str(p.resolve()) for p in paths] and out["averaged"]["from_epochs"] == [
        0,
        1,
        2,
    ]


def test_each_tensor_is_cast_back_to_its_dtype_within_its_range():
    a = {"w": torch.tensor([1.0, 65504.0], dtype=torch.float16), "n": torch.tensor([1, 2])}
    b = {"w": torch.tensor([2.0, 65504.0], dtype=torch.float16), "n": torch.tensor([2, 2])}
    out = mean_state_dict([a, b])
    assert out["w"].dtype == torch.float16 and out["w"].tolist() == [1.5, 65504.0] and torch.isfinite(out["w"]).all()
    assert out["n"].dtype == torch.int64 and out["n"].tolist() == [2, 2]  # 1.5 rounds to even: 2


@pytest.mark.parametrize("ema", ["beside", "kept"])
def test_ema_weights_are_averaged_where_the_checkpoints_carry_them_or_with_use_ema(tmp_path, ema):
    paths = [str(tmp_path / f"{i}.ckpt") for i in range(2)]
    ckpts = [_ckpt(p, i, ema=ema) for i, p in enumerate(paths)]
    key = "model.head.bias"
    beside = "average_model_state" if ema == "beside" else "current_model_state"
    mean = lambda sets: torch.stack([s[key] for s in sets]).mean(0)  # noqa: E731
    out = average_checkpoints(paths)
    torch.testing.assert_close(out["state_dict"][key], mean([c["state_dict"] for c in ckpts]), atol=1e-6, rtol=0)
    torch.testing.assert_close(out[beside][key], mean([c[beside] for c in ckpts]), atol=1e-6, rtol=0)
    ema_sets = [c["average_model_state"] if ema == "beside" else c["state_dict"] for c in ckpts]
    with_ema = average_checkpoints(paths, use_ema=True)
    torch.testing.assert_close(with_ema["state_dict"][key], mean(ema_sets), atol=1e-6, rtol=0)
    assert beside not in with_ema and with_ema["averaged"]["use_ema"]


def test_use_ema_without_ema_and_mismatched_checkpoints_are_refused_in_one_line(tmp_path):
    a, b, c = (str(tmp_path / f"{n}.ckpt") for n in "abc")
    _ckpt(a, 0), _ckpt(b, 1, shape=(5, 3)), _ckpt(c, 2, ema="beside")
    with pytest.raises(UserError, match=r"model.head.weight is \(4, 3\) in one and \(5, 3\) in the other"):
        average_checkpoints([a, b])
    with pytest.raises(UserError, match=r"use_ema=true averages EMA weights, and checkpoint '.*a.ckpt' holds none"):
        average_checkpoints([c, a], use_ema=True)
    with pytest.raises(UserError, match=r"key 'extra' is only in '1'"):
        mean_state_dict([{"w": torch.zeros(1)}, {"w": torch.zeros(1), "extra": torch.zeros(1)}])


def test_a_directory_of_shards_averages_as_its_one_file_would(tmp_path):
    import torch.distributed.checkpoint as dcp

    one, two = tmp_path / "one.ckpt", tmp_path / "shards"
    ckpt = _ckpt(one, 0)
    two.mkdir()
    dcp.save({"state_dict": {k: v.clone() + 1 for k, v in ckpt["state_dict"].items()}}, checkpoint_id=str(two),
             no_dist=True)  # fmt: skip
    torch.save({"epoch": 1, "hyper_parameters": ckpt["hyper_parameters"]}, two / "meta.pt")
    out = average_checkpoints([str(one), str(two)])
    torch.testing.assert_close(out["state_dict"]["model.head.bias"], ckpt["state_dict"]["model.head.bias"] + 0.5)
