"""Count the files a flow passes through and how often it re-enters one, from the source alone (``ast``, no imports).

    python tools/callpath.py                      # the load, load_raw and save flows of ./fabric_hsdp
    python tools/callpath.py --flow load_raw -v   # also print the walk, one call per line
    python tools/callpath.py --root /some/checkout

A flow starts at a strategy method and follows every call the source names statically, depth first, each function
once: plain names and module attributes through the imports, ``self.method``, ``ClassName(...)`` (its
``__init__``), ``self.attribute.method`` when ``__init__`` assigned the attribute a class of the package, and
``variable.method(...)`` when exactly one class of the package defines ``method`` and no builtin or standard
type has a method of that name (``match.group``, ``stream.flush`` and ``names.add`` are not the package's). Calls
made through other objects (a DCP planner calling back, Fabric's hooks) are not followed.

Three counts per flow:

- *files*: the distinct files the flow passes through.
- *re-entries*: calls that go into a file the walk has already been in, coming from another file (a shared helper
  called from two places counts each time).
- *back-calls*: calls into a file that is still on the call stack above the caller: a module calling into a lower
  one and being called back by it. A flow that reads as one way down has none.
- *up-calls*: calls from a lower layer of ``checkpoint/`` into a higher one (:data:`LAYERS`, top first).
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

FLOWS = {
    "load_raw": "fabric_hsdp.strategy:HybridFSDPStrategy.load_raw",
    "load": "fabric_hsdp.strategy:HybridFSDPStrategy.load_checkpoint",
    "save": "fabric_hsdp.strategy:HybridFSDPStrategy.save_checkpoint",
}


LAYERS = (
    "fabric_hsdp.strategy",
    "fabric_hsdp.checkpoint.training",
    "fabric_hsdp.checkpoint.writers",
    "fabric_hsdp.checkpoint.formats",
    "fabric_hsdp.checkpoint.core",
)
# Methods of the builtin and standard types a local variable may hold: a call of one of these names is not taken for
# the package's one class defining it.
_FOREIGN_METHODS = frozenset(
    name
    for kind in (dict, list, set, str, bytes, tuple, Path, io.BufferedWriter, io.TextIOWrapper, type(re.match("", "")))
    for name in dir(kind)
    if not name.startswith("__")
) | {"modules", "parameters", "named_modules", "named_parameters", "children"}  # torch.nn.Module's


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of ``module``'s layer (0 the top), ``None`` for a module outside them."""
    for index, layer in enumerate(LAYERS):
        if module == layer or module.startswith(layer + "."):
            return index
    return None


@dataclass
class Module:
    name: str
    file: Path
    names: dict[str, str] = field(default_factory=dict)  # local name -> "module:qualname" or "module"
    functions: dict[str, ast.AST] = field(default_factory=dict)  # qualname -> def
    attributes: dict[str, str] = field(default_factory=dict)  # "Class.attr" -> the name of the class assigned to it


