"""The cluster kits under examples/, checked by the tools that will run them, offline.

- ParallelCluster configurations (examples/parallelcluster/*.yaml), placeholders filled,
  load through aws-parallelcluster's own ``ClusterSchema`` with dummy credentials and every
  AWS call refused; broken ones are refused by it; the OnNodeConfigured script accepts the
  arguments each configuration gives it. Skipped where aws-parallelcluster is not
  installed (``pip install 'distlm[cluster]'``).
- Slurm recipes (examples/slurm/*.sbatch): ``bash -n``, ``#SBATCH`` options that sbatch
  knows, and the Llama-3.1-8B job run for real under the Slurm stand-in in tests/fake_slurm
  (2 nodes of 1 task, both on this machine), shrunk through the recipe's own environment
  variables to the tiny models on CPU. tests/test_slurm.py runs the RoBERTa and 70B
  recipes under a real Slurm instead.
- The mpiexec kit (examples/mpi/) on 2 local ranks.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shutil
import signal
import socket
import string
import subprocess
import sys
from pathlib import Path

import pytest

from distlm.checkpoint import CheckpointReader
from distlm.launch.hosts import find_free_port

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
FAKE_SLURM = Path(__file__).resolve().parent / "fake_slurm"
CLUSTER_CONFIGS = sorted((EXAMPLES / "parallelcluster").glob("*.yaml"))
ON_NODE_CONFIGURED = EXAMPLES / "parallelcluster" / "on-node-configured.sh"
SLURM_RECIPES = sorted((EXAMPLES / "slurm").glob("*.sbatch"))
MPI_KIT = EXAMPLES / "mpi" / "run_roberta_large.sh"
# A normal job here takes 10-40 s (each step starts Python and torch on every rank); past this it is hung.
JOB_TIMEOUT = 300

PLACEHOLDERS = {
    "REGION": "us-west-2",
    "PUBLIC_SUBNET_ID": "subnet-0123456789abcdef0",
    "PRIVATE_SUBNET_ID": "subnet-0fedcba9876543210",
    "KEY_NAME": "distlm-key",
    "BUCKET_NAME": "distlm-bucket",
}

# Every long option of sbatch(1), Slurm 24.11.
SBATCH_LONG_OPTIONS = frozenset("""
    account acctg-freq array batch bb bbf begin chdir cluster-constraint clusters comment constraint
    container container-id contiguous core-spec cores-per-socket cpu-freq cpus-per-gpu cpus-per-task
    deadline delay-boot dependency distribution error exclude exclusive export export-file extra
    extra-node-info get-user-env gid gpu-bind gpu-freq gpus gpus-per-node gpus-per-socket gpus-per-task
    gres gres-flags help hint hold ignore-pbs input job-name kill-on-invalid-dep licenses mail-type
    mail-user mcs-label mem mem-bind mem-per-cpu mem-per-gpu mincpus network nice no-kill no-requeue
    nodefile nodelist nodes ntasks ntasks-per-core ntasks-per-gpu ntasks-per-node ntasks-per-socket
    oom-kill-step open-mode output overcommit oversubscribe parsable partition power prefer priority
    profile propagate qos quiet reboot requeue reservation resv-ports segment signal sockets-per-node
    spread-job stepmgr switches test-only thread-spec threads-per-core time time-min tmp tres-bind
    tres-per-task uid usage use-min-nodes verbose version wait wait-all-nodes wckey wrap
