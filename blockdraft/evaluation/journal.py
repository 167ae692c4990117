"""A bench's journal (`blockdraft bench --journal FILE`): each prompt's figures appended as one JSON
line the moment the prompt is done, so that a bench killed after an hour resumes with the prompts
it lacks instead of starting over. The first line is the run's configuration; a journal written
by another configuration (other methods, prompts, lengths, dtypes) is refused rather than mixed in.

A resumed run's adaptive policies start afresh (what they learned on the journaled prompts is not
stored), as after a restart of the server; the report says how many prompts came from the journal.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BlockdraftError
from .results import MethodResult

VERSION = 1


def prompts_digest(prompts: list[list[int]]) -> str:
    """A short fingerprint of the prompts' token ids (the same dataset, limit and template)."""
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]


@dataclass
class Journal:
    path: Path
    header: dict  # the run's configuration, the file's first line
    done: dict[int, dict] = field(default_factory=dict)  # prompt index -> its record

    @classmethod
    def open(cls, path: str | Path, header: dict) -> "Journal":
        """The journal at `path` (created with `header` when missing or empty); a BlockdraftError
        when it was written by another configuration or is not a journal."""
        path, header = Path(path), {"journal": VERSION, **header}
        journal = cls(path, header)
        text = path.read_text() if path.exists() else ""
        lines = text.splitlines()
        if not lines:
            path.parent.mkdir(parents=True, exist_ok=True)
            journal._append(header)
            return journal
        try:
            written = json.loads(lines[0])
        except json.JSONDecodeError:
            written = None
        if not isinstance(written, dict) or written.get("journal") != VERSION:
            raise BlockdraftError(f"{path} is not a bench journal; pass another --journal file")
        if written != header:
            diff = sorted(k for k in header.keys() | written.keys() if header.get(k) != written.get(k))
            raise BlockdraftError(f"{path} was written by a bench with other settings ({', '.join(diff)}); "
                                  "delete it or pass another --journal file")
        for n, line in enumerate(lines[1:], 2):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if n < len(lines):
                    raise BlockdraftError(f"{path}:{n} is not JSON; the journal is damaged") from None
                # the last line, cut short by the kill: drop it, that prompt runs again
                path.write_text("\n".join(lines[:-1]) + "\n")
                return journal
            journal.done[record["prompt"]] = record
        if not text.endswith("\n"):  # whole, but its newline never written
            path.write_text(text + "\n")
        return journal

    def results(self, i: int) -> dict[str, MethodResult]:
        """Prompt i's figures per method, as journaled."""
        return {m: MethodResult.from_dict(r) for m, r in self.done[i]["methods"].items()}

    def cost_sample(self, i: int) -> dict | None:
        """Prompt i's cost-model measurement (its target-forward keys back to ints), if taken."""
        s = self.done[i].get("costs")
        return s and {**s, "t_target": {int(b): t for b, t in s["t_target"].items()}}

    def record(self, i: int, results: dict[str, MethodResult], costs: dict | None) -> None:
        """Append prompt i's figures, on disk before the next prompt starts."""
        record = {"prompt": i, "methods": {m: r.to_dict() for m, r in results.items()}, "costs": costs}
        self._append(record)
        self.done[i] = json.loads(json.dumps(record))  # as a resume would read it

    def _append(self, obj: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(obj) + "\n")
            f.flush()
            os.fsync(f.fileno())
