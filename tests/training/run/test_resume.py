"""Going on from a checkpoint (training/run/resume.py): the file is read once per command, when the run is planned, and
what it holds handed to each step that asks (the batch, the resumability checks, the W&B run to continue)."""

from pathlib import Path

SHORT = ["debug=limit", "progress_bar=none", "test=false"]


def test_a_resumed_run_reads_its_checkpoint_once(compose_cfg, tmp_path, monkeypatch):
    """Lightning's fit reads the checkpoint's state itself; vitlab reads it once before (cli.plans: its metadata), not
    once per step that asks, as it did in three places of a resumed run before."""
    from vitlab.convert import weights
    from vitlab.train import train

    train(compose_cfg("train", [*SHORT, "trainer.max_epochs=1"], output_dir=tmp_path / "first"))
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    reads, read = [], weights._load_weights_only  # the one reader of every file vitlab opens (convert.weights)
    monkeypatch.setattr(weights, "_load_weights_only", lambda path: reads.append(Path(path)) or read(path))
    resumed = compose_cfg("train", [*SHORT, "trainer.max_epochs=2", f"ckpt_path={last}"], output_dir=tmp_path / "on")
    train(resumed)
    assert reads.count(last) == 1
    assert (tmp_path / "on" / "checkpoints" / "last.ckpt").is_file()  # it went on: its second epoch was saved
