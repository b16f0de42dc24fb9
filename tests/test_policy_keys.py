"""Every policy key changes behaviour (issue 14.2).

1. No key is read by tests alone: each leaf of the policy model must be read
   by a module the product reaches from its entry point (`slurmguard.cli`,
   following every import, also those inside functions), together with its
   section (`policy.detection.peers` ... `.window_s`, or the section's model
   class). The five `detection.mycroft.*` keys and `cross_group.min_groups`
   were read only by modules that nothing but tests imported.
2. No value validates that the runtime refuses: every value of a choice key
   (a Literal field) is accepted by the code that consumes it (`slurm.backend:
   pyslurm` once validated and then failed in the Slurm client).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from slurmguard import config
from slurmguard.config import Policy

PKG = Path(config.__file__).resolve().parent
ROOT = PKG.parent


def entry_points() -> list[str]:
    """The CLI, every command module it loads by name, and what job scripts,
    the prolog/epilog and the systemd units run with `python -m`."""
    from slurmguard.cli import COMMANDS

    out = ["slurmguard.cli"] + [t.split(":")[0] for t in COMMANDS.values()]
    for d in ("prolog_epilog", "sweeps", "systemd", "slurmguard"):
        for f in (ROOT / d).rglob("*"):
            if f.is_file() and f.suffix in ("", ".sh", ".py", ".service", ".j2", ".tmpl", ".sbatch"):
                try:
                    text = f.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                for mod in re.findall(r"-m (slurmguard[a-z_.]*)", text):
                    out += [mod, f"{mod}.__main__"]  # -m PACKAGE runs its __main__
    # the SPANK plugin puts the torch hook's site directory first in guarded tasks' PYTHONPATH
    # (sitecustomize loads hook/torchhook.py by its file path)
    out += ["slurmguard.hook.site.sitecustomize", "slurmguard.hook.torchhook"]
    return sorted(set(out))


LAZY = re.compile(r"^slurmguard(\.\w+)+:\w+$")


# ------------------------------------------------------------------ the model
def _models(tp) -> list[type]:
    """The section classes inside an annotation (X, tuple[X, ...], X | None): pydantic models,
    and stdlib dataclasses that pydantic validates (slurmguard.whatif_policy.WhatIfPolicy)."""
    if isinstance(tp, type) and (issubclass(tp, BaseModel) or dataclasses.is_dataclass(tp)):
        return [tp]
    return [m for a in typing.get_args(tp) for m in _models(a)]


def _fields(model: type) -> dict[str, typing.Any]:
    """A section's field names and annotations."""
    if dataclasses.is_dataclass(model):
        hints = typing.get_type_hints(model)
        return {f.name: hints[f.name] for f in dataclasses.fields(model)}
    return {name: f.annotation for name, f in model.model_fields.items()}


def leaves(model: type = Policy, prefix: tuple[tuple[str, str], ...] = ()):
    """(dotted key, [(section name, section model class name), ...], annotation) per leaf."""
    for name, f in _fields(model).items():
        sub = _models(f)
        path = prefix + ((name, sub[0].__name__ if sub else ""),)
        if sub:
            yield from leaves(sub[0], path)
        else:
            yield ".".join(p for p, _ in path), list(path[:-1]), f


def choice_fields(model: type = Policy, prefix: str = ""):
    """(dotted key, allowed values) of every Literal field (also inside tuples)."""
    for name, f in _fields(model).items():
        key = f"{prefix}{name}"
        sub = _models(f)
        if sub:
            yield from choice_fields(sub[0], key + ".")
            continue
        lits = _literals(f)
        if lits:
            yield key, lits


def _literals(tp) -> tuple:
    if typing.get_origin(tp) is typing.Literal:
        return typing.get_args(tp)
    for a in typing.get_args(tp):
        if got := _literals(a):
            return got
    return ()


