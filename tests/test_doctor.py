"""``python -m distlm.doctor``: every check passing under torchrun, a save directory that is
not shared and a stalled rank each named in rank 0's table, bad input refused in one line,
and the EFA, device and launcher verdicts on hosts this machine can only describe.

References come from outside the doctor: the bundled profile's own TOML numbers for the
expected bus bandwidth, the backends' own ``apply_env_preset`` for the EFA variables,
and real files, directories and executables for the probes.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from importlib import resources
from pathlib import Path

import pytest
import torch.distributed as dist

from distributed import run_distributed
from distlm.backends.efa import apply_env_preset, build_efa_preset, efa_available
from distlm.doctor import main
from distlm.doctor.cli import load_expected_cluster, parse_doctor_args
from distlm.doctor.allreduce import bus_bytes, expected_bus_bandwidth, judge_allreduce
from distlm.doctor.devices import judge_devices
from distlm.doctor.efa import efa_variables, find_nccl_net_plugin, judge_efa, run_fi_info
from distlm.doctor.launcher import judge_launch, probe_launch
from distlm.doctor.report import format_ranks
from distlm.launch.cluster_env import ClusterEnv
from distlm.launch.hosts import find_free_port
from distlm.plan import load_cluster

SUBPROCESS_TIMEOUT = 120
ROW = re.compile(r"^(?P<name>\S.*?)\s{2,}(?P<status>PASS|FAIL|WARN|SKIP)\s+(?P<detail>.*)$")
EFA_HERE = efa_available()


def write_profile(directory: Path, name: str, bandwidth_gbps: float, latency_us: float = 10.0) -> Path:
    """A CPU cluster profile whose links run at ``bandwidth_gbps`` GB/s."""
    path = directory / f"{name}.toml"
    path.write_text(
        f'name = "{name}"\ndevice_type = "cpu"\ndevice = "cpu"\nranks_per_node = 2\n'
        "memory_gib_per_rank = 1\nmemory_bandwidth_GBps_per_rank = 1\n"
        "[achieved_fraction]\nfp32 = 0.5\n"
        f"[intra_node]\nbandwidth_GBps = {bandwidth_gbps}\nlatency_us = {latency_us}\n"
        f"[inter_node]\nnominal_Gbps = {bandwidth_gbps * 8}\nefficiency = 1.0\nlatency_us = {latency_us}\n"
    )
    return path


def table_rows(text: str) -> dict[str, tuple[str, str]]:
    """name -> (status, detail) of a printed doctor table."""
    rows = {}
    for line in text.splitlines():
        match = ROW.match(line)
        if match and match["name"] != "CHECK":
            rows[match["name"].strip()] = (match["status"], match["detail"])
    return rows


def expected_efa_status() -> str:
    return "SKIP" if not EFA_HERE else "PASS"


# --------------------------------------------------------------------- torchrun, all pass


def test_every_check_passes_under_torchrun(tmp_path):
    """Two ranks under torchrun: exit 0, figures consistent with the profile, save dir cleaned up."""
    profile = write_profile(tmp_path, "slow", bandwidth_gbps=0.001)  # 1 MB/s: any loopback beats it
    save_dir = tmp_path / "shared" / "checkpoints"  # absent: the doctor creates it, then removes it
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "distlm.doctor", "--save-dir", str(save_dir), "--device", "cpu", "--cluster", str(profile),
        "--allreduce-mib", "0.25,1", "--allreduce-repeats", "3", "--timeout-sec", "60", "--json",
    ]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    checks = {check["name"]: check for check in report["checks"]}
    assert report["ok"] is True
    assert {name: check["status"] for name, check in checks.items()} == {
        "launcher": "PASS", "devices": "PASS", "save dir": "PASS", "efa libfabric": expected_efa_status(),
        "nccl net plugin": "SKIP", "efa variables": "SKIP", "all-reduce": "PASS",
    }
    assert [rank["rank"] for rank in checks["launcher"]["data"]["ranks"]] == [0, 1]
    assert {rank["launcher"] for rank in checks["launcher"]["data"]["ranks"]} == {"torchelastic"}

    figures = checks["all-reduce"]["data"]
    assert figures["sizes_bytes"] == [262144, 1048576]
    for nbytes, seconds, gbps in zip(figures["sizes_bytes"], figures["median_seconds"], figures["bus_GBps"]):
        assert gbps == pytest.approx(2 * (2 - 1) / 2 * nbytes / seconds / 1e9)
    # The profile's ring on one node: 2 (n-1) steps of its latency plus the bus bytes at its bandwidth.
    bus = 2 * (2 - 1) / 2 * 1048576
    assert figures["expected_bus_GBps"] == pytest.approx(bus / (2 * (2 - 1) * 10e-6 + bus / 0.001e9) / 1e9)
    assert figures["fraction_of_expected"] > 1

    assert not (tmp_path / "shared").exists()


# --------------------------------------------------------------------- failures, named


def _line_up(world_size: int) -> None:
    """Start ranks together, so a short --timeout-sec bounds the doctor and not process start-up."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    store.add("doctor-test/ready", 1)
    while store.add("doctor-test/ready", 0) < world_size:
        time.sleep(0.02)


