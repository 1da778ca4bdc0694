"""In-place ops of a traced cell step rewritten into their out-of-place forms, where that provably computes the same.

torch's own cells trace to graphs that update step-internal values in place (``nn.LSTMCell`` on the CPU:
``add_`` of the two projections, then ``sigmoid_`` / ``tanh_`` on ``unsafe_split`` pieces of the gate block;
``nn.GRUCell``: ``add_``, ``mul_``, ``tanh_``), and ``make_fx`` keeps them. The step's analysis
(:mod:`~lightning_bppsa.nn.cell_structure`) reads pure graphs, so :func:`out_of_place` rewrites each
``y = op_(a, ...)`` into ``y = op(a, ...)`` where nothing can tell the difference:

- ``a`` shares no memory with the cell's inputs, parameters or buffers (the step would modify the caller's
  tensors: refused);
- no node after it reads memory the op wrote, other than through ``y`` (``y`` itself, views taken of it, later
  in-place results of it): a read of exactly ``a``'s elements in ``a``'s layout (another view of the same
  elements, made before the op) is redirected to ``y``, which then holds the same values; a read of other
  overlapping memory (the base of a modified view, a view overlapping it) is refused. Views do not read: a view
  of the base taken after the op is checked where it is used, so the other pieces of a split gate block stay
  readable. (``make_fx`` already records later uses of the Python tensor an in-place op modified as uses of
  ``y``.)

Memory is told from the trace's fake values (their storages, sizes, strides and offsets): exact for views
whose schema does not say they alias (``unsafe_split``'s pieces). The out-of-place form must give ``a``'s
dtype and shape (an in-place op neither promotes nor broadcasts its target); otherwise the cell is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, fx
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["out_of_place"]

aten = torch.ops.aten

#: storages larger than this (elements) are not enumerated: their views are taken to overlap
_MAX_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class _Region:
    """The memory a tensor value covers: its storage and the strided elements it views of it."""

    storage: int
    itemsize: int
    extent: int  # the storage's elements
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def elements(self) -> Tensor:
        return torch.arange(self.extent).as_strided(self.size, self.stride, self.offset).reshape(-1)


def out_of_place(gm: fx.GraphModule, roles: list[str]) -> str | None:
    """Rewrite ``gm``'s in-place ops into their out-of-place forms (module docstring), in place; ``None`` where
    every one was, else why not (the graph is then partly rewritten: the caller drops it). ``roles`` names each
    placeholder for the reasons (e.g. ``"a parameter or buffer"``, ``"its state"``)."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    # the original program's memory, read throughout (the rewritten nodes' values change)
    regions = {n: _regions(n.meta.get("val")) for n in nodes}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    mutating = [
        n for n in nodes if isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
    ]
    strided = next(
        (n for n in nodes if n.target in (aten.as_strided.default, aten.as_strided_.default)), None
    )
    if mutating and strided is not None:
        # a rewritten value may lie in memory differently (an out-of-place result is dense): views by strides differ
        return f"the cell views memory by its strides ({strided.target}) and modifies values in place"
    for node in mutating:
        target = node.target
        functional = _functional_form(target)
        if isinstance(functional, str):
            return functional
        written = node.args[0] if node.args else None
        region = regions.get(written) if isinstance(written, fx.Node) else None
        if region is None or len(region) != 1:
            return f"the cell modifies a value in place whose memory is unknown ({target})"
        (region,) = region
        for placeholder, role in zip(placeholders, roles, strict=True):
            if any(_overlap(r, region) for r in regions[placeholder] or ()):
                return f"the cell modifies {role} in place ({target})"
        for later in nodes[order[node] + 1 :]:
            for read in later.all_input_nodes:
                reason = _read(later, read, node, region, regions)
                if reason == "same":
                    later.replace_input_with(read, node)
                elif reason is not None:
                    return reason
        vals = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
        new = functional(*vals[0], **vals[1])
        old = node.meta["val"]
        if not isinstance(new, Tensor) or new.dtype != old.dtype or new.shape != old.shape:
            return f"the out-of-place form of {target} changes the dtype or the shape of what it modifies"
        node.target, node.meta["val"] = functional, new
    return None


