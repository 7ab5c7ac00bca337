"""Running the parts so that one GPU session returns results whatever breaks.

Every part is a list of ``Case`` objects (``_rows.py``) run by a worker process (``worker.py``) that writes each
row as soon as it exists. The runner starts the worker, watches the case in flight against its time limit and the
global deadline, and restarts a fresh worker after the case that crashed it, hung, or left the CUDA context
unusable (a sticky error such as an illegal address poisons every later call in its process). Tools that watch a
whole process (Nsight Compute, compute-sanitizer) are started by ``run_tool``: a time limit, no exception for a
tool that is missing or times out, and the tool's whole process group stopped on a timeout.
"""
from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ._rows import RowLog, fixed_columns

ROOT = Path(__file__).resolve().parents[2]  # the repository root: every subprocess runs there (``cwd=ROOT``)
STICKY_EXIT = 3  # the worker's exit status after a case left the CUDA context unusable
STARTUP_LIMIT_S = 120.0  # a worker that has not started its first case by then is stopped (imports hang)
POLL_S = 0.2
AT_DEADLINE = "stopped at the global deadline"


def load_part(factory: str):
    """``"module:function"`` -> (the part's CSV columns, its cases for ``quick``)."""
    module_name, _, function = factory.partition(":")
    module = importlib.import_module(module_name)
    return module.COLUMNS, getattr(module, function or "cases")


def subprocess_env() -> dict:
    """The environment of every subprocess: the repository root first on PYTHONPATH, Python unbuffered."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the group this runner started for proc (its own session)
    except (ProcessLookupError, PermissionError):
        proc.send_signal(sig)


def _stop_group(proc: subprocess.Popen, grace_s: float = 0.0) -> None:
    """Stop ``proc`` and the processes of its group: SIGTERM first when ``grace_s`` > 0 (a worker then stops the
    tool it runs in a session of its own), SIGKILL when it has not ended by then."""
    if grace_s > 0:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            pass
    _signal_group(proc, signal.SIGKILL)
    proc.wait()


@dataclass(frozen=True)
class ToolRun:
    """What a tool run left: exit code (None when it did not finish), its output, and why it did not run."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool = False
    missing: bool = False

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def tail(self, chars: int = 240) -> str:
        text = " / ".join(line.strip() for line in self.output.strip().splitlines()[-4:] if line.strip())
        return text[-chars:]


def run_tool(cmd: list[str], timeout_s: float, cwd: Path = ROOT) -> ToolRun:
    """Run ``cmd`` in its own process group with a time limit; a missing executable or a timeout is a
    ``ToolRun`` saying so, never an exception."""
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                                env=subprocess_env(), start_new_session=True)
    except OSError as err:  # FileNotFoundError, PermissionError: the tool is not there
        return ToolRun(None, "", f"{type(err).__name__}: {err}", missing=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop_group(proc)
        stdout, stderr = proc.communicate()
        return ToolRun(None, stdout or "", (stderr or "") + f"\nstopped after {timeout_s:.0f} s", timed_out=True)
    finally:  # the worker is being stopped (SIGTERM raised SystemExit here): the tool goes with it
        if proc.poll() is None:
            _stop_group(proc)
    return ToolRun(proc.returncode, stdout, stderr)


def _read_inflight(path: Path):
    """(case id, start time) of the worker's case in flight, or None before the first case."""
    try:
        text = path.read_text().split()
        return int(text[0]), float(text[1])
    except (OSError, ValueError, IndexError):
        return None


def run_part(name: str, factory: str, out_dir: Path, *, quick: bool, deadline: float, log_path: Path,
             progress=print, cwd: Path = ROOT) -> list[dict]:
    """Run part ``name`` (cases from ``factory``) into ``out_dir/<name>.csv``; returns its rows.

    A case that raises is an "error" row (the worker catches it); a case that kills its worker or outlives its
    time limit gets an "error" or "timed out" row here, and a fresh worker carries on with the next case; cases
    not started by ``deadline`` (seconds since the epoch) get "skipped" rows.
    """
    columns, make_cases = load_part(factory)
    cases = make_cases(quick)
    log = RowLog(out_dir / f"{name}.csv", columns)
    # outside the run directory (a lent machine sends back a few files of it only)
    inflight = Path(tempfile.gettempdir()) / f"ioaware-gpu-check-{os.getpid()}-{name}.inflight"
    start = 0
    while start < len(cases):
        if time.time() >= deadline:
            break
        inflight.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "simulator.gpu_check.worker", factory, "--csv", str(log.path), "--start",
               str(start), "--inflight", str(inflight), "--deadline", f"{deadline:.3f}"] + (["--quick"] if quick
                                                                                           else [])
        with log_path.open("a") as worker_log:  # the worker's progress lines go to our stdout, its errors here
            offset = worker_log.tell()
            proc = subprocess.Popen(cmd, stdout=sys.stdout, stderr=worker_log, cwd=cwd,
                                    env=subprocess_env(), start_new_session=True)
            stopped = ""
            t_started = time.time()
            while proc.poll() is None:
                time.sleep(POLL_S)
                now = time.time()
                current = _read_inflight(inflight)
                if current is None and now - t_started > STARTUP_LIMIT_S:
                    stopped = f"the worker started no case in {STARTUP_LIMIT_S:.0f} s"
                elif current is not None and now - current[1] > cases[current[0]].time_limit():
                    stopped = f"stopped after its limit of {cases[current[0]].time_limit():.0f} s"
                elif now >= deadline:
                    stopped = AT_DEADLINE
                if stopped:
                    _stop_group(proc, grace_s=5.0)
        with log_path.open() as f:
            f.seek(offset)
            tail = " / ".join(ln.strip() for ln in f.read().strip().splitlines()[-3:])[-300:]
        done = log.ids()
        current = _read_inflight(inflight)
        if current is not None and current[0] not in done:  # the case in flight left no row: say why
            case = cases[current[0]]
            status = "timed out" if stopped.startswith("stopped") else "error"
            reason = stopped or f"its worker died with exit status {proc.returncode}"
            log.write({**fixed_columns(current[0], case, log), "seconds": f"{time.time() - current[1]:.3f}",
                       "status": status, "note": f"{reason}: {tail}"[:400]})
            progress(f"{name}: {case.name}: {status} ({reason})")
            start = current[0] + 1
        elif current is None and stopped == AT_DEADLINE:  # stopped while starting: what is left is skipped
            break
        elif current is None and proc.returncode != 0:  # died before its first case: every case would
            note = f"the worker failed before any case ({stopped or proc.returncode}): {tail}"[:400]
            for i in range(start, len(cases)):
                log.write({**fixed_columns(i, cases[i], log), "status": "error", "note": note})
            start = len(cases)
        else:
            start = max(done, default=start - 1) + 1
    for i in sorted(set(range(len(cases))) - log.ids()):
        log.write({**fixed_columns(i, cases[i], log), "status": "skipped",
                   "note": "not started: the part's share of the global deadline had passed"})
    inflight.unlink(missing_ok=True)
    return sorted(log.rows(), key=lambda r: int(r["case_id"]))
