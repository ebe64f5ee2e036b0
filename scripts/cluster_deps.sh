#!/usr/bin/env bash
# What `make test-cluster` needs besides the venv: Debian's Slurm and munge, and the `ray` extra.
# Fails loudly (set -e, and a check of each tool) instead of letting the tests skip.
set -euo pipefail
PY=${1:-.venv/bin/python}
if ! command -v sbatch >/dev/null || ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    if [ "$(id -u)" != 0 ]; then echo "cluster_deps: need root to apt-get install slurm-wlm munge" >&2; exit 1; fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq slurm-wlm munge >/dev/null
fi
for tool in sbatch srun scontrol slurmctld slurmd munged; do
    command -v "$tool" >/dev/null || { echo "cluster_deps: $tool is missing after the install" >&2; exit 1; }
done
"$PY" -c "import ray" 2>/dev/null || "$PY" -m pip install -q -e '.[ray]'
"$PY" -c "import ray; print('cluster_deps: ray', ray.__version__)" || { echo "cluster_deps: ray did not install" >&2; exit 1; }
echo "cluster_deps: $(slurmd -V)"