def _doctor(argv_by_rank: list[list[str]], stall_rank: int | None = None, stall_sec: float = 0.0):
    """Run ``main`` with this rank's arguments; ``stall_rank`` sleeps before writing its probe file."""
    rank = int(os.environ["RANK"])
    if rank == stall_rank:
        from distlm.checkpoint import shared_dir

        write_probe = shared_dir.write_probe

        def stalled_write(*args, **kwargs):
            time.sleep(stall_sec)
            return write_probe(*args, **kwargs)

        shared_dir.write_probe = stalled_write
    _line_up(len(argv_by_rank))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv_by_rank[rank])
    return status, out.getvalue(), err.getvalue()


def test_unshared_save_dir_and_slow_network_fail_naming_the_rank(tmp_path):
    """Each rank gets its own directory (as node-local disks would give it): rank 0's table
    names rank 1 both ways, and an all-reduce far below the profile fails too."""
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    for directory in dirs:
        directory.mkdir()
    (dirs[1] / "keep.txt").write_text("not the doctor's")
    profile = write_profile(tmp_path, "fast", bandwidth_gbps=1e6)  # no loopback reaches a petabyte/s
    common = ["--device", "cpu", "--cluster", str(profile), "--allreduce-mib", "0.25", "--allreduce-repeats", "2",
              "--timeout-sec", "30"]
    results = run_distributed(_doctor, 2, [["--save-dir", str(d), *common] for d in dirs], timeout=90)

    (status0, table, _), (status1, out1, _) = results
    assert (status0, status1) == (1, 1)
    assert out1 == ""  # only rank 0 prints
    rows = table_rows(table)
    assert rows["launcher"][0] == rows["devices"][0] == "PASS"
    status, detail = rows["save dir"]
    assert status == "FAIL"
    assert "rank 1 (host" in detail and "cannot read the file rank 0 wrote (missing)" in detail
    assert "rank 0 cannot read the files written by rank 1" in detail
    assert str(dirs[1]) in detail  # what rank 1 was given
    status, detail = rows["all-reduce"]
    assert status == "FAIL" and "below --min-busbw-fraction 0.5" in detail
    assert table.splitlines()[-1].startswith("doctor: FAILED: 2 passed, 2 failed")
    assert [sorted(p.name for p in d.iterdir()) for d in dirs] == [[], ["keep.txt"]]


