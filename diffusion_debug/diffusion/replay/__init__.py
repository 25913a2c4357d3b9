"""Replaying a failing component call: repro bundles, private copies, and ``why`` (one factor changed at a time)."""
