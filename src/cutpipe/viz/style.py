"""Colours and patterns shared by every picture.

Kinds differ in lightness as well as hue, so they stay apart in greyscale: F is the lightest,
then B, W, BW, and FB the darkest (relative luminance 0.69, 0.52, 0.40, 0.19, 0.05). The second
direction of DualPipe (and the second leg of a V) keeps its kind's colour, hatched, with a darker
edge. Between steps, the all-reduce (AR) and the optimizer step (OPT) are hatched with a pattern
of their own, so they stay apart from every op in greyscale too; odd steps are drawn lighter.
"""

from __future__ import annotations

KIND_COLOURS = {
    "F": "#c6dbef",  # light blue
    "B": "#fdae6b",  # light orange
    "W": "#66bd63",  # green
    "BW": "#d94801",  # dark orange
    "FB": "#54278f",  # dark purple
    "AR": "#f1b6da",  # pink, dotted
    "OPT": "#fee391",  # yellow, crossed
}
KIND_NAMES = {
    "F": "F forward",
    "B": "B input backward",
    "W": "W weight backward",
    "BW": "BW full backward",
    "FB": "F&B overlapped pair",
    "AR": "gradient all-reduce (all ranks wait)",
    "OPT": "optimizer step",
}
#: Kinds told apart by a pattern of their own (not ops of the schedule: what runs between steps).
KIND_HATCH = {"AR": "....", "OPT": "xxx"}
#: How opaque the boxes of odd steps are, so consecutive steps stand apart.
ODD_STEP_ALPHA = 0.5
#: What a legend adds to a kind's name: how to read the box's label where it is not a plain
#: microbatch number.
KIND_LABEL_NOTES = {"FB": "label: forward mb / backward mb"}
LEG_HATCH = {0: "", 1: "///"}
LEG_EDGE = {0: "#4d4d4d", 1: "#111111"}
IDLE_COLOUR = "#ececec"
TEXT_ON = {"F": "#000000", "B": "#000000", "W": "#000000", "BW": "#ffffff", "FB": "#ffffff",
           "AR": "#000000", "OPT": "#000000"}  # fmt: skip
#: Rows that repeat an earlier schedule's rows are bracketed in this colour, apart from every kind.
SHARED_COLOUR = "#b2182b"
#: What live activation memory is counted in (``Costs.activation``: what one F of one stage
#: leaves live for its backward), so a memory axis can say it.
MEMORY_UNIT = "stage-microbatch activations"


def legend_name(kind: str) -> str:
    """A kind's legend entry: its name, and how to read its box label where that needs saying."""
    note = KIND_LABEL_NOTES.get(kind)
    return f"{KIND_NAMES[kind]} ({note})" if note else KIND_NAMES[kind]


def relative_luminance(colour: str) -> float:
    """WCAG relative luminance of a #rrggbb colour (what a greyscale print keeps)."""
    channels = [int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]
