"""A stand-in for torchvision, on the PYTHONPATH of the tests' engine processes only.

vLLM's ``qwen3_5.py`` (Qwen3.6) imports ``qwen3_vl``, which imports transformers'
``image_processing_qwen2_vl``, which imports ``torchvision.transforms.v2.functional``
unconditionally. No torchvision on PyPI loads beside the CPU torch (2.13.0+cpu): its
``_C.so`` links ``libtorch_cuda``, fails to load, and ``_meta_registrations.py`` then
registers a fake kernel for ``torchvision::nms`` without checking ``_has_ops()``
("operator torchvision::nms does not exist"), so ``deploy/setup.sh`` removes it.

Once a ``torchvision`` is importable, transformers takes its torchvision branches at
import time (``image_utils.py`` builds an ``InterpolationMode`` table), so every name
of these modules is a placeholder class: its attributes are placeholders too, and
calling one raises. The text-only models the tests run never process an image.
"""

from __future__ import annotations

from typing import Any, NoReturn

__version__ = "0.0+tierstore.test.stub"


class _Placeholder(type):
    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return placeholder(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(
            f"torchvision {cls.__qualname__}: torchvision is a test-only stand-in here "
            "(tests/e2e/stubs); the CPU build has no working torchvision"
        )


def placeholder(qualname: str) -> type:
    cls = _Placeholder(qualname.rsplit(".", 1)[-1], (), {"__module__": "torchvision"})
    cls.__qualname__ = qualname
    return cls


def module_getattr(module: str) -> Any:
    """A module ``__getattr__`` that answers every public name with a placeholder."""

    def __getattr__(name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return placeholder(f"{module}.{name}")

    return __getattr__
