"""The project's own sbatch kits under a real Slurm on simulated nodes (tests/slurm_cluster.py).

Debian's slurm-wlm runs on 4 network namespaces (slurmctld on node0, a slurmd and a munged
on each node), and two 2-node jobs go through it side by side, as a user submits them:

- examples/slurm/roberta_large_p3dn.sbatch, one ``srun`` task per rank (distlm's Slurm
  launcher). While it trains, ``scontrol requeue`` stops it (Slurm's SIGTERM: every rank
  saves ``checkpoint_last`` at one update); the requeued job resumes there. In its second
  run ``scancel --signal=USR1`` delivers what the kit's ``--signal=USR1@300`` sends before
  the time limit: distlm saves and stops with status 138 and the kit requeues the job
  itself. The third run finishes. Its weights must equal, bit for bit, those of one
  uninterrupted run of the kit's own training command at the same world size on one node
  (this host, through the test harness): the data position, RNG and optimizer state are in
  the checkpoint, and gloo sums 2 ranks in one order whichever network carries the bytes.
- examples/slurm/llama3_1_70b.sbatch (INSTANCE=p5: FSDP, bf16) shrunk to the tiny Llama,
  ``srun torchrun --nnodes 2`` with c10d rendezvous at the first host of ``scontrol show
  hostnames``: doctor, training, export, equal bit for bit to the same command on one node.

The kits are shrunk through their own environment variables; DRY_RUN=1 prints the very
training command each job runs, which the one-node references run. About 1.5 min (2.5 on a
machine busy with other work).
"""

from __future__ import annotations

import itertools
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from distributed import Scenarios
from slurm_cluster import SlurmCluster, require_slurm, slurm_cluster
from test_examples import EXAMPLES, REPO, job_environment, shrunk
from test_launch import assert_models_identical, fit, last_checkpoint

# The jobs all run in the module's fixture, inside the first test's time.
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

SRUN_KIT = EXAMPLES / "slurm" / "roberta_large_p3dn.sbatch"
TORCHRUN_KIT = EXAMPLES / "slurm" / "llama3_1_70b.sbatch"
# Enough updates that a signal sent when a run logs its first update lands well before its
# end (an update takes 0.1-0.3 s here, the signal under a second), and within the first epoch.
SRUN_UPDATES = 30
TORCHRUN_UPDATES = 3
# A job here takes 20-70 s under load; past this it is hung (each run of the requeued job counts).
JOB_TIMEOUT = 300
DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
               "DEADLINE", "PREEMPTED"}
TRAIN_LINE = re.compile(r'^\{"kind": "train", "update": (\d+)', re.M)


def srun_kit_settings(data_dir: str, save_dir: Path) -> dict[str, str]:
    # PRECISION empty: fp32. The recipe's fp16 runs several times slower on a CPU without fast fp16.
    settings = shrunk(data_dir, save_dir, "roberta_tiny", "--batch-size 4")
    settings.update(MAX_UPDATE=str(SRUN_UPDATES), PRECISION="", CONFIG=str(REPO / "examples" / "roberta_large.toml"))
    return settings


def torchrun_kit_settings(data_dir: str, root: Path) -> dict[str, str]:
    settings = shrunk(data_dir, root / "checkpoints", "llama_tiny", "--save-interval-updates 0")
    settings.update(INSTANCE="p5", MAX_UPDATE=str(TORCHRUN_UPDATES), RANKS_PER_NODE="1", TP_DEGREE="1",
                    PP_DEGREE="1", BATCH_SIZE="2", HF_DIR=str(root / "hf"), COMPILE_CACHE=str(root / "compile-cache"))
    return settings


