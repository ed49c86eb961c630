"""bench/cpu_split.py: its /proc and strace readings, and its refusals."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import cpu_split  # noqa: E402


def test_proc_readings_of_this_process_add_up_over_its_threads():
    sum(range(3_000_000))  # some user time
    got = cpu_split.read_proc(os.getpid())
    assert got["utime"] > 0 and got["voluntary"] + got["nonvoluntary"] > 0 and got["minflt"] > 0


def test_strace_summary_is_read_per_system_call():
    text = """% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 89.05    2.396518      119825        20         1 futex
  3.15    0.084756          17      4835           read
  1.46    0.039171          16      2414           poll
------ ----------- ----------- --------- --------- ----------------
100.00    2.691283         157     17067        17 total
"""
    assert cpu_split.parse_strace_summary(text) == {"futex": 20, "read": 4835, "poll": 2414}


def test_unknown_routers_and_bad_options_are_refused(capsys):
    for argv in (["--routers", "nope"], ["--duration", "0"], ["--body-size", "lots"]):
        with pytest.raises(SystemExit) as exc:
            cpu_split.main(argv)
        assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown router(s) ['nope']" in err and "--duration must be >= 1" in err and "not a size" in err
