"""What a newcomer copies from README.md works: its links resolve, and every command in its code blocks is
one that the test suite (or the demo) runs.

How a command counts as run, without running it a second time: each test function (with the helpers and
module-level option lists it uses) and each recipe script that a test runs is a *runner*; a README command
is covered when one runner runs the same program (``fairseq-train``, ``python -m preprocess.text``,
``bash user_dir_examples/lm/eval.sh``, ...) and passes every option the README passes (``--mask-prob``,
hydra's ``task.data=``, a recipe's ``FORM=``). Each README fairseq command also goes through fairseq's own
argument parser, so a misspelled option, arch, task or criterion fails here. A line whose program this
file does not know fails too: a new kind of command needs a test before it goes into the README."""
import ast
import importlib.util
import inspect
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import ROOT, USER_DIR

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
TESTS = ROOT / "tests"
RECIPES = ROOT / "user_dir_examples"
FAIRSEQ_PARSERS = {"fairseq-train": "get_training_parser", "fairseq-eval-lm": "get_eval_lm_parser",
                   "fairseq-interactive": "get_interactive_generation_parser", "fairseq-generate": "get_generation_parser",
                   "fairseq-validate": "get_validation_parser"}


# ---- the README's code blocks and commands ---------------------------------------------------------------

def fenced_blocks(text: str):
    """[(info string, [lines])] of the ``` blocks of a markdown text."""
    blocks, info, lines = [], None, []
    for line in text.splitlines():
        fence = re.match(r"^\s*```(.*)$", line)
        if fence and info is None:
            info, lines = fence.group(1).strip(), []
        elif fence:
            blocks.append((info, lines))
            info = None
        elif info is not None:
            lines.append(line)
    assert info is None, "an unclosed ``` block"
    return blocks


@dataclass
class Command:
    text: str                      # as the README writes it, continuation lines joined
    env: list                      # VAR of each leading VAR=value
    argv: list                     # the words, quotes removed, "..." dropped

    @property
    def program(self) -> str:
        a = self.argv
        if a[0] in ("python", "python3") and len(a) > 2 and a[1] == "-m":
            return f"python -m {a[2]}"
        if a[0] == "bash":
            return f"bash {a[1]}"
        return a[0]

    @property
    def options(self) -> set:
        return {w.split("=")[0] for w in self.argv if w.startswith("--")}

    @property
    def overrides(self) -> set:
        """hydra's key=value words: their keys with the '='."""
        return {w.split("=")[0] + "=" for w in self.argv if re.match(r"^[a-z_]+\.[a-z_.]+=", w)}


def shell_commands(lines):
    """Commands of a shell block: continuations joined, comments dropped, split at ``&&`` and ``|``."""
    joined, out = [], []
    for line in lines:
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1] + " " + line.strip()
        else:
            joined.append(line.strip())
    for line in joined:
        lex = shlex.shlex(line, posix=True, punctuation_chars="|&;")
        lex.whitespace_split = True
        words = list(lex)
        segments, current = [], []
        for w in words:
            if w in ("&&", "|", ";"):
                segments.append(current)
                current = []
            else:
                current.append(w)
        segments.append(current)
        for seg in segments:
            env = []
            while seg and re.match(r"^[A-Z_][A-Z0-9_]*=", seg[0]):
                env.append(seg.pop(0).split("=")[0])
            seg = [w for w in seg if w != "..."]
            if seg:
                out.append(Command(line, env, seg))
    return out


def readme_commands():
    blocks = fenced_blocks(README.read_text())
    return [c for info, lines in blocks if info not in ("python", "text") for c in shell_commands(lines)]


def test_first_block_is_the_two_commands():
    """SPEC section 5: the README's first code block holds the main job, then the tests (.ci/run runs it)."""
    info, lines = fenced_blocks(README.read_text())[0]
    assert [line.strip() for line in lines if line.strip()] == ["bash run.sh demo", "bash run.sh test"]
    assert "bash run.sh test" in (ROOT / ".ci" / "run").read_text()


# ---- links ------------------------------------------------------------------------------------------------

