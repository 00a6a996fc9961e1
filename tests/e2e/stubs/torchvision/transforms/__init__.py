"""Placeholders only: see ``torchvision/__init__.py`` (a test-only stand-in)."""

from torchvision import module_getattr

__getattr__ = module_getattr(__name__)
