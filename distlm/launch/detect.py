"""``detect_launch()``: the launcher of this process, asked in a fixed order, merged with fairseq's flags."""

from __future__ import annotations

import os
from typing import Mapping

from distlm.errors import UsageError
from distlm.launch.cluster_env import ClusterEnv, ExplicitLaunch, first_present, read_int
from distlm.launch.env_vars import EnvLauncher, require_env_master
from distlm.launch.explicit import explicit_or_single, merge_explicit
from distlm.launch.mpi import MPICHLauncher, OpenMPILauncher
from distlm.launch.slurm import SlurmLauncher
from distlm.launch.torchrun import TorchElasticLauncher

# Fixed order: torchrun's variables are the most specific (srun torchrun ... sets both
# torchrun's and Slurm's), then Slurm, then MPI (whose daemons may carry Slurm's), then
# bare RANK/WORLD_SIZE, which srun and mpiexec tasks may also carry.
LAUNCHERS = (TorchElasticLauncher, SlurmLauncher, OpenMPILauncher, MPICHLauncher, EnvLauncher)


_TASK_LAUNCHERS = (SlurmLauncher, OpenMPILauncher, MPICHLauncher)


def check_rank_variables(environ: Mapping[str, str]) -> None:
    """``RANK``/``WORLD_SIZE`` must be whole and must not contradict srun or mpiexec.

    The rule, by who set them:

    * torchrun (``TORCHELASTIC_RUN_ID`` set): they describe the worker. Under
      ``srun torchrun`` Slurm's ``SLURM_PROCID``/``SLURM_NTASKS`` describe the torchrun
      agent task that started it, a different process in a smaller world, so the two
      are not compared (TorchElasticLauncher checks torchrun's own set).
    * anyone else (a job script, ``srun bash -c 'RANK=$SLURM_PROCID ...'``): if srun or
      mpiexec describe this process too, both describe the same process, so each of
      ``RANK`` and ``WORLD_SIZE`` that is set must equal the task's rank and world size
      (``SLURM_PROCID``/``SLURM_STEP_NUM_TASKS``, ``OMPI_COMM_WORLD_RANK``/``_SIZE``,
      ``PMI_RANK``/``PMI_SIZE``); either alone is fine there, the task launcher gives the
      other. A per-node launcher other than torchrun started by srun (one task starting
      several workers) is refused for that reason: start the workers with torchrun.
    * no launcher: ``RANK`` and ``WORLD_SIZE`` must come together (EnvLauncher).

    Raises a one-line ``UsageError`` naming the variables that disagree.
    """
    if "TORCHELASTIC_RUN_ID" in environ:
        return
    has_rank, has_world = "RANK" in environ, "WORLD_SIZE" in environ
    if not (has_rank or has_world):
        return
    for launcher in _TASK_LAUNCHERS:
        task = launcher.detect(environ)
        if task is None:
            continue
        world_var = first_present(environ, launcher.WORLD_VARS) or launcher.WORLD_VARS[0]
        fix = (
            f"unset RANK and WORLD_SIZE ({task.launcher} gives every task its rank), "
            "or start the workers with torchrun"
        )
        if has_world and read_int(environ, "WORLD_SIZE", minimum=1) != task.world_size:
            raise UsageError(
                f"WORLD_SIZE={environ['WORLD_SIZE']} but {world_var}={task.world_size} and no torchrun "
                f"(TORCHELASTIC_RUN_ID unset); {fix}"
            )
        if has_rank and read_int(environ, "RANK") != task.rank:
            raise UsageError(
                f"RANK={environ['RANK']} but {launcher.RANK_VAR}={task.rank} and no torchrun "
                f"(TORCHELASTIC_RUN_ID unset); {fix}"
            )
        return
    if has_rank != has_world:
        present, missing = ("RANK", "WORLD_SIZE") if has_rank else ("WORLD_SIZE", "RANK")
        raise UsageError(
            f"{present} is set but {missing} is not; export both (with MASTER_ADDR and MASTER_PORT), "
            f"or unset {present} for a single process"
        )


def detect_launch(environ: Mapping[str, str] | None = None, explicit: ExplicitLaunch | None = None) -> ClusterEnv:
    """The first launcher that recognises ``environ`` (default ``os.environ``), merged with ``explicit``."""
    environ = os.environ if environ is None else environ
    explicit = explicit if explicit is not None else ExplicitLaunch()
    check_rank_variables(environ)
    for launcher in LAUNCHERS:
        env = launcher.detect(environ)
        if env is not None:
            env = merge_explicit(env, launcher, explicit, environ)
            return require_env_master(env) if launcher is EnvLauncher else env
    return explicit_or_single(explicit, environ)