def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set:
    seen, out = {}, set()
    in_code = False
    for line in page.read_text().splitlines():
        if re.match(r"^\s*```", line):
            in_code = not in_code
        m = re.match(r"^(#{1,6})\s+(.*)$", line)
        if m and not in_code:
            s = slug(m.group(2))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(page: Path):
    """(target) of every markdown link and image outside code."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"!?\[[^\]\n]*\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_relative_links_resolve(page):
    bad = []
    for target in links(page):
        if re.match(r"^[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            bad.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            bad.append(f"{target}: no heading with that anchor in {file.name}")
    assert not bad, f"{page.name}: " + "; ".join(bad)


def module_file(module: str):
    """The checkout's file of ``python -m module``, or None when the module is not the checkout's."""
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__main__.py"):
        if candidate.exists():
            return candidate
    return None


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_python_m_modules_exist(page):
    """Every ``python -m X`` that README.md or a docs page names, in code or prose, can run."""
    for module in sorted(set(re.findall(r"python -m ([A-Za-z_][\w.]*[A-Za-z_0-9])", page.read_text()))):
        if module.split(".")[0] in ("lion_fairseq", "preprocess"):
            assert module_file(module), f"{page.name}: python -m {module}: no such module in the checkout"
        else:
            assert importlib.util.find_spec(module), f"{page.name}: python -m {module}: not installed"


# ---- the commands the tests run ---------------------------------------------------------------------------

@dataclass
class Runner:
    where: str
    programs: set = field(default_factory=set)
    words: set = field(default_factory=set)      # every string it uses, split at blanks; keyword names

    @property
    def options(self) -> set:
        return {w.split("=")[0] for w in self.words if w.startswith("--")}

    def has_override(self, key: str) -> bool:
        return any(w.startswith(key) for w in self.words)


def strings(node) -> list:
    """Every string literal under ``node`` (f-strings' literal parts too), but not docstrings."""
    out = []
    for n in ast.walk(node):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)) and n.body:
            first = n.body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant):
                first.value._docstring = True
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and not getattr(n, "_docstring", False):
            out.append(((n.lineno, n.col_offset), n.value))
        elif isinstance(n, ast.keyword) and n.arg:
            out.append(((n.lineno, n.col_offset), n.arg))
    return [s for _, s in sorted(out)]  # in source order (ast.walk is breadth-first)


def script_path(parts: list):
    """The recipe script a test's ``["bash", <path expression>, ...]`` names, from its literal parts."""
    tail = "/".join(p.strip("/") for p in parts if p)
    found = [p for p in RECIPES.rglob("*.sh") if p.as_posix().endswith("/" + tail) or p.as_posix().endswith(tail)]
    return found[0].relative_to(ROOT).as_posix() if len(found) == 1 else None


