"""Reports built from a saved run directory alone (never from live objects), so a report can
be rebuilt later, on another machine, without a GPU."""

from .html import write_html
from .load import RunData, load_run

__all__ = ["RunData", "load_run", "write_html"]
