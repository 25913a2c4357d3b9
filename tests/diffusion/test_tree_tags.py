"""The tree memo's per-call test by dict version tags (components/tree_tags.py): an unchanged tree is
not walked, and every change the walk's key sees is still seen — each kind below fails a test that
misses it (checked by dropping each part of the tagged dicts in turn: the non-root ``__dict__``s, the
``_modules``, the ``_parameters``, the registries below the root, the root's own dicts read through
it, and the lengths where the reader misses a clone)."""

from __future__ import annotations

import itertools
import sys

import pytest
import torch
from diffusion_helpers import run
from torch import nn

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion.components import structure, tree_tags
from diffusion_debug.diffusion.components.structure import TreeMemo, tree_key
from diffusion_debug.testing import tiny_pipeline
from diffusion_debug.testing.features import HAS_CACHE_HOOKS

NO_HOOKS = pytest.mark.skipif(not HAS_CACHE_HOOKS, reason="this diffusers has no hook registry (diffusers.hooks)")
NO_READER = pytest.mark.skipif(tree_tags.READ is None, reason="this torch/Python reads no dict version tags")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        self.proj = nn.Linear(2, 2)

    def forward(self, x):
        return self.proj(self.inner(x))


def tree() -> nn.Module:
    return nn.Sequential(Block(), Block(), nn.Linear(2, 2))


def registry(module):
    from diffusers.hooks import HookRegistry

    return HookRegistry.check_if_exists_or_initialize(module)


def hook():
    from diffusers.hooks import ModelHook

    return ModelHook()


CHANGES = {  # each a change of the walk's key, made deep in the tree unless named "root"
    "setattr of a module": lambda net: setattr(net[1].inner[1], "extra", nn.Linear(2, 2)),
    "a module replaced (a LoRA layer set in)": lambda net: setattr(net[0].inner, "0", nn.Linear(2, 2)),
    "del of a submodule": lambda net: delattr(net[1], "proj"),
    "_modules[...] = write": lambda net: net[0].inner._modules.__setitem__("1", nn.ReLU()),
    "_modules.pop and add elsewhere": lambda net: net[1].add_module("moved", net[0].inner._modules.pop("1")),
    "child registered as None": lambda net: net[0].inner._modules.__setitem__("1", None),
    "_modules dict replaced": lambda net: setattr(net[0], "_modules", dict(reversed(net[0]._modules.items()))),
    "a leaf's empty _modules updated (a clone)": lambda net: net[2]._modules.update({"x": nn.ReLU()}),
    "a parameter set": lambda net: setattr(net[0].proj, "weight", nn.Parameter(torch.zeros(2, 2))),
    "_parameters[...] = write (accelerate's)": lambda net: (
        net[1].inner[0]._parameters.__setitem__("bias", nn.Parameter(torch.zeros(2)))
    ),
    "a parameter popped": lambda net: net[1].inner[0]._parameters.pop("bias"),
    "a parameter set on a module that had none (its empty _parameters)": lambda net: setattr(
        net[1].inner[1], "scale", nn.Parameter(torch.ones(()))
    ),
    "a parameter set on a container (its empty _parameters)": lambda net: setattr(
        net[0].inner, "scale", nn.Parameter(torch.ones(()))
    ),
    "module.compile() below the root": lambda net: net[1].compile(backend="eager"),
    "root: module.compile()": lambda net: net.compile(backend="eager"),
    "root: a method compiled in place": lambda net: setattr(
        net, "forward", torch.compile(net.forward, backend="eager")
    ),
    "root: a child added": lambda net: net.append(nn.Linear(2, 2)),
    "root: a parameter set": lambda net: setattr(net, "scale", nn.Parameter(torch.ones(()))),
}
HOOKS = {
    "a diffusers registry below the root": lambda net: registry(net[0].proj),
    "a hook added to a registry below the root": lambda net: registry(net[0].proj).register_hook(hook(), "x"),
    "a hook written into a registry's hooks": lambda net: registry(net[0].proj).hooks.__setitem__("y", hook()),
    "a registry's hooks dict replaced": lambda net: setattr(registry(net[0].proj), "hooks", {}),
    "root: a diffusers registry": lambda net: registry(net),
    "root: a hook written into its registry's hooks": lambda net: registry(net).hooks.__setitem__("y", hook()),
    "root: its registry's hooks dict replaced": lambda net: setattr(registry(net), "hooks", {"z": hook()}),
}


