"""Judges: measured values of a training step in, anomalies out (no collectives, no record)."""
