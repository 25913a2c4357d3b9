"""The job behind ``diffusion-debug inspect``: the components of a pipeline, as tables or as JSON.

Limits: a static look (parameters, dtypes, devices, sizes, the scheduler's config); nothing runs.
"""

from __future__ import annotations

from . import pipeline_loading as loading  # looked up at call time: tests plant a loader there


def inspect_pipeline(
    model: str | None, kind: str = "sd", dtype: str = "float32", device: str | None = None, *, as_json: bool = False
) -> int:
    """Print what the pipeline holds; the exit code."""
    from ..diffusion.components.inventory import analyze_pipeline
    from ..record import dumps
    from ..report.terminal import components_table, table

    pipe = loading.load_pipeline(model, kind, dtype, device)
    analysis = analyze_pipeline(pipe)
    if as_json:
        print(dumps(analysis, indent=1))
        return 0
    components = {k: v for k, v in analysis.items() if isinstance(v, dict) and "parameters" in v}
    print(f"{type(pipe).__name__}: {analysis['total_parameters']:,} parameters")
    print(components_table(components))
    scheduler = analysis.get("scheduler") or {}
    if scheduler:
        print(f"\nscheduler {scheduler.get('class', '')}")
        options = sorted((scheduler.get("config") or {}).items())
        # str(): False and None are values here, not blanks
        print(table(["option", "value"], [(k, str(v) if v is None or isinstance(v, bool) else v) for k, v in options]))
    return 0
