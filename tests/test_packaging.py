"""A wheel (`pip install .`, not -e) carries what the code reads from beside its modules."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_wheel_carries_the_presets_task_data_and_stylesheet(tmp_path):
    # A wheel once lacked configs/: `hivespec join --config public` then found no preset (seen on a GPU machine).
    # Built from a copy of the tree git sees, so no earlier build/ folder lends it files.
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split("\0")
    source = tmp_path / "source"
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(source)],
                   check=True, capture_output=True)
    (wheel,) = tmp_path.glob("hivespec-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    data = {f"hivespec/configs/{p.name}" for p in (ROOT / "configs").glob("*.yaml")}
    data |= {f"hivespec/node/tasks/data/{p.name}" for p in (ROOT / "node" / "tasks" / "data").glob("*.jsonl")}
    data |= {f"hivespec/dashboard/{p.name}" for p in (ROOT / "dashboard").glob("*.tcss")}
    assert {"hivespec/configs/public.yaml", "hivespec/configs/demo.yaml"} <= data
    assert data - names == set()
