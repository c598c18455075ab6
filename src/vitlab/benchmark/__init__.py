"""python -m vitlab.benchmark: how fast, against what. One module per task (`models`: vitlab vs timm on
one batch; `overhead`: vitlab.train's Lightning loop vs a plain loop), `measure` for timers and
memory, `config` for the settings; `__main__` is the command."""