def training_command(kit: Path, settings: dict[str, str]) -> list[str]:
    """The distlm.train flags the kit runs with these settings, from its DRY_RUN=1."""
    # Outside a job: the stand-in's scontrol expands the nodelist the 70B kit reads.
    env = job_environment(DRY_RUN="1", SLURM_JOB_NODELIST="node[0-1]", SLURM_JOB_NUM_NODES="2", SLURM_JOB_ID="1",
                          **settings)
    done = subprocess.run(["bash", str(kit)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if " -m distlm.train " in line]
    argv = shlex.split(line)
    return argv[argv.index("distlm.train") + 1:]


def output_after(path: Path, pattern: re.Pattern | str, start: int, slurm: SlurmCluster, job: str,
                 timeout: float = JOB_TIMEOUT) -> int:
    """Wait for ``pattern`` in the job's output after offset ``start``; the offset past it.
    Fails when the job ends first or past ``timeout``."""
    deadline = time.monotonic() + timeout
    for polls in itertools.count():
        text = path.read_text(errors="replace") if path.exists() else ""
        found = re.compile(pattern).search(text, start)
        if found:
            return found.end()
        # The file every 0.2 s (the signal must come soon after the line), the job's state every 2 s.
        if polls % 10 == 9:
            info = slurm.job(job)
            if info["JobState"] in DONE_STATES or time.monotonic() > deadline:
                pytest.fail(f"job {job} ({info['JobState']}, Reason={info.get('Reason')}) never wrote {pattern!r} "
                            f"after offset {start}:\n{text[-4000:]}")
        time.sleep(0.2)
    raise AssertionError("unreachable")


def wait_done(slurm: SlurmCluster, job: str, timeout: float) -> dict[str, str]:
    return slurm.wait(job, lambda info: info["JobState"] in DONE_STATES, timeout=timeout)


@pytest.fixture(scope="module")
def slurm():
    require_slurm()
    # 4 nodes: the two 2-node jobs run side by side (4 training processes on the 2 cores).
    with slurm_cluster(nodes=4) as slurm:
        yield slurm


@pytest.fixture(scope="module")
def jobs(slurm, data_dir, tmp_path_factory) -> dict:
    """Both kits submitted at once; the srun job stopped twice while it trains; then the
    one-node references (while the srun job's last run trains) and the jobs' ends."""
    root = tmp_path_factory.mktemp("jobs")
    srun_settings = srun_kit_settings(data_dir, root / "srun")
    torchrun_settings = torchrun_kit_settings(data_dir, root / "torchrun")
    submit = {}
    # One task (srun) or one torchrun (a worker) per node: the kits' 8 GPUs' worth of ranks in
    # 2 CPUs would pend forever.
    for name, kit, settings in (("srun", SRUN_KIT, srun_settings), ("torchrun", TORCHRUN_KIT, torchrun_settings)):
        out = root / f"{name}.out"
        job = slurm.sbatch([f"--output={out}", "--nodes=2", "--ntasks-per-node=1", str(kit)],
                           env=job_environment(stand_in=False, **settings), cwd=REPO)
        submit[name] = {"job": job, "out": out}
    srun = submit["srun"]

    # Run 1: Slurm's requeue (SIGTERM to every step) once the first update is logged.
    offset = output_after(srun["out"], TRAIN_LINE, 0, slurm, srun["job"])
    slurm.command(["scontrol", "requeue", srun["job"]])
    # Run 2 (after ~7 s pending): once it has resumed and trains, the signal the kit's
    # --signal sends before the time limit; the kit then requeues the job itself.
    offset = output_after(srun["out"], "resumed from", offset, slurm, srun["job"])
    output_after(srun["out"], TRAIN_LINE, offset, slurm, srun["job"])
    slurm.command(["scancel", "--signal=USR1", srun["job"]])

    # The torchrun job's end first, so that the references, started next, share the cores
    # with the srun job's last run only.
    submit["torchrun"]["info"] = wait_done(slurm, submit["torchrun"]["job"], JOB_TIMEOUT)
    references = Scenarios(2, [
        ("srun", fit, (training_command(SRUN_KIT, srun_kit_settings(data_dir, root / "srun-reference")),)),
        ("torchrun", fit, (training_command(TORCHRUN_KIT, torchrun_kit_settings(data_dir, root / "torchrun-ref")),)),
    ], timeout=JOB_TIMEOUT)
    srun["info"] = wait_done(slurm, srun["job"], JOB_TIMEOUT)
    for name in submit:
        submit[name]["log"] = submit[name]["out"].read_text(errors="replace")
    return {**submit, "references": references, "srun_save_dir": root / "srun",
            "torchrun_save_dir": root / "torchrun" / "checkpoints", "torchrun_hf": root / "torchrun" / "hf",
            "srun_reference": root / "srun-reference", "torchrun_reference": root / "torchrun-ref" / "checkpoints"}


def completed(job: dict) -> None:
    info = job["info"]
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), job["log"][-6000:]


