"""Draw seeds.png: the test accuracy of the digits default over seeds 42 and 1-7, per configuration, as measured
on 2026-11-25 (README.md, "Re-measured"; each value is the `test/acc` line of one `python -m vitlab.train seed=<s>`
run with the arguments in the label)."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SEEDS = [42, 1, 2, 3, 4, 5, 6, 7]
TEST_ACC = {
    "080e829\n(before data on device)": [0.9778, 0.9704, 0.9815, 0.9815, 0.9667, 0.9778, 0.9667, 0.9852],
    "a8cd9fd\n(data on device)": [0.9519, 0.9778, 0.9630, 0.9704, 0.9704, 0.9741, 0.9667, 0.9741],
    "74cc5c9\ndata.on_device=false": [0.9852, 0.9815, 0.9519, 0.9630, 0.9593, 0.9889, 0.9667, 0.9778],
    "74cc5c9\nmodel.drop_path_rate=0.1": [0.9852, 0.9704, 0.9741, 0.9667, 0.9815, 0.9778, 0.9704, 0.9667],
}

fig, ax = plt.subplots(figsize=(7, 3.6))
for i, values in enumerate(TEST_ACC.values()):
    ax.scatter([i] * len(values), values, s=18, alpha=0.7, color="tab:blue")
    ax.scatter([i], [sum(values) / len(values)], marker="_", s=600, color="black")
ax.axhline(0.98, color="tab:red", linestyle="--", linewidth=1, label="98% target")
ax.set_xticks(range(len(TEST_ACC)), list(TEST_ACC), fontsize=8)
ax.set_ylabel("test/acc (270 images)")
ax.set_title("digits default, seeds 42 and 1-7 (bar: mean)", fontsize=10)
ax.legend(loc="lower right", fontsize=8)
fig.tight_layout()
fig.savefig(Path(__file__).with_name("seeds.png"), dpi=120)
