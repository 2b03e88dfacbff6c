"""One error root per package, drawn in its package's docstring."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

import pytest

import launcher
import launcher.sim
import producer
import workers
from fleetgen import errors as worker_errors
from fleetgen.errors import FleetgenError
from launcher.errors import LauncherError
from launcher.sim import SimError

# Not errors: Ctrl-C carried out of an enqueue with its report (producer/__init__.py says so).
NOT_ERRORS = {"EnqueueInterrupted"}


def raised_on_purpose(package: ModuleType, skip: str | None = None) -> set[type[BaseException]]:
    """The public exception classes defined in `package`'s modules (not `skip`'s)."""
    found: set[type[BaseException]] = set()
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if (skip and info.name.startswith(skip)) or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if (isinstance(obj, type) and issubclass(obj, BaseException)
                    and obj.__module__ == module.__name__ and not obj.__name__.startswith("_")
                    and obj.__name__ not in NOT_ERRORS):
                found.add(obj)
    return found


@pytest.mark.parametrize(("package", "root", "skip", "tree"), [
    (launcher, LauncherError, "launcher.sim", launcher.__doc__),
    (launcher.sim, SimError, None, launcher.sim.__doc__),
    (workers, FleetgenError, None, worker_errors.__doc__),
    (producer, FleetgenError, None, producer.__doc__),
])
def test_every_error_a_package_raises_on_purpose_is_under_its_root_and_in_its_tree(
        package: ModuleType, root: type[BaseException], skip: str | None, tree: str) -> None:
    errors = raised_on_purpose(package, skip)
    assert {e.__name__ for e in errors if not issubclass(e, root)} == set()
    assert {e.__name__ for e in errors if e.__name__ not in tree} == set()
