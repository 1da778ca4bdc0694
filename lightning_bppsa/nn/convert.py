"""``convert(model)``: swap supported submodules for their BPPSA versions, keeping the same Parameters.

Each family of modules registers a *converter* with :func:`register_converter`. A converter looks at one
module and answers ``None`` (not mine: keep looking, recurse into its children) or a
:class:`Conversion`: the replacement module (or ``None`` when the module stays on autograd) and a
human-readable reason. *Traced* converters (``register_converter(traced=True)``, e.g. the ``torch.fx``
rewriting of layer chains written as ``forward()`` code, ``lightning_bppsa.nn.traced``) run first, and
only under ``convert(model, trace=True)``: they replace modules with generated code. Replacements reuse the original ``Parameter`` objects, so optimizers,
schedulers and checkpoints built on the original model keep working, and take over the replaced
module's hooks (forward, forward-pre, backward and ``state_dict`` hooks, with their handles).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

__all__ = ["Conversion", "ConversionRecord", "carry_hooks", "convert", "is_converted", "register_converter"]


@dataclass(frozen=True)
class Conversion:
    """A converter's answer for one module: ``replacement is None`` means it stays on autograd."""

    replacement: nn.Module | None
    reason: str


@dataclass(frozen=True)
class ConversionRecord:
    """One row of the conversion table: where a module's backward runs, and why.

    ``already_converted`` marks a module that was a BPPSA module before this ``convert`` call (converted
    earlier, e.g. by a previous ``Trainer.fit``, or built from ``lightning_bppsa.nn`` directly).
    """

    path: str
    module_type: str
    scanned: bool
    reason: str
    already_converted: bool = False


Converter = Callable[[nn.Module], "Conversion | None"]
_CONVERTERS: list[Converter] = []
_TRACED_CONVERTERS: list[Converter] = []


def register_converter(
    converter: Converter | None = None, *, traced: bool = False
) -> Converter | Callable[[Converter], Converter]:
    """Register a converter: ``@register_converter`` or ``@register_converter(traced=True)`` (run first,
    and only under ``convert(..., trace=True)``). Registering the same function twice is a no-op."""

    def register(function: Converter) -> Converter:
        registry = _TRACED_CONVERTERS if traced else _CONVERTERS
        if function not in registry:
            registry.append(function)
        return function

    return register if converter is None else register(converter)


def is_converted(module: nn.Module) -> bool:
    """Whether ``module`` is already a BPPSA module (an instance of a ``lightning_bppsa.nn`` class or of a
    subclass of one), whose backward runs through the scan."""
    # by defining package rather than a registry: classes built directly by users count too, even before
    # any converter has run in this process
    return any(cls.__module__.startswith("lightning_bppsa.nn.") for cls in type(module).__mro__)


#: every per-module hook registry of ``nn.Module`` (forward, backward, state_dict)
_HOOK_ATTRIBUTES = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_is_full_backward_hook",
    "_state_dict_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def carry_hooks(old: nn.Module, new: nn.Module) -> None:
    """Give ``new`` the hooks registered on ``old``: the very same registries, so the handles that
    ``old.register_forward_hook(...)`` and friends returned still remove them."""
    for name in _HOOK_ATTRIBUTES:
        if name in old.__dict__:
            new.__dict__[name] = old.__dict__[name]


def _convert_one(module: nn.Module, trace: bool) -> Conversion | None:
    for converter in (*_TRACED_CONVERTERS, *_CONVERTERS) if trace else _CONVERTERS:
        answer = converter(module)
        if answer is not None:
            return answer
    return None


def convert(
    model: nn.Module,
    *,
    modules: Sequence[str] | None = None,
    report: list[ConversionRecord] | None = None,
    trace: bool = False,
) -> nn.Module:
    """Swap supported submodules of ``model`` in place for their BPPSA versions.

    Args:
        model: any ``nn.Module``; if ``model`` itself is supported, the replacement is returned.
        modules: qualified names (as in ``model.named_modules()``) to restrict conversion to; ``None``
            converts every supported module.
        report: if given, one :class:`ConversionRecord` per module a converter looked at is appended,
            and one (``scanned``, ``already_converted``) per module that already was a BPPSA module.
        trace: also look for layer chains in the ``forward()`` code of user-defined modules with
            ``torch.fx`` and replace such a module by a ``GraphModule`` running them through the scan
            (``lightning_bppsa.nn.traced`` says when it does; opt-in: tracing bakes in one path through
            the Python code).

    Returns:
        The converted model (the same object unless ``model`` itself was replaced).

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.RNN(1, 20, batch_first=True))
        >>> model = convert(model)
        >>> type(model[0]).__module__.startswith("lightning_bppsa")
        True
    """
    wanted = None if modules is None else set(modules)
    if wanted is not None:
        known = {name for name, _ in model.named_modules()}
        missing = sorted(wanted - known)
        if missing:
            raise ValueError(f"modules {missing} not found in {type(model).__name__}; known: {sorted(known)}")
    return _convert(model, "", wanted, report, trace)


def _convert(
    module: nn.Module, path: str, wanted: set[str] | None, report: list | None, trace: bool
) -> nn.Module:
    if is_converted(module):
        # converting twice (e.g. Trainer.validate after Trainer.fit) must keep it, and say it runs through
        # the scan: listed whatever ``wanted`` says, since the table tells where every backward runs
        if report is not None:
            name = type(module).__name__
            reason = f"{name}: already a BPPSA module; backward through the scan"
            report.append(ConversionRecord(path or "<root>", name, True, reason, already_converted=True))
        return module
    answer = _convert_one(module, trace) if wanted is None or path in wanted else None
    if answer is not None:
        if report is not None:
            scanned = answer.replacement is not None
            report.append(ConversionRecord(path or "<root>", type(module).__name__, scanned, answer.reason))
        if answer.replacement is not None:
            carry_hooks(module, answer.replacement)
            return answer.replacement
    for name, child in list(module.named_children()):
        new = _convert(child, f"{path}.{name}" if path else name, wanted, report, trace)
        if new is not child:
            setattr(module, name, new)
            if name == "_orig_mod" and hasattr(module, "_initialize"):
                module._initialize()  # a torch.compile wrapper binds its forward to the original module
    return module
