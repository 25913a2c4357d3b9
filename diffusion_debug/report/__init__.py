"""Reports built from a saved run directory alone (never from live objects), so a report can
be rebuilt later, on another machine, without a GPU."""

from ..record import RunData, load_run

__all__ = ["RunData", "load_run", "write_html"]


def __getattr__(name: str):
    # the page's stack (jinja2, matplotlib: half a second) loads when a report is first written,
    # not in every process that imports a debugger (seven of eight ranks never write one)
    if name == "write_html":
        from .html import write_html

        return write_html
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