def programs_in(node, imports: dict) -> set:
    """The programs a piece of test code runs: ``fairseq_cli("train", ...)``; an argv list that starts with
    ``fairseq-x`` or ``bash script``, or holds ``-m module``; ``module.main(...)`` in process."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name == "fairseq_cli" and n.args and isinstance(n.args[0], ast.Constant):
                out.add("fairseq-" + n.args[0].value.replace("_", "-"))
            if isinstance(f, ast.Attribute) and f.attr == "main" and isinstance(f.value, ast.Name) \
                    and f.value.id in imports:
                out.add(f"python -m {imports[f.value.id]}")
            if isinstance(f, ast.Name) and f.id in imports and imports[f.id].endswith(".main"):
                out.add(f"python -m {imports[f.id][:-len('.main')]}")
        if isinstance(n, (ast.List, ast.Tuple)) and n.elts:
            items = [e.value if isinstance(e, ast.Constant) and isinstance(e.value, str) else None for e in n.elts]
            if items[0] and items[0].startswith("fairseq-"):
                out.add(items[0])
            if items[0] == "bash" and len(n.elts) > 1:
                script = script_path(strings(n.elts[1]))
                if script:
                    out.add(f"bash {script}")
            for a, b in zip(items, items[1:]):
                if a == "-m" and b:
                    out.add(f"python -m {b}")
    for p in list(out):  # python -m fairseq_cli.train is fairseq-train
        if p.startswith("python -m fairseq_cli."):
            out.add("fairseq-" + p.split(".")[-1].replace("_", "-"))
    return out


def python_runners(path: Path) -> list:
    tree = ast.parse(path.read_text())
    imports, assigned, functions = {}, {}, {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                imports[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                imports[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    assigned[t.id] = node.value
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions[node.name] = node

    def closure(fn_name):
        """The function, the module-level helpers it calls and the module-level values it reads."""
        todo, seen = [fn_name], set()
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            node = functions.get(name) or assigned.get(name)
            for n in ast.walk(node):
                if isinstance(n, ast.Name) and (n.id in functions or n.id in assigned):
                    todo.append(n.id)
        return [functions.get(n) or assigned.get(n) for n in seen]

    runners = []
    for name in functions:
        r = Runner(f"{path.relative_to(ROOT)}::{name}")
        for node in closure(name):
            r.programs |= programs_in(node, imports)
            for s in strings(node):
                r.words.update(s.split() or [s])
        if r.programs:
            runners.append(r)
    return runners


def script_runner(script: str, callers: list) -> Runner:
    """A recipe script as a runner: the programs it runs and its options, with the options its callers pass."""
    text = "\n".join(line for line in (ROOT / script).read_text().splitlines() if not line.lstrip().startswith("#"))
    r = Runner(script)
    r.programs = set(re.findall(r"(?<![\w-])(fairseq-[a-z-]+)", text))
    r.programs |= {f"python -m {m}" for m in re.findall(r"python -m ([\w.]+)", text)}
    r.words = set(re.findall(r"--[a-z0-9][a-z0-9-]*", text)) | {w.strip("'\"") for w in text.split()}
    for c in callers:
        r.words |= c.words
    return r


@pytest.fixture(scope="module")
def runners() -> list:
    found = [r for path in sorted(TESTS.glob("*.py")) if path.name != Path(__file__).name  # not this file
             for r in python_runners(path)]
    scripts = {p.split(" ", 1)[1] for r in found for p in r.programs if p.startswith("bash ")}
    found += [script_runner(s, [r for r in found if f"bash {s}" in r.programs]) for s in sorted(scripts)]
    return found


def requirement(cmd: Command):
    """(program, what a runner of it must pass) for one README command; checks what needs no runner."""
    program, need = cmd.program, set(cmd.options) | set(cmd.env) | set(cmd.overrides)
    if program == "bash run.sh":
        action = cmd.argv[2] if len(cmd.argv) > 2 else ""
        assert f"{action})" in (ROOT / "run.sh").read_text(), f"run.sh has no '{action}'"
        if action == "test":
            assert "bash run.sh test" in (ROOT / ".ci" / "run").read_text()
            return None, set()  # the suite itself, as CI runs it
        return {"demo": "python -m lion_fairseq.demo"}[action], set()
    if program.startswith("bash "):
        assert (ROOT / cmd.argv[1]).is_file(), f"{cmd.text}: no script {cmd.argv[1]}"
        for var in cmd.env:
            assert "${" + var in (ROOT / cmd.argv[1]).read_text(), f"{cmd.argv[1]} does not read {var}"
    if program == "fairseq-hydra-train":
        name = cmd.argv[cmd.argv.index("--config-name") + 1]
        config = ROOT / cmd.argv[cmd.argv.index("--config-dir") + 1] / f"{name}.yaml"
        assert config.exists(), f"{cmd.text}: no config {config.relative_to(ROOT)}"
        need.add(name)
    for name in ("--task", "--criterion"):  # the workflow itself, not only its option names
        if name in cmd.argv[:-1]:
            need.add(cmd.argv[cmd.argv.index(name) + 1])
    return program, need


def lacks(runner: Runner, need: set) -> set:
    """What of ``need`` (options, words, hydra keys ending in '=') a runner does not pass."""
    return {w for w in need if not (runner.has_override(w) if w.endswith("=") else
                                    w in runner.options if w.startswith("--") else w in runner.words)}


KNOWN = ("fairseq-", "python -m ", "bash ")
INSTALL = ("pip", "python3", ".")


def test_every_readme_command_is_run_by_a_test(runners):
    commands = readme_commands()
    assert len(commands) > 15, "the README's commands were not found"
    missing = []
    for cmd in commands:
        if cmd.argv[0] in INSTALL or cmd.argv[0] == "echo":
            continue  # the install block (test below); echo feeds a prompt to the next command
        assert cmd.program.startswith(KNOWN), (
            f"README command with a program this test does not know: {cmd.text!r}: give it a check here")
        program, need = requirement(cmd)
        if program is None:
            continue
        close = sorted((r for r in runners if program in r.programs), key=lambda r: len(lacks(r, need)))
        if not close:
            missing.append(f"{cmd.text}\n    -> no test runs {program}")
        elif lacks(close[0], need):
            missing.append(f"{cmd.text}\n    -> the closest, {close[0].where}, does not pass "
                           f"{sorted(lacks(close[0], need))}")
    assert not missing, "README commands that no test runs:\n" + "\n".join(missing)


def test_readme_fairseq_commands_parse():
    """fairseq's own parsers accept each README command: its options, arch, task and criterion exist."""
    import lion_fairseq  # noqa: F401
    from fairseq import options

    checked = 0
    for cmd in readme_commands():
        if cmd.program not in FAIRSEQ_PARSERS:
            continue
        argv = list(cmd.argv[1:])
        if "--user-dir" in argv:
            argv[argv.index("--user-dir") + 1] = USER_DIR
        parser = getattr(options, FAIRSEQ_PARSERS[cmd.program])()
        try:
            args = options.parse_args_and_arch(parser, argv)
        except SystemExit as e:
            raise AssertionError(f"fairseq refuses the README's {cmd.text!r} (exit {e.code})") from None
        arch = next((argv[i + 1] for i, w in enumerate(argv[:-1]) if w == "--arch"), None)
        assert arch is None or args.arch == arch
        checked += 1
    assert checked >= 8


