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
    return subprocess.run(
        [sys.executable, str(script), ref], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )


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


def test_a_saved_config_finds_a_module_of_its_first_directory_from_another(
    tmp_path, monkeypatch, tiny_model_dir, arith_data
):
    """A run's config.yaml records where `myproj.rw:r` was found (run.python_path), so every command that reads it
    from elsewhere (`--resume`, `config validate`, the children) imports the same module."""
    from fleetrl.common.config import load_config, save_resolved

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "myproj_30b").mkdir(parents=True)
    (project / "myproj_30b" / "__init__.py").write_text("")
    (project / "myproj_30b" / "rw.py").write_text("def r(response: str) -> float:\n    return 1.0\n")
    (project / "tools_30.py").write_text('def calc(expr: str) -> str:\n    """Evaluate."""\n    return expr\n')
    elsewhere.mkdir()
    monkeypatch.chdir(project)
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            f"data.train={arith_data}",
            "rollout.rewards=[{name: python, args: {function: 'myproj_30b.rw:r'}}]",
        ],
    )
    saved = save_resolved(cfg, tmp_path / "run")
    assert load_config(saved).run.python_path == [str(project.resolve())]
    tool = load_config(None, ["rollout.env.type=tool", "rollout.env.tool.tools=['tools_30.py:calc']"])
    assert with_paths(tool).rollout.env.tool.tools == [f"{(project / 'tools_30.py').resolve()}:calc"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-m", "fleetrl.app.cli", "config", "validate", "--config", str(saved)],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("OK")


def with_paths(cfg):
    from fleetrl.common.config.names import with_absolute_paths

    return with_absolute_paths(cfg)
