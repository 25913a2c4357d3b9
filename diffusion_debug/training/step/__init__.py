"""One monitored training step's plumbing: what is kept between steps, the policy at its end, what it leaves behind."""
