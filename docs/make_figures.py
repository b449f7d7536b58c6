"""Draw the figures of docs/concepts.md into docs/_static/ (run by hand; the PNGs are committed).

    .venv/bin/python docs/make_figures.py

Kept out of the Sphinx build so that ``make docs`` stays fast and needs no plotting backend.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

STATIC = Path(__file__).resolve().parent / "_static"
COLORS = ["#ffffff", "#f28e2b", "#4e79a7"]  # masked, intra-chunk, through the state


def chunked_form(path: Path, T: int = 16, C: int = 4, d: int = 128) -> None:
    """Left: which query/key pairs each part of the chunked form covers. Right: memory."""
    t = np.arange(T)[:, None]
    s = np.arange(T)[None, :]
    kind = np.where(s > t, 0, np.where(t // C == s // C, 1, 2))

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4.2), gridspec_kw={"width_ratios": [1, 1.15]})
    ax.imshow(kind, cmap=ListedColormap(COLORS), vmin=0, vmax=2, interpolation="nearest")
    ax.set_xticks(np.arange(-0.5, T, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, T, 1), minor=True)
    ax.grid(which="minor", color="#dddddd", linewidth=0.5)
    for edge in np.arange(-0.5, T, C):
        ax.axhline(edge, color="black", linewidth=1.2)
        ax.axvline(edge, color="black", linewidth=1.2)
    ax.set_xticks(np.arange(C // 2 - 0.5, T, C), [f"chunk {n}" for n in range(T // C)])
    ax.set_yticks(np.arange(C // 2 - 0.5, T, C), [f"chunk {n}" for n in range(T // C)])
    ax.tick_params(which="both", length=0)
    ax.set_xlabel("key position s")
    ax.set_ylabel("query position t")
    ax.set_title(f"Causal weights $\\phi(q_t)\\cdot\\phi(k_s)$, T={T}, C={C}", fontsize=10)
    ax.legend(
        handles=[
            Patch(color=COLORS[1], label="within the chunk: $(Q_n K_n^T \\odot M)\\,V_n$"),
            Patch(color=COLORS[2], label="earlier chunks: $Q_n S_n$, read from the state"),
            Patch(facecolor=COLORS[0], edgecolor="#999999", label="future keys: never computed"),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.14),
        fontsize=8.5,
        frameon=False,
    )

    lengths = np.logspace(2, 6, 50)
    kv_cache = 2 * lengths * d  # one key and one value of size d per token
    state = np.full_like(lengths, d * (d + 1))  # S (d x d) and z (d)
    bx.loglog(lengths, kv_cache, color="#e15759", linewidth=2, label="softmax KV cache: $2Td$")
    label = "linear attention state: $d(d+1)$"
    bx.loglog(lengths, state, color=COLORS[2], linewidth=2, label=label)
    bx.set_xlabel("tokens seen T")
    bx.set_ylabel(f"numbers stored per head (d = {d})")
    bx.set_title("Decoding memory per head and layer", fontsize=10)
    bx.grid(True, which="major", color="#dddddd")
    bx.legend(fontsize=8.5, frameon=False, loc="upper left")

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    STATIC.mkdir(exist_ok=True)
    chunked_form(STATIC / "chunked_form.png")
    print(f"wrote {STATIC / 'chunked_form.png'}")
