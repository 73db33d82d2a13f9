"""The served app in a child process: its own local Ray cluster, its own temp dir, loopback only.

``AppProcess(config, code_root)`` starts ``python app_process.py`` with ``PYTHONPATH=code_root``
(so a bench can serve another checkout's code, e.g. ``main`` before a change, next to this one),
waits until the app answers, and on exit sends the child SIGTERM: the child shuts Serve and Ray
down itself and the temp dir is removed; what is left of its process group afterwards (Ray's
agents outlive ``ray.shutdown``) is stopped too. Only the child's own process id and the process
group it leads are ever signalled.

The child writes ``ready.json`` (the base URL) into its folder once ``serve.run`` returned.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

READY_FILE = "ready.json"
LOG_FILE = "app.log"
STOP_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AppProcess:
    """Context manager: ``with AppProcess(config, root) as url: ...``."""

    def __init__(
        self, config: Path, code_root: Path, start_timeout_s: float = 300.0, num_cpus: int = 2
    ) -> None:
        self.config = Path(config).resolve()
        self.code_root = Path(code_root).resolve()
        self.start_timeout_s = start_timeout_s
        self.num_cpus = num_cpus
        self.folder: Path | None = None
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> str:
        # a short path: Ray's unix sockets live under the temp dir (108-byte path limit)
        self.folder = Path(tempfile.mkdtemp(prefix="rso-", dir="/tmp"))
        env = {
            **os.environ,
            "PYTHONPATH": str(self.code_root),
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        env.setdefault("PAGEDSERVE_CACHE", str(Path(tempfile.gettempdir()) / "pagedserve"))
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--config",
            str(self.config),
            "--folder",
            str(self.folder),
            "--port",
            str(free_port()),
            "--num-cpus",
            str(self.num_cpus),
        ]
        with open(self.folder / LOG_FILE, "wb") as log:
            self.process = subprocess.Popen(
                command,
                cwd=self.code_root,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: ours to signal should it hang
            )
        try:
            return self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def _wait_ready(self) -> str:
        assert self.process is not None and self.folder is not None
        deadline = time.monotonic() + self.start_timeout_s
        ready = self.folder / READY_FILE
        while time.monotonic() < deadline:
            if ready.exists():
                return json.loads(ready.read_text())["url"]
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the app process exited ({self.process.returncode}):\n" + self.log_tail()
                )
            time.sleep(0.5)
        waited = self.start_timeout_s
        raise TimeoutError(f"the app was not ready in {waited} s:\n" + self.log_tail())

    def cpu(self) -> dict[str, float]:
        """CPU seconds used so far by the app's processes (its session), by label."""
        assert self.process is not None
        return session_cpu(self.process.pid)

    def settle(
        self, busy_cpu: float = 0.3, period_s: float = 1.0, timeout_s: float = 60.0
    ) -> float:
        """Wait until the app's processes use less than ``busy_cpu`` cores (Serve's controller
        stays busy for seconds after a deploy); the seconds waited (at most ``timeout_s``)."""
        start = time.monotonic()
        before = self.cpu()
        while time.monotonic() - start < timeout_s:
            time.sleep(period_s)
            after = self.cpu()
            if sum(cpu_used(before, after).values()) < busy_cpu * period_s:
                break
            before = after
        return time.monotonic() - start

    def log_tail(self, chars: int = 4000) -> str:
        assert self.folder is not None
        try:
            return (self.folder / LOG_FILE).read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def __exit__(self, *exc: object) -> None:
        process, folder = self.process, self.folder
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("the app process ignored SIGTERM; killing its process group")
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        if process is not None:
            stop_leftovers(process.pid)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        self.process = self.folder = None


def stop_leftovers(group: int, grace_s: float = 5.0) -> None:
    """SIGTERM whatever is left of the child's process group after the child exited (Ray's
    dashboard and runtime-env agents outlive ``ray.shutdown`` as orphans), then SIGKILL what
    ignores it. The group is the one the child led, so nothing else is ever signalled."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(group, sig)
        except (ProcessLookupError, PermissionError):  # empty: everything has exited
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and group_alive(group):
            time.sleep(0.1)
        if not group_alive(group):
            return


def group_alive(group: int) -> bool:
    """Whether a process of this group still runs (zombies waiting for init do not count)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == group:
            return True
    return False


# -- CPU time of the app's processes ---------------------------------------------------------


def parse_stat(text: str) -> tuple[int, float]:
    """``(session id, user + system CPU seconds)`` from one ``/proc/<pid>/stat`` line."""
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[3]), (int(fields[11]) + int(fields[12])) / ticks


def process_label(cmdline: bytes) -> str:
    """A short name for a process: Ray's worker title (``ray::ServeReplica:...``) or the
    program's file name."""
    args = [a for a in cmdline.decode(errors="replace").split("\0") if a]
    if not args:
        return "?"
    if args[0].startswith("ray::"):
        return args[0].split()[0]
    program = Path(args[0]).name
    if program.startswith("python") and len(args) > 1:
        return Path(args[1]).name
    return program


def session_cpu(session: int) -> dict[str, float]:
    """CPU seconds used so far by the live processes of one session, summed by label
    (Linux /proc; processes that already exited are not counted)."""
    totals: dict[str, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            sid, seconds = parse_stat((entry / "stat").read_text())
            if sid != session:
                continue
            label = process_label((entry / "cmdline").read_bytes())
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
        totals[label] = totals.get(label, 0.0) + seconds
    return totals


def cpu_used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds per label between two ``session_cpu`` readings (labels of either)."""
    labels = sorted(set(before) | set(after))
    return {k: max(0.0, after.get(k, 0.0) - before.get(k, 0.0)) for k in labels}


# -- the child ------------------------------------------------------------------------------------


def _serve(config: str, folder: Path, port: int, num_cpus: int) -> None:
    import ray
    from ray import serve

    from deployments.app import build_app

    stop = False

    def on_sigterm(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_sigterm)
    # address="local": a cluster of our own; every Ray endpoint on the loopback address
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=str(folder / "ray"),
        _node_ip_address="127.0.0.1",
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"config": config}), name="bench", route_prefix="/")
        (folder / READY_FILE).write_text(json.dumps({"url": f"http://127.0.0.1:{port}"}))
        while not stop:
            time.sleep(0.2)
    finally:
        serve.shutdown()
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="serve one preset until SIGTERM (bench helper)")
    p.add_argument("--config", required=True)
    p.add_argument("--folder", type=Path, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--num-cpus", type=int, default=2)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    _serve(args.config, args.folder, args.port, args.num_cpus)
    return 0


if __name__ == "__main__":
    # run as a script: its own folder (bench/loadgen, with modules named like `stats`) must not
    # shadow anything Ray imports
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]
    sys.exit(main())
