"""Cost-aware schedules (``cutpipe tune``): list scheduling, then named passes that improve the
order under a memory cap, the lower bounds they are held against, and the memory/bubble
frontier."""
