"""Schedule generators, one short module each, and the registry that names them."""

from cutpipe.schedule.generators.dualpipe import dualpipe
from cutpipe.schedule.generators.dualpipev import dualpipev
from cutpipe.schedule.generators.gpipe import gpipe
from cutpipe.schedule.generators.interleaved import interleaved
from cutpipe.schedule.generators.interleaved_zb import interleaved_zb
from cutpipe.schedule.generators.looped_bfs import looped_bfs
from cutpipe.schedule.generators.one_f_one_b import one_f_one_b
from cutpipe.schedule.generators.zb_h1 import zb_h1
from cutpipe.schedule.generators.zb_h2 import zb_h2
from cutpipe.schedule.generators.zbv import zbv

__all__ = [
    "dualpipe",
    "dualpipev",
    "gpipe",
    "interleaved",
    "interleaved_zb",
    "looped_bfs",
    "one_f_one_b",
    "zb_h1",
    "zb_h2",
    "zbv",
]
