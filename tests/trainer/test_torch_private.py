"""The private torch names the project uses (torchspot_trainer.torch_private): each one still where the
list says in the installed torch, and no use of one in the project's code left off the list."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from torchspot_trainer.torch_private import PRIVATE_TORCH, SINCE_TORCH_2_14

LISTED = PRIVATE_TORCH + SINCE_TORCH_2_14
TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {  # folder: the import name of its top package
    ROOT / "trainer" / "torchspot_trainer": "torchspot_trainer",
    ROOT / "torchspot": "torchspot",
    ROOT / "operator" / "torchspot_operator": "torchspot_operator",
    ROOT / "lab" / "torchspot_lab": "torchspot_lab",
}
SCRIPTS = [ROOT / "bench", ROOT / "examples"]
"""Scanned too, not imported: programs rather than packages."""


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _dotted(entry: str) -> str:
    return entry.replace(":", ".")


def _owner_sets(cls: type, member: str) -> bool:
    """Whether a class of `cls`'s method resolution order sets `member` on its instances in its source."""
    pattern = re.compile(rf"self\.{re.escape(member)}\b")
    for klass in cls.__mro__:
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):  # a class without Python source (an extension's)
            continue
        if pattern.search(source):
            return True
    return False


def resolves(entry: str) -> bool:
    """Whether `module:qualified.name` is there in the installed torch: each part an attribute of the
    one before it, the last one of a class also when the class only sets it on its instances."""
    module_name, qualname = entry.split(":")
    target: object = importlib.import_module(module_name)
    parts = qualname.split(".")
    for index, part in enumerate(parts):
        if hasattr(target, part):
            target = getattr(target, part)
        elif index == len(parts) - 1 and isinstance(target, type):
            return _owner_sets(target, part)
        else:
            return False
    return True


@pytest.mark.parametrize("entry", PRIVATE_TORCH)
def test_each_listed_name_is_where_the_list_says(entry: str) -> None:
    assert resolves(entry), f"{entry} is not in the installed torch: it moved; update its users and the list"


@pytest.mark.parametrize("entry", SINCE_TORCH_2_14)
def test_each_name_of_a_newer_torch_is_there_exactly_from_that_version_on(entry: str) -> None:
    assert resolves(entry) == (TORCH >= (2, 14)), f"{entry} in torch {torch.__version__}"


def test_an_entry_that_moved_is_found() -> None:
    """The check above can fail: a name torch never had, and a member its class never sets."""
    assert not resolves("torch.distributed:_no_such_function")
    assert not resolves("torch.distributed.elastic.agent.server.api:SimpleElasticAgent._no_such_member")
    assert resolves("torch.distributed.elastic.agent.server.local_elastic_agent:LocalElasticAgent._pcontext")


def _files() -> Iterator[Path]:
    for folder in [*PACKAGES, *SCRIPTS]:
        yield from (path for path in folder.rglob("*.py") if "__pycache__" not in path.parts)


def _torch_aliases(tree: ast.Module) -> dict[str, str]:
    """Names bound to torch modules or objects by the file's imports: name -> dotted path."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    aliases[alias.asname or "torch"] = alias.name if alias.asname else "torch"
    return aliases


def _imported_and_module_uses(path: Path, tree: ast.Module) -> Iterator[tuple[str, str]]:
    """(dotted name, where) of each private torch name the file imports, or reaches through a torch
    module's attributes (`dist.distributed_c10d._abort_process_group`)."""
    aliases = _torch_aliases(tree)
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                if any(_private(part) for part in dotted.split(".")):
                    yield dotted, where
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            chain: list[str] = []
            current: ast.expr = node
            while isinstance(current, ast.Attribute):
                chain.append(current.attr)
                current = current.value
            if isinstance(current, ast.Name) and current.id in aliases:
                yield ".".join([aliases[current.id], *reversed(chain)]), where


