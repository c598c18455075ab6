"""vitlab's commands, one module each: a Hydra entry point (`@entry_point("<config>")`) over the library,
importing nothing else of its kind. `python -m vitlab.<command>` runs one (vitlab/<command>.py passes it on),
as does `python -m vitlab <command>`."""
