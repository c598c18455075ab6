"""The command line around every command: the entry decorator (`@entry_point`), the run-directory claim, the
config tree and its resolvers, the sweep summary and the Slurm launcher."""
