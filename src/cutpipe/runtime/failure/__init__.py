"""No hangs and no silent disagreement: ranks agree on the step before running it, beat their
heart while they run it, and when one fails or stalls every rank stops naming the cause."""
