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


def test_a_shell_scripts_commands_start_warm_with_their_own_status(tmp_path):
    """A recipe's fairseq commands, through the stand-ins on_path puts first on its PATH."""
    (tmp_path / "ref.txt").write_text("a b c d e\n")
    script = ('echo "a b c d e" | fairseq-score --sys - --ref ref.txt\n'
              'python -m fairseq_cli.score --ref ref.txt --no-such-option; echo "status $?"\n'
              'python -c "import sys; print(sys.flags.no_site)"\n'  # not a fairseq command: the real python
              # a command waiting on its input, terminated as a shell's job is
              'mkfifo waiting; fairseq-score --sys - --ref ref.txt < waiting & exec 3> waiting\n'
              'sleep 1; kill -TERM $!; wait $!; echo "status $?"\n')
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=warm_python.on_path(dict(os.environ)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "BLEU4 = 100.00" in proc.stdout, proc
    said = [line for line in proc.stdout.splitlines() if not line.startswith(("Namespace", "BLEU4"))]
    assert said == ["status 2", "0", "status 143"], proc.stdout
    assert "unrecognized arguments: --no-such-option" in proc.stderr
    if os.environ.get("LION_TEST_COLD") != "1":
        assert warm_python.on_path({"PATH": "x"})["PATH"].endswith("bin:x")
