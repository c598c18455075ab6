"""Processes and devices: FSDP2's sharding of the ViT (sharding.py), the state each process keeps in every checkpoint
(rank_state.py: RNGs, loader positions), the hardware defaults a Trainer is given (hardware.py) and the memory
estimate a run checks before it starts (memory.py). The lowest floor of vitlab.training: it imports none of the
other sub-packages, only torch, Lightning and vitlab's model, data and utils."""
