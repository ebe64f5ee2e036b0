"""User code imports as TRL users expect (issue 30, item 7): a reward file's siblings, and a module of the cwd."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import sys
    from fleetrl.common.plugins.userfn import load_function
    print(load_function(sys.argv[1])("abc"))
""")


def probe(ref: str, cwd) -> subprocess.CompletedProcess:
    """Resolve ``ref`` in a script that lives outside ``cwd``, as the ``fleetrl`` console script does (so the
    working directory is not on sys.path by Python's own rule, as it is for ``python -c``)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    script = cwd.parent / "probe_bin" / "probe.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(PROBE)
    return subprocess.run([sys.executable, str(script), ref], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=60)


def test_a_reward_file_imports_its_sibling_module(tmp_path):
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "helper_30.py").write_text("def norm(s):\n    return s.upper()\n")
    (tmp_path / "code" / "rw.py").write_text("from helper_30 import norm\n\ndef r(x):\n    return norm(x)\n")
    (tmp_path / "elsewhere").mkdir()
    out = probe(str(tmp_path / "code" / "rw.py") + ":r", tmp_path / "elsewhere")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ABC"


def test_a_dotted_module_of_the_working_directory_imports_without_pythonpath(tmp_path):
    (tmp_path / "myproj_30").mkdir()
    (tmp_path / "myproj_30" / "__init__.py").write_text("")
    (tmp_path / "myproj_30" / "rw.py").write_text("def r(x):\n    return len(x)\n")
    (tmp_path / "work").mkdir()
    (tmp_path / "myproj_30").rename(tmp_path / "work" / "myproj_30")
    out = probe("myproj_30.rw:r", tmp_path / "work")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"
