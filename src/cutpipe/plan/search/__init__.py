"""Cost-aware schedules (``cutpipe tune``): named passes over rank orders, under a memory cap.

``tune.cost_aware`` runs the passes in this order, timing every candidate with the simulator:

1. ``list_schedule``: one greedy order per rank by simulated time, for each ``Policy``;
2. the fixed orders (``tune.FIXED``) that fit the cap join the candidates;
3. ``rounds.rounds_schedule`` (on a V): one backward and one forward per rank per round, W
   passes held back for the cool-down;
4. ``fill.fill_weights``: the best few keep their F and B order, their W passes re-placed;
5. ``cooldown.settle_cooldown``: each rank's tail re-sequenced by critical path;
6. ``local_search.local_search``: swaps and W delays on one rank per simulation;
7. ``expedite.expedite``: the ops that wait for their rank on the critical path moved earlier.

Shared by the passes: ``events`` (ranks advancing in simulated time), ``caps`` (the default and
least caps, and whether memory fits), ``round_trips`` (when a rank's first gradient can come
back). After the search, if asked: ``polish`` (CP-SAT around a schedule), ``exact`` (CP-SAT for
small shapes). Yardsticks: ``bounds`` (lower bounds) and ``frontier`` (the best at every cap).
"""
