"""How a child's end is described: exit code or signal, and the last error line of its log."""

from __future__ import annotations

import signal

import pytest

from launchers.logs import last_error_line
from launchers.processes import describe_exit

VLLM_ENGINE_CRASH = """\
# CUDA_VISIBLE_DEVICES=0 vllm serve /models/PRIMO-R1-7B --served-model-name PRIMO-R1-7B
(APIServer pid=100) INFO 09-10 12:33:01 [api_server.py:1805] vLLM API server version 0.10.2
(EngineCore_0 pid=123) INFO 09-10 12:34:40 [gpu_model_runner.py:2007] Loading model weights took 15.6 GiB
(EngineCore_0 pid=123) ERROR 09-10 12:34:56 [core.py:700] EngineCore failed to start.
(EngineCore_0 pid=123) ERROR 09-10 12:34:56 [core.py:700] Traceback (most recent call last):
(EngineCore_0 pid=123) ERROR 09-10 12:34:56 [core.py:700]   File "/vllm/v1/engine/core.py", line 691, in run_engine_core
(EngineCore_0 pid=123) ERROR 09-10 12:34:56 [core.py:700]     raise ValueError(
(EngineCore_0 pid=123) ERROR 09-10 12:34:56 [core.py:700] torch.OutOfMemoryError: CUDA out of memory.
(APIServer pid=100) Traceback (most recent call last):
(APIServer pid=100)   File "/vllm/entrypoints/openai/api_server.py", line 1920, in <module>
(APIServer pid=100)     raise RuntimeError("Engine core initialization failed. "
(APIServer pid=100) RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
/usr/lib/python3.12/multiprocessing/resource_tracker.py:279: UserWarning: resource_tracker: leaked objects
  warnings.warn('resource_tracker: There appear to be %d '
"""


@pytest.mark.parametrize(("code", "asked", "expected"), [
    (3, False, "exited with code 3"),
    (1, True, "exited with code 1"),
    (0, False, "exited on its own (code 0)"),  # never a plain "code 0" for an unasked exit
    (0, True, "exited with code 0"),
    (-signal.SIGKILL, False, "was killed by SIGKILL"),
    (-signal.SIGSEGV, True, "was killed by SIGSEGV"),
    (-200, False, "was killed by signal 200"),
    (None, False, "is still running"),
])
def test_describe_exit(code, asked, expected):
    assert describe_exit(code, asked_to_stop=asked) == expected


def test_last_error_line_of_an_engine_crash_is_the_final_exception():
    assert last_error_line(VLLM_ENGINE_CRASH) == (
        "(APIServer pid=100) RuntimeError: Engine core initialization failed. See root cause "
        "above. Failed core proc(s): {}")


def test_last_error_line_skips_logged_traceback_frames():
    engine_part = VLLM_ENGINE_CRASH.split("(APIServer pid=100) Traceback")[0]
    assert last_error_line(engine_part) == (
        "(EngineCore_0 pid=123) ERROR 09-10 12:34:56 [core.py:700] torch.OutOfMemoryError: CUDA "
        "out of memory.")
    frames_only = "\n".join(line for line in engine_part.splitlines() if "OutOfMemoryError" not in line)
    assert last_error_line(frames_only) == (
        "(EngineCore_0 pid=123) ERROR 09-10 12:34:56 [core.py:700] EngineCore failed to start.")


@pytest.mark.parametrize(("log", "expected"), [
    ("INFO loading\nKeyError: 'model_type'\n", "KeyError: 'model_type'"),
    ("INFO a\nERROR 01-02 03:04:05 [x.py:9] Engine core proc EngineCore_0 died unexpectedly, "
     "shutting down client.\nINFO 01-02 03:04:06 [x.py:10] bye\n",
     "ERROR 01-02 03:04:05 [x.py:9] Engine core proc EngineCore_0 died unexpectedly, shutting "
     "down client."),
    ("(APIServer pid=1) Engine core proc EngineCore_0 died unexpectedly\n",
     "(APIServer pid=1) Engine core proc EngineCore_0 died unexpectedly"),
    ("ERROR fake vllm: exiting with code 3 as asked\n", "ERROR fake vllm: exiting with code 3 as asked"),
    ("INFO 01-02 03:04:05 [x.py:1] Starting vLLM API server on http://127.0.0.1:8001\n"
     "INFO: Shutting down\nWARNING 01-02 [x.py:2] no ErrorHandler configured\n", None),
    ("", None),
])
def test_last_error_line(log, expected):
    assert last_error_line(log) == expected


def test_a_long_error_line_is_shortened():
    line = last_error_line("RuntimeError: " + "x" * 1000)
    assert line is not None and len(line) == 240 and line.endswith("...")
