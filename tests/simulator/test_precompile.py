"""simulator.precompile: the jobs compile what they name, the plan shares them out, the processes run them, a job
that fails elsewhere is named and left to its first call, and a stop here ends the other processes."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from simulator import precompile


def test_every_sentinel_is_a_cached_numba_function():
    named = [("kernels.int8._vnni", "split_gemv"), ("kernels.int8._numba_cpu", "split_gemv")]  # whichever this CPU runs
    for name, (job, sentinels, seconds) in precompile.JOBS.items():
        assert callable(job) and seconds > 0, name
        named += [(module() if callable(module) else module, function) for module, function in sentinels]
    for module, function in named:
        dispatcher = precompile.sentinel(module, function)
        assert dispatcher._cache.__class__.__name__ == "FunctionCache", f"{module}.{function} is not cached"


@pytest.mark.parametrize("processes", [1, 2, 3, 4, 8])
def test_the_plan_runs_every_job_once_largest_share_first(processes):
    names = list(precompile.JOBS)
    bins = precompile.plan(names, processes)
    assert sorted(n for share in bins for n in share) == sorted(names)
    assert len(bins) == min(processes, len(names))
    seconds = [sum(precompile.JOBS[n][2] for n in share) for share in bins]
    assert seconds == sorted(seconds, reverse=True)
    # the longest-processing-time rule: no share exceeds the ideal by more than its own smallest job
    assert max(seconds) <= sum(seconds) / len(bins) + max(min(precompile.JOBS[n][2] for n in s) for s in bins)


def test_the_plan_of_nothing_is_empty():
    assert precompile.plan([], 4) == []


def test_cached_follows_numba_cache_of_a_function(tmp_path, monkeypatch):
    source = textwrap.dedent("""
        from numba import njit

        @njit(cache=True)
        def twice(x):
            return 2 * x
    """)
    (tmp_path / "fresh_module.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("fresh_module")
    try:
        assert not precompile.cached(module.twice)  # nothing compiled yet
        assert module.twice(3) == 6
        assert precompile.cached(module.twice)
        (tmp_path / "fresh_module.py").write_text(source.replace("2 * x", "2 * x + 1"))
        module = importlib.reload(module)  # a new source (another size: stale whatever the clock's resolution)
        assert not precompile.cached(module.twice)
    finally:
        sys.modules.pop("fresh_module", None)


def test_cached_is_false_for_what_it_cannot_read(tmp_path, monkeypatch):
    assert not precompile.cached(len)
    (tmp_path / "torn_module.py").write_text("from numba import njit\n\n@njit(cache=True)\ndef one():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("torn_module")
    try:
        assert module.one() == 1 and precompile.cached(module.one)
        index = Path(module.one._cache._cache_file._index_path)  # where Numba keeps it (NUMBA_CACHE_DIR, if set)
        index.write_bytes(index.read_bytes()[:20])  # an index cut short, as by a full disk
        assert not precompile.cached(module.one)
    finally:
        sys.modules.pop("torn_module", None)


def test_the_jobs_compile_their_sentinels():
    # each job in a fresh process of its own: a sentinel that its job never calls (one this CPU does not run, or one
    # another job compiles) must show here, not pass because another job or test compiled it first
    check = textwrap.dedent("""
        import sys
        from simulator import precompile
        name = sys.argv[1]
        precompile.run_jobs([name])
        print([function for module, function in precompile.JOBS[name][1]
               if not precompile.sentinel(module, function).signatures])
        """)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for name in precompile.JOBS:
        done = subprocess.run([sys.executable, "-c", check, name], capture_output=True, text=True, env=env, cwd=root,
                              timeout=600)
        assert done.returncode == 0, f"{name}: {done.stderr[-2000:]}"
        assert done.stdout.split("\n")[-2] == "[]", f"{name}: {done.stdout[-2000:]}"  # its sentinels, all called
    assert precompile.needed() == []  # and cached


# jobs for the processes: module-level functions, which a spawned process imports by name
def _write_pid(name):
    Path(os.environ["PRECOMPILE_TEST_DIR"], name).write_text(str(os.getpid()))


def _job_a():
    _write_pid("a")


def _job_b():
    _write_pid("b")


def _job_fails():
    raise ValueError("a job that fails")


def _job_dies():
    os._exit(3)  # as a process the OS kills: no exception, no result


def _fake_jobs(monkeypatch, tmp_path, jobs):
    monkeypatch.setenv("PRECOMPILE_TEST_DIR", str(tmp_path))
    monkeypatch.setattr(precompile, "JOBS", {name: (job, (), seconds) for name, (job, seconds) in jobs.items()})
    monkeypatch.setattr(precompile, "needed", lambda names=None: list(precompile.JOBS))


def test_two_processes_run_their_shares(tmp_path, monkeypatch):
    _fake_jobs(monkeypatch, tmp_path, {"a": (_job_a, 2.0), "b": (_job_b, 1.0)})
    summary = precompile.precompile(processes=2)
    assert summary["jobs"] == ["a", "b"] and summary["processes"] == 2 and summary["failed"] == []
    assert (tmp_path / "a").read_text() == str(os.getpid())  # the largest share in this process
    assert (tmp_path / "b").read_text() != str(os.getpid())


def test_one_process_runs_all_here(tmp_path, monkeypatch):
    _fake_jobs(monkeypatch, tmp_path, {"a": (_job_a, 2.0), "b": (_job_b, 1.0)})
    assert precompile.precompile(processes=1)["processes"] == 1
    assert (tmp_path / "a").read_text() == (tmp_path / "b").read_text() == str(os.getpid())


@pytest.mark.parametrize("job", [_job_fails, _job_dies], ids=["raises", "killed"])
def test_a_job_that_fails_in_another_process_is_named_and_left_to_its_first_call(tmp_path, monkeypatch, job):
    _fake_jobs(monkeypatch, tmp_path, {"a": (_job_a, 2.0), "broken": (job, 1.0)})
    with pytest.warns(RuntimeWarning, match="broken failed in another process"):
        summary = precompile.precompile(processes=2)
    assert summary["failed"] == ["broken"]
    assert (tmp_path / "a").read_text() == str(os.getpid())  # this process's share ran


def test_where_no_process_starts_this_one_runs_every_job(tmp_path, monkeypatch):
    import multiprocessing

    class NoProcesses:
        class Process:
            def __init__(self, *args, **kwargs):
                pass

            def start(self):
                raise OSError("no semaphores here")

    _fake_jobs(monkeypatch, tmp_path, {"a": (_job_a, 2.0), "b": (_job_b, 1.0)})
    monkeypatch.setattr(multiprocessing, "get_context", lambda method: NoProcesses)
    with pytest.warns(RuntimeWarning, match="no semaphores here"):
        summary = precompile.precompile(processes=2)
    assert summary["failed"] == [] and summary["processes"] == 1
    assert (tmp_path / "a").read_text() == (tmp_path / "b").read_text() == str(os.getpid())


def _job_stops():
    raise SystemExit(143)  # as the CLI's SIGTERM handler raises it


def _job_sleeps():
    import time

    time.sleep(120)


def test_a_stop_here_ends_the_other_processes_at_once(tmp_path, monkeypatch):
    import time

    _fake_jobs(monkeypatch, tmp_path, {"stops": (_job_stops, 2.0), "sleeps": (_job_sleeps, 1.0)})
    start = time.monotonic()
    with pytest.raises(SystemExit):
        precompile.precompile(processes=2)
    assert time.monotonic() - start < 60  # the sleeping process was terminated, not waited for
