"""Bad trace input gives one clear error naming the file and the column or key."""

from __future__ import annotations

import pandas as pd
import pytest
import yaml
from click.testing import CliRunner

from slurmguard.cli import cli, main
from slurmguard.errors import InputError
from slurmguard.whatif.tensor import tensorize
from slurmguard.whatif.trace import check_trace, load_meta, load_trace, parse_meta
from tests.fixtures.whatif import make_trace, write_case


@pytest.fixture(scope="module")
def small():
    return make_trace(2, 4, 2, 1)


def _meta_file(tmp_path, data, name="meta-x.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


def test_missing_columns_are_named(tmp_path, small):
    df, meta = small
    trace, metap = write_case(tmp_path, df.drop(columns=["duration", "seq_id"]), meta, "bad")
    with pytest.raises(InputError, match=r"trace-bad.parquet: missing column\(s\): duration, seq_id"):
        load_trace(trace, metap)


def test_wrong_parallelism_names_meta_and_counts(tmp_path, small):
    df, meta = small
    trace, _ = write_case(tmp_path, df, meta, "AR")
    metap = _meta_file(tmp_path, {**meta, "dp_size": 8, "world_size": 32}, "meta-AR.yaml")
    with pytest.raises(InputError) as exc:
        load_trace(trace, metap)
    assert str(exc.value) == "meta-AR.yaml: dp=8 x pp=4 = 32 workers but trace-AR.parquet has 8 ranks"


def test_stage_outside_pp_size(tmp_path, small):
    df, meta = small
    trace, _ = write_case(tmp_path, df, meta, "x")
    metap = _meta_file(tmp_path, {**meta, "dp_size": 4, "pp_size": 2, "world_size": 8})
    with pytest.raises(InputError, match="meta-x.yaml: pp_size=2 but trace-x.parquet has stage 3"):
        load_trace(trace, metap)


@pytest.mark.parametrize(
    "data,message",
    [
        ({"pp_size": 4}, "missing key 'dp_size'"),
        (
            {"dp_size": 2, "pp_size": 0},
            "key 'pp_size' must be a positive integer, got 0",
        ),
        ({"dp_size": "two", "pp_size": 4}, "key 'dp_size' must be a positive integer"),
        (
            {"dp_size": 2, "pp_size": 4, "tp_size": 2, "world_size": 8},
            "world_size=8 but dp_size x pp_size x tp_size x dsp_size = 2 x 4 x 2 x 1 = 16",
        ),
        (
            {"dp_size": 2, "pp_size": 4, "vpp_size": 2},
            "vpp_size=2: interleaved pipeline schedules are not supported",
        ),
        ([1, 2], "metadata must be a YAML mapping"),
    ],
)
def test_bad_meta_keys(tmp_path, data, message):
    p = _meta_file(tmp_path, data)
    with pytest.raises(
        InputError,
        match="meta-x.yaml: " + message.replace("(", r"\(").replace(")", r"\)"),
    ):
        load_meta(p)


def test_meta_file_missing_and_invalid_yaml(tmp_path):
    with pytest.raises(InputError, match="metadata file not found"):
        load_meta(tmp_path / "nope.yaml")
    p = tmp_path / "m.yaml"
    p.write_text("dp_size: [1,\n")
    with pytest.raises(InputError, match=r"m.yaml:\d+: invalid YAML"):
        load_meta(p)


def test_bad_values(small):
    df, meta = small
    jm = parse_meta(meta, "m.yaml")
    neg = df.copy()
    neg.loc[5, "duration"] = -1.0
    with pytest.raises(
        InputError,
        match="t.parquet: column 'duration' has 1 negative value\\(s\\), first at row 5",
    ):
        check_trace(neg, jm, "t.parquet")
    nan = df.copy()
    nan["start_ts"] = nan["start_ts"].astype(float)
    nan.loc[3, "start_ts"] = float("nan")
    with pytest.raises(InputError, match="column 'start_ts' row 3: not a finite number"):
        check_trace(nan, jm, "t.parquet")
    bad_type = df.copy()
    bad_type["optype"] = bad_type["optype"].astype(str)
    bad_type.loc[0, "optype"] = "all-to-all"
    with pytest.raises(InputError, match="column 'optype' has unknown op type\\(s\\): all-to-all"):
        check_trace(bad_type, jm, "t.parquet")
    frac = df.copy()
    frac["seq_id"] = frac["seq_id"].astype(float)
    frac.loc[2, "seq_id"] = 0.5
    with pytest.raises(InputError, match="column 'seq_id' row 2: not an integer"):
        check_trace(frac, jm, "t.parquet")


def test_missing_and_duplicate_ops_are_located(small):
    df, meta = small
    jm = parse_meta(meta, "m.yaml")
    row = df.index[(df.optype == "forward-compute") & (df.stage == 2) & (df.dp_rank == 1)][1]
    with pytest.raises(
        InputError,
        match=r"t: step 10 dp_rank 1 stage 2: forward-compute seq_id 1 is missing",
    ):
        tensorize(check_trace(df.drop(index=row).reset_index(drop=True), jm, "t"), jm, "t")
    dup = df.loc[[row]]
    with pytest.raises(
        InputError,
        match=r"step 10 dp_rank 1 stage 2: forward-compute seq_id 1 is recorded twice",
    ):
        tensorize(check_trace(pd.concat([df, dup], ignore_index=True), jm, "t"), jm, "t")


def test_unpaired_pp_ops_are_reported(small):
    from slurmguard.whatif.model import build_model

    df, meta = small
    jm = parse_meta(meta, "m.yaml")
    no_recv = df[~((df.optype == "forward-recv") & (df.stage == 1))].reset_index(drop=True)
    t = tensorize(check_trace(no_recv, jm, "t"), jm, "t")
    with pytest.raises(InputError, match="stage 0 has 2 forward-send but stage 1 has 0 forward-recv"):
        build_model(t)


def test_cli_prints_one_line_error_and_exits_2(tmp_path, small, capsys):
    df, meta = small
    trace, _ = write_case(tmp_path, df.drop(columns=["mb_id"]), meta, "c")
    metap = _meta_file(tmp_path, meta)
    with pytest.raises(SystemExit) as exc:
        main(["whatif", str(trace), "--meta", str(metap)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.strip() == "slurmguard: error: trace-c.parquet: missing column(s): mb_id"
    assert "Traceback" not in err
    with pytest.raises(SystemExit) as exc:
        main(["whatif", str(tmp_path / "absent.parquet"), "--meta", str(metap)])
    assert exc.value.code == 2
    assert "absent.parquet: trace file not found" in capsys.readouterr().err


def test_two_ranks_in_one_cell_is_reported(small):
    df, meta = small
    jm = parse_meta(meta, "m.yaml")
    bad = df.copy()
    bad.loc[(bad.stage == 0) & (bad.dp_rank == 1), "rank"] = 0  # cell (1, 0) reuses rank 0
    split = (bad.stage == 1) & (bad.dp_rank == 1) & (bad.optype == "backward-compute")
    bad.loc[split, "rank"] = 1  # and cell (1, 1) shows up with a second rank
    with pytest.raises(InputError, match="t.parquet: row .* expected one rank per DP x PP cell"):
        check_trace(bad, jm, "t.parquet")


def test_only_the_trace_columns_are_read_and_nulls_are_named(tmp_path, small):
    from slurmguard.whatif.trace import read_columns

    df, meta = small
    extra = df.assign(note="not needed")
    extra["mb_id"] = extra["mb_id"].astype("Int64")
    extra.loc[4, "mb_id"] = pd.NA
    trace, metap = write_case(tmp_path, extra, meta, "n")
    cols = read_columns(trace)
    assert "note" not in cols and set(cols) == {
        "dp_rank", "stage", "rank", "step", "optype", "start_ts", "duration",
        "seq_id", "mc", "mb_id", "gmc",
    }  # fmt: skip
    with pytest.raises(InputError, match="trace-n.parquet: column 'mb_id' row 4: not an integer: nan"):
        load_trace(trace, metap)


NOT_FOR_WHATIF = (
    "pandas",  # alone costs more than the analysis
    "scipy",
    "rich",  # only for the tables, not --json
    "sqlalchemy",
    "psycopg",
    "torch",
    "numpy.ma",  # np.median/np.unique's first call imports it: slurmguard.whatif.tensor.median
    "importlib.metadata",  # the entry-point scan for plugin commands, pydantic's plugin discovery
    # without a policy file the whatif defaults come from slurmguard.whatif_policy: the policy's
    # models cost about a quarter of the command
    "pydantic",
    "annotated_types",
    "slurmguard.config",
    "slurmguard.agent",
    "slurmguard.controller",
    "slurmguard.store",
    "slurmguard.slurm",
)


def _run_whatif_in_a_process(tmp_path, small, env=None, args=("--json",), name="p") -> dict:
    import json
    import os
    import subprocess
    import sys

    df, meta = small
    trace, metap = write_case(tmp_path, df, meta, name)
    # atexit runs handlers last-registered first: this one sees the command's own exit handler done
    code = (
        "import atexit, gc, json, os, sys\n"
        "seen = {}\n"
        "atexit.register(lambda: print(json.dumps({**seen, 'frozen': gc.get_freeze_count()})))\n"
        "from slurmguard.cli import main\n"
        "try:\n"
        f"    main(['whatif', {str(trace)!r}, '--meta', {str(metap)!r}, *{list(args)!r}])\n"
        "except SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        f"seen['imported'] = sorted(m for m in {NOT_FOR_WHATIF!r} if m in sys.modules)\n"
        "seen['threads'] = len(os.listdir('/proc/self/task'))\n"
        "seen['gc'] = gc.isenabled()\n"
        "seen['openblas'] = os.environ.get('OPENBLAS_NUM_THREADS')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "SLURMGUARD_POLICY")} | (
        env or {}
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        cwd=tmp_path, env=env, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_command_imports_only_what_it_needs(tmp_path, small):
    """Start-up is most of `slurmguard whatif`'s time (`slurmguard bench whatif`)."""
    seen = _run_whatif_in_a_process(tmp_path, small)
    assert seen["imported"] == []
    # the tables need rich, and nothing else of that list
    seen = _run_whatif_in_a_process(tmp_path, small, args=(), name="t")
    assert seen["imported"] == ["rich"]
    # the collector is back on, the heap frozen for the exit, the variable not left behind
    assert seen["gc"] is True and seen["frozen"] > 10_000 and seen["openblas"] is None


def test_one_openblas_thread_unless_the_user_sets_more(tmp_path, small):
    import os

    import numpy as np

    if np.__config__.CONFIG["Build Dependencies"]["blas"]["name"] != "scipy-openblas":
        pytest.skip("numpy is not built with OpenBLAS here")
    if (os.cpu_count() or 1) < 2:
        pytest.skip("OpenBLAS starts one thread per core: one core here")
    ours = _run_whatif_in_a_process(tmp_path, small)
    users = _run_whatif_in_a_process(tmp_path, small, env={"OPENBLAS_NUM_THREADS": "2"})
    # pyarrow's threads are there in both; OpenBLAS adds its second one only when asked
    assert users["threads"] == ours["threads"] + 1 and users["openblas"] == "2"


def test_in_process_the_collector_and_environment_are_as_before(tmp_path, small, monkeypatch):
    import gc
    import os

    df, meta = small
    trace, metap = write_case(tmp_path, df, meta, "g")
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    gc.disable()
    try:
        res = CliRunner().invoke(cli, ["whatif", str(trace), "--meta", str(metap), "--json"])
        assert res.exit_code == 0, res.output
        assert not gc.isenabled()
    finally:
        gc.enable()
    res = CliRunner().invoke(cli, ["whatif", str(trace), "--meta", str(metap), "--json"])
    assert res.exit_code == 0, res.output
    assert gc.isenabled() and "OPENBLAS_NUM_THREADS" not in os.environ


def test_a_policy_file_is_validated_and_used(tmp_path, small, capsys, monkeypatch):
    """Without a file the command skips the policy's models (above); with one, the whole file
    is validated as for every command and its whatif values are used."""
    df, meta = small
    trace, metap = write_case(tmp_path, df, meta, "pol")
    cmd = ["whatif", str(trace), "--meta", str(metap), "--json"]
    monkeypatch.delenv("SLURMGUARD_POLICY", raising=False)
    for text, error in [
        ("whatif:\n  top_worker_percent: 0\n", "whatif.top_worker_percent: Input should be greater than 0"),
        ("whatif:\n  nonsense: 1\n", "whatif.nonsense: unknown key"),
        ("whatif: {}\ncontroler: {}\n", "controler: unknown key"),
    ]:
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        for how in ("--policy", "env"):
            if how == "env":
                monkeypatch.setenv("SLURMGUARD_POLICY", str(bad))
            with pytest.raises(SystemExit) as exc:
                main((["--policy", str(bad)] if how == "--policy" else []) + cmd)
            monkeypatch.delenv("SLURMGUARD_POLICY", raising=False)
            assert exc.value.code == 2
            assert capsys.readouterr().err == f"slurmguard: error: {bad}:2: {error}\n", (how, text)
    good = tmp_path / "good.yaml"
    good.write_text("whatif:\n  straggling_slowdown: 1000\n")
    res = CliRunner().invoke(cli, ["--policy", str(good), *cmd])
    assert res.exit_code == 0, res.output
    assert "is below 1000.0: not straggling" in res.output
