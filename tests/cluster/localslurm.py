"""A real one-host Slurm cluster for the `make test-cluster` lane: munged, slurmctld and slurmd started by
hand (no systemd here), tracked by PID, configured under a scratch directory.

    with LocalSlurm(tmp_dir) as slurm:        # writes slurm.conf, starts the daemons, waits for the node
        env = slurm.env                       # SLURM_CONF for sbatch / squeue / scontrol
        slurm.job_state(job_id)               # from `scontrol show job`, else the jobcomp file

Facts checked on this machine (Debian 12, slurm-wlm 22.05):
- munged must run as the ``munge`` user with ``/run/munge`` owned by it; slurmctld and slurmd run as
  root in the foreground (``-D``), so the PIDs we hold are the daemons themselves;
- ``sacct`` needs slurmdbd, so final states come from ``jobcomp/filetxt`` (or ``scontrol show job``
  while the controller still remembers the job, ``MinJobAge``);
- ``proctrack/cgroup`` (cgroup v1 is mounted here) kills double-forked processes on ``scancel``;
  ``proctrack/linuxproc`` does not.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

from fleetrl.common.net import free_port


def missing_tools() -> list[str]:
    return [
        t
        for t in ("sbatch", "srun", "scontrol", "slurmctld", "slurmd", "munged")
        if shutil.which(t) is None and not Path(f"/usr/sbin/{t}").exists()
    ]


SLURM_CONF = """\
ClusterName=fleetrl-test
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/{proctrack}
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/jobcomp.txt
JobAcctGatherType=jobacct_gather/none
MailProg=/bin/true
ReturnToService=2
MinJobAge=600
KillWait=10
InactiveLimit=0
MpiDefault=none
JobRequeue=1
NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""

CGROUP_CONF = "CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\nConstrainCores=no\nConstrainRAMSpace=no\n"


class LocalSlurm:
    """munged + slurmctld + slurmd on this host, for tests; stops exactly the daemons it started."""

    def __init__(self, root: Path, cpus: int | None = None, proctrack: str = "cgroup"):
        self.root = Path(root)
        self.host = socket.gethostname().split(".")[0]
        self.node = self.host
        self.cpus = cpus or (os.cpu_count() or 2)
        self.proctrack = proctrack
        self.procs: dict[str, subprocess.Popen] = {}
        self.conf = self.root / "slurm.conf"

    n_nodes = 1

    def slurm_cmd(self, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        """A Slurm client command (sinfo, squeue, scontrol, sbatch, ...) against this cluster."""
        return subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=timeout)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def write_config(self) -> None:
        for d in ("state", "spool"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        mem = max(1000, int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 * 0.9))
        self.conf.write_text(
            SLURM_CONF.format(
                host=self.host,
                node=self.node,
                root=self.root,
                cpus=self.cpus,
                mem=mem,
                ctld_port=free_port(),
                slurmd_port=free_port(),
                proctrack=self.proctrack,
            )
        )
        (self.root / "cgroup.conf").write_text(CGROUP_CONF)

    def start(self) -> LocalSlurm:
        self.write_config()
        self._start_munge()
        log = (self.root / "daemons.out").open("ab")
        self.procs["slurmctld"] = subprocess.Popen(
            ["slurmctld", "-D", "-i", "-f", str(self.conf)], stdout=log, stderr=subprocess.STDOUT, env=self.env
        )
        self.procs["slurmd"] = subprocess.Popen(
            ["slurmd", "-D", "-f", str(self.conf)], stdout=log, stderr=subprocess.STDOUT, env=self.env
        )
        self.wait_idle(60)
        return self

    def _start_munge(self) -> None:
        """munged as the munge user, with Debian's default paths (/run/munge, /var/log/munge, /var/lib/munge:
        the package creates them owned by munge); its socket is where slurm's auth/munge plugin looks."""
        user = pwd.getpwnam("munge")
        for d in ("/run/munge", "/var/log/munge", "/var/lib/munge"):
            Path(d).mkdir(parents=True, exist_ok=True)
            os.chown(d, user.pw_uid, user.pw_gid)
        if self._munge_ok():  # one already serving the socket (another session's): use it, leave it alone
            return
        self.procs["munged"] = subprocess.Popen(
            ["munged", "-F", "--force"],
            user=user.pw_uid,
            group=user.pw_gid,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while not self._munge_ok():
            if self.procs["munged"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"munged did not start (exit {self.procs['munged'].poll()}); see /var/log/munge/munged.log"
                )
            time.sleep(0.1)

    @staticmethod
    def _munge_ok() -> bool:
        try:
            cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=5)
            return (
                cred.returncode == 0
                and subprocess.run(["unmunge"], input=cred.stdout, capture_output=True, timeout=5).returncode == 0
            )
        except (OSError, subprocess.TimeoutExpired):
            return False

    def wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            for name in [n for n in self.procs if n != "munged"]:
                if self.procs[name].poll() is not None:
                    raise RuntimeError(f"{name} exited with {self.procs[name].returncode}; see {self.root}/{name}*.log")
            out = self.slurm_cmd(["sinfo", "-h", "-N", "-o", "%T"])
            state = out.stdout.strip()
            if state and all(s.startswith("idle") for s in state.split()) and len(state.split()) == self.n_nodes:
                return
            time.sleep(0.3)
        raise RuntimeError(f"the slurm node never became idle (state {state!r}); see {self.root}")

    def scontrol_job(self, job_id: str) -> dict[str, str]:
        out = self.slurm_cmd(["scontrol", "-o", "show", "job", str(job_id)])
        return dict(re.findall(r"(\w+)=(\S*)", out.stdout)) if out.returncode == 0 else {}

    def job_state(self, job_id: str) -> str:
        """RUNNING, PENDING, COMPLETED, FAILED, CANCELLED, ... ('' when unknown)."""
        info = self.scontrol_job(job_id)
        if info.get("JobState"):
            return info["JobState"]
        comp = self.root / "jobcomp.txt"
        states = re.findall(rf"JobId={job_id} .*?JobState=(\S+)", comp.read_text()) if comp.exists() else []
        return states[-1] if states else ""

    def wait_state(self, job_id: str, states: set[str], timeout: float) -> str:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in states:
                return state
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} is {state!r} after {timeout:.0f} s, wanted one of {sorted(states)}")

    def cancel_all(self, timeout: float = 90) -> None:
        """Cancel every job of this cluster and wait for them to leave: slurmd does not take running jobs
        down with it, so stopping the daemons first would orphan them."""
        if self.procs.get("slurmctld") is None or self.procs["slurmctld"].poll() is not None:
            return
        queue = lambda: self.slurm_cmd(["squeue", "-h", "-o", "%i"]).stdout.split()  # noqa: E731
        jobs = queue()
        if jobs:
            self.slurm_cmd(["scancel", "--full", *jobs])
        deadline = time.monotonic() + timeout
        while queue() and time.monotonic() < deadline:
            time.sleep(0.5)

    def stop(self) -> None:
        self.cancel_all()
        for name in reversed(list(self.procs)):  # slurmd(s), slurmctld, munged (when we started it)
            proc = self.procs.pop(name)
            if proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> LocalSlurm:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


