"""Fault injection for sweep workloads, the development tools' own: never on a production node.

The development cluster has no GPUs and all its "nodes" share one host, so a bad node
cannot be produced physically. The product's workloads (sweeps/, whose shared module
sweeplib has no notion of a fault) cannot be told to fake one: this launcher does it from
the outside. Used as the sweep interpreter (`sweeps.python`, see `launcher`), it runs

    python -m slurmguard_dev.sweepfaults WORKLOAD.py [ARGS...]

which reads the faults from

* ``SLURMGUARD_SWEEP_INJECT``: inline JSON, or
* ``SLURMGUARD_SWEEP_INJECT_FILE``: path of a JSON file (read when the workload starts),

keyed by the node name the workload measures as (``--node``, else ``SLURMD_NODENAME``), e.g.::

    SLURMGUARD_SWEEP_INJECT='{"node2": {"gemm_slowdown": 0.25, "gpus": [5]}}'

then imports the workload's sweeplib, wraps its functions in place (`install`) and runs
WORKLOAD.py as its own main. The workload and sweeplib call those functions through the
module, so they get the wrappers; the processes sweeplib spawns (one per GPU) install the
same wrappers before they run (`_spawn_target`). Slowdowns are fractions of throughput lost
(0.25 = the metric reads 25% low): the wrapped timers (`timed_ops`, `timed_copy`) sleep
`extra_delay` after each timed region and count it, inside the measurement whose slowdown
is in force (`gemm_run`, `membw`, `pair_gbps`, `allreduce_bench`, `transfer_time`). Every
result written while faults are active records them under ``injected``, so a demo result
can never pass for a real one.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import runpy
import shlex
import sys
import time
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from slurmguard import datafiles
from slurmguard.errors import InputError, SlurmguardError
from slurmguard.names import is_node_name

ENV_INLINE = "SLURMGUARD_SWEEP_INJECT"
ENV_FILE = "SLURMGUARD_SWEEP_INJECT_FILE"
ENV_NODE = "SLURMGUARD_SWEEP_INJECT_NODE"
"""Set by the launcher for the workload's spawned workers: the node the workload measures."""

CRASH_STATUS = 3
"""Exit status of an injected crash (the workloads' own are 0, 1 and 2)."""

_SLOWDOWNS = ("gemm_slowdown", "membw_slowdown", "p2p_slowdown", "link_slowdown")


@dataclass(frozen=True)
class NodeFault:
    """Slowdowns and failures a development run asks of one node; all off by default.

    Slowdowns are fractions of throughput lost (0.25 = the metric reads 25% low), realised
    by sleeping inside the timed region (`extra_delay`), so the CPU stays idle."""

    gemm_slowdown: float = 0.0
    """Fraction of GEMM throughput lost on the affected GPUs."""
    membw_slowdown: float = 0.0
    """Fraction of device memory bandwidth lost on the affected GPUs."""
    p2p_slowdown: float = 0.0
    """Fraction of intra-node GPU-to-GPU bandwidth lost (copies and the intra-node
    all-reduce) on pairs touching affected GPUs."""
    link_slowdown: float = 0.0
    """Fraction of cross-node bandwidth lost (send/recv and all-reduce) on this node."""
    link_direction: Literal["tx", "rx", "both"] = "both"
    """Which transfers of this node the link slowdown hits: sends, receives or both."""
    gpus: tuple[int, ...] | None = None
    """GPU indexes affected by the per-GPU faults; None = all."""
    crash: bool = False
    """Exit with status 3 before measuring or writing any result (a crashed sweep)."""
    hang_s: float = 0.0
    """Sleep this long before measuring (drives the sweep into its time limit), seconds."""
    corrupt_output: bool = False
    """Write a truncated, invalid JSON result."""
    gemm_corrupt: bool = False
    """Flip one element of each verified GEMM product on the affected GPUs (silent data
    corruption): the float64 reference check must catch it."""

    def hits_gpu(self, index: int | None) -> bool:
        return self.gpus is None or index in self.gpus

    def link_factor(self, sending: bool) -> float:
        """Slowdown that applies to one transfer of this node (0 when it does not)."""
        if self.link_slowdown <= 0:
            return 0.0
        if self.link_direction == "both" or (self.link_direction == "tx") == sending:
            return self.link_slowdown
        return 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.gpus is not None:
            d["gpus"] = list(self.gpus)
        return d