def _module_name(root: Path, file: Path) -> str:
    parts = list(file.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def load_package(root: Path, package: str = "fabric_hsdp") -> dict[str, Module]:
    modules = {}
    for file in sorted((root / package).rglob("*.py")):
        module = Module(_module_name(root, file), file)
        tree = ast.parse(file.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                module.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                module.names[node.name] = f"{module.name}:{node.name}"
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        module.functions[f"{node.name}.{item.name}"] = item
                for assign in ast.walk(node):  # self.x = SomeClass(...): calls on self.x go to SomeClass
                    if isinstance(assign, ast.Assign) and isinstance(assign.value, ast.Call):
                        called = assign.value.func
                        for target in assign.targets:
                            is_self = isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                            if is_self and target.value.id == "self" and isinstance(called, ast.Name):
                                module.attributes[f"{node.name}.{target.attr}"] = called.id
        for node in ast.walk(tree):  # imports anywhere (the package imports lazily inside functions)
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    module.names[alias.asname or alias.name] = f"{node.module}:{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    module.names[alias.asname or alias.name.split(".")[0]] = alias.name
        for name in module.functions:
            if "." not in name:
                module.names[name] = f"{module.name}:{name}"
        modules[module.name] = module
    return modules


class Walk:
    def __init__(self, modules: dict[str, Module]) -> None:
        self.modules = modules
        self.seen: set[str] = set()
        self.files: list[str] = []  # distinct files, in the order first entered
        self.reentries: list[str] = []
        self.back_calls: list[str] = []  # "caller -> callee" into a file still on the stack
        self.up_calls: list[str] = []  # "caller -> callee" from a lower layer into a higher one
        self.stack: list[str] = []  # the files of the calls being walked, outermost first
        self.lines: list[str] = []
        owners: dict[str, list[str]] = {}
        for module in modules.values():
            for qualname in module.functions:
                if "." in qualname:
                    owners.setdefault(qualname.split(".")[1], []).append(f"{module.name}:{qualname}")
        self.unique_methods = {
            name: found[0] for name, found in owners.items() if len(found) == 1 and name not in _FOREIGN_METHODS
        }

    def resolve(self, target: str) -> str | None:
        """``module:qualname`` of a function defined in the package, following re-exports; ``None`` if none."""
        for _ in range(10):
            module_name, _, qualname = target.partition(":")
            if module_name not in self.modules or not qualname:
                return None
            module = self.modules[module_name]
            if qualname in module.functions:
                return target
            if f"{qualname}.__init__" in module.functions:
                return f"{module_name}:{qualname}.__init__"
            head = qualname.split(".")[0]
            if head in module.names and module.names[head] != target:
                rest = qualname[len(head) :]
                mapped = module.names[head]
                # a module (module.attr), else a name in a module
                target = (f"{mapped}:{rest[1:]}" if rest else mapped) if ":" not in mapped else mapped + rest
                continue
            if f"{module_name}.{head}" in self.modules:  # a submodule named as an attribute of its package
                target = f"{module_name}.{head}:{qualname[len(head) + 1 :]}"
                continue
            return None
        return None

    def callees(self, target: str) -> list[str]:
        module_name, _, qualname = target.partition(":")
        module = self.modules[module_name]
        cls = qualname.split(".")[0] if "." in qualname else None
        found = []
        for node in ast.walk(self.modules[module_name].functions[qualname]):
            if not isinstance(node, ast.Call):
                continue
            func, callee = node.func, None
            if isinstance(func, ast.Name):
                callee = self.resolve(f"{module_name}:{func.id}")
            elif isinstance(func, ast.Attribute):
                chain = []
                value: ast.AST = func
                while isinstance(value, ast.Attribute):
                    chain.append(value.attr)
                    value = value.value
                if isinstance(value, ast.Name):
                    chain.append(value.id)
                    chain.reverse()
                    if chain[0] == "self" and cls and len(chain) == 2:
                        callee = self.resolve(f"{module_name}:{cls}.{chain[1]}")
                    elif chain[0] == "self" and cls and len(chain) == 3 and f"{cls}.{chain[1]}" in module.attributes:
                        callee = self.resolve(f"{module_name}:{module.attributes[f'{cls}.{chain[1]}']}.{chain[2]}")
                    elif chain[0] in module.names:
                        callee = self.resolve(f"{module_name}:{'.'.join(chain)}")
                # a local variable (source.read_slice), not a module (torch.load) or a call's result
                local_object = isinstance(value, ast.Name) and value.id not in module.names and value.id != "self"
                if callee is None and local_object and func.attr in self.unique_methods:
                    callee = self.unique_methods[func.attr]
            if callee is not None and callee != target:
                found.append((node.lineno, node.col_offset, callee))
        return [callee for *_, callee in sorted(found)]

    def file_of(self, target: str) -> str:
        return str(self.modules[target.partition(":")[0]].file)

    def run(self, target: str, caller: str | None = None, depth: int = 0) -> None:
        file = self.file_of(target)
        caller_file = self.file_of(caller) if caller else None
        if file != caller_file and caller is not None:
            if file in self.stack:
                self.back_calls.append(f"{caller} -> {target}")
            above, below = layer_of(caller.partition(":")[0]), layer_of(target.partition(":")[0])
            if above is not None and below is not None and below < above:
                self.up_calls.append(f"{caller} -> {target}")
        if target in self.seen:
            return
        self.seen.add(target)
        if file != caller_file:
            if file in self.files:
                self.reentries.append(file)
            else:
                self.files.append(file)
        self.lines.append(f"{'  ' * depth}{target}")
        self.stack.append(file)
        for callee in self.callees(target):
            self.run(callee, target, depth + 1)
        self.stack.pop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--flow", choices=sorted(FLOWS), action="append")
    parser.add_argument("-v", "--verbose", action="store_true", help="print the walk")
    args = parser.parse_args(argv)
    modules = load_package(args.root)
    for flow in args.flow or sorted(FLOWS):
        walk = Walk(modules)
        walk.run(FLOWS[flow])
        if args.verbose:
            print("\n".join(walk.lines))
        again: dict[str, int] = {}
        for file in walk.reentries:
            again[file] = again.get(file, 0) + 1
        ranked = sorted(again.items(), key=lambda item: -item[1])
        worst = ", ".join(f"{Path(file).relative_to(args.root)} x{count}" for file, count in ranked)
        print(f"{flow}: {len(walk.files)} files, {len(walk.reentries)} re-entries ({worst or 'none'})")
        print(f"  {len(walk.back_calls)} back-calls, {len(walk.up_calls)} up-calls between checkpoint layers")
        for call in walk.back_calls:
            print(f"    back: {call}")
        for call in walk.up_calls:
            print(f"    up: {call}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
