"""The demo's working folder and what a second run may reuse from it.

Each stage (data, mlm, lm, eval) records in ``state.json`` a key: a hash of everything it was made
from (the corpus bytes, the exact command, the key of the stage before). A later run reuses a stage
whose key matches and whose outputs exist, and otherwise removes that stage's outputs and redoes it,
so an interrupted or changed run never mixes old and new files.
"""
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, Iterable, Optional

MARKER = ".lion-demo"


def fingerprint(*parts: Any, files: Iterable[Path] = ()) -> str:
    """A short hash of ``parts`` (JSON-serialisable) and the bytes of ``files``."""
    h = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode())
    for f in files:
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


class Workdir:
    """``--workdir``: created with a marker file; a non-empty folder without it is refused, so the
    demo never deletes files it did not make."""

    def __init__(self, root: Path):
        self.root = root.resolve()
        self.state_file = self.root / "state.json"

    def prepare(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"--workdir {self.root} exists and is not a folder")
        if self.root.is_dir() and any(self.root.iterdir()) and not (self.root / MARKER).exists():
            raise ValueError(f"--workdir {self.root} is not empty and was not made by the demo; "
                             "pass an empty or new folder")
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / MARKER).write_text("made by python -m lion_fairseq.demo; safe to delete\n")

    def _state(self) -> Dict[str, Any]:
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {}

    def done(self, stage: str, key: str, *outputs: Path) -> Optional[Dict[str, Any]]:
        """The record of ``stage`` if it finished with this ``key`` and its outputs are all there."""
        record = self._state().get(stage)
        if record and record.get("key") == key and all(p.exists() for p in outputs):
            return record
        return None

    def record(self, stage: str, key: str, **info: Any) -> None:
        state = self._state()
        state[stage] = dict(info, key=key)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2, sort_keys=True, default=str))
        os.replace(tmp, self.state_file)  # atomic: a Ctrl-C never leaves half a state file

    def forget(self, stage: str) -> None:
        state = self._state()
        if state.pop(stage, None) is not None:
            tmp = self.state_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(state, indent=2, sort_keys=True, default=str))
            os.replace(tmp, self.state_file)
