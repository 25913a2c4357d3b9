"""Two setups of a pipeline compared on the same call and seed: the first component, step and module
where they drift apart, made there or received (:func:`compare_pipelines`)."""

from .comparison import Comparison, Divergence, ModuleDivergence, StepDivergence
from .pipelines import compare_pipelines

__all__ = ["Comparison", "Divergence", "ModuleDivergence", "StepDivergence", "compare_pipelines"]
