"""Variants: other pdserves a compare measures beside the default one (`--variant`).

This machine's speed drifts by a fifth within an hour, so two compares run one after the
other cannot judge a change of a few requests in 40; a variant takes turns with pdserve on
the same requests (`pdserve.bench.compare`), and `compare_report.ab_dict` pairs the two.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

VARIANT_PREFIX = "pdserve-"
# The checkout this code runs from.
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(slots=True, frozen=True)
class Variant:
    """Another pdserve measured beside the default one, turn by turn on the same requests:
    system pdserve-NAME, `pdserve up` with ``flags`` added, from the checkout at ``source``
    (None: this one)."""

    name: str
    flags: tuple[str, ...] = ()
    source: Path | None = None

    @property
    def system(self) -> str:
        return VARIANT_PREFIX + self.name

    @classmethod
    def parse(cls, spec: str) -> "Variant":
        """NAME[@SOURCE]=FLAGS, e.g. `fixed=--long-prefill-tokens 256 --no-long-prefill-adaptive`
        or `base@/work/wt/base=` (the checkout at /work/wt/base, no flags)."""
        head, sep, flags = spec.partition("=")
        name, at, source = head.partition("@")
        name = name.strip()
        if not sep or not re.fullmatch(r"[a-z0-9][a-z0-9_]*", name) or name == "fifo":
            raise ValueError(f"variant {spec!r}: want NAME[@SOURCE]=FLAGS with NAME of lower-case "
                             f"letters, digits and '_' (not 'fifo'), e.g. "
                             f"'fixed=--no-long-prefill-adaptive'")
        root = None
        if at:
            root = Path(source.strip()).expanduser().resolve()
            if not (root / "pdserve" / "cli.py").is_file():
                raise ValueError(f"variant {name}: {root} is not a pdserve checkout "
                                 f"(no pdserve/cli.py there)")
        try:
            argv = tuple(shlex.split(flags))
        except ValueError as e:
            raise ValueError(f"variant {name}: cannot split its flags {flags!r}: {e}") from e
        if not argv and root is None:
            raise ValueError(f"variant {name}: no flags and no @SOURCE: it would be pdserve itself")
        return cls(name, argv, root)

    def describe(self) -> dict:
        return {"flags": list(self.flags), "source": None if self.source is None else str(self.source),
                "commit": git_commit(self.source or REPO_ROOT)}


# Variants --systems may name without --variant (older commands in docs/benchmarks.md).
BUILTIN_VARIANTS = {v.system: v for v in (Variant("whole", ("--decode-yield", "whole")),)}


def git_commit(root: Path) -> str | None:
    """The checkout's HEAD commit (with "+dirty" when it has changes); None: not a git
    checkout."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")