def prepared(name: str) -> nn.Module:
    net = tree()
    if name.startswith(("a hook", "a registry's")):
        registry(net[0].proj).register_hook(hook(), "first")
    if name.startswith(("root: a hook", "root: its")):
        registry(net).register_hook(hook(), "first")
    return net


@pytest.fixture
def walks(monkeypatch):
    """The trees :func:`tree_key` walked (their roots' class names)."""
    found: list[str] = []
    walk = structure.tree_key
    monkeypatch.setattr(structure, "tree_key", lambda root: (found.append(type(root).__name__), walk(root))[1])
    return found


@NO_READER
@pytest.mark.parametrize("name", [*CHANGES, *(pytest.param(name, marks=NO_HOOKS) for name in HOOKS)])
def test_every_change_of_the_key_is_seen_without_a_walk_of_an_unchanged_tree(name, walks):
    change = {**CHANGES, **HOOKS}[name]
    net = prepared(name)
    memo = TreeMemo()
    assert memo.refresh([net]) is True
    key = tree_key(net)[0]
    assert memo.refresh([net]) is False and memo.refresh([net]) is False and memo.refresh([net]) is False
    assert walks == ["Sequential"] * 2  # tagged by the second walk (it found the first's tree): no more walks
    change(net)
    assert tree_key(net)[0] != key  # a change the walk's key sees ...
    assert memo.refresh([net]) is True  # ... seen by the memo
    assert memo.refresh([net]) is False and memo.refresh([net]) is False
    assert walks == ["Sequential"] * 4  # the change's walk, and the one that tags it again


@NO_READER
def test_a_write_that_leaves_the_key_as_it_was_costs_one_walk_and_keeps_the_memo(walks):
    net = tree()
    memo = TreeMemo()
    memo.refresh([net]), memo.refresh([net])  # walked, then walked and tagged
    calls = []
    compute = lambda: calls.append(1) or len(calls)  # noqa: E731
    assert memo.get(net, "n", compute) == 1
    net[0].inner[1].inplace = True  # a flag (as set_adapters' are): written, not in the key
    assert memo.refresh([net]) is False and len(walks) == 3
    assert memo.get(net, "n", compute) == 1
    net[0].inner[1].inplace = True  # the same value again: no write
    assert memo.refresh([net]) is False and len(walks) == 3


@NO_READER
def test_the_dicts_empty_when_tagged_are_tested_for_emptiness_not_read_and_an_empty_one_refilled_is_seen(
    monkeypatch, walks
):
    """Of this tree's 35 dicts below the root, 14 were empty when tagged (the 7 leaves' ``_modules``, the root's,
    the blocks' and the ReLUs' ``_parameters``): a check reads the tags of the 21 others and the root's ``__dict__``;
    an empty dict written
    and emptied again is no change (the walk would read nothing from it either), one left holding something is."""
    net = tree()
    memo = TreeMemo()
    memo.refresh([net]), memo.refresh([net])  # walked, then walked and tagged
    read, counted = tree_tags.READ, []
    monkeypatch.setattr(tree_tags, "READ", lambda found: (counted.append(found), read(found))[1])
    assert memo.refresh([net]) is False and len(walks) == 2
    assert len(counted) == 22 and all(counted) and len(tree_tags._dicts(list(net.modules()))) == 35
    relu = net[1].inner[1]
    relu._parameters["scale"] = nn.Parameter(torch.ones(()))
    del relu._parameters["scale"]  # written, empty again
    assert memo.refresh([net]) is False and len(walks) == 2
    relu._parameters["scale"] = nn.Parameter(torch.ones(()))
    assert memo.refresh([net]) is True and len(walks) == 3


@NO_READER
def test_a_tree_with_an_ordered_dict_is_walked_at_every_refresh(walks):
    """``del module_list[i]`` leaves an OrderedDict ``_modules``, whose ``move_to_end`` reorders the children
    with no write: no tags for that tree, and a reorder is seen by the walk."""
    net = nn.Sequential(nn.ModuleList([nn.Linear(2, 2), nn.ReLU(), nn.Tanh()]))
    del net[0][0]
    assert type(net[0]._modules) is not dict
    memo = TreeMemo()
    memo.refresh([net]), memo.refresh([net])
    assert memo.refresh([net]) is False and len(walks) == 3
    net[0]._modules.move_to_end("0")
    assert memo.refresh([net]) is True and len(walks) == 4