def _read(
    user: fx.Node,
    read: fx.Node,
    op: fx.Node,
    written: _Region,
    regions: dict[fx.Node, tuple[_Region, ...] | None],
) -> str | None:
    """Whether ``user`` (after the in-place ``op``, which wrote ``written``) reading ``read`` stays the same once
    ``op`` is out-of-place: ``None`` (yes), ``"same"`` (yes, reading ``op``'s result instead), else why not."""
    mine = regions.get(read)
    if mine is None or _derived(read, op, regions) or not any(_overlap(r, written) for r in mine):
        return None  # not a tensor, the result, or memory the op did not write
    if len(mine) == 1 and mine[0] == written:
        return "same"
    if _is_view(user, read, regions):
        return None  # a view reads nothing: its own users are checked
    return f"the cell reads {read.name} after modifying memory it overlaps in place ({op.target})"


def _derived(node: fx.Node, op: fx.Node, regions: dict) -> bool:
    """Whether ``node`` is ``op``'s result or a view (or a later in-place result) of it: a chain of nodes each
    sharing its parent's storage."""
    while node is not op:
        parent = _parent(node)
        if parent is None or not _shares(node, parent, regions):
            return False
        node = parent
    return True


def _parent(node: fx.Node) -> fx.Node | None:
    """The value a view node (or an item of a split's list) views."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    return node.args[0]


def _is_view(user: fx.Node, read: fx.Node, regions: dict) -> bool:
    """Whether ``user`` only views ``read`` (a non-mutating op whose outputs share its storage)."""
    target = user.target
    if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
        return False
    return user.op == "call_function" and user.args and user.args[0] is read and _shares(user, read, regions)


def _shares(node: fx.Node, parent: fx.Node, regions: dict) -> bool:
    """Whether every tensor ``node`` holds lies in a storage of ``parent``'s."""
    mine, theirs = regions.get(node), regions.get(parent)
    return bool(mine) and bool(theirs) and {r.storage for r in mine} <= {r.storage for r in theirs}


def _functional_form(target: torch._ops.OpOverload) -> torch._ops.OpOverload | str:
    """``op`` for ``op_`` (the same overload and arguments, writing only its first): else why not."""
    schema = target._schema
    name = schema.name.split("::")[-1]
    writes = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    if writes != [0] or not name.endswith("_") or name.startswith("_"):
        return f"the cell writes into a tensor ({target})"
    packet = getattr(aten, name[:-1], None)
    overload = getattr(packet, target._overloadname, None) if packet is not None else None
    if (
        not isinstance(overload, torch._ops.OpOverload) or overload._schema.is_mutable
        or [a.name for a in overload._schema.arguments] != [a.name for a in schema.arguments]
    ):  # fmt: skip
        return f"the cell modifies a tensor in place with an op that has no out-of-place form ({target})"
    return overload


def _regions(val: object) -> tuple[_Region, ...] | None:
    """The memory of a traced value (a tensor, or a list of them as a split gives); ``None`` for others."""
    vals = val if isinstance(val, (list, tuple)) else [val]
    if not vals or not all(isinstance(v, Tensor) for v in vals):
        return None
    out = []
    for v in vals:
        storage = v.untyped_storage()
        out.append(
            _Region(
                StorageWeakRef(storage).cdata,
                v.element_size(),
                storage.nbytes() // v.element_size(),
                tuple(v.shape),
                tuple(v.stride()),
                v.storage_offset(),
            )  # fmt: skip
        )
    return tuple(out)


def _overlap(a: _Region, b: _Region) -> bool:
    """Whether two regions share an element (taken to where the storages are too large to enumerate or the
    element sizes differ)."""
    if a.storage != b.storage:
        return False
    if a == b:
        return math.prod(a.size) > 0
    if a.itemsize != b.itemsize or a.extent > _MAX_ELEMENTS:
        return True
    mask = torch.zeros(a.extent, dtype=torch.bool)
    mask[a.elements()] = True
    return bool(mask[b.elements()].any())
