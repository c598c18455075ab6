import json

import pytest

from tests.helpers import run_cli


@pytest.fixture(scope="session")
def digits_ckpt(tmp_path_factory):
    """A small trained checkpoint (debug=limit on digits), trained once for every file of this folder that a worker
    runs: its frozen features are what the probes are scored on."""
    run_dir = tmp_path_factory.mktemp("probe") / "run"
    r = run_cli("train", "debug=limit", "progress_bar=none", f"hydra.run.dir={run_dir}")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((run_dir / "metrics.json").read_text())["tested_checkpoint"]
