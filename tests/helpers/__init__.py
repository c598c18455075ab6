"""What tests share, one job a module: commands.py (running a command as a user does, through the fork server;
refusals, a full disk), configs.py (tiny model configs, the argument lists runs share), callbacks.py (test-only
Lightning callbacks that real runs load by name), runs.py (runs trained once per pytest run, interrupted and
resumed, compared), images.py (folders of small images), references.py (the reference implementations), docs.py
(the commands the documentation shows)."""
