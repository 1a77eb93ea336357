"""The demo node's host: a ``/proc`` and a cgroup v2 tree in a directory, as the exporter reads them.

The exporter reads the host through ``--path.procfs`` and ``--path.cgroupfs``; the demo points
both here. What is written imitates a Debian 12 host running Docker with the systemd cgroup
driver (cgroup v2, the default there):

* ``cgroup/``: ``cgroup.controllers`` at the root, ``init.scope``, ``system.slice/docker.service``,
  ``system.slice/containerd.service``, ``user.slice/user-1000.slice/session-N.scope``, and one
  ``system.slice/docker-<64 hex>.scope`` per running container, each with ``cgroup.procs``;
* ``proc/sys/kernel/random/boot_id``; ``proc/<pid>/``: ``stat`` (52 fields; field 22 the start time in clock ticks after boot),
  ``cgroup`` (one ``0::<path>`` line) and ``mountinfo`` (a container's overlay root, its
  ``/home/config`` and ``/home/work`` bind mounts of the kernel's scratch directory, the NVIDIA
  device nodes and libraries the runtime injects; or the host's own mounts).

A process directory appears whole (written aside, then renamed into place) and disappears whole,
as a process does in procfs; a reader racing an exit gets ``FileNotFoundError``, as from procfs.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterable
from pathlib import Path

__all__ = ["CLOCK_TICKS", "SimulatedHost"]

CLOCK_TICKS = 100  # USER_HZ: /proc/<pid>/stat times are in 1/100 s on Linux
_BOOT_ID = "4f0c7f3e-9b1d-4c6a-8e2f-5d3b1a7c9e04"
_DRIVER = "550.54.15"  # the NVIDIA driver whose libraries the container runtime injects
# Fields 23-52 of /proc/<pid>/stat after the start time (vsize, rss, … exit_code), as a python3
# process shows them; only field 22 matters to the exporter.
_STAT_TAIL = (
    "38654705664 1544213 18446744073709551615 94603710521344 94603713377853 140730021406320 0 0 0 0 "
    "16781312 134235650 0 0 0 17 11 0 0 0 0 0 94603713640048 94603713747796 94603739582464 "
    "140730021411163 140730021411240 140730021411240 140730021412821 0"
)
_HOST_MOUNTS = (
    "22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw,errors=remount-ro",
    "23 22 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw",
    "24 22 0:22 / /sys rw,nosuid,nodev,noexec,relatime shared:2 - sysfs sysfs rw",
    "25 22 0:6 / /dev rw,nosuid,relatime shared:8 - devtmpfs udev rw,size=1007213704k,nr_inodes=251803426,mode=755",
    "26 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot",
    "27 22 0:25 / /run rw,nosuid,nodev,noexec,relatime shared:5 - tmpfs tmpfs rw,size=201442744k,mode=755",
    "28 22 259:3 / /home rw,relatime shared:30 - ext4 /dev/nvme1n1p1 rw",
    "97 27 0:95 / /run/user/1000 rw,nosuid,nodev,relatime shared:70 - tmpfs tmpfs rw,size=201442740k,nr_inodes=50360685,mode=700,uid=1000,gid=1000",
)


def _escape(path: str) -> str:
    """mountinfo's octal escapes for space, tab, newline and backslash."""
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in path)


