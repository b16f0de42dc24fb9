"""slurmguard's torch.distributed hook, loaded by Python at start-up.

The SPANK plugin puts this directory first on PYTHONPATH for guarded jobs
(plugstack.conf torch_hook=<this directory>). Python imports the first
`sitecustomize` it finds, so this file then runs the one it shadows (a
site's or a virtualenv's), exactly once, as Python would have.

Outside guarded jobs (no SLURMGUARD_RING_DIR) it only chain-loads. The hook
modules are loaded from this package's files under private names, so the
job needs neither slurmguard installed nor anything beyond the standard
library until it imports torch itself.
"""

import os
import sys
from types import ModuleType


def _load(name: str, path: str) -> ModuleType:
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: not a loadable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _start_hook() -> None:
    if not os.environ.get("SLURMGUARD_RING_DIR"):
        return
    try:
        hook_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        _load("_slurmguard_ring", os.path.join(hook_dir, "ring.py"))
        torchhook = _load("_slurmguard_torchhook", os.path.join(hook_dir, "torchhook.py"))
        torchhook.install()
    except Exception as exc:  # never let the hook stop the job
        sys.stderr.write(f"slurmguard: torch.distributed timing off: {exc!r}\n")


def _chain() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        # what site.py prints for a failing sitecustomize
        sys.stderr.write(
            f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: {exc}\n"
        )
        return
    sys.modules["sitecustomize"] = module


_start_hook()
_chain()