def assert_equals_one_node(save_dir: Path, reference_dir: Path, updates: int) -> None:
    trained, reference = last_checkpoint(save_dir), last_checkpoint(reference_dir)
    assert trained["world_size"] == reference["world_size"] == 2
    assert trained["num_updates"] == reference["num_updates"] == updates
    assert trained["consumed_samples"] == reference["consumed_samples"]
    assert_models_identical(trained["model"], reference["model"])


def test_srun_kit_trains_across_two_nodes_through_distlms_slurm_launcher(jobs):
    completed(jobs["srun"])
    # Ranks from srun's variables, one per node, in the doctor's and the training's step of
    # each of the job's 3 runs; the master is the first node of the run's allocation.
    masters = re.findall(r"launcher slurm: rank 0 of 2, local rank 0 of 1 on node 0 of 2, master (node\d):\d+",
                         jobs["srun"]["log"])
    assert len(masters) == 6, jobs["srun"]["log"][-6000:]
    nodes = re.fullmatch(r"node\[(\d)[-,](\d)\]", jobs["srun"]["info"]["NodeList"])  # the last run's
    assert nodes and masters[-1] == f"node{nodes.group(1)}", (masters, jobs["srun"]["info"]["NodeList"])


def test_scontrol_requeue_saves_on_sigterm_and_the_requeued_job_resumes_there(jobs):
    log = jobs["srun"]["log"]
    stop = re.search(r"distlm: SIGTERM: stopped at update (\d+) and saved (\S+)/checkpoint_last", log)
    assert stop, log[-6000:]
    assert Path(stop.group(2)) == jobs["srun_save_dir"]
    update = int(stop.group(1))
    assert 1 <= update < SRUN_UPDATES
    assert f"resumed from {jobs['srun_save_dir']}/checkpoint_last at update {update} " in log[stop.end():]


def test_the_kits_signal_stops_the_job_which_requeues_itself_and_resumes(jobs):
    log = jobs["srun"]["log"]
    stop = re.search(r"distlm: SIGUSR1: stopped at update (\d+) and saved \S+/checkpoint_last", log)
    assert stop, log[-6000:]
    first = int(re.search(r"SIGTERM: stopped at update (\d+)", log).group(1))
    update = int(stop.group(1))
    assert first < update < SRUN_UPDATES
    assert f"resumed from {jobs['srun_save_dir']}/checkpoint_last at update {update} " in log[stop.end():]
    assert jobs["srun"]["info"]["Restarts"] == "2"  # Slurm's count: scontrol's requeue and the kit's own


def test_twice_requeued_srun_job_equals_an_uninterrupted_run_on_one_node(jobs):
    jobs["references"]["srun"]  # fails here with the reference run's traceback
    completed(jobs["srun"])
    assert_equals_one_node(jobs["srun_save_dir"], jobs["srun_reference"], SRUN_UPDATES)


def test_srun_torchrun_kit_meets_at_the_first_host_and_equals_one_node(jobs):
    jobs["references"]["torchrun"]
    completed(jobs["torchrun"])
    log = jobs["torchrun"]["log"]
    assert re.search(r"launcher torchelastic: rank 0 of 2, local rank 0 of 1 on node 0 of 2, .*strategy fsdp", log), \
        log[-6000:]
    assert_equals_one_node(jobs["torchrun_save_dir"], jobs["torchrun_reference"], TORCHRUN_UPDATES)
    assert (jobs["torchrun_hf"] / "config.json").is_file()  # the kit's last step, the export, ran
