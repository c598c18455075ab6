import json

import pytest

from tests.helpers.runs import trained


@pytest.fixture(scope="session")
def digits_ckpt(tmp_path_factory):
    """A small trained checkpoint (debug=limit on digits), trained once per pytest run (every file of this folder,
    and tests/training/objectives/test_distillation.py's teacher): its frozen features are what the probes are scored
    on."""
    run_dir = trained(tmp_path_factory, "debug-limit", "debug=limit", "progress_bar=none")
    return json.loads((run_dir / "metrics.json").read_text())["tested_checkpoint"]
