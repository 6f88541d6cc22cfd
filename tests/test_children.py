"""Children die with vlmrl (issue 37): a kill -9 of vlmrl takes the GGUF converter and the math worker with it,
so none is left writing into a run folder after its lock is released. Before, the converter went on writing
its partial file after `vlmrl export` was killed.

Each test starts a parent process that starts a child the way vlmrl does, kills the parent with SIGKILL and
watches the child's pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")


def alive(pid: int) -> bool:
    """Running (a zombie, killed and waiting for its new parent to reap it, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def child_of_killed_parent(script: str, tmp_path: Path, timeout: float = 60) -> int:
    """Run `script` (it prints its child's pid, then waits), SIGKILL it once the pid is out; the child's pid."""
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), str(pid_file)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    while not (pid_file.is_file() and pid_file.read_text().strip()):
        assert parent.poll() is None, parent.stderr.read().decode()
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.05)
    child = int(pid_file.read_text())
    assert alive(child)
    parent.kill()
    parent.wait()
    return child


def gone_within(pid: int, seconds: float = 5) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def test_a_child_started_from_a_short_lived_thread_lives_until_its_process_dies(tmp_path):
    script = """
        import sys, threading, time
        from pathlib import Path
        from vlmrl.common import children

        def start():
            child = children.popen([sys.executable, "-c", "import time; time.sleep(120)"])
            time.sleep(0.5)  # the thread that asked has ended by the time the pid is out; the child must not care
            Path(sys.argv[1]).write_text(str(child.pid))

        thread = threading.Thread(target=start)
        thread.start()
        thread.join()
        time.sleep(120)
    """
    child = child_of_killed_parent(script, tmp_path)
    assert gone_within(child)


def test_the_gguf_converter_dies_with_vlmrl_export(tmp_path):
    """A stand-in for llama.cpp's converter that writes its output forever, run as `vlmrl export` runs it."""
    llama = tmp_path / "llama.cpp"
    (llama / "conversion").mkdir(parents=True)
    (llama / "conversion" / "__init__.py").write_text("")
    (llama / "conversion" / "base.py").write_text("class TextModel:\n    def get_vocab_base_pre(self, t):\n        pass\n")
    (llama / "convert_hf_to_gguf.py").write_text(textwrap.dedent(f"""
        import os, sys, time
        out = sys.argv[sys.argv.index("--outfile") + 1]
        with open(out, "wb") as handle:
            open({str(tmp_path / "child.pid")!r}, "w").write(str(os.getpid()))
            while True:
                handle.write(b"x" * 1024)
                handle.flush()
                time.sleep(0.01)
    """))
    script = f"""
        from pathlib import Path
        from vlmrl.export.gguf import _run_converter

        _run_converter(Path({str(llama)!r}), Path({str(tmp_path)!r}), Path({str(tmp_path / "model.gguf")!r}), "f16")
    """
    child = child_of_killed_parent(script, tmp_path)
    assert gone_within(child)
    size = (tmp_path / "model.gguf").stat().st_size
    time.sleep(0.3)
    assert (tmp_path / "model.gguf").stat().st_size == size  # nothing writes it any more


def test_the_math_worker_dies_with_its_parent(tmp_path):
    pytest.importorskip("math_verify")
    script = """
        import sys, time
        from pathlib import Path
        from vlmrl.grading import symbolic

        assert symbolic.expressions_equal("\\\\frac{1}{2}", "0.5")
        Path(sys.argv[1]).write_text(str(symbolic._WORKER._proc.pid))
        time.sleep(120)
    """
    child = child_of_killed_parent(script, tmp_path, timeout=120)
    assert gone_within(child)


def test_popen_and_run_behave_like_subprocess(tmp_path):
    from vlmrl.common import children

    done = children.run([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"])
    assert (done.returncode, done.stdout.strip()) == (3, "out")
    with pytest.raises(FileNotFoundError):
        children.popen([str(tmp_path / "no-such-program")])
    proc = children.popen([sys.executable, "-c", "import time; time.sleep(60)"])
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=10) == -signal.SIGTERM
