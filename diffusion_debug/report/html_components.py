"""The components section of report.html: a table of the pipeline's (or the trained model's)
components, their configs, the modules with the largest gradient norms and the training summary."""

from __future__ import annotations

import math

from ..record import RunData
from .html_cells import cell, escape, kv_table, named_rows_table
from .plots_common import number


def components_section(run: RunData) -> str:
    """The components section: the components table, configs, gradient norms, training summary."""
    s = run.summary
    components = s.get("components") or {}
    parts = ["<section id='components'><h2>Components</h2>"]
    rows = []
    for name, info in components.items():
        if not isinstance(info, dict) or not ("parameters" in info or "trainable_parameters" in info):
            continue
        rows.append(
            (
                name,
                info.get("class"),
                info.get("role"),
                info.get("parameters", info.get("trainable_parameters")),
                info.get("dtype"),
                info.get("device"),
                info.get("calls"),
                info.get("total_time_s"),
                info.get("mean_time_s"),
                info.get("peak_memory_mb"),
            )
        )
    headers = [
        "component",
        "class",
        "role",
        "parameters",
        "dtype",
        "device",
        "calls",
        "total time s",
        "mean time s",
        "peak CUDA MB" if any(str(r[5]).startswith("cuda") for r in rows) else "process RSS MB (peak)",
    ]
    if rows:
        keep = [i for i in range(len(headers)) if any(r[i] is not None for r in rows)]
        head = "".join(f"<th>{escape(headers[i])}</th>" for i in keep)
        body = "".join(
            "<tr>" + "".join(cell(r[i]) if i else f"<td><code>{escape(r[i])}</code></td>" for i in keep) + "</tr>"
            for r in rows
        )
        parts.append(f"<div class='scroll'><table><tr>{head}</tr>{body}</table></div>")
    for name, info in components.items():
        if isinstance(info, dict) and isinstance(info.get("config"), dict) and "parameters" not in info:
            parts.append(f"<h3>{escape(name)}: {escape(info.get('class', ''))}</h3>")
            parts.append(kv_table(list(info["config"].items()), per_row=3))
    model = components.get("model") if isinstance(components.get("model"), dict) else None
    if model:
        facts = [
            (k.replace("_", " "), model[k])
            for k in ("trainable_tensors", "modules_with_trainable_parameters", "num_train_timesteps")
            if k in model
        ]
        parts.append(kv_table(facts, per_row=3))
        largest = model.get("module_grad_norm_max")
        last = model.get("module_grad_norm_last") or {}
        if isinstance(largest, dict) and largest:
            ranked = sorted(
                largest.items(), key=lambda item: -number(item[1]) if math.isfinite(number(item[1])) else -math.inf
            )[:10]
            rows = [(m, v, last.get(m) if isinstance(last, dict) else None) for m, v in ranked]
            table = named_rows_table(("module", "largest norm", "last norm"), rows)
            parts.append(f"<h3>Largest gradient norms per module</h3>{table}")
    training = s.get("training")
    if isinstance(training, dict):
        parts.append("<h3>Training summary</h3>")
        parts.append(
            kv_table([(k.replace("_", " "), v) for k, v in training.items() if not isinstance(v, dict)], per_row=4)
        )
    if len(parts) == 1:
        parts.append("<p class='note'>No component information was recorded.</p>")
    parts.append("</section>")
    return "".join(parts)
