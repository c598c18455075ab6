import json

import onnxruntime
import pytest
import torch

from tests.helpers import tiny
from vitlab.convert import programs as export_module
from vitlab.convert.programs import check_shapes, export
from vitlab.model import ViT
from vitlab.utils.errors import UserError


@pytest.mark.parametrize("suffix", [".onnx", ".pt2"])
def test_export_round_trips_with_dynamic_batch_and_size(tmp_path, suffix):
    """The ONNX file, run by onnxruntime, and the reloaded .pt2 program give the model's logits within 1e-4 at
    other batch sizes and other (non-square, padded) image sizes than the one exported with."""
    torch.manual_seed(0)
    model = ViT(tiny(dynamic_img_size=True, dynamic_img_pad=True, reg_tokens=1))
    report = export(model, tmp_path / f"m{suffix}", metadata={"preprocessing": {"mean": [0.5] * 3}})
    shapes = [tuple(c["input_shape"]) for c in report["checks"]]
    assert shapes == check_shapes(model) and len({s[0] for s in shapes}) > 1 and len({s[2:] for s in shapes}) > 2
    assert report["max_abs_diff"] <= 1e-4
    assert [p.name for p in tmp_path.iterdir()] == [f"m{suffix}"]  # no temporary left
    x = torch.randn(4, 3, 40, 56)
    with torch.no_grad():
        expected = model.eval()(x)
    if suffix == ".onnx":
        session = onnxruntime.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
        got = torch.from_numpy(session.run(None, {"images": x.numpy()})[0])
        meta = session.get_modelmeta().custom_metadata_map
    else:
        extra = {"vitlab_config": "", "preprocessing": ""}
        got = torch.export.load(str(tmp_path / "m.pt2"), extra_files=extra).module()(x)
        meta = extra
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert json.loads(meta["vitlab_config"]) == model.cfg.to_dict()
    assert json.loads(meta["preprocessing"]) == {"mean": [0.5] * 3}


def test_a_failed_check_writes_nothing(tmp_path):
    model = ViT(tiny())
    (tmp_path / "m.pt2").write_bytes(b"the previous file")
    with pytest.raises(UserError, match="the exported program differs from the model by .*: refused, nothing was"):
        export(model, tmp_path / "m.pt2", atol=-1.0)  # no difference passes a negative tolerance
    assert [p.name for p in tmp_path.iterdir()] == ["m.pt2"] and (
        tmp_path / "m.pt2"
    ).read_bytes() == b"the previous file"


def test_user_errors(tmp_path, monkeypatch):
    model = ViT(tiny())
    with pytest.raises(UserError, match=r"export path '.*m.tflite' must end in one of \['.onnx', '.pt2'\]"):
        export(model, tmp_path / "m.tflite")
    monkeypatch.setattr(export_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="ONNX export needs onnx, onnxscript: pip install"):
        export(model, tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []
