"""The Python example of python/README.md, run as it is given there: the shell block after "The examples
in `examples/python/`", minus its install line (scripts/test.sh has just installed the package
into this interpreter). Both toy engine ranks must install step 3, verified, rank 1 by swap."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_block():
    text = (ROOT / "python" / "README.md").read_text()
    at = text.index("The examples in `examples/python/`")
    block = re.search(r"```sh\n(.*?)```", text[at:], re.S).group(1)
    lines = block.splitlines()
    assert lines[0].startswith("scripts/install-deps.sh"), lines[0]
    return "\n".join(lines[1:]) + "\n"


def test_readme_python_example_runs_verbatim(tmp_path):
    # The README's etcd directory is a fixed path; this run gets its own, so two runs (a CI
    # clone beside a developer's checkout) never share or stop each other's etcd.
    script = readme_block().replace("/tmp/reshard-example", str(tmp_path / "etcd"))
    assert str(tmp_path) in script, "the README example's etcd is no longer in /tmp/reshard-example"
    venv = ROOT / ".deps" / "venv"
    # Which virtualenv runs us is sys.prefix: the interpreter paths of two virtualenvs of one
    # Python resolve to the same file, so comparing them cannot tell the two apart.
    if Path(sys.prefix).resolve() != venv.resolve():
        # Only where pytest runs outside that virtualenv: the same command, this interpreter.
        script = script.replace(".deps/venv/bin/python", sys.executable)
    # The script runs in a session of its own, so everything it started (engines that keep
    # retrying discovery while no publisher appears, trainers that linger) is one process group
    # to stop when it fails part-way.
    proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the script and all it started have ended
        proc.wait()
        # The script stops its etcd at its end; a failure part-way must not leave it running.
        subprocess.run(["scripts/etcd.sh", "stop", str(tmp_path / "etcd")], cwd=ROOT,
                       capture_output=True)
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        assert f"engine rank {rank}: step 3 installed, verified=True" in out.stdout, out.stdout
    # Rank 0 copies into its own arrays; rank 1 swaps, copying nothing.
    assert re.search(r"engine rank 0: step 3 .* \+ copy \d", out.stdout), out.stdout
    assert re.search(r"engine rank 1: step 3 .* \+ swap 0\.00 ms", out.stdout), out.stdout
    for rank in range(4):
        assert f"trainer rank {rank}: published step 3" in out.stdout, out.stdout
