"""Table and plot for experiments/parity_zoo from a `vitlab.parity -m` sweep directory.

python experiments/parity_zoo/report.py outputs/parity_zoo
python experiments/parity_zoo/report.py outputs/parity_zoo_rope --rows   # the table's rows only (no slips, no plot)
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from vitlab.model import ViT, ViTConfig  # noqa: E402


def num_params(config: dict) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in ViT(ViTConfig.from_dict(config)).parameters())


def slips(cfg: ViTConfig) -> dict[str, list[float]]:
    """Per-layer max |diff| between our ViT and timm's built with one common implementation slip, same weights."""
    from functools import partial

    from timm.layers import set_fused_attn
    from timm.models.vision_transformer import VisionTransformer

    from vitlab.convert.compare import timm_taps
    from vitlab.convert.timm_args import timm_kwargs
    from vitlab.convert.weights import check_state_dict

    torch.manual_seed(0)
    ours = ViT(cfg).eval()
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    names = ["patch_embed"] + [f"blocks.{i}" for i in range(cfg.depth)] + ["norm"]
    with torch.no_grad():
        mine = ours.intermediates_by_name(x, names)
        mine["logits"] = ours.forward_head(mine["norm"])
    variants = {
        "LayerNorm eps 1e-5 (PyTorch default)": dict(norm_layer=partial(torch.nn.LayerNorm, eps=1e-5)),
        "tanh-approximate GELU": dict(act_layer=partial(torch.nn.GELU, approximate="tanh")),
        "softmax attention, unfused (timm's fallback)": {},
    }
    out = {}
    for label, extra in variants.items():
        set_fused_attn(not label.startswith("softmax"))
        theirs = VisionTransformer(**timm_kwargs(cfg), **extra).eval()
        set_fused_attn(True)
        theirs.load_state_dict(check_state_dict(ours.state_dict(), cfg))
        taps, _ = timm_taps(theirs)
        with torch.no_grad():
            feats = theirs.forward_features(x)
            logits = theirs.forward_head(feats)
        theirs_out = {**taps, "norm": feats, "logits": logits}
        out[label] = [(mine[n] - theirs_out[n]).abs().max().item() for n in [*names, "logits"]]
    return out


def main(sweep: Path, rows_only: bool = False) -> None:
    reports = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/parity.json"), key=lambda p: int(p.parent.name))]
    cols = [
        "model",
        "timm",
        "params (M)",
        "patch embed",
        "worst block",
        "features",
        "logits",
        "top-1 agree",
        "grad (rel.)",
        "pass",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    fig, ax = plt.subplots(figsize=(9, 4))
    for r in reports:
        c, layers = r["model"]["config"], r["layers"]
        blocks = max(v["max_abs"] for k, v in layers.items() if k.startswith("blocks."))
        name = f"{c['embed_dim']}/{c['depth']}/{c['patch_size']}@{c['img_size']}" + (
            f" {c['rope']} RoPE" * bool(c.get("rope"))
        )
        print(
            f"| {name} | {r['model']['timm_name'] or '(VisionTransformer)'} | {num_params(c) / 1e6:.1f} | "
            f"{layers['patch_embed']['max_abs']:.1e} | {blocks:.1e} | {layers['features']['max_abs']:.1e} | "
            f"{layers['logits']['max_abs']:.1e} | {r['top1_agreement']:.2f} | {r['grad']['relative']:.1e} | "
            f"{'yes' if r['passed'] else 'NO'} |"
        )
        ys = [v["max_abs"] for v in layers.values()]
        ax.plot(range(len(ys)), [max(y, 1e-12) for y in ys], marker="o", label=r["model"]["timm_name"] or name)
    if rows_only:
        return
    for label, ys in slips(ViTConfig.from_variant("B/16")).items():
        ax.plot(range(len(ys)), [max(y, 1e-12) for y in ys], ls=":", marker="x", label=f"ViT-B/16 vs timm with {label}")
        print(
            f"| ViT-B/16 vs timm with {label} | | | {ys[0]:.1e} | {max(ys[1:-2]):.1e} | {ys[-2]:.1e} | "
            f"{ys[-1]:.1e} | | | {'yes' if ys[-1] <= 1e-5 else 'NO'} |"
        )
    ax.axhline(1e-5, color="r", ls="--", label="tolerance (logits)")
    ax.set(
        yscale="log",
        ylim=(1e-13, 1e-1),
        xlabel="layer (patch embed, blocks..., features, logits)",
        ylabel="max |vitlab - timm| (0 drawn at 1e-12)",
        title="vitlab vs timm, fp32 CPU, random weights",
    )
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    out = Path(__file__).with_name("parity.png")
    fig.savefig(out, dpi=100)
    print(f"\nwrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main(Path(sys.argv[1]), rows_only="--rows" in sys.argv[2:])
