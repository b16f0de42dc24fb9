"""The GPU count Slurm expects on a node, read from slurm.conf (no scontrol).

slurm.conf syntax used here (slurm.conf(5)): `Key=Value` tokens separated by
blanks, keys case-insensitive, `#` starts a comment, `Include FILE` (relative
to the directory of slurm.conf, wildcards allowed), `NodeName=DEFAULT ...`
sets defaults for the NodeName lines after it, and NodeName takes a hostlist
(`gpu[001-128]`). The node's `Gres=` is a comma list of
`name[:type][:no_consume]:count[K|M|G]` (a bare `name` counts 1); the GPUs are
the sum of the `gpu` entries. A node without Gres has 0 GPUs.
"""

from __future__ import annotations

import glob
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

from slurmguard.errors import ConfigError, read_user_text
from slurmguard.slurm.hostlist import expand

_SUFFIX = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}
_COUNT = re.compile(r"^(\d+)([KMG]?)$", re.IGNORECASE)
_MAX_INCLUDE_DEPTH = 8


def parse_gres_gpus(gres: str, where: str = "Gres") -> int:
    """'gpu:h100:8,nvme:1' -> 8; 'gpu:a100:4,gpu:h100:4' -> 8; '(null)' -> 0."""
    total = 0
    gres = gres.strip()
    if gres in ("", "(null)"):
        return 0
    for item in gres.split(","):
        item = re.sub(r"\(.*\)$", "", item.strip())  # socket binding suffix "(S:0-1)"
        if not item:
            continue
        parts = item.split(":")
        if parts[0].lower() != "gpu":
            continue
        fields = [p for p in parts[1:] if p.lower() != "no_consume"]
        m = _COUNT.match(fields[-1]) if fields else None
        if m is None:
            if len(fields) <= 1:  # "gpu" or "gpu:type": one device
                total += 1
                continue
            raise ConfigError(f"{where}: cannot read a GPU count in '{item}'")
        total += int(m.group(1)) * _SUFFIX[m.group(2).upper()]
    return total


def _logical_lines(path: Path, depth: int = 0) -> Iterator[tuple[Path, int, list[str]]]:
    """(file, line number, tokens) for every non-empty line, following Include."""
    if depth > _MAX_INCLUDE_DEPTH:
        raise ConfigError(f"{path}: Include nested more than {_MAX_INCLUDE_DEPTH} deep")
    text = read_user_text(path, "slurm.conf", ConfigError, replace_undecodable=True)
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            tokens = shlex.split(line, posix=True)
        except ValueError as exc:
            raise ConfigError(f"{path}:{no}: {exc}") from None
        if tokens and tokens[0].lower() == "include" and len(tokens) >= 2:
            pattern = tokens[1]
            if not pattern.startswith("/"):
                pattern = str(path.parent / pattern)
            for inc in sorted(glob.glob(pattern)):
                yield from _logical_lines(Path(inc), depth + 1)
            continue
        yield path, no, tokens


def expected_gpus(conf_path: str | Path, node: str) -> int:
    """GPUs slurm.conf gives `node` (0 without Gres). ConfigError if the node is absent."""
    defaults: dict[str, str] = {}
    for path, no, tokens in _logical_lines(Path(conf_path)):
        pairs = {}
        for tok in tokens:
            if "=" in tok:
                k, v = tok.split("=", 1)
                pairs[k.lower()] = v
        names = pairs.get("nodename")
        if names is None:
            continue
        if names.upper() == "DEFAULT":
            defaults.update({k: v for k, v in pairs.items() if k != "nodename"})
            continue
        try:
            hosts = expand(names)
        except ValueError as exc:
            raise ConfigError(f"{path}:{no}: NodeName: {exc}") from None
        if node in hosts:
            gres = pairs.get("gres", defaults.get("gres", ""))
            return parse_gres_gpus(gres, f"{path}:{no}: Gres")
    raise ConfigError(
        f"{conf_path}: node '{node}' has no NodeName line; set prolog.expected_gpus in the policy"
    )