NO_FAULT = NodeFault()


def extra_delay(elapsed_s: float, slowdown: float) -> float:
    """Seconds to add to a measurement of `elapsed_s` so its rate drops by `slowdown`."""
    if slowdown <= 0 or elapsed_s <= 0:
        return 0.0
    return elapsed_s * slowdown / (1.0 - slowdown)


def _sweeplib(workload_dir: Path | None = None) -> ModuleType:
    """The workloads' shared module, imported as the workloads do: by name from their own
    folder, so the workload, its spawned workers and the wrappers share one module."""
    if "sweeplib" not in sys.modules:
        sys.path.insert(0, str(workload_dir or datafiles.sweep_dir()))
    import sweeplib

    return sweeplib


def parse_faults(data: Any, source: str) -> dict[str, NodeFault]:
    """Validate the node -> fault mapping into NodeFault records. Raises InputError
    naming source and key."""
    if not isinstance(data, dict):
        raise InputError(f"{source}: expected a JSON object of node name -> faults")
    known = {f.name for f in fields(NodeFault)}
    out: dict[str, NodeFault] = {}
    for node, spec in data.items():
        if not is_node_name(node):
            raise InputError(f"{source}: invalid node name {node!r}")
        if not isinstance(spec, dict):
            raise InputError(f"{source}: {node}: expected an object of faults")
        kw: dict[str, Any] = {}
        for key, value in spec.items():
            where = f"{source}: {node}.{key}"
            if key not in known:
                raise InputError(f"{where}: unknown fault (known: {', '.join(sorted(known))})")
            if key in _SLOWDOWNS:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                    raise InputError(f"{where}: expected a fraction in [0, 1), got {value!r}")
                kw[key] = float(value)
            elif key == "hang_s":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                    raise InputError(f"{where}: expected seconds >= 0, got {value!r}")
                kw[key] = float(value)
            elif key in ("crash", "corrupt_output", "gemm_corrupt"):
                if not isinstance(value, bool):
                    raise InputError(f"{where}: expected true or false, got {value!r}")
                kw[key] = value
            elif key == "link_direction":
                if value not in ("tx", "rx", "both"):
                    raise InputError(f"{where}: expected tx, rx or both, got {value!r}")
                kw[key] = value
            elif key == "gpus":
                if value is not None and (
                    not isinstance(value, list)
                    or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
                ):
                    raise InputError(f"{where}: expected a list of GPU indexes or null")
                kw[key] = None if value is None else tuple(value)
        out[node] = NodeFault(**kw)
    return out


