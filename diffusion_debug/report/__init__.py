"""Reports built from a saved run directory alone (never from live objects), so a report can
be rebuilt later, on another machine, without a GPU."""

from ..record import RunData, load_run
from .html import write_html

__all__ = ["RunData", "load_run", "write_html"]
