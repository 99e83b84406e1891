"""Which modules fastdp can clip exactly, and ``fix`` for the common ones it cannot.

The engine validates its module when it is built: anything that would make a per-sample
norm wrong is refused with the module path, the parameter and the fix. What can change
later (a layer's parameters used outside its forward, parameters unfrozen or hooked after
the optimizer was built) is checked again at each backward pass or step.
"""
from __future__ import annotations

import math
from typing import Iterable, List, Optional

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.nn.modules.lazy import LazyModuleMixin

from fastdp.layers import UnsupportedModuleError, layer_class, rule_for, rule_for_type, supported_types


def find_problems(module: nn.Module, params: Optional[Iterable[torch.Tensor]] = None) -> List[str]:
    """Every reason why ``module`` (training ``params``) cannot be made private, as messages."""
    problems = []
    if isinstance(module, nn.parallel.DistributedDataParallel):
        problems.append("the model is wrapped in DistributedDataParallel, whose all-reduce of unclipped gradients "
                        "bypasses per-sample clipping: pass the plain module to fastdp.DistributedDPOptimizer, "
                        "which all-reduces the clipped, noised sums itself")
    # parameters a supported layer owns under its rule's names: another module's alias of one (self.w =
    # self.fc.weight) is no use of it; a use outside the layer's forward is caught at the first backward
    rules = {m: rule_for(m) for m in module.modules()}
    owned = {id(p) for m, rule in rules.items() if rule is not None for p in rule.trainable(m).values()}
    trained = None if params is None else {id(p) for p in params}
    for name, p in module.named_parameters():
        hooked = grad_hook_problem(p, name) if p.requires_grad and (trained is None or id(p) in trained) else None
        if hooked is not None:
            problems.append(hooked)
    for path, child in module.named_modules():
        where = f"module '{path or '<root>'}' ({type(child).__name__})"
        if isinstance(child, parametrize.ParametrizationList):
            continue  # reported with the layer it parametrises
        if parametrize.is_parametrized(child) and _trained_parametrization_unchanged(child):
            tensors = ", ".join(f"'{n}'" for n in child.parametrizations)
            problems.append(
                f"{where} computes {tensors} from other parameters (torch.nn.utils.parametrizations: weight_norm, "
                "spectral_norm, ...), which fastdp cannot clip per sample; remove the parametrisation "
                f"(torch.nn.utils.parametrize.remove_parametrizations(layer, {next(iter(child.parametrizations))!r}))"
                " or freeze what it is computed from (the layer's other parameters may train)")
            continue
        rule = rules[child]
        trainable = [n for n, p in child.named_parameters(recurse=False)
                     if p.requires_grad and (rule is not None or id(p) not in owned)]
        not_real = [n for n, p in child.named_parameters(recurse=False) if p.requires_grad and not
                    (p.is_floating_point() or isinstance(p, nn.parameter.UninitializedParameter))]
        if not_real:
            names = ", ".join(f"'{path + '.' if path else ''}{n}'" for n in not_real)
            problems.append(f"{where} has trainable parameter(s) {names} of a dtype other than a real floating one "
                            "(complex): fastdp's norms, clipped sums and noise are for real parameters (an "
                            "imaginary part would be dropped, unclipped and unnoised); train real and imaginary "
                            "parts as two real parameters")
            continue
        if isinstance(child, LazyModuleMixin) and child.has_uninitialized_params():
            problems.append(f"{where} has not made its parameters yet (a lazy layer): run one forward pass on a "
                            "sample batch before building the optimizer")
            continue
        if isinstance(child, _BatchNorm):
            problems.append(
                f"{where}: BatchNorm mixes the samples of a batch, so per-sample gradients do not "
                "exist (and in train mode it updates running statistics from them, frozen or not); "
                "replace it with GroupNorm (model = fastdp.fix(model))"
            )
            continue
        if rule is None:
            if trainable:
                names = ", ".join(f"'{path + '.' if path else ''}{n}'" for n in trainable)
                problems.append(
                    f"{where} has trainable parameter(s) {names} but fastdp has no per-sample rule "
                    f"for {layer_class(child).__name__}; supported layers: "
                    f"{', '.join(sorted(t.__name__ for t in supported_types()))}. Freeze them "
                    "(requires_grad_(False)), rebuild the layer from supported ones, or register "
                    f"a rule with fastdp.layers.register{_subclass_hint(child)}"
                )
            continue
        foreign = [n for n in trainable if n not in rule.param_names]
        if foreign:
            names = ", ".join(f"'{path + '.' if path else ''}{n}'" for n in foreign)
            problems.append(
                f"{where} has trainable parameter(s) {names} that its rule does not clip (it clips "
                f"{', '.join(rule.param_names)}): {_foreign_fix(child, foreign)}"
            )
        forward = _forward_problem(child)
        if forward is not None and rule.trainable(child):
            problems.append(f"{where} {forward}")
        try:  # frozen modules too: state the data changes (running statistics) leaks without noise
            rule.check(child)
        except UnsupportedModuleError as exc:
            problems.append(f"{where}: {exc}")
    if params is not None:
        owned = {id(p) for p in module.parameters()}
        names = [i for i, p in enumerate(params) if id(p) not in owned]
        if names:
            problems.append(
                f"the optimizer holds {len(names)} parameter(s) (indices {names[:5]}) that are not "
                "parameters of the module given to fastdp; pass the module that owns them"
            )
    return problems