def test_a_stalled_rank_is_named_instead_of_hanging(tmp_path):
    """Rank 1 stalls in the save-dir probe past --timeout-sec: rank 0 fails that check naming
    rank 1, skips the rest, and both ranks exit 1 instead of waiting for each other."""
    timeout = 4
    argv = ["--save-dir", str(tmp_path), "--device", "cpu", "--timeout-sec", str(timeout)]
    started = time.monotonic()
    results = run_distributed(_doctor, 2, [argv, argv], 1, timeout + 1, timeout=90)

    (status0, table, _), (status1, _, errors1) = results
    assert (status0, status1) == (1, 1)
    rows = table_rows(table)
    assert rows["launcher"][0] == rows["devices"][0] == "PASS"
    assert rows["save dir"] == (
        "FAIL",
        f"rank 1 did not reach 'save dir' within --timeout-sec {timeout}: stalled, died, or cannot reach rank 0 "
        "(their own output says why)",
    )
    assert {rows[name] for name in ("efa libfabric", "nccl net plugin", "efa variables", "all-reduce")} == {
        ("SKIP", "not run: a rank is missing")
    }
    assert "distlm.doctor: error:" in errors1  # rank 1 reports its own side
    assert list(tmp_path.iterdir()) == []  # each rank removed its probe file
    assert time.monotonic() - started < 60


def test_a_rank_that_never_starts_fails_the_rendezvous(tmp_path, capsys):
    """Rank 0 of an explicit two-rank launch whose rank 1 never comes: a table after --timeout-sec."""
    argv = ["--device", "cpu", "--save-dir", str(tmp_path), "--timeout-sec", "2", "--distributed-world-size", "2",
            "--distributed-rank", "0", "--distributed-init-method", f"tcp://127.0.0.1:{find_free_port()}"]
    assert main(argv) == 1
    rows = table_rows(capsys.readouterr().out)
    assert list(rows) == ["rendezvous"]
    status, detail = rows["rendezvous"]
    assert status == "FAIL" and "Check that all 2 ranks started" in detail
    assert not dist.is_initialized()


# --------------------------------------------------------------------- one process, bad input


