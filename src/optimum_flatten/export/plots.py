"""Figures written beside a compressed checkpoint (matplotlib, headless Agg backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def plot_layer_matrix(
    matrix: Sequence[Sequence[float | None]],
    groups: Sequence[Sequence[int]] | None,
    path: str | Path,
    value_label: str = "value",
) -> Path:
    """Heatmap of a layer x layer matrix (a method's `LayerMatrixFigure`) with the groups outlined in red.

    Entries outside the computed band (None/NaN) are left blank.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Rectangle

    matrix = np.array([[np.nan if v is None else float(v) for v in row] for row in matrix], dtype=float)
    size = matrix.shape[0]
    fig, ax = plt.subplots(figsize=(6.5, 5.5), dpi=120)
    finite = matrix[np.isfinite(matrix)]
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    image = ax.imshow(matrix, cmap="viridis", vmin=low, vmax=max(high, low + 1e-12), origin="upper")
    fig.colorbar(image, ax=ax, label=value_label)
    for group in groups or []:
        if len(group) > 1:
            start, stop = group[0] - 0.5, group[-1] + 0.5
            ax.add_patch(Rectangle((start, start), stop - start, stop - start, fill=False, edgecolor="red", lw=2))
    ax.set_xlabel("layer j")
    ax.set_ylabel("layer i")
    ax.set_title(f"{value_label[:1].upper()}{value_label[1:]} ({size} layers); groups outlined", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