def trained_parametrization(module: nn.Module) -> bool:
    """Whether a tensor a parametrization of ``module`` computes (at each access) requires grad:
    from the parametrization's own trainable parameters, or from any other tensor it reads (a
    weight tied to another layer's). Its gradient then comes only through autograd. May compute
    the tensors (under ``parametrize.cached()`` the forward reuses them)."""
    if any(p.requires_grad for p in module.parametrizations.parameters()):
        return True
    with torch.enable_grad():
        return any(getattr(module, name).requires_grad for name in module.parametrizations)


def _trained_parametrization_unchanged(module: nn.Module) -> bool:
    """:func:`trained_parametrization` with the parametrizations in eval mode: computing them in
    training mode may update their state (spectral_norm's power iteration)."""
    modes = [(m, m.training) for m in module.parametrizations.modules()]
    module.parametrizations.eval()
    try:
        return trained_parametrization(module)
    finally:
        for m, mode in modes:
            m.training = mode


def grad_hook_problem(param: torch.Tensor, name: str) -> Optional[str]:
    """Why trainable ``param`` (named ``name``) cannot be private, if it has autograd gradient
    hooks: fastdp forms its gradient outside autograd, so a hook would see None (raising, or
    silently doing nothing); else None."""
    if not (param._backward_hooks or getattr(param, "_post_accumulate_grad_hooks", None)):
        return None
    return (f"parameter '{name}' has a gradient hook (register_hook or register_post_accumulate_grad_hook): "
            "fastdp forms private parameters' gradients outside autograd, so the hook would get None; remove "
            "it, and transform the noised gradient instead in a step pre-hook of the wrapped optimizer "
            "(optimizer.original_optimizer.register_step_pre_hook), or freeze what it masked")


def stale_forward(module: nn.Module) -> bool:
    """The instance ``forward`` is a leftover of hooking another module (a ``copy.deepcopy`` of a
    hooked module) or the class's own forward (an unpickled hooked module): inert, replaceable."""
    forward = module.__dict__.get("forward")
    if forward is None:
        return False
    if getattr(forward, "fastdp_module", module) is not module:
        return True
    return getattr(forward, "__self__", None) is module and getattr(forward, "__func__", None) is type(module).forward


def _forward_problem(module: nn.Module) -> Optional[str]:
    """Why a supported layer's ``forward`` set on the instance stops fastdp hooking it, if it has one."""
    if "forward" not in module.__dict__ or stale_forward(module):
        return None
    if getattr(module.forward, "fastdp_engine", None) is not None:
        return "is already hooked by a fastdp optimizer; call .detach() on it first"
    return "has its forward replaced on the instance, which fastdp cannot hook; subclass the layer and register a rule"