def load_faults(env: Mapping[str, str] | None = None) -> dict[str, NodeFault]:
    """Faults from the environment (inline JSON beats the file); {} when neither is set."""
    env = os.environ if env is None else env
    inline = env.get(ENV_INLINE)
    if inline:
        source, text = ENV_INLINE, inline
    elif env.get(ENV_FILE):
        source = env[ENV_FILE]
        try:
            with open(source, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise InputError(f"{source}: cannot read fault file: {exc.strerror or exc}") from None
    else:
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{source}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    return parse_faults(data, source)


def launcher(path: Path, fault_file: Path | None = None, python: str | None = None) -> Path:
    """Write an executable interpreter for `sweeps.python` that runs every sweep workload
    under this module (with the faults of `fault_file` when given, else of the job's
    environment); returns its absolute path."""
    path = Path(path).absolute()
    env = f"export {ENV_FILE}={shlex.quote(str(fault_file))}\n" if fault_file is not None else ""
    path.write_text(
        "#!/bin/sh\n# slurmguard-dev: sweep workloads with injected faults (never in production)\n"
        f'{env}exec {shlex.quote(python or sys.executable)} -m slurmguard_dev.sweepfaults "$@"\n'
    )
    path.chmod(0o755)
    return path


# ---------------------------------------------------------------- the wrappers
_slowdown: ContextVar[float] = ContextVar("sweepfaults_slowdown", default=0.0)
"""The slowdown the timers add to the timed regions of the measurement now running."""
_gpu: ContextVar[int | None] = ContextVar("sweepfaults_gpu", default=None)
"""The local device (GPU index) the current device phase or worker measures."""
_spec: ContextVar[Any] = ContextVar("sweepfaults_spec", default=None)
"""The sweeplib.WorkerSpec of the distributed worker running in this process."""

_originals: dict[str, Callable[..., Any]] = {}
"""sweeplib's own functions, kept when `install` replaced them."""
_faults: dict[str, NodeFault] = {}
_node: list[str] = []  # the node the workload measures, once it has said (node_name)


def _fault() -> NodeFault:
    return _faults.get(_node[0], NO_FAULT) if _node else NO_FAULT


def _named_args(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    return dict(inspect.signature(fn).bind(*args, **kwargs).arguments)


def _under(name: str, slowdown: Callable[[dict[str, Any]], float]) -> Callable[..., Any]:
    """sweeplib.<name> with `slowdown(its arguments by name)` in force in its timed regions."""
    fn = _originals[name]

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        token = _slowdown.set(slowdown(_named_args(fn, args, kwargs)))
        try:
            return fn(*args, **kwargs)
        finally:
            _slowdown.reset(token)

    return run


def _slowed(name: str) -> Callable[..., float]:
    """The timer sweeplib.<name>, lengthened by the slowdown in force: it sleeps the extra
    time after the timed region and counts it, so the rate it yields drops by the slowdown."""
    fn = _originals[name]

    @functools.wraps(fn)
    def timer(*args: Any, **kwargs: Any) -> float:
        t = float(fn(*args, **kwargs))
        x = extra_delay(t, _slowdown.get())
        if x > 0:
            time.sleep(x)
        return t + x

    return timer


def _on_device(name: str, index: Callable[[dict[str, Any]], int], spec: bool = False) -> Callable[..., Any]:
    """sweeplib.<name> with the device it measures (and its WorkerSpec) known to the others."""
    fn = _originals[name]

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        named = _named_args(fn, args, kwargs)
        tokens = [(_gpu, _gpu.set(index(named)))]
        if spec:
            tokens.append((_spec, _spec.set(named["spec"])))
        try:
            return fn(*args, **kwargs)
        finally:
            for var, tok in reversed(tokens):
                var.reset(tok)

    return run


def _gpu_slowdown(kind: str) -> Callable[[dict[str, Any]], float]:
    def pick(_: dict[str, Any]) -> float:
        f = _fault()
        return float(getattr(f, kind)) if f.hits_gpu(_gpu.get()) else 0.0

    return pick


def _pair_slowdown(a: dict[str, Any]) -> float:
    f = _fault()
    return f.p2p_slowdown if f.hits_gpu(a["i"]) or f.hits_gpu(a["j"]) else 0.0


def _allreduce_slowdown(a: dict[str, Any]) -> float:
    f = _fault()
    if a["scope"] == "intra":
        return f.p2p_slowdown if f.hits_gpu(_gpu.get()) else 0.0
    return max(f.link_factor(True), f.link_factor(False))


def _link_slowdown(a: dict[str, Any]) -> float:
    """The link's slowdown, the sender's tx or the receiver's rx, applied on both ends: a
    link's time is the longer of its two ends' (passes_bench), so it grows by the slowdown
    whichever end's clock is the reliable one (a send may return before the data is in)."""
    spec = _spec.get()
    me = spec.node_names[spec.node_rank]
    peer = spec.node_names[a["peer"] // spec.gpus_per_node]
    sender, receiver = (me, peer) if a["role"] == "send" else (peer, me)
    return max(
        _faults.get(sender, NO_FAULT).link_factor(True), _faults.get(receiver, NO_FAULT).link_factor(False)
    )


def _node_name(override: str | None) -> str:
    """The workload's node name: from here on that node's faults are in force, and its
    start faults happen (a hang, then a crash: before anything is measured)."""
    node = str(_originals["node_name"](override))
    _node[:] = [node]
    os.environ[ENV_NODE] = node  # for the workers it spawns
    f = _fault()
    if f.hang_s > 0:
        time.sleep(f.hang_s)
    if f.crash:
        print("slurmguard sweep: injected crash", file=sys.stderr, flush=True)
        os._exit(CRASH_STATUS)
    return node


def _verify_gemm(a: Any, b: Any, c: Any, dtype: str, seed: int) -> float:
    f = _fault()
    if f.gemm_corrupt and f.hits_gpu(_gpu.get()):  # silent data corruption: one element far off
        n, m = c.shape
        c[n // 2, m // 3] = c[n // 2, m // 3] * -64.0 + 1000.0
    return float(_originals["verify_gemm"](a, b, c, dtype, seed))


def _write_result(path: str, doc: dict[str, Any]) -> bool:
    """Record the faults of the sweep's nodes under `injected`; corrupt_output truncates
    the file the workload wrote."""
    injected = {n: _faults[n].to_dict() for n in doc.get("nodes", ()) if n in _faults}
    ok = bool(_originals["write_result"](path, {**doc, "injected": injected or None}))
    if _fault().corrupt_output:
        text = Path(path).read_text(encoding="utf-8")
        Path(path).write_text(text[: len(text) // 2], encoding="utf-8")
    return ok


def _spawn_target(spec: Any, queue: Any, barrier: Any | None = None) -> None:
    """A spawned worker's entry (sweeplib._spawn_target's replacement, picklable by name):
    install the wrappers in this fresh process, with the launcher's faults and node."""
    install(_sweeplib(), load_faults(), os.environ.get(ENV_NODE))
    _originals["_spawn_target"](spec, queue, barrier)


def install(sl: ModuleType, faults: Mapping[str, NodeFault], node: str | None = None) -> None:
    """Wrap sweeplib `sl`'s functions in place with `faults` (once per process); `node`:
    the node already known (a spawned worker's), else the workload's first node_name()."""
    if _originals:
        return
    for name in (
        "node_name", "timed_ops", "timed_copy", "gemm_run", "membw", "pair_gbps", "allreduce_bench",
        "transfer_time", "device_phase", "run_worker", "verify_gemm", "write_result", "_spawn_target",
    ):  # fmt: skip
        _originals[name] = getattr(sl, name)
    _faults.update(faults)
    if node:
        _node[:] = [node]
    wrappers: dict[str, Callable[..., Any]] = {
        "node_name": _node_name,
        "timed_ops": _slowed("timed_ops"),
        "timed_copy": _slowed("timed_copy"),
        "gemm_run": _under("gemm_run", _gpu_slowdown("gemm_slowdown")),
        "membw": _under("membw", _gpu_slowdown("membw_slowdown")),
        "pair_gbps": _under("pair_gbps", _pair_slowdown),
        "allreduce_bench": _under("allreduce_bench", _allreduce_slowdown),
        "transfer_time": _under("transfer_time", _link_slowdown),
        "device_phase": _on_device("device_phase", lambda a: a["index"]),
        "run_worker": _on_device("run_worker", lambda a: a["spec"].local_index, spec=True),
        "verify_gemm": _verify_gemm,
        "write_result": _write_result,
        "_spawn_target": _spawn_target,
    }
    for name, fn in wrappers.items():
        setattr(sl, name, fn)


def main(argv: list[str] | None = None) -> None:
    """Run WORKLOAD.py ARGS... with the faults of the environment (see the module doc)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or not args[0].endswith(".py"):
        sys.exit("usage: python -m slurmguard_dev.sweepfaults WORKLOAD.py [ARGS...]")
    script = os.path.abspath(args[0])
    try:
        faults = load_faults()
    except SlurmguardError as exc:
        print(f"slurmguard sweep: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)  # the workloads' "bad options/policy" status
    # the spawned workers read the faults as loaded here (a fault file may change meanwhile)
    os.environ[ENV_INLINE] = json.dumps({n: f.to_dict() for n, f in faults.items()})
    install(_sweeplib(Path(script).parent), faults)
    sys.argv = [script, *args[1:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    # run as this module's own name, so the workers' entry (_spawn_target) pickles by a
    # name the spawned processes can import
    from slurmguard_dev.sweepfaults import main as _main

    _main()
