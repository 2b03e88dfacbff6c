"""One error root per package, drawn in its package's docstring."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

import pytest

import launcher
import launcher.sim
from launcher.errors import LauncherError
from launcher.sim import SimError


def raised_on_purpose(package: ModuleType, skip: str | None = None) -> set[type[BaseException]]:
    """The public exception classes defined in `package`'s modules (not `skip`'s)."""
    found: set[type[BaseException]] = set()
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if (skip and info.name.startswith(skip)) or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if (isinstance(obj, type) and issubclass(obj, BaseException)
                    and obj.__module__ == module.__name__ and not obj.__name__.startswith("_")):
                found.add(obj)
    return found


@pytest.mark.parametrize(("package", "root", "skip"), [
    (launcher, LauncherError, "launcher.sim"),
    (launcher.sim, SimError, None),
])
def test_every_error_a_package_raises_on_purpose_is_under_its_root_and_in_its_docstring(
        package: ModuleType, root: type[BaseException], skip: str | None) -> None:
    errors = raised_on_purpose(package, skip)
    assert root in errors
    assert {e.__name__ for e in errors if not issubclass(e, root)} == set()
    assert {e.__name__ for e in errors if e.__name__ not in (package.__doc__ or "")} == set()
