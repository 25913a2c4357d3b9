"""Replaying a failing component call: which replays a call's readings call for and what they name (``decide``),
repro bundles, private copies, and ``why`` (one factor changed at a time)."""
