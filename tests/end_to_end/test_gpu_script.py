"""experiments/gpu: the script a lent GPU runs, dry-run here at tiny sizes (its modules, configs and every command's
start), so that a renamed key or a missing wheel is found on the CPU and not in the lease."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.commands import _ForkServer

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "experiments" / "gpu"
sys.path.insert(0, str(GPU))

import points  # noqa: E402
import wheels  # noqa: E402


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """points.py --dry-run with the import recorder that `make gpu-wheels` uses: (results, the recorded imports).
    Its `python -m vitlab.<command>` commands are forked from a fork server started in the dry run's environment (as
    run_cli's are: the same commands without a new interpreter's ~10 s of imports each, two thirds of the dry run);
    with the recorder on its path, each child records the modules it ends with (the server's among them, which every
    vitlab command imports). Its other commands (timm's train.py, pytest, the JPEG script) start afresh as points.run
    starts them; `make gpu-dry-run` starts every command afresh."""
    out, imports = tmp_path_factory.mktemp("gpu"), tmp_path_factory.mktemp("imports")
    path = os.pathsep.join(filter(None, [str(GPU / "record"), os.environ.get("PYTHONPATH")]))  # (the rest kept)
    handler = signal.getsignal(signal.SIGTERM)  # (points.main sets its own)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {**points.DRY_ENV, "VITLAB_RECORD_IMPORTS": str(imports), "PYTHONPATH": path}.items():
            mp.setenv(key, value)
        server = _ForkServer()
        mp.setattr(points, "run", _forked(server, points.run))
        mp.setattr(sys, "argv", ["points.py", str(out), "--dry-run"])
        try:
            with pytest.raises(SystemExit) as ended:
                points.main()
        finally:
            signal.signal(signal.SIGTERM, handler)
            server.proc.stdin.close()
            server.proc.wait(timeout=60)
    assert ended.value.code == 0
    return json.loads((out / "results.json").read_text()), imports


def _forked(server: _ForkServer, run):
    """points.run, with `python -m vitlab.<command>` forked from `server` (in its own process group, stopped past its
    limit) where the server serves the command's environment."""

    def forked(argv: list[str], limit: float, log_path: Path, env: dict | None = None):
        module = argv[2] if argv[1:2] == ["-m"] else ""
        if not module.startswith("vitlab.") or not server.serves(env or dict(os.environ)):
            return run(argv, limit, log_path, env)
        start = time.monotonic()
        try:
            r = server.run(argv, module, argv[3:], REPO, env, True, max(1, int(limit)))
        except subprocess.TimeoutExpired as stopped:
            log_path.write_text(f"{stopped.stdout or ''}{stopped.stderr or ''}")
            return "timeout", time.monotonic() - start
        log_path.write_text(r.stdout + r.stderr)
        return r.returncode, time.monotonic() - start

    return forked


def test_every_point_runs_its_commands_at_tiny_sizes(dry_run):
    results, _ = dry_run
    assert [p["name"] for p in results["points"]] == [p.name for p in points.POINTS]
    for point in results["points"]:
        assert point["status"] == "ok", (point["name"], point["commands"][-1]["log_tail"][-10:])
        for command in point["commands"]:
            assert command["rc"] == 0 and command["result"] is not None or point["name"] == "pytest_gpu"
    # the dry run swaps sizes, not commands: what it adds beyond the GPU's overrides are sizes (steps, repeats, depth;
    # timm's train.py's network through --model-kwargs)
    for point in points.POINTS:
        for command in point.commands:
            sizes = ("benchmark.", "model.", "--model-kwargs")
            assert all(k in command.args or k.startswith(sizes) for k in command.dry), command.dry


def test_the_wheels_carried_are_what_the_script_imports_and_the_image_lacks(dry_run):
    """The image lacks Hydra, OmegaConf and pydantic (the wheel a hand list once missed): each is carried, at the
    version installed here; the torch stack never is; every distribution imported is accounted for."""
    _, imports = dry_run
    carry, specs = wheels.plan(imports)
    needed = wheels.imported_distributions(imports)
    held = wheels.image()
    for name in ("hydra-core", "omegaconf", "pydantic", "pydantic-core", "antlr4-python3-runtime", "torchdata"):
        assert carry[name] == needed[name]
    assert not {n for n in carry if wheels.NEVER.match(n)} and "torch" not in needed
    for name in needed:  # carried, or the image holds a version every requirement accepts
        assert name in carry or (name in held and wheels.satisfies(held[name], specs.get(name, wheels.SpecifierSet())))


def test_a_point_past_its_limit_is_stopped_and_one_without_time_left_is_skipped(tmp_path):
    t0 = time.monotonic()
    rc, seconds = points.run([sys.executable, "-c", "import time; time.sleep(60)"], 1.0, tmp_path / "log")
    assert rc == "timeout" and 1.0 <= seconds < 10 and time.monotonic() - t0 < 12
    assert points.run([sys.executable, "-c", "import sys; sys.exit(3)"], 10, tmp_path / "log")[0] == 3
    r = subprocess.run(
        [sys.executable, str(GPU / "points.py"), str(tmp_path), "--deadline", "60", "--only", "b16_compiled"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0 and re.search(r"\[b16_compiled\] skipped: \d+ s left, it needs 120", r.stdout), r.stdout
    (point,) = json.loads((tmp_path / "results.json").read_text())["points"]
    assert point["status"].startswith("skipped") and point["commands"] == []


def test_a_stopped_dry_run_leaves_no_run_directories(tmp_path):
    """Issue 64 point 18: the run directories (checkpoints: 859 MB for a whole dry run) go with the script, also when
    it is stopped; the command it was running is stopped with it."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    p = subprocess.Popen([sys.executable, str(GPU / "points.py"), str(tmp_path / "out"), "--dry-run"], cwd=REPO,
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 120
    while not any(tmp_path.glob("vitlab-gpu-*/*/0.log")) and time.monotonic() < deadline:  # a command is running
        time.sleep(0.2)
    assert any(tmp_path.glob("vitlab-gpu-*/*/0.log"))
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 128 + signal.SIGTERM
    assert not list(tmp_path.glob("vitlab-gpu-*"))