# ------------------------------------------------------------------ the product's code
def _module_file(mod: str) -> Path | None:
    rel = Path(*mod.split("."))
    for cand in (PKG.parent / rel.with_suffix(".py"), PKG.parent / rel / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _lazy_names(tree: ast.Module) -> dict[str, str]:
    """A package's PEP 562 map (detect/__init__.py's _WHERE): name -> submodule."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_WHERE" for t in node.targets
        ):
            where = ast.literal_eval(node.value)
            return {n: m for m, names in where.items() for n in names}
    return {}


@functools.lru_cache(maxsize=1)
def reachable() -> dict[str, ast.Module]:
    """Modules of the package reachable from the entry points by static imports."""
    seen: dict[str, ast.Module] = {}
    todo = entry_points()
    # the sweep jobs run these files (sweeps/*.py, shipped as package data) directly
    files = {f"sweeps/{f.name}": f for f in sorted((ROOT / "sweeps").glob("*.py"))}
    todo += list(files)
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        f = files.get(mod) or _module_file(mod)
        if f is None:
            continue
        tree = ast.parse(f.read_text(encoding="utf-8"))
        seen[mod] = tree
        parts = mod.split(".")
        pkg = mod if f.name == "__init__.py" else ".".join(parts[:-1])
        # a module's parent packages run first
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and LAZY.match(node.value):
                todo.append(node.value.split(":")[0])  # a lazy command map ("module:attribute")
            elif isinstance(node, ast.Import):
                todo += [a.name for a in node.names if a.name.startswith("slurmguard")]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                if not base.startswith("slurmguard"):
                    continue
                todo.append(base)
                bf = _module_file(base)
                lazy = _lazy_names(ast.parse(bf.read_text())) if bf and bf.name == "__init__.py" else {}
                for a in node.names:
                    todo.append(
                        f"{base}.{lazy.get(a.name, a.name)}" if a.name in lazy else f"{base}.{a.name}"
                    )
    return seen


def _names_used(tree: ast.Module) -> set[str]:
    """What a module can read a key by: attribute names (`p.window_s`), string
    constants (getattr, dumped dicts) and the classes it names (a section's
    model class). Not variable, parameter or keyword names: a function's own
    `min_groups` argument reads no policy."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.add(node.value)
        elif isinstance(node, ast.Name) and node.id[:1].isupper():
            out.add(node.id)
    return out


@pytest.fixture(scope="module")
def product() -> dict[str, set[str]]:
    mods = reachable()
    assert "slurmguard.controller.loop" in mods and "slurmguard.agent" in mods, sorted(mods)
    return {m: _names_used(t) for m, t in mods.items() if m != "slurmguard.config"}


@functools.lru_cache(maxsize=1)
def _shared_leaf_names() -> frozenset[str]:
    seen: dict[str, int] = {}
    for key, _, _ in leaves():
        leaf = key.rsplit(".", 1)[-1]
        seen[leaf] = seen.get(leaf, 0) + 1
    return frozenset(k for k, n in seen.items() if n > 1)


def _readers(key: str, sections: list[tuple[str, str]], product: dict[str, set[str]]) -> list[str]:
    """Modules that read the key. A leaf name used by several sections (window_s,
    timeout_s, run) counts only in a module that also names its section (or the
    section's model class, or the parent section where a key repeats per stage)."""
    leaf = key.rsplit(".", 1)[-1]
    if leaf not in _shared_leaf_names():
        return sorted(m for m, used in product.items() if leaf in used)
    names = {n for sec in sections[-2:] for n in sec if n}
    return sorted(m for m, used in product.items() if leaf in used and names & used)


def test_the_scan_sees_what_it_must():
    """The reachability scan is not vacuous: the runtime modules are in, the
    test-only helpers are not, and a key read nowhere is found unread."""
    mods = reachable()
    for must in (
        "slurmguard.controller.assess",
        "slurmguard.controller.decide",
        "slurmguard.detect.steps",
        "slurmguard.detect.findings",
        "slurmguard.nodecheck.prolog",
    ):
        assert must in mods
    for lazy in ("slurmguard.whatif.simulate", "slurmguard.workloads.runtime", "slurmguard.hook.torchhook"):
        assert lazy in mods  # through `whatif`, `python -m slurmguard.workloads`, the site dir
    # a package nothing imports is not reached, nor are the development tools (dev/): a key
    # only a benchmark or the dev cluster reads changes nothing the product does
    assert "slurmguard._data" not in mods
    assert not [m for m in mods if m.startswith("slurmguard_dev")]
    product = {m: _names_used(t) for m, t in mods.items() if m != "slurmguard.config"}
    assert _readers(
        "detection.peers.window_s", [("detection", "DetectionPolicy"), ("peers", "PeerPolicy")], product
    )
    assert not _readers(
        "detection.peers.no_such_key_anywhere",
        [("detection", "DetectionPolicy"), ("peers", "PeerPolicy")],
        product,
    )


def test_every_policy_key_is_read_by_the_product(product):
    unread = [key for key, sections, _ in leaves() if not _readers(key, sections, product)]
    assert not unread, (
        "policy keys read by nothing the product runs (only tests, or nothing): "
        f"{unread}; use them or delete them from config.py and policies.yaml"
    )


# ------------------------------------------------------------------ refused at run time
def _with(key: str, value) -> Policy:
    data: dict = {}
    d = data
    parts = key.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
    d[parts[-1]] = value
    if key == "slurm.backend" and value == "restd":
        d.update(restd_url="http://127.0.0.1:6820", restd_token_file="/nonexistent/token")
    return Policy.model_validate(data)


def _slurm_backend(p: Policy) -> None:
    from slurmguard.slurm.backend import client_from_policy

    client_from_policy(p.slurm)


def _telemetry_source(p: Policy) -> None:
    from slurmguard.errors import ConfigError
    from slurmguard.telemetry import open_source

    try:
        src = open_source(p.agent.telemetry_source, "node1", infiniband=False)
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 - no GPU/DCGM on this host: the source exists and was tried
        return
    if src is not None:
        src.close()


def _bocd_rule(p: Policy) -> None:
    import numpy as np

    from slurmguard.detect.bocd import detect_changepoints

    x = np.r_[np.full(60, 1.0), np.full(60, 1.5)] * (1 + 0.01 * np.sin(np.arange(120)))
    detect_changepoints(x, p.detection.bocd)


def _prolog_checks(p: Policy) -> None:
    from slurmguard.nodecheck.prolog import build_checks

    checks = build_checks(p.prolog.model_copy(update={"expected_gpus": 0}), "node1", {})
    assert len(checks) == len(p.prolog.checks), p.prolog.checks


#: the runtime consumer of each choice key, called with a policy holding each
#: allowed value; None: checked statically (the value is dispatched on by the
#: product's code and no error the product raises names it)
CONSUMERS = {
    "slurm.backend": _slurm_backend,
    "detection.bocd.rule": _bocd_rule,
    "agent.telemetry_source": _telemetry_source,
    "prolog.checks": _prolog_checks,
    "sweeps.device": None,
    "sweeps.stages.dcgm_diag.run": None,
    "sweeps.stages.nccl_all_reduce.run": None,
    "sweeps.stages.nvbandwidth.run": None,
    "sweeps.stages.ib_write_bw.run": None,
    "sweeps.stages.dcgm_level": None,
    "triage.ladder": None,
    "triage.reboot_next_state": None,
}


def test_every_choice_key_has_a_runtime_check():
    assert sorted(k for k, _ in choice_fields()) == sorted(CONSUMERS), (
        "a choice key was added or removed: say here which runtime code consumes each value"
    )


@pytest.mark.parametrize(
    "key,value", [(k, v) for k, vs in choice_fields() for v in vs if CONSUMERS.get(k) is not None]
)
def test_each_choice_validates_and_runs(key, value):
    p = _with(key, [value] if key == "prolog.checks" else value)
    CONSUMERS[key](p)


def _raised_texts(tree: ast.Module) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            out += [
                c.value
                for c in ast.walk(node.exc)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            ]
    return out


@functools.lru_cache(maxsize=1)
def _product_strings() -> tuple[set[str], list[str]]:
    """(names and strings the product's modules use, texts of the errors they raise)."""
    mods = {m: t for m, t in reachable().items() if m != "slurmguard.config"}
    return (
        set().union(*(_names_used(t) for t in mods.values())),
        [s for t in mods.values() for s in _raised_texts(t)],
    )


@pytest.mark.parametrize("key", [k for k, v in CONSUMERS.items() if v is None])
def test_static_choices_are_handled_and_never_refused(key):
    values = dict(choice_fields())[key]
    strings, raised = _product_strings()
    for v in values:
        if isinstance(v, str):
            assert v in strings, f"{key}: {v!r} validates but no product code dispatches on it"
        for text in raised:
            assert not (
                isinstance(v, str)
                and f"{key.rsplit('.', 1)[-1]} {v}" in text
                and ("not supported" in text or "not implemented" in text)
            ), f"{key}: {v!r} validates but is refused at run time: {text!r}"


def test_a_removed_choice_is_rejected_when_validated():
    from slurmguard.errors import ConfigError

    with pytest.raises(ConfigError, match="slurm.backend"):
        config.parse_policy("slurm:\n  backend: pyslurm\n", "policies.yaml")
