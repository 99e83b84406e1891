"""Layer rules: one module per layer family, each mapping layer types to a :class:`LayerRule`.

``rule_for(module)`` looks a module's exact type up (a subclass may change ``forward``, so
it must be registered on its own; the class ``torch.nn.utils.parametrize`` generates for a
parametrised layer keeps its layer's forward and rule). Register a rule for your own layer with
``fastdp.layers.register(MyRule())``.
"""
from typing import Dict, Optional

from torch import nn
from torch.nn.utils import parametrize

from fastdp.layers.base import LayerRule, Record, Tap, UnsupportedModuleError

_RULES: Dict[type, LayerRule] = {}


def register(rule: LayerRule) -> LayerRule:
    """Make ``rule`` handle every type in ``rule.module_types``."""
    for module_type in rule.module_types:
        _RULES[module_type] = rule
    return rule


def rule_for(module: nn.Module) -> Optional[LayerRule]:
    return rule_for_type(layer_class(module))


def layer_class(module: nn.Module) -> type:
    """The module's class; for a parametrized module, the class torch generated its subclass from
    (the layer's forward, tensors as properties)."""
    return type(module).__bases__[0] if parametrize.is_parametrized(module) else type(module)


def rule_for_type(cls: type) -> Optional[LayerRule]:
    """The rule registered for exactly ``cls`` (a subclass may change forward: not its base's)."""
    return _RULES.get(cls)


def supported_types():
    return tuple(_RULES)


# Importing the families registers their rules.
from fastdp.layers import conv, embedding, linear, norm  # noqa: E402,F401

__all__ = ["LayerRule", "Record", "Tap", "UnsupportedModuleError", "layer_class", "register", "rule_for",
           "rule_for_type", "supported_types"]
