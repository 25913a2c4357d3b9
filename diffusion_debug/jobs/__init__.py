"""Ready-made debug jobs behind the CLI commands."""
