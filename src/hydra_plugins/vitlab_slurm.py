"""Hydra looks for launchers only in the `hydra_plugins` namespace: vitlab's Slurm launcher (vitlab.cli.slurm) is
registered here, as `hydra_plugins.vitlab_slurm.SlurmLauncher` (conf/hydra/launcher/slurm.yaml)."""

from vitlab.cli import slurm


class SlurmLauncher(slurm.SlurmLauncher):
    pass
