"""Write output into a hidden folder beside ``--destdir``, renamed into place only on success.

A run that fails or is interrupted leaves no ``--destdir`` (or the previous one, untouched): a
folder with that name is always complete.
"""
import logging
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Optional, Tuple

from preprocess.errors import PreprocessError

log = logging.getLogger("preprocess")

Inputs = Iterable[Tuple[Optional[Path], str]]  # (path or None, the option that named it)


def check_destdir(destdir: Path, force: bool, inputs: Inputs = ()) -> None:
    """Refuse to clobber existing output unless ``--force``, and even with it a folder that holds this run's
    inputs or the current folder (replacing it would delete them). fairseq's preprocess splits paths on ',',
    and fairseq-train its data path on ':'. A symlink is followed: its target is the output folder."""
    destdir = Path(destdir)
    try:
        where = destdir.resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop: RuntimeError before Python 3.13
        raise PreprocessError(f"--destdir: {destdir} cannot be resolved ({e})") from None
    for sep, who in ((",", "fairseq's preprocess splits paths"), (":", "fairseq-train splits its data path")):
        if sep in str(where):
            raise PreprocessError(f"--destdir: {who} on '{sep}', so the path must not contain one: {destdir}")
    if not destdir.exists():
        return
    if not destdir.is_dir():
        raise PreprocessError(f"--destdir: exists and is not a directory: {destdir}")
    if os.path.ismount(where):  # the finished output takes its place by a rename, which a mount point refuses
        raise PreprocessError(f"--destdir: {destdir} is a mount point, which the finished output cannot replace; "
                              f"name a folder inside it, e.g. {destdir / 'data-bin'}")
    for path, option in inputs:
        if path is not None and (where == Path(path).resolve() or where in Path(path).resolve().parents):
            raise PreprocessError(f"--destdir: {destdir} holds this run's input ({option} {path}), which "
                                  "replacing it would delete; write the output to another folder")
    cwd = Path.cwd().resolve()
    if where == cwd or where in cwd.parents:
        raise PreprocessError(f"--destdir: {destdir} is the current folder or holds it, which replacing it "
                              "would delete; name a folder of its own, e.g. data-bin/NAME")
    if any(destdir.iterdir()) and not force:
        raise PreprocessError(f"--destdir: {destdir} already exists and is not empty; "
                              f"pass --force to replace it")


def remove_staging(stage: Path, tries: int = 10) -> None:
    """Remove an unfinished staging folder. The signal that stopped the run often comes twice (``timeout`` and
    a terminal's Ctrl-C signal the whole process group; users press it again), and pool workers that it
    also stopped may write a last file: neither may leave the folder behind (a folder that cannot be
    removed is given up after about a second)."""
    for _ in range(tries):
        try:
            shutil.rmtree(stage, ignore_errors=True)
            if not stage.exists():
                return
            time.sleep(0.1)
        except (KeyboardInterrupt, SystemExit):  # a second Ctrl-C or kill: the removal goes on
            continue


@contextmanager
def staged_destdir(destdir: Path, force: bool = False) -> Iterator[Path]:
    """Yield an empty staging folder; on normal exit it becomes ``destdir``, on error it is removed."""
    destdir = Path(destdir)
    check_destdir(destdir, force)
    if destdir.is_symlink():  # the output replaces the folder it points to (a rename would meet the link)
        destdir = destdir.resolve()
    # a run killed outright (kill -9, a lost node) cannot remove its staging folder; one still running
    # elsewhere (a shared file system) would lose its work, so they are named, not deleted
    left = (sorted(str(p) for p in destdir.parent.glob(f".{destdir.name}.partial-*"))
            if destdir.parent.is_dir() else [])
    if left:
        log.warning("%s: staging folder(s) of another run into %s, unfinished (still running, or killed): delete "
                    "them once no such run is left", ", ".join(left), destdir)
    try:
        destdir.parent.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=f".{destdir.name}.partial-", dir=destdir.parent))
    except OSError as e:
        raise PreprocessError(f"--destdir: cannot create {destdir} ({e.strerror or e}: "
                              f"{e.filename or destdir.parent})") from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(stage, 0o777 & ~umask)  # mkdtemp makes it private; the output should not be
    try:
        yield stage
    except BaseException:
        remove_staging(stage)
        raise
    old, moved = None, False
    try:
        if destdir.exists():
            # Move the old output aside first so the rename below cannot meet a non-empty folder.
            old = Path(tempfile.mkdtemp(prefix=f".{destdir.name}.old-", dir=destdir.parent))
            os.replace(destdir, old)
            moved = True
        os.replace(stage, destdir)
    except BaseException as e:
        if moved:
            os.replace(old, destdir)
        elif old is not None:
            old.rmdir()
        remove_staging(stage)
        if isinstance(e, OSError):  # the previous output, if any, is back in place
            raise PreprocessError(f"--destdir: cannot put the output in place at {destdir} ({e.strerror or e}); "
                                  "nothing was written there") from None
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    log.info("wrote %s", destdir)
