"""What an op does to a rank's stage modules: run them (with the B/W split, recompute and the
phases of overlapped pairs), or sleep for their cost, and meter the activations they keep."""