NODE_LINE = "NodeName={node} NodeHostname={node} NodeAddr={addr} CPUs={cpus} RealMemory={mem} State=UNKNOWN\n"


class HostsSlurm(LocalSlurm):
    """Slurm across network-namespace hosts (tests/cluster/hosts.py): slurmctld on host 0, one slurmd per
    compute host under its own NodeName/NodeAddr (``slurmd -N``), client commands run on host 0 (the
    login node). munged is shared: its socket is a path, reachable from every namespace.

    ``proctrack/linuxproc`` here: with cgroup v1 every slurmd on this kernel would make the same
    ``slurm/uid_0/job_N/step_M`` directories for a job spanning nodes, so one node's step cleanup would
    reach another's processes; what linuxproc leaves behind, `Hosts.close()` stops."""

    def __init__(self, root: Path, hosts, compute: list[int], cpus: int | None = None):
        super().__init__(root, cpus=cpus, proctrack="linuxproc")
        self.hosts = hosts
        self.compute = list(compute)
        self.host = self.node = hosts.names[0]
        self.nodes = [hosts.names[i] for i in self.compute]
        self.n_nodes = len(self.nodes)

    def slurm_cmd(self, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        return self.hosts.run(0, argv, timeout=timeout, env=self.env)

    def write_config(self) -> None:
        super().write_config()
        text = self.conf.read_text()
        head = text[: text.index("NodeName=")]
        mem = re.search(r"RealMemory=(\d+)", text).group(1)
        head = head.replace(f"SlurmctldHost={self.host}", f"SlurmctldHost={self.host}({self.hosts.addrs[0]})")
        nodes = "".join(
            NODE_LINE.format(node=self.hosts.names[i], addr=self.hosts.addrs[i], cpus=self.cpus, mem=mem)
            for i in self.compute
        )
        part = (
            f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP "
            "OverSubscribe=FORCE:4\n"
        )
        self.conf.write_text(head + "SlurmdTimeout=300\n" + nodes + part)

    def start(self) -> HostsSlurm:
        self.write_config()
        self._start_munge()
        log = (self.root / "daemons.out").open("ab")
        self.procs["slurmctld"] = self.hosts.popen(
            0, ["slurmctld", "-D", "-i", "-f", str(self.conf)], stdout=log, stderr=subprocess.STDOUT, env=self.env
        )
        for i in self.compute:
            name = self.hosts.names[i]
            self.procs[f"slurmd-{name}"] = self.hosts.popen(
                i,
                ["slurmd", "-D", "-N", name, "-f", str(self.conf)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )
        self.wait_idle(90)
        return self


if __name__ == "__main__":  # a cluster to try jobs by hand: python -m tests.cluster.localslurm DIR (Ctrl-C stops it)
    import signal
    import sys

    with LocalSlurm(Path(sys.argv[1])) as cluster:
        print(f"export SLURM_CONF={cluster.conf}", flush=True)
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
