"""Size profile of a fleetrl tree's code packages: modules over 400 lines, the longest functions, lines
over 120 (and 110) characters (issue 25's before/after figure).

    python benchmarks/size_profile.py [ROOT] [--out FILE.json]

ROOT defaults to this checkout; an older tree (e.g. `git worktree add /tmp/old 37bf540`) has its own
package folders, and whichever of common, broker, rollout, learner, app exist are counted.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

PACKAGES = ("common", "broker", "rollout", "learner", "app")


def profile(root: Path) -> dict:
    files = sorted(p for top in PACKAGES if (root / top).is_dir() for p in (root / top).rglob("*.py"))
    big, funcs, over120, over110, total = [], [], 0, 0, 0
    for path in files:
        text = path.read_text()
        lines = text.splitlines()
        total += len(lines)
        over120 += sum(len(line) > 120 for line in lines)
        over110 += sum(len(line) > 110 for line in lines)
        name = str(path.relative_to(root))
        if len(lines) > 400:
            big.append((len(lines), name))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs.append((node.end_lineno - node.lineno + 1, f"{name}:{node.name}"))
    big.sort(reverse=True)
    funcs.sort(reverse=True)
    return {
        "modules": len(files),
        "lines": total,
        "modules_over_400": big,
        "lines_over_120": over120,
        "lines_over_110": over110,
        "functions_over_60": sum(n > 60 for n, _ in funcs),
        "longest_functions": funcs[:10],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--out", help="also write the figures here (JSON)")
    args = ap.parse_args()
    p = profile(Path(args.root))
    print(
        f"{p['modules']} modules, {p['lines']} lines; {len(p['modules_over_400'])} modules over 400 lines; "
        f"{p['lines_over_120']} lines over 120 chars ({p['lines_over_110']} over 110); "
        f"{p['functions_over_60']} functions over 60 lines"
    )
    for n, name in p["modules_over_400"]:
        print(f"  {n:4d}  {name}")
    print("longest functions:")
    for n, name in p["longest_functions"]:
        print(f"  {n:4d}  {name}")
    if args.out:
        Path(args.out).write_text(json.dumps(p, indent=1))


if __name__ == "__main__":
    main()
