"""A pipeline call's dealings with its VAE, read from its source with :mod:`ast` for
:func:`~diffusion_debug.diffusion.components.vae_details.call_facts`: whether the latents each ``self.vae.decode`` is
handed are cast to the VAE's dtype on every path to it (:class:`Flow`, statement by statement, the methods of the
pipeline the call hands its latents read where they decode), and whether the call reaches the VAE's encode
(:meth:`Flow.encodes`). Pure reading: no pipeline is called, nothing is imported.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

_ENCODES = frozenset({"encode", "_encode", "tiled_encode"})
_UNDOING = frozenset({"half", "bfloat16", "double", "type", "int", "long"})
_FLOAT32 = frozenset({"float32", "float"})


def _self_vae(node: ast.AST) -> bool:
    """Whether ``node`` is ``self.vae`` or an attribute, call or subscript on it (``self.vae.config``,
    ``next(iter(self.vae.post_quant_conv.parameters()))``)."""
    while True:
        if isinstance(node, ast.Attribute):
            if node.attr == "vae" and isinstance(node.value, ast.Name) and node.value.id == "self":
                return True
            node = node.value
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            node = node.func.value
        elif isinstance(node, ast.Call) and node.args:
            node = node.args[0]
        else:
            return False


def _decode_call(node: ast.AST) -> bool:
    func = getattr(node, "func", None)
    return (
        isinstance(node, ast.Call)
        and isinstance(func, ast.Attribute)
        and func.attr == "decode"
        and (_self_vae(func.value) and isinstance(func.value, ast.Attribute) and func.value.attr == "vae")
    )


class Flow:
    """Which names hold a value cast to the VAE's dtype (``cast``) and which name the VAE's dtype (``dtypes``),
    statement by statement; a branch's end merged by intersection (cast on every path), a path that returns or
    raises dropped. ``found`` collects, per decode met, whether its latents were cast; a method of ``owner`` the
    call calls (``self.decode_latents(latents)``) is read where it decodes, its parameters bound to what it is given
    (``helpers``: those that decode; ``direct``: a decode in the call itself)."""

    def __init__(self, owner: type | None = None) -> None:
        self.found: list[bool] = []
        self.owner, self.helpers, self.direct, self.depth = owner, set(), False, 0
        self.parsed: dict[str, Any] = {}
        self.sources: dict[str, tuple[str, bool]] = {}
        self.seen: dict[str, int] = {}  # (the methods :meth:`encodes` read, by the least depth met at)

    def decodes_cast(self, function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool | None:
        self.block(function.body, (frozenset(), frozenset()))
        return all(self.found) if self.found else None

    # -- expressions
    def vae_dtype(self, node: ast.AST, state: tuple[frozenset, frozenset]) -> bool:
        """Whether ``node`` names the VAE's dtype, or float32 (a float32 VAE's)."""
        if isinstance(node, ast.Name):
            return node.id in state[1]
        if isinstance(node, ast.Attribute):
            if node.attr == "dtype":
                return _self_vae(node.value) or self.cast(node.value, state)
            return node.attr in _FLOAT32 and isinstance(node.value, ast.Name) and node.value.id == "torch"
        return False

    def cast(self, node: ast.AST | None, state: tuple[frozenset, frozenset]) -> bool:
        """Whether the value of ``node`` is cast to the VAE's dtype."""
        if node is None:
            return False
        if isinstance(node, ast.Name):
            return node.id in state[0]
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute):
                if func.attr == "to":
                    dtypes = [*node.args, *(kw.value for kw in node.keywords if kw.arg == "dtype")]
                    if any(self.vae_dtype(arg, state) for arg in dtypes):
                        return True
                    if any(kw.arg == "dtype" for kw in node.keywords) or any(_dtype_like(arg) for arg in node.args):
                        return False  # another dtype
                    return self.cast(func.value, state)  # (a device alone)
                if func.attr == "float":
                    return True
                if func.attr in _UNDOING:
                    return False
                if self.cast(func.value, state):  # a method of a cast value (.permute, .unsqueeze, .clone)
                    return True
            args = [*node.args, *(kw.value for kw in node.keywords)]
            return any(self.cast(arg, state) for arg in args)  # torch.cat([...]), self._unpack_latents(latents)
        if isinstance(node, ast.BinOp):
            return self.cast(node.left, state) or self.cast(node.right, state)
        if isinstance(node, ast.UnaryOp):
            return self.cast(node.operand, state)
        if isinstance(node, ast.IfExp):
            return self.cast(node.body, state) and self.cast(node.orelse, state)
        if isinstance(node, (ast.Subscript, ast.Starred)):
            return self.cast(node.value, state)
        if isinstance(node, (ast.List, ast.Tuple)):
            return bool(node.elts) and all(self.cast(elt, state) for elt in node.elts)
        if isinstance(node, (ast.ListComp, ast.GeneratorExp)):
            return self.cast(node.elt, self.comprehension(node, state))
        return False

    def comprehension(self, node: Any, state: tuple[frozenset, frozenset]) -> tuple[frozenset, frozenset]:
        """``state`` with each generator's target bound to its iterable's cast."""
        for generator in node.generators:
            state = self.bind(generator.target, self.cast(generator.iter, state), False, state)
        return state

    def decodes_in(self, node: ast.AST, state: tuple[frozenset, frozenset]) -> None:
        """Every ``self.vae.decode`` call in the expression ``node``, judged in ``state``."""
        if isinstance(node, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return
        if isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp, ast.DictComp)):
            state = self.comprehension(node, state)
        if _decode_call(node):
            self.found.append(bool(node.args) and self.cast(node.args[0], state))
            self.direct = self.direct or self.depth == 0
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and self.depth < 2:
            if isinstance(node.func.value, ast.Name) and node.func.value.id == "self":
                self.helper(node.func.attr, node, state)
        for child in ast.iter_child_nodes(node):
            self.decodes_in(child, state)

    def source(self, name: str, static: bool = False) -> str:
        """The source of the owner's method ``name`` ("": none, or not readable: made by ``exec``, in a REPL;
        ``static``: a static or class method's too), read once per name whether ``static`` or not."""
        if name not in self.sources:
            method = inspect.getattr_static(self.owner, name, None) if self.owner is not None else None
            function = getattr(method, "__func__", method)
            try:
                read = textwrap.dedent(inspect.getsource(function)) if inspect.isfunction(function) else ""
            except (OSError, TypeError):
                read = ""
            self.sources[name] = (read, function is not method)
        read, wrapped = self.sources[name]
        return read if static or not wrapped else ""

    def encodes(self, function: ast.AST, depth: int) -> bool:
        """Whether ``function`` reaches the VAE's encode (``self.vae.encode``, ``._encode``, ``vae.encode`` of a
        static method given it), itself or in a method of the owner it calls, three calls deep at most (Visual
        Cloze's ``prepare_latents`` -> ``_prepare_latents`` -> ``_encode_vae_image``)."""
        for node in ast.walk(function):
            func = getattr(node, "func", None)
            if not isinstance(node, ast.Call) or not isinstance(func, ast.Attribute):
                continue
            if func.attr in _ENCODES and (_self_vae(func.value) or getattr(func.value, "id", None) == "vae"):
                return True
            if getattr(func.value, "id", None) == "self" and depth < self.seen.get(func.attr, 3):
                self.seen[func.attr] = depth  # (met shallower than before: read again, its calls deeper)
                source = self.source(func.attr, static=True)
                if ("self." in source or "vae." in source) and self.encodes(ast.parse(source), depth + 1):
                    return True
        return False

    def helper(self, name: str, call: ast.Call, state: tuple[frozenset, frozenset]) -> None:
        """The decodes in the method ``name`` of the owner that ``call`` calls, its parameters bound to its
        arguments' casts."""
        if name not in self.parsed:
            source = self.source(name)
            self.parsed[name] = ast.parse(source).body[0] if "self.vae.decode" in source else None
        function = self.parsed[name]
        if function is None:
            return
        params = [arg.arg for arg in [*function.args.posonlyargs, *function.args.args]][1:]
        given = {**dict(zip(params, call.args)), **{kw.arg: kw.value for kw in call.keywords if kw.arg}}
        casts = frozenset(param for param, value in given.items() if self.cast(value, state))
        dtypes = frozenset(param for param, value in given.items() if self.vae_dtype(value, state))
        before, self.depth = len(self.found), self.depth + 1
        try:
            self.block(function.body, (casts, dtypes))
        finally:
            self.depth -= 1
        if len(self.found) > before:
            self.helpers.add(name)

    # -- statements
    def bind(
        self, target: ast.AST, cast: bool, dtype: bool, state: tuple[frozenset, frozenset]
    ) -> tuple[frozenset, frozenset]:
        if isinstance(target, ast.Name):
            casts, dtypes = state[0] - {target.id}, state[1] - {target.id}
            return (casts | {target.id} if cast else casts, dtypes | {target.id} if dtype else dtypes)
        if isinstance(target, (ast.Tuple, ast.List)):
            for elt in target.elts:
                state = self.bind(elt, False, False, state)
        return state

    def block(self, body: list[ast.stmt], state: tuple[frozenset, frozenset] | None) -> Any:
        for statement in body:
            if state is None:
                return None
            state = self.statement(statement, state)
        return state

    def statement(self, node: ast.stmt, state: tuple[frozenset, frozenset]) -> Any:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):  # (its decodes, read where it is made)
            own = {arg.arg for arg in ast.walk(node.args) if isinstance(arg, ast.arg)}
            self.block(node.body, (state[0] - own, state[1] - own))
            return state
        if isinstance(node, ast.ClassDef):
            return state
        if isinstance(node, (ast.Return, ast.Raise, ast.Break, ast.Continue)):
            self.decodes_in(node, state)
            return None
        if isinstance(node, ast.If):
            self.decodes_in(node.test, state)
            return _merge(self.block(node.body, state), self.block(node.orelse, state))
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            head = node.iter if isinstance(node, (ast.For, ast.AsyncFor)) else node.test
            self.decodes_in(head, state)
            entry = state
            for _ in range(2):  # the body's second pass starts from what the first left
                inside = state
                if isinstance(node, (ast.For, ast.AsyncFor)):
                    inside = self.bind(node.target, self.cast(node.iter, state), False, state)
                state = _merge(entry, self.block(node.body, inside))
            return _merge(state, self.block(node.orelse, state))
        if isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                self.decodes_in(item.context_expr, state)
            return self.block(node.body, state)
        if isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            done = self.block(node.body, state)
            ends = [self.block(handler.body, state) for handler in node.handlers]
            after = _merge(done, *ends) if node.handlers else done
            after = self.block(node.orelse, after) if node.orelse and after is not None else after
            return self.block(node.finalbody, after) if node.finalbody and after is not None else after
        self.decodes_in(node, state)
        if isinstance(node, ast.Assign):
            cast, dtype = self.cast(node.value, state), self.vae_dtype(node.value, state)
            for target in node.targets:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    for elt, value in zip(target.elts, node.value.elts):
                        state = self.bind(elt, self.cast(value, state), self.vae_dtype(value, state), state)
                else:
                    state = self.bind(target, cast, dtype, state)
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            state = self.bind(node.target, self.cast(node.value, state), self.vae_dtype(node.value, state), state)
        elif isinstance(node, ast.AugAssign):
            state = self.bind(node.target, self.cast(node.target, state) or self.cast(node.value, state), False, state)
        return state


def _merge(*states: Any) -> Any:
    """What holds on every path that goes on (None: none does)."""
    going = [state for state in states if state is not None]
    if not going:
        return None
    return (frozenset.intersection(*(s[0] for s in going)), frozenset.intersection(*(s[1] for s in going)))


def _dtype_like(node: ast.AST) -> bool:
    """Whether ``node`` reads as a dtype (``torch.float16``, ``dtype``, ``x.dtype``): a ``.to`` to it casts."""
    if isinstance(node, ast.Attribute):
        return node.attr == "dtype" or isinstance(node.value, ast.Name) and node.value.id == "torch"
    return isinstance(node, ast.Name) and "dtype" in node.id
