"""What a training step computes: the Objective interface (objective.py) and its kinds: classification with timm's
MixUp/CutMix and label smoothing (classification.py), DeiT's distillation (distillation.py) and feature and token
distillation (feature_distill.py, its parts in distill_heads.py), MAE (mae.py), DINO and iBOT self-distillation
(dino.py; its networks' step, dino_nets.py) with their losses and schedules written as the references compute them
(dino_losses.py), and DINOv3's Gram anchoring (gram.py). A new objective subclasses Objective here and is named in
module.OBJECTIVES. May import devices/ (a teacher sharded as the student is); not callbacks/, the module or run/."""