def test_a_reader_that_misses_a_write_is_not_used_and_one_that_misses_a_clone_adds_lengths(monkeypatch):
    assert tree_tags._checked(lambda d: 0) == (None, False, False)
    monkeypatch.setattr(tree_tags, "READ", lambda found: 7)  # sees no write at all ...
    monkeypatch.setattr(tree_tags, "LENGTHS_TOO", True)  # ... but lengths are compared
    net = tree()
    tags = tree_tags.tree_tags(list(net.modules()))
    assert tree_tags.unchanged(net, tags)
    net[2]._modules.update({"x": nn.ReLU()})  # an empty dict filled: only the length tells it
    assert not tree_tags.unchanged(net, tags)


@pytest.mark.skipif(tree_tags.READ is None, reason="no dict version tags")
def test_a_reused_debugger_walks_no_tree_while_none_changes_and_follows_a_lora_and_a_deleted_block(tmp_path, walks):
    peft = pytest.importorskip("peft")
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), probes="full", log_level="error"))

    def attached_modules() -> set[str]:
        with dbg:
            run(pipe, steps=1)
            return set(dbg._steps.probes.probes["unet"].module_names)

    unet = ["UNet2DConditionModel"]
    try:
        first = attached_modules()
        assert attached_modules() == first  # walked again: tagged
        walked = len(walks)
        assert attached_modules() == first and len(walks) == walked  # no walk of an unchanged tree
        pipe.unet.add_adapter(peft.LoraConfig(r=2, target_modules=["to_q"]), adapter_name="one")
        assert {name for name in attached_modules() - first if name.endswith("to_q.lora_A.one")}
        assert walks[walked:] == unet
        pipe.unet.delete_adapters("one")  # (not tagged yet after the change: walked, and would be anyway)
        assert not {name for name in attached_modules() if name.endswith(".one")}
        attached_modules(), attached_modules()
        assert walks[walked:] == unet * 3  # the adapter's deletion walked and tagged; the last not walked
        pipe.unet.mid_block.attentions[0].transformer_blocks[0].attn2 = None  # a child registered as None
        gone = first - attached_modules()
        assert "mid_block.attentions.0.transformer_blocks.0.attn2" in gone
        attached_modules(), attached_modules()
        assert walks[walked:] == unet * 5  # tagged with its None child
    finally:
        dbg.close()


@NO_READER
@pytest.mark.parametrize("where", ["below the root", "root"])
def test_a_hook_attribute_set_to_none_is_no_registry_as_the_walk_reads_it(where, walks):
    """``module._diffusers_hook = None`` (a registry dropped by hand): tree_key reads no registry there;
    the tags did ``vars(None)`` (below the root) and ``None.__dict__`` (at the root) and raised."""
    net = tree()
    memo = TreeMemo()
    memo.refresh([net]), memo.refresh([net])  # walked, then walked and tagged
    (net[1] if where == "below the root" else net)._diffusers_hook = None  # in the key (an entry with no registry)
    assert memo.refresh([net]) is True
    assert memo.refresh([net]) is False  # walked, the same tree: tagged, with the None (raised here)
    assert memo.refresh([net]) is False and memo.refresh([net]) is False
    assert walks == ["Sequential"] * 4  # the write's walk and the tagging one; then tags read, no walk
    net.append(nn.Linear(2, 2))
    assert memo.refresh([net]) is True and len(walks) == 5


class FirstReadTags:
    """torch's reader on Python 3.12+ (a dict watcher, :data:`tree_tags.FIRST_READ_TAGS`), on any Python: a dict
    gets the next tag when first read, and again when read after a write this Python's reader saw."""

    def __init__(self, read):
        self.read, self.count, self.seen = read, itertools.count(1), {}

    def __call__(self, found: dict) -> int:
        version = self.read(found)
        entry = self.seen.get(id(found))
        if entry is None or entry[1] != version:
            entry = self.seen[id(found)] = (found, version, next(self.count))  # (held: no id reused)
        return entry[2]


@pytest.fixture(params=["this Python's reader", "a reader that tags a dict at its first read"])
def reader(request, monkeypatch):
    if request.param != "this Python's reader":
        monkeypatch.setattr(tree_tags, "READ", FirstReadTags(tree_tags.READ))
        monkeypatch.setattr(tree_tags, "FIRST_READ_TAGS", True)
    return request.param


