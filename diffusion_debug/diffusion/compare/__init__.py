"""Two setups of a pipeline compared on the same call and seed: the first component, step and module
where they drift apart, made there or received (:func:`compare_pipelines`); two saved runs compared
as far as their records allow (:func:`compare_run_dirs`, ``diffusion-debug diff``)."""

from .comparison import Comparison, Divergence, ModuleDivergence, StepDivergence
from .pipelines import compare_pipelines
from .saved_runs import compare_run_dirs

__all__ = ["Comparison", "Divergence", "ModuleDivergence", "StepDivergence", "compare_pipelines", "compare_run_dirs"]
