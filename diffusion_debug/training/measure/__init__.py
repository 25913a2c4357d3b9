"""What a rank measures on its own device in a training step, and the one transfer that brings it to the host."""