@NO_READER
def test_the_reader_tags_a_dict_when_first_read_from_python_3_12_and_when_made_before():
    """torch's reader: ``ma_version_tag`` before 3.12 (set as a dict is made and at each write); from 3.12 a dict
    watcher's map, a tag given at a dict's first read (which watches it from then on), blind to a clone."""
    made_first, made_next = {}, {}
    assert (tree_tags.READ(made_next) < tree_tags.READ(made_first)) is (sys.version_info >= (3, 12))
    assert tree_tags.FIRST_READ_TAGS is tree_tags.LENGTHS_TOO is (sys.version_info >= (3, 12))


def test_the_reader_is_not_used_on_python_3_13_0_whose_watcher_misses_a_module_attribute_set():
    """CPython gh-125608 (3.13.0 only): an attribute set on an object whose ``__dict__`` shares its inline values
    tells no watcher; ``_checked`` finds it (``setattr(module, ...)``) and every attach walks, as before the tags."""
    guards = pytest.importorskip("torch._C._dynamo.guards")
    if not hasattr(guards, "dict_version") or sys.implementation.name != "cpython":
        pytest.skip("no dict version reader in this torch")
    if not (3, 10) <= sys.version_info[:2] <= (3, 13):
        pytest.skip("read on Pythons 3.10 to 3.13 only: a later one's watcher is not known here")
    assert (tree_tags.READ is None) is (sys.version_info[:3] == (3, 13, 0))


@NO_READER
def test_a_reader_that_tags_at_first_read_tags_the_tree_after_its_second_walk_and_after_a_change(reader, walks):
    """On 3.12+ a tree's dicts never read before got tags newer than the walk, dropped as a write: one walk more
    before the tags held, at first and after each change (3 walks where 2, then 3 where 2). The last walk's tree is
    read before the walk that builds the tags (``start_of_walk``): as many walks as before 3.12, changes all seen."""
    net = tree()
    memo = TreeMemo()
    assert memo.refresh([net]) is True
    assert memo.refresh([net]) is False and memo.refresh([net]) is False and memo.refresh([net]) is False
    assert walks == ["Sequential"] * 2
    net[0].inner.append(nn.Linear(2, 2))  # a module whose dicts were never read
    assert memo.refresh([net]) is True
    assert memo.refresh([net]) is False and memo.refresh([net]) is False
    assert walks == ["Sequential"] * 4
    net[0].inner[2].extra = nn.ReLU()  # a write to one of its dicts, read only since
    assert memo.refresh([net]) is True and walks == ["Sequential"] * 5


@NO_READER
def test_a_write_between_the_walk_and_the_tags_read_is_not_hidden_by_the_tags(monkeypatch, reader):
    """Another thread's write after the walk and before the tags are read: tags read after it would say
    'unchanged' at every later attach, the memo keeping the tree as the walk saw it (its key stale for good)."""
    racing_write(monkeypatch, lambda net: net.append(nn.Linear(2, 2)))


@pytest.mark.parametrize("blind", [False, True], ids=["this Python's reader", "a blind reader, lengths read"])
def test_a_clone_between_the_walk_and_the_tags_read_is_not_hidden_by_the_lengths(monkeypatch, blind):
    """Where the reader misses a clone (an empty dict filled by ``update``: torch's watcher, 3.12+), only the lengths
    tell it; another thread's clone after the walk and before the tags are read was read into the tags' lengths, and
    its tag was unchanged (no ``since`` to find it newer): 'unchanged' at every later attach, the child never seen
    (review M1). The lengths read before the walk are compared with the tags' own: a change drops the tags."""
    if blind:  # (on any Python: a reader that sees no write at all, the lengths compared)
        monkeypatch.setattr(tree_tags, "READ", lambda found: 7)
        monkeypatch.setattr(tree_tags, "LENGTHS_TOO", True)
    elif tree_tags.READ is None or not tree_tags.LENGTHS_TOO:
        pytest.skip("this Python's reader tells a clone by its tag (before 3.12): the since test finds it")
    racing_write(monkeypatch, lambda net: net[0]._modules.update({"x": nn.ReLU()}))  # a clone


