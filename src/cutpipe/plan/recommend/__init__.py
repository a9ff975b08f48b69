"""Which schedule and parallel layout to run (``cutpipe recommend``): every fitting layout
simulated, the best ranked, and why the others were refused."""