def _subclass_hint(module: nn.Module) -> str:
    """Rules match exact types (a subclass may change forward): for a subclass of a supported
    layer whose forward is the layer's own, say how to reuse the layer's rule."""
    cls = layer_class(module)
    base = next((t for t in cls.__mro__[1:] if t in supported_types()), None)
    if base is None:
        return ""
    rule = type(rule_for_type(base))
    return (f" ({cls.__name__} subclasses {base.__name__}, but rules match exact types since a subclass may "
            f"change forward; if it keeps {base.__name__}'s, register its rule for it: class "
            f"{cls.__name__}Rule({rule.__module__}.{rule.__name__}): module_types = ({cls.__name__},), then "
            f"fastdp.layers.register({cls.__name__}Rule()))")


def _foreign_fix(module: nn.Module, names: List[str]) -> str:
    """How to remove parameters a layer's rule does not clip: for each legacy reparametrisation their
    names show (a tensor recomputed from them before each forward), its undo; else freezing them."""
    buffers = {b for b, _ in module.named_buffers(recurse=False)}
    undo = {}
    for n in names:
        if n.endswith("_g") or n.endswith("_v"):
            undo[n[:-2]] = f"torch.nn.utils.remove_weight_norm(module, {n[:-2]!r})"
        elif n.endswith("_orig") and n[:-5] + "_mask" in buffers:
            undo[n[:-5]] = f"torch.nn.utils.prune.remove(module, {n[:-5]!r})"
        elif n.endswith("_orig"):
            undo[n[:-5]] = f"torch.nn.utils.remove_spectral_norm(module, {n[:-5]!r})"
    if not undo:
        return "freeze them (requires_grad_(False)), or compute what they do in a supported layer"
    tensors = ", ".join(f"'{t}'" for t in undo)
    return (f"{tensors} computed from them (weight_norm, spectral_norm or pruning) would get no gradient; remove "
            f"the reparametrisation ({'; '.join(undo.values())}) or freeze them")


def validate(module: nn.Module, params: Optional[Iterable[torch.Tensor]] = None) -> None:
    """Raise :class:`UnsupportedModuleError` listing every problem :func:`find_problems` finds."""
    problems = find_problems(module, params)
    if problems:
        raise UnsupportedModuleError(
            "fastdp cannot clip this model exactly:\n  - " + "\n  - ".join(problems)
        )


def _like(new: nn.Module, old: nn.Module) -> nn.Module:
    """``new`` on ``old``'s device and dtype, its parameters frozen where ``old``'s were."""
    tensors = list(old.parameters()) + list(old.buffers())
    floats = [t for t in tensors if t.is_floating_point()]
    if floats:
        new = new.to(device=floats[0].device, dtype=floats[0].dtype)
    for name, p in new.named_parameters():
        was = getattr(old, name, None)
        if isinstance(was, torch.Tensor):
            p.requires_grad_(was.requires_grad)
    return new


def _group_norm_for(bn: _BatchNorm) -> nn.GroupNorm:
    channels = bn.num_features
    return _like(nn.GroupNorm(math.gcd(32, channels), channels, eps=bn.eps, affine=bn.affine), bn)


def fix(module: nn.Module) -> nn.Module:
    """Replace BatchNorm by GroupNorm (gcd(32, C) groups) and stop InstanceNorm from tracking
    running statistics; returns the module (a new one only when the root itself is replaced).
    Replacements take the old layer's device and dtype, and stay frozen if it was."""
    if isinstance(module, _BatchNorm):
        return _group_norm_for(module)
    if isinstance(module, _InstanceNorm) and module.track_running_stats:
        fixed = _like(type(module)(module.num_features, eps=module.eps, affine=module.affine,
                                   track_running_stats=False), module)
        if module.affine:
            fixed.load_state_dict({"weight": module.weight, "bias": module.bias}, strict=False)
        return fixed
    for name, child in module.named_children():
        replacement = fix(child)
        if replacement is not child:
            setattr(module, name, replacement)
    return module
