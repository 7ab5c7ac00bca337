"""Matplotlib set-up shared by the report's charts (headless, one style)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# one colour per algorithm and per tensor, the same in every chart
ALGO_COLORS = {"standard": "tab:red", "flash1": "tab:orange", "flash2": "tab:blue"}
ALGO_LABELS = {"standard": "standard", "flash1": "FlashAttention-1", "flash2": "FlashAttention-2"}
TENSOR_COLORS = {"Q": "#4c72b0", "K": "#55a868", "V": "#8172b2", "S": "#c44e52", "P": "#dd8452", "O": "#64b5cd",
                 "stats": "#999999"}


def figure(ncols=1, nrows=1, width=5.5, height=4.2):
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    return fig, axes


def save(fig, path):
    if not fig.get_layout_engine():
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
