"""The single-stream cache classes a state file can hold (``StepCache``, ``RotatingCache``):
``simple.py`` registers them here, ``files.load_simple`` builds them from here. A module of
its own, importing nothing, so ``simple.py`` registers without loading the state format."""

from __future__ import annotations

from typing import Dict

#: class name -> kind of the single-stream caches a state file can hold
_SIMPLE_CLASSES = {"StepCache": "step", "RotatingCache": "rotating"}

#: class name -> class of the single-stream caches ``files.load_simple`` builds; ``simple.py``
#: fills it (:func:`register_simple_class`): an outer module, so the state modules never import it.
_SIMPLE_REGISTRY: Dict[str, type] = {}


def register_simple_class(cls: type) -> None:
    """Let ``load_simple`` build ``cls`` (``StepCache`` or ``RotatingCache``, by class name)."""
    if cls.__name__ not in _SIMPLE_CLASSES:
        raise ValueError(f"cls must be StepCache or RotatingCache, got {cls.__name__}")
    _SIMPLE_REGISTRY[cls.__name__] = cls


__all__ = ["register_simple_class"]
