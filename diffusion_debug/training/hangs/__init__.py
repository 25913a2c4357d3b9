"""Naming a hang before the collective's watchdog fires: where each rank is, read through a
side channel that cannot hang."""
