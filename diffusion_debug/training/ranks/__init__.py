"""What the ranks of a multi-process run know of each other: processes, the per-step exchange, replica agreement."""
