"""Experiment trackers as fairseq names them: TensorBoard, Weights & Biases, MLflow.

Rank 0 alone writes. Each log record becomes numbers tagged ``train/<key>`` or
``valid/<subset>/<key>`` with the update number as the step, the values of the JSON
line unchanged. A resumed run continues the same TensorBoard directory (events after
the checkpoint's update are purged, so no update appears twice) and the same W&B and
MLflow runs, whose ids the checkpoint keeps. A tracker that fails during the run is
reported once and dropped; training goes on.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from typing import Any

from distlm.config import LoggingConfig, TrainConfig
from distlm.errors import UsageError

logger = logging.getLogger("distlm")

# flag -> (config field, module it imports)
_PACKAGES = {
    "--tensorboard-logdir": ("tensorboard_logdir", "tensorboard"),
    "--wandb-project": ("wandb_project", "wandb"),
    "--mlflow-tracking-uri": ("mlflow_tracking_uri", "mlflow"),
}


def check_tracker_packages(settings: LoggingConfig) -> None:
    """Each tracker flag given needs its package: one line naming the extra otherwise."""
    for flag, (name, module) in _PACKAGES.items():
        if getattr(settings, name) is not None and not _importable(module):
            raise UsageError(f"{flag} needs the {module} package: pip install 'distlm[trackers]'")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def record_tags(record: dict[str, Any], kind: str) -> dict[str, float]:
    """The numbers of one log record under their tracker tags; None and text are left out."""
    if kind == "train":
        prefix = "train/"
    elif kind == "valid":
        prefix = f"valid/{record.get('subset', 'valid')}/"
    else:
        return {}
    return {prefix + key: float(value) for key, value in record.items()
            if key not in ("update", "subset") and isinstance(value, (int, float)) and not isinstance(value, bool)}


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, logdir: str, resumed_at: int | None):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step hides events a killed run logged after the checkpoint it resumes from.
        self.writer = SummaryWriter(logdir, purge_step=None if resumed_at is None else resumed_at + 1)
        self.run_id = None

    def log(self, tags: dict[str, float], step: int) -> None:
        for tag, value in tags.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    name = "wandb"

    def __init__(self, project: str, run_name: str | None, run_id: str | None, config: dict[str, Any]):
        import wandb

        self.run = wandb.init(project=project, name=run_name, id=run_id, resume="allow" if run_id else None,
                              config=config)
        self.run_id = self.run.id

    def log(self, tags: dict[str, float], step: int) -> None:
        self.run.log(tags, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    name = "mlflow"
    EXPERIMENT = "distlm"
    _BATCH = 100  # MLflow's limit of params per log_batch

    def __init__(self, uri: str, run_name: str | None, run_id: str | None, config: dict[str, Any]):
        if uri.startswith("file:") and "MLFLOW_ALLOW_FILE_STORE" not in os.environ:
            # MLflow 3 refuses its file store unless asked; the database stores need the full
            # mlflow package, which the trackers extra does not bring.
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
            logger.info("mlflow: using the file store %s (MLFLOW_ALLOW_FILE_STORE=true)", uri)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        self.logged_up_to = 0
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            # A run killed after its last checkpoint logged updates that the resumed run does
            # again; MLflow cannot delete points, so those updates are not logged twice.
            self.logged_up_to = max((m.step for key in self.client.get_run(run_id).data.metrics
                                     for m in self.client.get_metric_history(run_id, key)), default=0)
            return
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", self.EXPERIMENT)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [Param(key, str(value)) for key, value in _flatten(config).items()]
        for start in range(0, len(params), self._BATCH):
            self.client.log_batch(self.run_id, params=params[start:start + self._BATCH])

    def log(self, tags: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        if step <= self.logged_up_to:
            return
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(tag, value, now, step) for tag, value in tags.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


class Trackers:
    """The trackers of one run (rank 0); each failure is one warning and drops that tracker."""

    def __init__(self, trackers: list | None = None):
        self.trackers = list(trackers or [])

    @classmethod
    def open(cls, config: TrainConfig, saved_ids: dict[str, str], resumed_at: int | None) -> Trackers:
        settings, whole = config.logging, config.to_dict()
        wanted = []
        if settings.tensorboard_logdir is not None:
            wanted.append(("tensorboard", lambda: TensorBoardTracker(settings.tensorboard_logdir, resumed_at)))
        if settings.wandb_project is not None:
            wanted.append(("wandb", lambda: WandbTracker(
                settings.wandb_project, settings.wandb_run_name, saved_ids.get("wandb"), whole)))
        if settings.mlflow_tracking_uri is not None:
            wanted.append(("mlflow", lambda: MlflowTracker(
                settings.mlflow_tracking_uri, settings.wandb_run_name, saved_ids.get("mlflow"), whole)))
        trackers = []
        for name, start in wanted:
            try:
                trackers.append(start())
            except Exception as err:  # noqa: BLE001 - an unreachable server must not stop training
                logger.warning("%s could not start (%s: %s); training goes on without it", name, type(err).__name__, err)
        return cls(trackers)

    def run_ids(self) -> dict[str, str]:
        """What a resumed run needs to continue the same runs (saved in the checkpoint)."""
        return {t.name: t.run_id for t in self.trackers if t.run_id is not None}

    def log(self, record: dict[str, Any], kind: str) -> None:
        tags = record_tags(record, kind)
        if tags and "update" in record:
            self._each("log", tags, int(record["update"]))

    def close(self) -> None:
        self._each("close")

    def _each(self, method: str, *args: Any) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception as err:  # noqa: BLE001 - a dashboard must never stop training
                self.trackers.remove(tracker)
                logger.warning("%s failed (%s: %s); training goes on without it",
                               tracker.name, type(err).__name__, err)
