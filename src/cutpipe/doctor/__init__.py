"""What a machine needs for pipelined training on GPUs: the checks behind ``cutpipe doctor``.

A V schedule (ZB-V, DualPipeV, Cut-in-half) puts two stages on every rank, so every rank sends
twice per microbatch in each direction where 1F1B sends once; its stages are half as long, so
fixed costs per op weigh twice as much; and a rank keeps two stages' activations alive at once.
The checks look at what decides how well a machine takes that (docs/deployment.md):

- ``gathering``: the facts of this machine and process, as a ``Machine`` (``gather``);
- ``findings``: what one check says, a ``Finding``, and its statuses;
- ``gpu_checks``: torch, CUDA, the GPUs, NCCL's version, bf16, CUDA graphs, the allocator;
- ``nccl_checks``: NCCL's settings for the doubled traffic, inside a node and between nodes;
- ``report``: every check in order (``diagnose``), and the lines to print before a run.

Importing any of them never imports torch; ``gather`` does when called.
"""
