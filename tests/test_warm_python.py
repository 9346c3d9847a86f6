"""tests/warm_python.py, which starts fairseq's commands for the other tests: a command started warm must be
a real child process whose input, output, exit status and signals are its own, or a test could pass on a
command that failed."""
import os
import signal
import subprocess
import sys

import warm_python

SCORE = [sys.executable, "-m", "fairseq_cli.score", "--sys", "-", "--ref"]  # reads the hypotheses on stdin


def test_a_warm_command_is_a_child_with_its_own_status_and_output(tmp_path):
    # conftest installed it (LION_TEST_COLD=1 checks the same of plain subprocesses)
    assert (subprocess.Popen is warm_python.WarmPopen) == (os.environ.get("LION_TEST_COLD") != "1")
    (tmp_path / "ref.txt").write_text("a b c d e\n")
    scored = subprocess.run([*SCORE, "ref.txt"], cwd=tmp_path, input="a b c d e\n", capture_output=True, text=True)
    assert scored.returncode == 0 and "BLEU4 = 100.00" in scored.stdout, scored
    bad = subprocess.run([*SCORE, "ref.txt", "--no-such-option"], cwd=tmp_path, capture_output=True, text=True)
    assert bad.returncode == 2 and "unrecognized arguments: --no-such-option" in bad.stderr, bad
    crashed = subprocess.run([*SCORE, "ref.txt"], cwd=tmp_path, input="", capture_output=True, text=True)
    assert crashed.returncode == 1 and "ZeroDivisionError" in crashed.stderr, crashed  # fairseq's, on no lines
    script = subprocess.run([str(warm_python.BIN / "fairseq-train"), "--help"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert script.returncode == 0 and "usage: fairseq-train [-h]" in script.stdout, script.stdout[:300]


def test_a_warm_command_can_be_fed_read_and_killed(tmp_path):
    (tmp_path / "ref.txt").write_text("a b c d e\n")
    proc = subprocess.Popen([*SCORE, tmp_path / "ref.txt"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert warm_python.warm_command(proc.args) and int(open(f"/proc/{proc.pid}/stat").read().split()[3]) == os.getpid()
    proc.stdin.write("a b c d e\n")
    proc.stdin.close()
    assert "BLEU4 = 100.00" in proc.stdout.read() and proc.wait(timeout=60) == 0
    waiting = subprocess.Popen([*SCORE, tmp_path / "ref.txt"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    waiting.send_signal(signal.SIGKILL)
    assert waiting.wait(timeout=60) == -signal.SIGKILL