def racing_write(monkeypatch, write):
    """``write`` (one more module) lands on a one-layer net after the memo's second walk and before the tags are read:
    the memo must see it at the next refresh (walked again, three modules), then tag the tree."""
    net = nn.Sequential(nn.Linear(2, 2))
    memo = TreeMemo()
    memo.refresh([net])
    walk, walked = structure.tree_key, []

    def racing(root):
        found = walk(root)
        walked.append(1)
        if len(walked) == 1:  # the write lands after the walk, before the tags are read
            write(net)
        return found

    monkeypatch.setattr(structure, "tree_key", racing)
    assert memo.refresh([net]) is False  # the walk found the first's tree; tags would be built here
    assert memo.refresh([net]) is True and len(walked) == 2  # not tagged: walked, the child seen
    assert len(memo._trees[id(net)][1]) == 3 == len(list(net.modules()))
    assert memo.refresh([net]) is False and memo.refresh([net]) is False and len(walked) == 3  # then tagged


@pytest.fixture
def builds(monkeypatch):
    """The trees whose tags were built (their roots' class names)."""
    found: list[str] = []
    build = tree_tags.tree_tags
    monkeypatch.setattr(
        tree_tags, "tree_tags", lambda kept, *read: (found.append(type(kept[0]).__name__), build(kept, *read))[1]
    )
    return found


@NO_READER
def test_a_write_before_every_refresh_that_leaves_the_key_backs_the_tags_off_and_a_hit_resets_them(walks, builds):
    """A flag written before every call (``set_adapters`` alternated) fails the tags at their first read and
    leaves the key: tags were built after every such walk (~0.2 ms, as much as the walk). Now after ``k``
    such failures in a row they are built once in ``2 ** (k - 1)`` walks, once in 64 at most; a tree left
    alone after it is tagged again within 64 walks, and tags read unchanged once reset the count."""
    net = tree()
    memo = TreeMemo()
    built_at = []

    def refresh(index: int) -> None:
        before = len(builds)
        assert memo.refresh([net]) is False or index == 1
        if len(builds) > before:
            built_at.append(index)

    refresh(1), refresh(2)  # walked; walked and tagged
    for index in range(3, 301):
        net[0].inner[1].inplace = bool(index % 2)  # written, not in the key
        refresh(index)
    assert len(walks) == 300
    assert built_at == [2, 3, 5, 9, 17, 33, 65, 129, 193, 257]  # was every refresh from 2 on (299 builds)
    for index in range(301, 340):  # left alone: tagged again within 64 walks of its last build
        refresh(index)
    assert built_at[-1] == 321 and len(walks) == 321  # (the last write's failure at 258: its walk, 63 more)
    net[0].inner[1].inplace = True  # one write after tags read unchanged: a hit had reset the strikes ...
    refresh(340)
    assert built_at[-1] == 340 and len(walks) == 322  # ... so built at its walk, at once
    refresh(341), refresh(342)
    assert len(walks) == 322
    net.append(nn.Linear(2, 2))  # a change is still seen at once
    assert memo.refresh([net]) is True and len(walks) == 323


@NO_READER
def test_set_adapters_alternated_before_each_call_builds_the_unets_tags_a_few_times(tmp_path, walks, builds):
    """peft's ``set_adapters`` alternated before every call writes the UNet's LoRA layers and leaves the key:
    the UNet is walked at each call (as before the tags), its tags built 3 times in 10 calls (was 10), the
    unchanged text encoder and VAE read from their tags."""
    peft = pytest.importorskip("peft")
    pipe = tiny_pipeline("sd")
    for name in ("a", "b"):
        pipe.unet.add_adapter(peft.LoraConfig(r=2, target_modules=["to_q"]), adapter_name=name)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    try:
        for _ in range(2):  # walked; walked and tagged
            with dbg:
                run(pipe, steps=1, output_type="latent")
        assert sorted(builds) == ["AutoencoderKL", "CLIPTextModel", "UNet2DConditionModel"]
        walks.clear(), builds.clear()
        for index in range(10):
            pipe.unet.set_adapters(["a" if index % 2 else "b"])
            with dbg:
                run(pipe, steps=1, output_type="latent")
        assert walks == ["UNet2DConditionModel"] * 10
        assert builds == ["UNet2DConditionModel"] * 3  # after the calls' walks 1, 3 and 7 (strikes 1, 2, 3)
    finally:
        dbg.close()
