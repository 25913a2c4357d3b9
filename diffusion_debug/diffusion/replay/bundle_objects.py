"""The plain objects a repro bundle holds (a component's own state passed as an object: GLM-Image's
``kv_caches``, Flux2 Klein's ``kv_cache``), made again for a replay from their class's name and attributes.

A class is found by name only among those the component's own module defines (diffusers keeps each cache class
beside its transformer): nothing is imported and no ``__init__`` runs, so a crafted ``meta.json`` makes no
object of any other class. Limit: a cache class defined elsewhere than its component's module is replayed as None.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from ..components.kept_calls import plain_class


def made_object(name: Any, attributes: Any, classes: dict[str, type]) -> Any:
    """A packed object made again (as a kept call makes its own state at each use: its class's ``__new__``, its
    attributes set, no ``__init__`` run), of a class found by name only among ``classes``: the plain classes
    the component's own module defines (:func:`own_classes`; GLM-Image's cache classes beside its
    transformer). Any other (transformers' ``DynamicCache``, a class a crafted file names) is None, as every
    object was before bundles kept them: nothing is imported.

    >>> class Layer: ...
    >>> made = made_object("Layer", {"mode": "read"}, {"Layer": Layer})
    >>> type(made).__name__, made.mode, made_object("os.system", {}, {"Layer": Layer})
    ('Layer', 'read', None)
    """
    cls = classes.get(name) if isinstance(name, str) else None
    if cls is None or not isinstance(attributes, dict):
        return None
    made = cls.__new__(cls)
    vars(made).update(attributes)
    return made


def own_classes(model: nn.Module) -> dict[str, type]:
    """The classes the module of ``model``'s class defines whose objects a bundle may hold (the plain objects
    of :func:`~..components.kept_calls.kept_as_passed`, :func:`~..components.kept_calls.plain_class`: not a
    module, a tensor, a container, an Enum, a callable (an attention processor), nor with ``__slots__`` or its
    own ``__new__``)."""
    where = type(model).__module__
    defined = vars(sys.modules[where]) if where in sys.modules else {}
    return {
        name: value
        for name, value in defined.items()
        if isinstance(value, type) and value.__module__ == where and plain_class(value)
    }