def test_every_private_torch_name_the_code_imports_is_listed() -> None:
    listed = {_dotted(entry) for entry in LISTED}
    found: dict[str, str] = {}
    for path in _files():
        for dotted, where in _imported_and_module_uses(path, ast.parse(path.read_text())):
            found.setdefault(dotted, where)
    assert found, "the scan found no private torch name: it no longer sees the project's code"
    missing = {dotted: where for dotted, where in found.items() if dotted not in listed}
    assert not missing, f"private torch names used but not in torch_private.PRIVATE_TORCH: {missing}"


def _subclasses_of_torch() -> Iterator[type]:
    """The project's classes with a torch class among their bases (imported: their bases resolved)."""
    for folder, package in PACKAGES.items():
        for path in folder.rglob("*.py"):
            tree = ast.parse(path.read_text())
            aliases = _torch_aliases(tree)
            names = [
                node.name
                for node in tree.body
                if isinstance(node, ast.ClassDef)
                and any(
                    isinstance(base, (ast.Name, ast.Attribute)) and ast.unparse(base).split(".")[0] in aliases
                    for base in node.bases
                )
            ]
            if not names:
                continue
            parts = path.relative_to(folder).with_suffix("").parts
            module = importlib.import_module(".".join([package, *(p for p in parts if p != "__init__")]))
            yield from (getattr(module, name) for name in names)


def test_every_private_member_of_torch_classes_our_subclasses_use_is_listed() -> None:
    """Our subclasses of torch's classes (the agent, the rendezvous handler and its parts, DDP): each
    private member they use or override that a torch class of theirs has is listed with that class."""
    listed = {(entry.split(":")[1].rsplit(".", 1)[0], entry.rsplit(".", 1)[1]) for entry in LISTED}
    classes = list(_subclasses_of_torch())
    assert len(classes) >= 4, f"the scan found too few subclasses of torch classes: {classes}"
    missing = []
    for cls in classes:
        bases = [klass for klass in cls.__mro__[1:] if klass.__module__.split(".")[0] == "torch"]
        source = inspect.getsource(cls)
        used = set(re.findall(r"(?:self|super\(\))\.(_[a-z][a-z_0-9]*)", source))
        used |= {name for name in vars(cls) if _private(name) and name not in {"_abc_impl", "_is_protocol"}}
        # (what abc and typing set on every subclass: a subclass of a Protocol class gets `_is_protocol`)
        for member in sorted(used):
            owners = [klass for klass in bases if member in vars(klass) or _owner_sets(klass, member)]
            if owners and not any((klass.__qualname__, member) in listed for klass in owners):
                missing.append(f"{cls.__qualname__}.{member} (torch's {owners[0].__qualname__})")
    assert not missing, f"private members of torch classes used but not in torch_private.PRIVATE_TORCH: {missing}"


def test_private_members_of_torch_objects_the_code_reads_are_listed() -> None:
    """A private attribute read on any other object (a GradScaler, a ProcessGroup), in a file that
    imports torch, that the project's code never defines itself must be a listed member of torch's."""
    ours: set[str] = set()
    reads: dict[str, str] = {}
    for path in _files():
        tree = ast.parse(path.read_text())
        uses_torch = bool(_torch_aliases(tree))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                ours.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                ours.add(node.id)
            elif isinstance(node, ast.Attribute):
                if isinstance(node.ctx, ast.Store):
                    ours.add(node.attr)
                elif _private(node.attr) and uses_torch:
                    reads.setdefault(node.attr, f"{path.relative_to(ROOT)}:{node.lineno}")
    members = {entry.rsplit(".", 1)[1] for entry in LISTED} | {entry.split(":")[1] for entry in LISTED}
    python_own = {"_exit", "_Environ", "_getframe", "_replace", "_asdict", "_fields", "_make"}
    """The standard library's private-looking public names (os._exit, namedtuple's), not torch's."""
    other_libraries = {"_quorum_id"}
    """Not torch's: torchft's Manager's, read by bench/recovery's TorchFT replica."""
    missing = {
        name: where
        for name, where in reads.items()
        if name not in ours and name not in members and name not in python_own | other_libraries
    }
    assert not missing, f"private attributes read that neither the project nor torch_private defines: {missing}"
