"""What every chart shares: one colour per model on every chart (its versions in shades of
it), and one layout (fonts, grid, a legend below the plot that never squeezes it)."""

from __future__ import annotations

import hashlib
from typing import Any

# Twelve colours far enough apart to tell lines apart, dark enough on white.
PALETTE = (
    "#2f5bea", "#e4572e", "#17a398", "#f3a712", "#7d5ba6", "#4f6d7a",
    "#c2185b", "#5c940d", "#0b7285", "#a0522d", "#6741d9", "#d9480f",
)  # fmt: skip
# How much of white each later version of a model mixes in (the first is the model's colour).
SHADES = (0.0, 0.35, 0.55, 0.7)


def _mix(colour: str, white: float) -> str:
    red, green, blue = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{round(c + (255 - c) * white):02x}" for c in (red, green, blue))


def model_colour(model: str, *, shade: int = 0) -> str:
    """The model's colour, the same on every chart of every page; ``shade`` (a version's
    rank among the model's versions shown) lightens it."""
    index = int.from_bytes(hashlib.blake2b(model.encode(), digest_size=4).digest(), "big") % len(PALETTE)
    return _mix(PALETTE[index], SHADES[min(shade, len(SHADES) - 1)])


def version_colours(pairs: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """A colour for each (model, version): the model's, lighter for each later version."""
    out: dict[tuple[str, str], str] = {}
    seen: dict[str, int] = {}
    for model, version in sorted(set(pairs)):
        out[(model, version)] = model_colour(model, shade=seen.get(model, 0))
        seen[model] = seen.get(model, 0) + 1
    return out


GRID = "#eef1f6"


def axis(**more: Any) -> dict[str, Any]:
    """An axis in the house style: its labels and title never clipped (the margin grows to fit)."""
    return {"automargin": True, "gridcolor": GRID, **more}


def layout(*, height: int, legend: bool, **more: Any) -> dict[str, Any]:
    """The house layout: a legend (when there is something to name) below the plot, axes whose
    labels are never clipped (``axis``; pass ``xaxis=axis(...)`` to add to them)."""
    return {
        "template": "none",
        "height": height,
        "margin": {"l": 50, "r": 10, "t": 10, "b": 30},
        "font": {"family": "system-ui, sans-serif", "size": 12, "color": "#1d2330"},
        "paper_bgcolor": "#fff",
        "plot_bgcolor": "#fff",
        "showlegend": legend,
        "legend": {"orientation": "h", "y": -0.25},
        "xaxis": axis(),
        "yaxis": axis(),
        **more,
    }
