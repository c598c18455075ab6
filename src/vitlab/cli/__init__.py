"""The command line around every command: the entry decorator (`@entry_point`), the config's checks (schemas,
node_checks), the plan a checked config becomes (plans), the run-directory claim, the config tree and its resolvers,
the sweep summary and the Slurm launcher."""
