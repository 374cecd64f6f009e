"""Static guard: hot-path modules read device data into Python only outside loops.

A `.item()`, `.tolist()`, `.numpy()` or `.cpu()` inside a loop is a device sync (or a transfer)
per iteration on a GPU; so is `int(...)`, `float(...)` or `bool(...)` around a tensor reduction.
Hot paths batch such reads through `hivespec.kernels.host_transfer.to_host`. A loop over data
that is already on the host (lists that `to_host` returned) may say so with a `# host data`
comment on the line. The behavioural counterpart is `HostTransferGuard` (tests/node/test_sync_devices.py).
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOT_PATHS = [
    "node/weights/sync.py", "node/weights/follower.py", "node/model/engine.py", "node/training/trainer.py",
    "kernels/delta.py", "kernels/speculative.py", "kernels/sampling.py", "kernels/importance.py", "kernels/logprobs.py",
]
READS = {"item", "tolist", "numpy", "cpu"}
REDUCTIONS = {"sum", "max", "min", "any", "all", "mean", "norm", "detach", "item"}
LOOPS = (ast.For, ast.AsyncFor, ast.While, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _reads_in_loops(source: str) -> list[tuple[int, str]]:
    tree = ast.parse(source)
    lines = source.splitlines()
    found = []

    def visit(node: ast.AST, in_loop: bool) -> None:
        if isinstance(node, ast.Call) and in_loop and "# host data" not in lines[node.lineno - 1]:
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in READS and not node.args:
                found.append((node.lineno, f".{func.attr}()"))
            elif isinstance(func, ast.Name) and func.id in {"int", "float", "bool"} and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and arg.func.attr in REDUCTIONS:
                    found.append((node.lineno, f"{func.id}(... .{arg.func.attr}())"))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_loop = False  # a function defined in a loop runs when called, not per iteration
        # What a loop iterates over is evaluated once, before the first iteration.
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            first = node.generators[0]
            visit(first.iter, in_loop)
            rest = [first.target, *first.ifs, *node.generators[1:]]
            rest += [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
            for child in rest:
                visit(child, True)
            return
        once = {id(node.iter)} if isinstance(node, (ast.For, ast.AsyncFor)) else set()
        for child in ast.iter_child_nodes(node):
            visit(child, in_loop or (isinstance(node, LOOPS) and id(child) not in once))

    visit(tree, False)
    return found


@pytest.mark.parametrize("module", HOT_PATHS)
def test_no_per_iteration_device_reads(module):
    found = _reads_in_loops((ROOT / module).read_text())
    assert not found, f"{module}: device reads inside loops at {found}; batch them through to_host once per step"


def test_the_check_finds_what_it_looks_for():
    source = ("for t in ts:\n    total += float(t.sum())\n    xs.append(t.tolist())\nys = [t.item() for t in ts]\n"
              "ok = [v for v in host]  # host data\nonce = [v for v in t.tolist()]\nfor v in t.tolist():\n    pass\n")
    assert [line for line, _ in _reads_in_loops(source)] == [2, 3, 4]
