"""Marks every figure shares: provenance badges, readable log ticks, "does not fit" and titles.

A panel's provenance is one of :data:`PROVENANCE`: *measured* (a run on the hardware the axis
names), *emulated* (this repo's CPU machine, the gpu tier emulated on the CPU) or *projected*
(the performance model). :func:`badge` writes it in the panel's corner, so panels of different
provenance never sit side by side unmarked; tests find it with :func:`provenance_of`.
"""
from __future__ import annotations

import textwrap
from typing import Optional

PROVENANCE = {
    "measured": ("MEASURED", "#1b7837"),
    "emulated": ("EMULATED (CPU; gpu tier on the CPU)", "#b35806"),
    "projected": ("PROJECTED (performance model)", "#542788"),
}
BADGE_GID = "provenance-badge"
DOES_NOT_FIT = "does not fit in GPU memory"
DOES_NOT_FIT_HATCH = "xx"


CORNERS = {"upper left": (0.01, 0.99, "left", "top"), "upper right": (0.99, 0.99, "right", "top"),
           "lower left": (0.01, 0.01, "left", "bottom"), "lower right": (0.99, 0.01, "right", "bottom")}


def badge(ax, kind: str, detail: str = "", loc: str = "upper left") -> None:
    """Write ``kind`` (a :data:`PROVENANCE` key) in a corner of the panel (``loc``), with ``detail``,
    and draw the panel's frame in its colour (dashed: projected, dotted: emulated)."""
    if kind not in PROVENANCE:
        raise ValueError(f"provenance {kind!r}: use one of {', '.join(PROVENANCE)}")
    text, color = PROVENANCE[kind]
    x, y, ha, va = CORNERS[loc]
    t = ax.text(x, y, text + (f"\n{detail}" if detail else ""), transform=ax.transAxes, ha=ha, va=va,
                fontsize=7, color="white", fontweight="bold", zorder=10,
                bbox=dict(boxstyle="round,pad=0.25", facecolor=color, edgecolor="none", alpha=0.9))
    t.set_gid(BADGE_GID)
    for spine in ax.spines.values():
        spine.set_edgecolor(color)
        spine.set_linestyle("-" if kind == "measured" else "--" if kind == "projected" else ":")


def run_provenance(df) -> str:
    """'emulated' when any of these runs had its gpu tier emulated on the CPU (the store's flag, or
    the realized device ``cpu-emulated``), else 'measured'."""
    col = "hardware.store.gpu.emulated"
    if col in df.columns and bool(df[col].fillna(False).astype(bool).any()):
        return "emulated"
    col = "run.realized.device"
    if col in df.columns and bool(df[col].astype(str).str.contains("emulated").any()):
        return "emulated"
    return "measured"


def provenance_of(ax) -> Optional[str]:
    """The provenance :func:`badge` wrote on ``ax`` (None when the panel has no badge)."""
    for t in ax.texts:
        if t.get_gid() == BADGE_GID:
            head = t.get_text().split("\n")[0]
            return next(k for k, (text, _) in PROVENANCE.items() if text == head)
    return None


def times_ticks(axis) -> None:
    """Readable log ticks for a ratio axis: '0.5x', '1x', '2x', '6x' (never '6x10^0')."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fmt = FuncFormatter(lambda v, _: f"{v:g}x")
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(fmt)
    axis.set_minor_formatter(NullFormatter())


def plain_log_ticks(axis, unit: str = "") -> None:
    """Readable log ticks for a quantity: '2', '5', '10', '20' (+ unit), no powers of ten."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}{unit}"))
    axis.set_minor_formatter(NullFormatter())


def does_not_fit_handle(color: str = "0.4"):
    """The legend entry for the hatched "does not fit" mark."""
    from matplotlib.patches import Patch

    return Patch(facecolor="none", edgecolor=color, hatch=DOES_NOT_FIT_HATCH, label=DOES_NOT_FIT)


def wrap(text: str, width: int = 60) -> str:
    """A title wrapped onto lines of at most ``width`` characters (never cut)."""
    return "\n".join(textwrap.fill(part, width) for part in text.split("\n"))
