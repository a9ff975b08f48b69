"""Pictures of timelines: PNG/SVG (matplotlib), an interactive HTML page, Chrome traces.

Nothing here imports torch; the PNG writer imports matplotlib when it is used.
"""

from cutpipe.viz.scene import Box, Panel, Scene, panel, scene

__all__ = ["Box", "Panel", "Scene", "panel", "scene"]