class SimulatedHost:
    """Processes and containers of a host, kept as files under ``root`` (``proc/``, ``cgroup/``).

    :param root: directory to write into (created).
    :param uptime_seconds: the host's uptime at creation; start times count from boot.
    """

    def __init__(self, root: Path, *, uptime_seconds: float = 86_400 * 12.5) -> None:
        self.proc = root / "proc"
        self.cgroup = root / "cgroup"
        self._lock = threading.Lock()
        self._uptime = uptime_seconds
        self._where: dict[int, Path] = {}  # pid -> its cgroup directory
        self.proc.mkdir(parents=True, exist_ok=True)
        # The kernel's boot id (the exporter keeps latched GPU faults per boot); this host never reboots.
        (self.proc / "sys" / "kernel" / "random").mkdir(parents=True, exist_ok=True)
        (self.proc / "sys" / "kernel" / "random" / "boot_id").write_text(_BOOT_ID + "\n")
        (self.cgroup / "system.slice").mkdir(parents=True, exist_ok=True)
        (self.cgroup / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma misc\n")
        (self.cgroup / "cgroup.subtree_control").write_text("cpuset cpu io memory pids\n")
        for path, pids in (("init.scope", [1]), ("system.slice/docker.service", [1187]),
                           ("system.slice/containerd.service", [1023]), ("user.slice/user-1000.slice/session-4.scope", [])):
            (self.cgroup / path).mkdir(parents=True, exist_ok=True)
            (self.cgroup / path / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
        self.host_session = self.cgroup / "user.slice/user-1000.slice/session-4.scope"

    # -- containers ----------------------------------------------------------------------------

    def container_dir(self, container_id: str) -> Path:
        """``system.slice/docker-<id>.scope``: where Docker's systemd driver puts a container."""
        return self.cgroup / "system.slice" / f"docker-{container_id}.scope"

    def start_container(self, container_id: str) -> None:
        """The container's cgroup appears (``docker start``)."""
        scope = self.container_dir(container_id)
        scope.mkdir(exist_ok=True)
        (scope / "cgroup.procs").touch()

    def remove_container(self, container_id: str) -> list[int]:
        """The container stops: its processes exit and its cgroup goes. Returns their pids."""
        scope = self.container_dir(container_id)
        with self._lock:
            pids = [pid for pid, where in self._where.items() if where == scope]
        for pid in pids:
            self.exit(pid)
        shutil.rmtree(scope, ignore_errors=True)
        return pids

    # -- processes -----------------------------------------------------------------------------

    def spawn(
        self,
        pid: int,
        comm: str,
        *,
        started: float,
        container_id: str | None = None,
        scratch_dir: Path | None = None,
        ppid: int = 1,
    ) -> None:
        """A process appears.

        :param started: seconds since the host was created (the process start time).
        :param container_id: run it in this container's cgroup, else in the host's user session.
        :param scratch_dir: the kernel's scratch directory, bind-mounted at ``/home/config`` and
            ``/home/work`` as the agent does.
        """
        where = self.container_dir(container_id) if container_id else self.host_session
        ticks = int((self._uptime + started) * CLOCK_TICKS)
        stat = f"{pid} ({comm[:15]}) S {ppid} {pid} {ppid} 0 -1 4194560 284113 0 31 0 9123 512 0 0 20 0 24 0 {ticks} {_STAT_TAIL}\n"
        cgroup = f"0::/{where.relative_to(self.cgroup)}\n"
        mounts = self._container_mounts(container_id, scratch_dir) if container_id else _HOST_MOUNTS
        staging = self.proc / f".{pid}.new"
        staging.mkdir()
        (staging / "stat").write_text(stat)
        (staging / "cgroup").write_text(cgroup)
        (staging / "mountinfo").write_text("\n".join(mounts) + "\n")
        (staging / "comm").write_text(comm[:15] + "\n")
        os.rename(staging, self.proc / str(pid))
        with self._lock:
            self._where[pid] = where
            self._write_procs(where)

    def exit(self, pid: int) -> None:
        """The process exits: its ``/proc`` entry and cgroup membership go."""
        with self._lock:
            where = self._where.pop(pid, None)
            if where is not None and where.is_dir():
                self._write_procs(where)
        gone = self.proc / f".{pid}.gone"
        try:
            os.rename(self.proc / str(pid), gone)
        except FileNotFoundError:
            return
        shutil.rmtree(gone, ignore_errors=True)

    def pids(self) -> Iterable[int]:
        with self._lock:
            return sorted(self._where)

    def _write_procs(self, where: Path) -> None:
        members = sorted(pid for pid, w in self._where.items() if w == where)
        (where / "cgroup.procs").write_text("".join(f"{p}\n" for p in members))

    @staticmethod
    def _container_mounts(container_id: str, scratch_dir: Path | None) -> list[str]:
        layer = container_id[:12]
        lines = [
            f"1456 1289 0:321 / / rw,relatime master:645 - overlay overlay rw,lowerdir=/var/lib/docker/overlay2/l/{layer.upper()}:"
            f"/var/lib/docker/overlay2/l/U4HHM5V2JQ,upperdir=/var/lib/docker/overlay2/{layer}/diff,workdir=/var/lib/docker/overlay2/{layer}/work",
            "1457 1456 0:324 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw",
            "1458 1456 0:325 / /dev rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755",
            "1459 1458 0:326 / /dev/pts rw,nosuid,noexec,relatime - devpts devpts rw,gid=5,mode=620,ptmxmode=666",
            "1460 1456 0:327 / /sys ro,nosuid,nodev,noexec,relatime - sysfs sysfs ro",
            "1461 1460 0:30 / /sys/fs/cgroup ro,nosuid,nodev,noexec,relatime - cgroup2 cgroup rw,nsdelegate,memory_recursiveprot",
            "1463 1458 0:328 / /dev/shm rw,nosuid,nodev,noexec,relatime - tmpfs shm rw,size=65536k",
        ]
        if scratch_dir is not None:
            # A bind mount's root is the source directory inside its filesystem (here the root fs).
            lines += [
                f"1464 1456 259:2 {_escape(str(scratch_dir / 'config'))} /home/config ro,relatime - ext4 /dev/nvme0n1p2 rw,errors=remount-ro",
                f"1465 1456 259:2 {_escape(str(scratch_dir / 'work'))} /home/work rw,relatime - ext4 /dev/nvme0n1p2 rw,errors=remount-ro",
            ]
        for n, name in enumerate(("resolv.conf", "hostname", "hosts")):
            lines.append(f"{1466 + n} 1456 259:2 /var/lib/docker/containers/{container_id}/{name} /etc/{name} rw,relatime - ext4 "
                         "/dev/nvme0n1p2 rw,errors=remount-ro")
        lines += [
            "1470 1458 0:6 /nvidiactl /dev/nvidiactl ro,nosuid,noexec,relatime master:2 - devtmpfs udev rw,size=1007213704k,nr_inodes=251803426,mode=755",
            "1471 1458 0:6 /nvidia-uvm /dev/nvidia-uvm ro,nosuid,noexec,relatime master:2 - devtmpfs udev rw,size=1007213704k,nr_inodes=251803426,mode=755",
            f"1473 1456 259:2 /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.{_DRIVER} /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.{_DRIVER} "
            "ro,nosuid,nodev,relatime - ext4 /dev/nvme0n1p2 rw,errors=remount-ro",
            f"1474 1456 259:2 /usr/lib/x86_64-linux-gnu/libcuda.so.{_DRIVER} /usr/lib/x86_64-linux-gnu/libcuda.so.{_DRIVER} "
            "ro,nosuid,nodev,relatime - ext4 /dev/nvme0n1p2 rw,errors=remount-ro",
        ]
        return lines