""".split())

# Variables of the shell running the tests that would change what a job does: any
# launcher's, and the doctor's default cluster profile (loopback fails its bandwidth verdict).
JOB_PREFIXES_UNSET = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_")
JOB_NAMES_UNSET = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                   "MASTER_ADDR", "MASTER_PORT", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "DISTLM_CLUSTER"}


def _export_writes_hf() -> bool:
    from distlm.export import cli as export

    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), pytest.raises(SystemExit):
        export.main(["--help"])
    return "--hf" in help_text.getvalue()


HAVE_DOCTOR = importlib.util.find_spec("distlm.doctor") is not None
NO_DOCTOR = "waits for python -m distlm.doctor, which every kit runs first"
needs_doctor = pytest.mark.skipif(not HAVE_DOCTOR, reason=NO_DOCTOR)
needs_hf_export = pytest.mark.skipif(not _export_writes_hf(), reason="waits for python -m distlm.export --hf")


# --------------------------------------------------------------------- ParallelCluster


def filled(path: Path) -> str:
    """The configuration as envsubst makes it; an unknown placeholder raises KeyError."""
    return string.Template(path.read_text()).substitute(PLACEHOLDERS)


@pytest.fixture
def cluster_schema(monkeypatch):
    """aws-parallelcluster's ClusterSchema, offline: a region, dummy credentials, no AWS
    configuration files, no instance metadata, and any AWS call or connection refused."""
    schema_module = pytest.importorskip(
        "pcluster.schemas.cluster_schema", reason="aws-parallelcluster is not installed (pip install 'distlm[cluster]')"
    )
    monkeypatch.setenv("AWS_DEFAULT_REGION", PLACEHOLDERS["REGION"])
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.setenv(name, "testing")
    for name in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.setenv(name, os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.delenv("AWS_PROFILE", raising=False)

    import botocore.client

    def refuse_call(client, operation, params):
        raise AssertionError(f"loading a configuration made the AWS call {operation}")

    def refuse_connection(sock, address):
        raise AssertionError(f"loading a configuration opened a connection to {address}")

    monkeypatch.setattr(botocore.client.BaseClient, "_make_api_call", refuse_call)
    monkeypatch.setattr(socket.socket, "connect", refuse_connection)
    return schema_module.ClusterSchema


def load_configuration(cluster_schema, config: dict):
    return cluster_schema(cluster_name="distlm").load(config)


def test_every_configuration_placeholder_is_in_the_readme_envsubst_command():
    readme = (EXAMPLES / "parallelcluster" / "README.md").read_text()
    (envsubst_list,) = re.findall(r"envsubst '([^']*)'", readme)
    documented = set(re.findall(r"\$\{(\w+)\}", envsubst_list))
    assert documented == set(PLACEHOLDERS)
    assert CLUSTER_CONFIGS
    for path in CLUSTER_CONFIGS:
        assert set(re.findall(r"\$\{(\w+)\}", path.read_text())) <= documented, path.name


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda path: path.name)
def test_parallelcluster_configuration_loads_through_its_own_schema(path, cluster_schema):
    import yaml

    config = load_configuration(cluster_schema, yaml.safe_load(filled(path)))

    family = path.stem  # p3dn.yaml describes p3dn.24xlarge nodes, trn2.yaml trn2.48xlarge...
    (queue,) = config.scheduling.queues
    (nodes,) = queue.compute_resources
    assert nodes.instance_type.split(".")[0] == family
    assert nodes.efa.enabled
    assert queue.networking.placement_group.enabled
    assert [(type(storage).__name__, storage.mount_dir) for storage in config.shared_storage] == [
        ("SharedFsxLustre", "/fsx")
    ]
    for role, action in (("head", config.head_node.custom_actions.on_node_configured),
                         ("compute", queue.custom_actions.on_node_configured)):
        assert action.script == f"s3://{PLACEHOLDERS['BUCKET_NAME']}/distlm/{ON_NODE_CONFIGURED.name}"
        assert action.args[:2] == [family, role]
        # The script takes these very arguments (DRY_RUN prints its commands instead).
        proc = subprocess.run(["bash", str(ON_NODE_CONFIGURED), *action.args], env={**os.environ, "DRY_RUN": "1"},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert f"done: {family} {role}" in proc.stdout


def _misspell_placement_group(config: dict) -> None:
    networking = config["Scheduling"]["SlurmQueues"][0]["Networking"]
    networking["PlacementGroups"] = networking.pop("PlacementGroup")


def _misspell_efa(config: dict) -> None:
    config["Scheduling"]["SlurmQueues"][0]["ComputeResources"][0]["Efa"] = {"Enable": True}


def _old_image(config: dict) -> None:
    config["Image"]["Os"] = "alinux2"  # as in the Trainium slides' configuration


@pytest.mark.parametrize(
    "break_it, refusal",
    [
        (_old_image, "Must be one of: alinux2023, ubuntu2204, ubuntu2404"),
        (_misspell_placement_group, "'PlacementGroups': ['Unknown field.']"),
        (_misspell_efa, "'Enable': ['Unknown field.']"),
    ],
    ids=["alinux2", "PlacementGroups", "Efa-Enable"],
)
def test_broken_configuration_is_refused_by_the_schema(break_it, refusal, cluster_schema):
    import yaml
    from marshmallow import ValidationError

    config = yaml.safe_load(filled(EXAMPLES / "parallelcluster" / "trn2.yaml"))
    load_configuration(cluster_schema, config)  # the unbroken one loads
    break_it(config)
    with pytest.raises(ValidationError) as refused:
        load_configuration(cluster_schema, config)
    assert refusal in str(refused.value.messages)


def test_on_node_configured_refuses_an_unknown_stack():
    proc = subprocess.run(["bash", str(ON_NODE_CONFIGURED), "trn3", "head", "s3://bucket/distlm/"],
                          env={**os.environ, "DRY_RUN": "1"}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("STACK trn3 is not one of p3dn, p4d, trn1, trn2")


# --------------------------------------------------------------------- the scripts themselves


@pytest.mark.parametrize("path", [*SLURM_RECIPES, MPI_KIT, ON_NODE_CONFIGURED], ids=lambda path: path.name)
def test_script_parses_as_bash(path):
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def sbatch_lines(path: Path) -> tuple[list[str], list[str]]:
    """(#SBATCH lines sbatch reads, #SBATCH lines after the first command, which it ignores)."""
    read, ignored, in_header = [], [], True
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = line.strip()
        if number == 1 and text.startswith("#!"):
            continue
        if text.startswith("#SBATCH"):
            (read if in_header else ignored).append(text)
        elif text and not text.startswith("#"):
            in_header = False
    return read, ignored


@pytest.mark.parametrize("path", SLURM_RECIPES, ids=lambda path: path.name)
def test_sbatch_options_are_options_of_sbatch(path):
    read, ignored = sbatch_lines(path)
    assert read and not ignored, f"#SBATCH lines after the first command are ignored by sbatch: {ignored}"
    for line in read:
        for word in line.split()[1:]:
            assert word.startswith("--"), f"{line}: write long options, --name=value"
            assert word[2:].partition("=")[0] in SBATCH_LONG_OPTIONS, f"{line}: sbatch has no option {word}"


def test_hostfile_of_the_mpi_kit_is_open_mpi_syntax():
    lines = [line for line in (EXAMPLES / "mpi" / "hostfile").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    assert lines
    assert all(re.fullmatch(r"\S+ slots=\d+", line) for line in lines), lines


# --------------------------------------------------------------------- real runs


def job_environment(stand_in: bool = True, **settings: str) -> dict[str, str]:
    """This environment less JOB_*_UNSET, the stand-ins (unless ``stand_in=False``: a real
    Slurm's commands) and this Python first on PATH, one thread per process, and the kit's settings."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(JOB_PREFIXES_UNSET) and name not in JOB_NAMES_UNSET}
    stand_ins = [str(FAKE_SLURM)] if stand_in else []
    env["PATH"] = os.pathsep.join([*stand_ins, str(Path(sys.executable).parent), env.get("PATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env.update(settings)
    return env


def run_job(command: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run a job in its own session; on a hang, kill all of it and fail with its output."""
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{' '.join(command)} did not finish in {JOB_TIMEOUT} s:\n{output[-6000:]}")
    return proc.returncode, output


def shrunk(data: str, save_dir: Path, arch: str, extra: str) -> dict[str, str]:
    """The settings every kit reads, at test size: tiny model, CPU, no EFA, no venv, no cluster profile."""
    return {"DATA": data, "SAVE_DIR": str(save_dir), "ARCH": arch, "MAX_UPDATE": "2", "DEVICE": "cpu",
            "NETWORK": "tcp", "VENV": "", "CLUSTER": "",
            "EXTRA_ARGS": f"--tokens-per-sample 32 --num-workers 0 --log-interval 1 --timeout-sec 60 {extra}"}


def trained_updates(save_dir: Path) -> tuple[int, int]:
    """(updates, world size) recorded in the run's last checkpoint."""
    meta = CheckpointReader(save_dir / "checkpoint_last").meta
    return meta["progress"]["num_updates"], meta["world_size"]


@pytest.fixture(scope="module")
def llama_job(data_dir, tmp_path_factory):
    """The Llama recipe's whole job (doctor, --precompile, training, export) at test size:
    2 nodes of one torchrun with one worker each, tensor parallel 2."""
    if not HAVE_DOCTOR:
        pytest.skip(NO_DOCTOR)
    root = tmp_path_factory.mktemp("llama_job")
    settings = shrunk(data_dir, root / "checkpoints", "llama_tiny", "--update-freq 1 --save-interval-updates 0")
    settings.update(RANKS_PER_NODE="1", TP_DEGREE="2", COMPILE_CACHE=str(root / "compile-cache"),
                    HF_DIR=str(root / "hf"), RDZV_PORT=str(find_free_port()))
    code, output = run_job(["sbatch", "--nodes=2", "examples/slurm/llama3_1_8b_trn.sbatch"],
                           job_environment(**settings))
    return {"code": code, "output": output, "save_dir": root / "checkpoints", "hf_dir": root / "hf"}


@needs_hf_export
def test_llama_recipe_trains_and_exports_to_hugging_face(llama_job):
    assert llama_job["code"] == 0, llama_job["output"][-6000:]
    assert trained_updates(llama_job["save_dir"]) == (2, 2)
    transformers = pytest.importorskip("transformers")
    import torch

    model, loading = transformers.AutoModelForCausalLM.from_pretrained(llama_job["hf_dir"], output_loading_info=True)
    assert not any(loading.values()), loading
    logits = model(torch.tensor([[4, 5, 6, 7]])).logits
    assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(logits).all()


@needs_hf_export
def test_llama_recipe_training_step_starts_from_scratch_after_precompile(llama_job):
    # --precompile fills the compile cache and writes no checkpoint, so the training step
    # after it starts at update 0 instead of resuming the compile pass.
    assert llama_job["code"] == 0, llama_job["output"][-6000:]
    assert "resumed from" not in llama_job["output"]


def test_llama_recipe_on_trn1_asks_for_a_model_that_fits(tmp_path):
    env = job_environment(INSTANCE="trn1", SAVE_DIR=str(tmp_path))
    env.pop("ARCH", None)
    code, output = run_job(["sbatch", "--nodes=2", "examples/slurm/llama3_1_8b_trn.sbatch"], env)
    assert code == 2
    assert "INSTANCE=trn1: set ARCH" in output


@needs_doctor
@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpiexec") is None,
                    reason="mpiexec not found (apt-get install openmpi-bin libopenmpi-dev)")
@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="mpi4py not installed (pip install 'distlm[mpi]')")
def test_mpi_kit_runs_on_two_local_ranks_as_two_nodes(data_dir, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    save_dir = tmp_path / "checkpoints"
    # --ranks-per-node 1: the 2 ranks are 2 nodes to the hierarchical hook, so its inter-node
    # leg runs, in fp16, through mpi4py.
    settings = shrunk(data_dir, save_dir, "roberta_tiny", "--batch-size 4 --ranks-per-node 1")
    settings.update(HOSTFILE=str(hostfile), RANKS_PER_NODE="2", OMPI_ALLOW_RUN_AS_ROOT="1",
                    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1")
    code, output = run_job(["bash", str(MPI_KIT)], job_environment(**settings))
    assert code == 0, output[-6000:]
    assert trained_updates(save_dir) == (2, 2)


# --------------------------------------------------------------------- the 70B recipe

RECIPE_70B = EXAMPLES / "slurm" / "llama3_1_70b.sbatch"
CONFIG_70B = EXAMPLES / "slurm" / "llama3_1_70b_config.json"
INSTANCE_PROFILES = {"trn2": "trn2.48xlarge", "p4d": "p4d.24xlarge", "p5": "p5.48xlarge"}
# distlm.train flags the plan must share with the training command (value, or presence).
SIZING_FLAGS = ("--strategy", "--tp-degree", "--pp-degree", "--pp-microbatches", "--batch-size")
SIZING_SWITCHES = ("--activation-checkpointing", "--sequence-parallel")


def stated_plans() -> dict[str, list[str]]:
    """The distlm.plan command the recipe's header states for each instance, as argv."""
    import shlex

    plans = {}
    for line in RECIPE_70B.read_text().splitlines():
        if line.startswith("#   python -m distlm.plan "):
            argv = shlex.split(line.removeprefix("#   python -m distlm.plan "))
            cluster = argv[argv.index("--cluster") + 1]
            plans[next(key for key, name in INSTANCE_PROFILES.items() if name == cluster)] = argv
    return plans


def sizing(argv: list[str]) -> dict[str, object]:
    return {**{flag: argv[argv.index(flag) + 1] if flag in argv else None for flag in SIZING_FLAGS},
            **{switch: switch in argv for switch in SIZING_SWITCHES}}


@pytest.mark.parametrize("instance", INSTANCE_PROFILES)
def test_70b_recipe_trains_the_layout_its_stated_plan_sized(instance, capsys):
    """The job's training command (DRY_RUN=1 prints it) has the degrees, strategy, batch
    and checkpointing of the distlm.plan command its header states for the instance, and
    that plan still runs and fits."""
    import json
    import shlex

    from distlm.plan import __main__ as plan_cli

    env = job_environment(INSTANCE=instance, DRY_RUN="1", VENV="", SLURM_JOB_NODELIST="node[01-08]",
                          SLURM_JOB_NUM_NODES="8", SLURM_JOB_ID="70")
    proc = subprocess.run(["bash", str(RECIPE_70B)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    (train,) = [shlex.split(line) for line in proc.stdout.splitlines()
                if "-m distlm.train" in line and "--precompile" not in line]
    assert ("--precompile" in proc.stdout) == (instance == "trn2")
    plan = stated_plans()[instance]
    assert sizing(train) == sizing(plan), (sizing(train), sizing(plan))
    assert train[train.index("--device") + 1] == ("neuron" if instance == "trn2" else "cuda")
    assert plan_cli.main(plan + ["--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["fits"] and row["pp_degree"] == 4 and row["tp_degree"] == 8


def test_70b_recipe_builds_the_shape_of_its_hugging_face_config():
    """The recipe's model flags (llama3_1_8b's settings with the 70B sizes) make exactly the
    model of Meta's config.json that the plans read."""
    import shlex

    import torch

    from distlm.training.builder import resolve_model_spec
    from distlm.config import parse_args
    from distlm.models.flops import count_parameters, model_shape, shape_from_hf_config

    (line,) = [line for line in RECIPE_70B.read_text().splitlines() if "model_args=(--arch llama3_1_8b" in line]
    flags = shlex.split(line.strip().removeprefix("model_args=(").removesuffix(")"))
    spec = resolve_model_spec(parse_args(flags + ["--device", "cpu"]).model)
    with torch.device("meta"):
        model = spec.build(spec.config.vocab_size, 1)
    assert model_shape(model) == shape_from_hf_config(CONFIG_70B)
    assert count_parameters(model_shape(model)) == sum(p.numel() for p in model.parameters())
