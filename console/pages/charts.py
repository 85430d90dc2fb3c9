"""What every chart shares: one colour per model on every chart (its versions in shades of
it; models drawn together never share one), and one layout (fonts, grid, a legend beside or
below the plot that never squeezes it)."""

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


def _palette_index(model: str) -> int:
    return int.from_bytes(hashlib.blake2b(model.encode(), digest_size=4).digest(), "big") % len(PALETTE)


def model_colour(model: str, *, shade: int = 0) -> str:
    """The model's own colour (its name's place in the palette); ``shade`` (a version's rank
    among the model's versions shown) lightens it. A chart with several models takes
    ``model_colours``: two names may share a place."""
    return _mix(PALETTE[_palette_index(model)], SHADES[min(shade, len(SHADES) - 1)])


def model_colours(models: list[str]) -> dict[str, str]:
    """A distinct colour for each of ``models`` (up to the palette's twelve): each its own
    colour unless a name earlier in order took it, then the next free one. The same set of
    models gets the same colours on every chart of a page."""
    taken: set[int] = set()
    out: dict[str, str] = {}
    for model in sorted(set(models)):
        index = _palette_index(model)
        if len(taken) < len(PALETTE):
            while index in taken:
                index = (index + 1) % len(PALETTE)
        taken.add(index)
        out[model] = PALETTE[index]
    return out


# What a chart's "other" series (every version beyond those it names) is drawn in.
OTHER = "#8a93a3"


def version_colours(pairs: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """A colour for each (model, version): the model's (``model_colours``), lighter for each
    later version."""
    models = model_colours([model for model, _ in pairs])
    out: dict[tuple[str, str], str] = {}
    seen: dict[str, int] = {}
    for model, version in sorted(set(pairs)):
        out[(model, version)] = _mix(models[model], SHADES[min(seen.get(model, 0), len(SHADES) - 1)])
        seen[model] = seen.get(model, 0) + 1
    return out


GRID = "#eef1f6"


def axis(**more: Any) -> dict[str, Any]:
    """An axis in the house style: its labels and title never clipped (the margin grows to fit)."""
    return {"automargin": True, "gridcolor": GRID, **more}


# A legend beside the plot (``layout(legend_beside=True)``): the page's script moves it below
# when the chart is narrow (static/console/overview.js).
LEGEND_BESIDE = {"orientation": "v", "x": 1.02, "xanchor": "left", "y": 1, "yanchor": "top"}


def layout(*, height: int, legend: bool, legend_beside: bool = False, **more: Any) -> dict[str, Any]:
    """The house layout: a legend (when there is something to name) below the plot, or beside
    it, axes whose labels are never clipped (``axis``; pass ``xaxis=axis(...)`` to add to them)."""
    return {
        "template": "none",
        "height": height,
        "margin": {"l": 50, "r": 10, "t": 10, "b": 30},
        "font": {"family": "system-ui, sans-serif", "size": 12, "color": "#1d2330"},
        "paper_bgcolor": "#fff",
        "plot_bgcolor": "#fff",
        "showlegend": legend,
        "legend": LEGEND_BESIDE if legend_beside else {"orientation": "h", "y": -0.25},
        "xaxis": axis(),
        "yaxis": axis(),
        **more,
    }
