"""Plots as PNG bytes, drawn headless, and as Markdown that a Dagster asset's metadata shows inline; a training's
loss curve (the run's own plots, drawn from what its steps stored, are report.py's)."""

from __future__ import annotations

import base64
import io


def pyplot():
    """matplotlib's pyplot on the Agg backend, imported at the first plot: most processes that import this draw none."""
    import matplotlib

    matplotlib.use("Agg")  # headless: plots are files or bytes, never a window
    import matplotlib.pyplot as plt

    return plt


def figure_png(fig) -> bytes:
    """The figure as PNG bytes; the figure is closed."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    pyplot().close(fig)
    return buf.getvalue()


def loss_png(loss_history: list[float], title: str, dpi: int = 100) -> bytes:
    """The training loss per iteration; log scale when it spans more than a decade (a fresh start)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3), dpi=dpi)
    ax.plot(range(1, len(loss_history) + 1), loss_history, lw=1.2)
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    low, high = min(loss_history, default=1.0), max(loss_history, default=1.0)
    if low > 0 and high / low > 10:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return figure_png(fig)


def png_markdown(png: bytes, alt: str) -> str:
    """Markdown that shows the image inline (Dagster's metadata renders data URIs)."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})"
