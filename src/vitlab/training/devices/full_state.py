"""A whole (one-file) checkpoint, any strategy's, loaded into a sharded module and its optimizers
(training.devices.sharding's FSDP2Strategy, and callbacks=ema's sharded average): each process takes its shard of
every tensor, the optimizer state by parameter name, the networks' keys strictly checked."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def keyed_by_name(state: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A one-process optimizer state (numbered; with `param_names`, or written before them, in the optimizer's own
    group order) -> torch's form keyed by parameter name, for set_optimizer_state_dict (the inverse of
    convert.weights.numbered_optimizer_state)."""
    groups = []
    for saved, live in zip(state["param_groups"], optimizer.param_groups, strict=True):
        names = saved.get("param_names") or live["param_names"]
        groups.append({**{k: v for k, v in saved.items() if k not in ("params", "param_names")}, "params": names})
    ids = [i for g in state["param_groups"] for i in g["params"]]
    names = [n for g in groups for n in g["params"]]
    by_name = {n: state["state"][i] for i, n in zip(ids, names, strict=True) if i in state["state"]}
    return {"state": by_name, "param_groups": groups}


def load_full_state(
    module: nn.Module, optimizers: list[torch.optim.Optimizer], checkpoint: dict[str, Any], strict: bool = True
) -> None:
    """A one-file checkpoint (any strategy's) into a sharded module and its optimizers, in place: every process
    takes its shard of each tensor (each has the file mapped), the optimizer state by parameter name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    load_full_module_state(module, checkpoint["state_dict"], strict)
    for optimizer, saved in zip(optimizers, checkpoint.get("optimizer_states", []), strict=False):
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        # A parameter the optimizer has not stepped yet has no state (DINO's last layer, without a gradient in its
        # first epoch): torch fills every state with a step of zero gradients before loading, so such a state is
        # removed again (its first real step is then AdamW's first, as in the run that saved it).
        state = keyed_by_name(saved, optimizer)
        options = StateDictOptions(full_state_dict=True, strict=False)
        set_optimizer_state_dict(module, optimizer, state, options=options)
        for group in optimizer.param_groups:
            for p, name in zip(group["params"], group["param_names"], strict=True):
                if name not in state["state"]:
                    optimizer.state.pop(p, None)


def load_full_module_state(module: nn.Module, state: Mapping[str, Any], strict: bool = True) -> None:
    """A whole state dict into a sharded module: each process keeps its shard of every tensor. Bookkeeping outside
    the networks (metric states) that an older file lacks starts fresh, as ViTModule.on_load_checkpoint does; a peft=
    run's frozen base, which its checkpoints omit (training.adapters.drop_frozen), is the one the module holds (it
    started from that base, checked by sha256, before it was sharded). Any other key missing is refused as a strict
    load refuses it: torch's full-state load would keep the module's own value for it without a word."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    here = module.state_dict()
    state = dict(state) | {k: v for k, v in here.items() if k not in state and not is_network_key(module, k)}
    missing = sorted(set(here) - set(state) - _frozen_base_keys(module))
    if strict and missing:
        raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}: missing keys {missing}")
    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, strict=strict))


def _frozen_base_keys(module: nn.Module) -> set[str]:
    """The state-dict keys of a peft= module's frozen parameters (none for any other module)."""
    hparams = getattr(module, "hparams", None)
    if not (hparams and hparams.get("peft")):
        return set()
    return {n for n, p in module.named_parameters() if not p.requires_grad}


def is_network_key(module: nn.Module, key: str) -> bool:
    """Whether `key` of the module's state dict is a network's (weights strictly checked) or bookkeeping."""
    networks = getattr(module, "network_prefixes", ("model.",))
    return key.startswith(tuple(networks))
