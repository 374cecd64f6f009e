"""Layering and packaging: the dependency direction holds, and nothing installs bare top-level modules."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 5 kept, 0 broken" in result.stdout
    # The contracts that keep heavy dependencies in their subpackage are among them.
    assert "only the swarm subpackage talks to hivemind KEPT" in result.stdout
    assert "only the model subpackage imports transformers KEPT" in result.stdout


def test_subpackages_live_under_hivespec_only():
    import hivespec.kernels
    import hivespec.protocol

    assert Path(hivespec.protocol.__file__).parent == ROOT / "protocol"
    assert Path(hivespec.kernels.__file__).parent == ROOT / "kernels"
    for bare in ("kernels", "protocol", "node", "dashboard"):
        spec = importlib.util.find_spec(bare)
        # PyPI has packages with these names (and transformers imports Hugging Face's `kernels`
        # when it finds one): a bare module, if any, must never be ours.
        assert spec is None or not str(spec.origin or "").startswith(str(ROOT)), f"bare `{bare}` resolves to {spec.origin}"


def test_console_script_is_installed():
    script = Path(sys.executable).with_name("hivespec")
    result = subprocess.run([str(script), "--help"], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    for command in ("demo", "join", "identity", "config"):
        assert command in result.stdout


def test_no_pickle_on_any_path():
    offenders = []
    for folder in ("protocol", "kernels", "node", "dashboard"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            if "import pickle" in text or "pickle.load" in text or "weights_only=False" in text:
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