def test_one_process_prints_json_and_leaves_the_save_dir_as_it_was(tmp_path, capsys):
    (tmp_path / "checkpoint_last").mkdir()
    assert main(["--save-dir", str(tmp_path), "--device", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    statuses = {check["name"]: check["status"] for check in report["checks"]}
    assert report["ok"] is True
    assert statuses["launcher"] == statuses["devices"] == statuses["save dir"] == "PASS"
    assert statuses["all-reduce"] == "SKIP"
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint_last"]


def test_without_save_dir_the_training_default_is_checked(tmp_path, monkeypatch, capsys):
    """The job without --save-dir writes checkpoints/MODEL; the doctor probes that directory."""
    monkeypatch.chdir(tmp_path)
    assert parse_doctor_args(["--arch", "llama_tiny"])[1].checkpoint.save_dir == "checkpoints/llama_tiny"
    assert main(["--device", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {check["name"]: check["status"] for check in report["checks"]}["save dir"] == "PASS"


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--cluster", "no-such-instance"], "--cluster no-such-instance is unknown"),
        (["--cluster", "p4d.24xlarge", "--device", "cpu"], "--cluster p4d.24xlarge describes cuda nodes"),
        (["--allreduce-mib", "1,x"], "--allreduce-mib '1,x': 'x' is not a number"),
        (["--allreduce-mib", "0"], "--allreduce-mib '0': 0 MiB is not a positive size"),
        (["--min-busbw-fraction", "2"], "--min-busbw-fraction must be in [0, 1], got 2"),
        (["--allreduce-repeats", "0"], "--allreduce-repeats must be at least 1, got 0"),
        (["--timeout-sec", "soon"], "--timeout-sec"),
        (["--no-such-flag"], "--no-such-flag"),
    ],
)
def test_bad_input_is_one_line_and_status_2(argv, named, capsys):
    assert main(["--device", "cpu", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distlm.doctor: error: ") and named in lines[0], captured.err
    assert captured.out == ""


@pytest.mark.parametrize("instance, device, expected", [
    ("p4d.24xlarge", "cuda", "p4d.24xlarge"),  # the node's own profile
    ("p4d.24xlarge", "cpu", None),  # a CPU job on a GPU node: no verdict rather than an error
    ("m5.large", "cpu", None),  # no profile for this instance type
])
def test_an_ec2_instance_type_with_a_profile_is_the_default_cluster(monkeypatch, instance, device, expected):
    monkeypatch.delenv("DISTLM_CLUSTER", raising=False)
    monkeypatch.setenv("DISTLM_INSTANCE_TYPE", instance)
    monkeypatch.setattr("distlm.doctor.cli.resolve_device", lambda requested: requested)  # no GPU needed here
    options, _ = parse_doctor_args(["--device", device])
    cluster = load_expected_cluster(options, device)
    assert (cluster.name if cluster is not None else None) == expected


def test_a_profile_from_the_environment_is_named_as_such(monkeypatch, capsys):
    monkeypatch.setenv("DISTLM_CLUSTER", "no-such-instance")
    assert main(["--device", "cpu"]) == 2
    assert "(the profile came from $DISTLM_CLUSTER)" in capsys.readouterr().err


# --------------------------------------------------------------------- verdicts on other hosts


def _cluster_env(rank: int, node: int, local_rank: int, world_size: int = 4, launcher: str = "slurm") -> ClusterEnv:
    return ClusterEnv(rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=2, node_rank=node,
                      num_nodes=2, master_addr="node-a", master_port=29500, launcher=launcher)


def _launch_reports() -> list[dict]:
    reports = [probe_launch(_cluster_env(rank, rank // 2, rank % 2)) for rank in range(4)]
    for report in reports:
        report["host"] = f"node-{'ab'[report['node_rank']]}"
    return reports


def test_launch_agreement():
    reports = _launch_reports()
    assert judge_launch(reports, "slurm").status == "PASS"

    reports[3]["launcher"] = "mpi"  # e.g. a node whose job script exports OMPI variables
    row = judge_launch(reports, "slurm")
    assert row.status == "FAIL"
    assert "launcher: slurm on ranks 0-2 (hosts node-a, node-b); mpi on rank 3 (host node-b)" in row.detail

    reports = _launch_reports()
    reports[1]["host"] = "node-c"  # node 0's local ranks on two hosts: the per-node counts are wrong
    row = judge_launch(reports, "slurm")
    assert row.status == "FAIL" and "node 0 spans hosts node-a, node-c" in row.detail


def _gpu_report(host: str, uuid: str, name: str = "NVIDIA A100-SXM4-40GB") -> dict:
    return {"host": host, "backend": "cuda", "device": "cuda:0", "cpus": 12, "cuda_devices": [name] * 8,
            "gpu": {"index": 0, "name": name, "uuid": uuid, "capability": [8, 0]}, "accelerators": 8,
            "neuron_devices": 0, "torch_neuronx": False}


def test_two_ranks_on_one_gpu_fail_and_mixed_hardware_fails():
    distinct = [_gpu_report("a", "GPU-1"), _gpu_report("a", "GPU-2"), _gpu_report("b", "GPU-1")]
    assert judge_devices(distinct).status == "PASS"  # the same UUID on two hosts is two GPUs

    shared = [_gpu_report("a", "GPU-1"), _gpu_report("a", "GPU-1"), _gpu_report("b", "GPU-3")]
    row = judge_devices(shared)
    assert row.status == "FAIL" and "ranks 0-1 (host a) on GPU-1" in row.detail

    mixed = distinct[:2] + [{**distinct[2], "backend": "cpu", "gpu": None}]
    row = judge_devices(mixed)
    assert row.status == "FAIL" and "rank 2 (host b) on cpu" in row.detail


FAKE_FI_INFO = """#!/bin/sh
if [ "$1" = "--version" ]; then
  printf 'fi_info: 1.22.0amzn4.0\\nlibfabric: 1.22.0amzn4.0\\nlibfabric api: 1.22\\n'; exit 0
fi
if [ "$1 $2" = "-p efa" ]; then
  printf 'provider: efa\\n    fabric: efa\\n    domain: rdmap16s27-rdm\\n    version: 122.0\\n'
  printf 'provider: efa\\n    fabric: efa\\n    domain: rdmap16s27-dgrm\\n    version: 122.0\\n'
  exit 0
fi
exit 2
"""
BROKEN_FI_INFO = "#!/bin/sh\necho 'fi_getinfo: -61 (No data available)' >&2\nexit 1\n"


def _executable(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


def test_fi_info_is_run_and_read(tmp_path):
    report = run_fi_info(_executable(tmp_path / "fi_info", FAKE_FI_INFO))
    assert report["ok"] is True and report["error"] is None
    assert report["domains"] == ["rdmap16s27-dgrm", "rdmap16s27-rdm"]
    assert report["version"] == "1.22.0amzn4.0"

    broken = run_fi_info(_executable(tmp_path / "broken", BROKEN_FI_INFO))
    assert broken["ok"] is False and broken["error"] == "fi_getinfo: -61 (No data available)"


def test_the_nccl_plugin_must_be_where_dlopen_looks(tmp_path):
    on_path, installed = tmp_path / "lib", tmp_path / "opt" / "ofi-nccl" / "lib"
    on_path.mkdir()
    installed.mkdir(parents=True)
    (installed / "libnccl-net.so").write_bytes(b"")
    found = find_nccl_net_plugin({"LD_LIBRARY_PATH": str(on_path)}, [str(installed)], loader_cache={})
    assert found["loadable"] is False and found["hint"] == f"add {installed} to LD_LIBRARY_PATH"

    found = find_nccl_net_plugin({"LD_LIBRARY_PATH": f"{on_path}:{installed}"}, [], loader_cache={})
    assert found == {"path": str(installed / "libnccl-net.so"), "loadable": True, "via": "LD_LIBRARY_PATH",
                     "names": ["libnccl-net.so"], "hint": None}

    cached = find_nccl_net_plugin({}, [], loader_cache={"libnccl-net.so": "/usr/lib/libnccl-net.so"})
    assert cached["loadable"] is True and cached["via"] == "the loader cache"

    (on_path / "libnccl-net-ofi.so").write_bytes(b"")  # aws-ofi-nccl >= 1.14 without its symlink
    unnamed = find_nccl_net_plugin({"LD_LIBRARY_PATH": str(on_path)}, [], loader_cache={})
    assert unnamed["loadable"] is False and "export NCCL_NET_PLUGIN=ofi" in unnamed["hint"]
    named = find_nccl_net_plugin({"LD_LIBRARY_PATH": str(on_path), "NCCL_NET_PLUGIN": "ofi"}, [], loader_cache={})
    assert named["loadable"] is True and named["path"] == str(on_path / "libnccl-net-ofi.so")
    off = find_nccl_net_plugin({"LD_LIBRARY_PATH": str(installed), "NCCL_NET_PLUGIN": "none"}, [], loader_cache={})
    assert off["loadable"] is False and "unset it" in off["hint"]


def _efa_report(host: str, efa: bool = True, plugin: bool = True, variables: dict | None = None) -> dict:
    report = {"host": host, "efa": efa}
    if efa:
        report["fabric"] = {"fi_info": "/opt/amazon/efa/bin/fi_info", "ok": True, "domains": ["rdmap16s27-rdm"],
                            "version": "1.22.0", "error": None}
        report["plugin"] = {"path": "/opt/amazon/ofi-nccl/lib/libnccl-net.so" if plugin else None,
                            "loadable": plugin, "via": "LD_LIBRARY_PATH" if plugin else None,
                            "names": ["libnccl-net.so"], "hint": None if plugin else "install aws-ofi-nccl"}
        report["variables"] = variables or {"distlm": {"FI_PROVIDER": "efa"}, "user_same": {}, "user_different": {},
                                            "unset": {}}
    return report


def test_efa_rows():
    names = ["efa libfabric", "nccl net plugin", "efa variables"]
    nowhere = judge_efa([_efa_report("a", efa=False), _efa_report("b", efa=False)], "nccl", "auto")
    assert [(row.name, row.status) for row in nowhere] == [(name, "SKIP") for name in names]

    healthy = judge_efa([_efa_report("a"), _efa_report("b")], "nccl", "auto")
    assert [row.status for row in healthy] == ["PASS", "PASS", "PASS"]

    rows = judge_efa([_efa_report("a"), _efa_report("b", efa=False), _efa_report("c", plugin=False)], "nccl", "auto")
    assert rows[0].status == "FAIL" and "no EFA device on rank 1 (host b)" in rows[0].detail
    assert rows[1].status == "FAIL" and rows[1].detail.startswith("rank 2 (host c): no libnccl-net.so")

    on_gloo = judge_efa([_efa_report("a")], "gloo", "auto")
    assert [row.status for row in on_gloo] == ["PASS", "SKIP", "SKIP"]
    on_neuron = judge_efa([_efa_report("a")], "neuron", "auto")
    assert [row.status for row in on_neuron] == ["PASS", "SKIP", "PASS"]


def test_efa_variables_tell_the_preset_from_the_user():
    preset = build_efa_preset(gpudirect_rdma=True)
    before = {"PATH": "/usr/bin", "FI_EFA_USE_HUGE_PAGE": "1", "FI_EFA_FORK_SAFE": "1"}
    now = dict(before)
    applied, kept = apply_env_preset(preset, now)  # what the backend does at start-up
    variables = efa_variables(preset, before, now)
    assert variables["distlm"] == applied
    assert variables["user_same"] == {"FI_EFA_FORK_SAFE": "1"}
    assert variables["user_different"] == {"FI_EFA_USE_HUGE_PAGE": ["1", preset["FI_EFA_USE_HUGE_PAGE"]]}
    assert set(variables["user_same"]) | set(variables["user_different"]) == set(kept)

    row = judge_efa([_efa_report("a", variables=variables)], "nccl", "auto")[2]
    assert row.status == "WARN"
    assert f"yours override the preset: FI_EFA_USE_HUGE_PAGE=1 (preset {preset['FI_EFA_USE_HUGE_PAGE']})" in row.detail
    assert judge_efa([_efa_report("a", variables=variables)], "nccl", "tcp")[2].detail.startswith("--network tcp")


def test_expected_bus_bandwidth_follows_the_profile():
    """p4d.24xlarge from its own TOML: inside a node the NVSwitch figure, across nodes the EFA one."""
    profile = tomllib.loads((resources.files("distlm.plan") / "profiles" / "p4d.24xlarge.toml").read_text())
    cluster = load_cluster("p4d.24xlarge")
    nbytes = 256 * 1024**2
    intra = profile["intra_node"]
    inter = profile["inter_node"]
    for ranks, nodes, bandwidth, latency in (
        (8, 1, intra["bandwidth_GBps"] * 1e9, intra["latency_us"] * 1e-6),
        (16, 2, inter["nominal_Gbps"] * 1e9 / 8 * inter["efficiency"], inter["latency_us"] * 1e-6),
    ):
        bus = 2 * (ranks - 1) / ranks * nbytes
        reference = bus / (2 * (ranks - 1) * latency + bus / bandwidth)
        assert expected_bus_bandwidth(cluster, nbytes, ranks, nodes) == pytest.approx(reference)
        assert bus_bytes(nbytes, ranks) == bus


def test_a_wrong_sum_fails_the_all_reduce():
    seconds = [[[0.01, 0.02, 0.01]], [[0.02, 0.01, 0.03]]]
    row = judge_allreduce([4 * 1024**2], seconds, [[], [4 * 1024**2]], 1, None, 0.5)
    assert row.status == "FAIL" and row.detail.startswith("wrong sums on ranks 1")
    passed = judge_allreduce([4 * 1024**2], seconds, [[], []], 1, None, 0.5)
    # Slowest rank per repetition (0.02, 0.02, 0.03), then the median.
    assert passed.status == "PASS" and passed.data["median_seconds"] == [0.02]


def test_format_ranks():
    assert format_ranks([8, 0, 1, 2, 5, 7]) == "0-2, 5, 7-8"
    assert format_ranks([3]) == "3"
