"""Colours and patterns shared by every picture.

Kinds differ in lightness as well as hue, so they stay apart in greyscale: F is the lightest,
then B, W, BW, and FB the darkest (relative luminance 0.69, 0.52, 0.40, 0.19, 0.05). The second
direction of DualPipe (and the second leg of a V) keeps its kind's colour, hatched, with a darker
edge.
"""

from __future__ import annotations

KIND_COLOURS = {
    "F": "#c6dbef",  # light blue
    "B": "#fdae6b",  # light orange
    "W": "#66bd63",  # green
    "BW": "#d94801",  # dark orange
    "FB": "#54278f",  # dark purple
}
KIND_NAMES = {
    "F": "F forward",
    "B": "B input backward",
    "W": "W weight backward",
    "BW": "BW full backward",
    "FB": "F&B overlapped pair",
}
LEG_HATCH = {0: "", 1: "///"}
LEG_EDGE = {0: "#4d4d4d", 1: "#111111"}
IDLE_COLOUR = "#ececec"
TEXT_ON = {"F": "#000000", "B": "#000000", "W": "#000000", "BW": "#ffffff", "FB": "#ffffff"}


def relative_luminance(colour: str) -> float:
    """WCAG relative luminance of a #rrggbb colour (what a greyscale print keeps)."""
    channels = [int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]
