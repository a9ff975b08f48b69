"""How values move between pipeline ranks: the point-to-point mailbox, the runner's own
collectives, and flattening many tensors into one message."""
