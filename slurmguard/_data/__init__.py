"""Runtime files that live at the top of the source tree, shipped inside the package.

`sql/`, `sweeps/` and `prolog_epilog/` stay where the design puts them; the entries
here are relative symlinks to them, so a source checkout (PYTHONPATH, the helpers'
venvs, `pip install -e`) and a wheel (where setuptools copies the files the links
point to) both find them at `importlib.resources.files("slurmguard._data")`.
Look them up through `slurmguard.datafiles`, never by path arithmetic.
"""
