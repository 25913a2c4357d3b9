"""One monitored training step's plumbing: what is kept between steps, which steps read the per-module
figures, the policy at its end, what it leaves behind."""