def test_install_block_is_what_run_sh_does():
    """The README's install commands are the ones scripts/env.sh (which run.sh sources) runs."""
    env_sh = (ROOT / "scripts" / "env.sh").read_text()
    normal = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", env_sh)  # ${VAR:-default} -> default
    normal = normal.replace('"$ROOT/', "").replace('"$ROOT"', ".").replace('"', "")
    installs = {line.split("pip install", 1)[1].strip() for line in normal.splitlines() if "pip install" in line}
    seen = 0
    for cmd in readme_commands():
        if cmd.argv[0] == "pip":
            assert cmd.argv[1] == "install" and " ".join(cmd.argv[2:]) in installs, \
                f"scripts/env.sh does not run {cmd.text!r}: it runs pip install {sorted(installs)}"
            seen += 1
        elif cmd.argv[0] == "python3":
            assert cmd.argv[1:3] == ["-m", "venv"] and '-m venv' in env_sh
    assert seen == 4


def test_operator_call_matches_its_signature():
    """The README's Python block calls lion_attention with parameters it has."""
    import lion_fairseq.ops as ops

    for info, lines in fenced_blocks(README.read_text()):
        if info != "python":
            continue
        tree = ast.parse("\n".join(lines))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and hasattr(ops, node.func.id):
                sig = inspect.signature(getattr(ops, node.func.id))
                sig.bind(*[None] * len(node.args), **{k.arg: None for k in node.keywords})


def test_summary_figures_are_in_their_records():
    """Each figure of the README's Benchmarks table is copied from the record it links, with its command."""
    text = README.read_text()
    table = text[text.index("## Benchmarks"):text.index("## Layout")]
    rows = [r for r in table.splitlines() if r.startswith("| ") and not r.startswith("| what")]
    assert len(rows) >= 5
    number = r"(?<![\w.])\d+(?:\.\d+)?x?(?!\w|\.\d)"
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        figure, command, record = cells[1], cells[2], cells[3]
        pages = [(README.parent / t.partition("#")[0]).read_text() for t in re.findall(r"\]\(([^)]+)\)", record)]
        assert pages, row
        for n in re.findall(number, figure):
            assert any(re.search(r"(?<![\w.])" + re.escape(n) + r"(?!\w|\.\d)", p) for p in pages), (n, row)
        module = re.search(r"python -m [\w.]+", command).group(0)
        assert any(module in p for p in pages), (module, row)
