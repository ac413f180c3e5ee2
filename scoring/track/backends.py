"""The three experiment trackers `specreplay log` and `watch` write to: TensorBoard, Weights &
Biases, MLflow. Each is a `Logger`: `name`, `destination` (what the ledger keys on), `log(step,
scalars)`, `close()`.

A logger checks its package on construction, so a missing one is an error before anything is
logged, but connects (creates the event file, starts the W&B run, opens the MLflow store) only
on its first `log`: a run with nothing new to log leaves no empty event file or W&B run behind.
"""

from __future__ import annotations

import importlib
import os
import time

from pipeline.common.errors import UserError

PREFIX = "specreplay"  # every tag starts with it, so a training run's own metrics never collide
STEP_KEY = f"{PREFIX}/step"  # the W&B x-axis of specreplay's metrics (see WandbLogger)
DEFAULT_RUN = "specreplay"  # W&B run id / MLflow run name used when no run id is given
EXTRA_HINT = "pip install -e '.[loggers]' (or `make setup`)"


def require(module: str, option: str):
    """Import a logger's package, or say which option needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise UserError(
            f"{option} needs the `{module}` package, which is not installed: {EXTRA_HINT} installs every logger"
        ) from error


class TensorBoardLogger:
    """Scalars as TensorBoard events in `logdir` at global_step = the training step.

    tensorboard's own event writer (the one torch's SummaryWriter wraps), so logging never
    imports torch. Events are written with file_version brain.Event:2 and no SessionLog.START,
    so TensorBoard keeps points that arrive out of step order instead of purging them.
    """

    name = "tensorboard"

    def __init__(self, logdir: str):
        require("tensorboard", "--tensorboard")
        self.logdir = os.path.abspath(logdir)
        self.destination = f"tensorboard:{os.path.realpath(logdir)}"
        self._writer = None

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        if self._writer is None:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            self._writer = EventFileWriter(self.logdir, filename_suffix=".specreplay")
        values = [Summary.Value(tag=tag, simple_value=float(value)) for tag, value in scalars.items()]
        self._writer.add_event(Event(wall_time=time.time(), step=int(step), summary=Summary(value=values)))
        # on disk before the ledger says so
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbLogger:
    """Scalars in a W&B run, against the custom x-axis `specreplay/step` = the training step.

    W&B drops a `log(..., step=s)` whose s is below the run's current step, and a training run
    resumed by id is already at its last training step, while checkpoints may be scored (and
    logged) in any order. So specreplay never passes `step=`: every row carries `specreplay/step`
    and `define_metric("specreplay/*", step_metric="specreplay/step")` makes it the x-axis of
    every specreplay chart. Rows then append to the run whatever its step, in any order.

    Without a run id the run `specreplay` of the project is created or resumed (one run reused
    across invocations, like MLflow's). WANDB_MODE (offline for no network) and WANDB_DIR are
    read by wandb itself. Resuming a run another process is still writing is W&B's to refuse.
    `run.log` hands rows to wandb's service, which writes them asynchronously: a process killed
    (-9) right after a log may lose that row although the ledger already lists it.
    """

    name = "wandb"

    def __init__(self, project: str, run_id: str | None = None):
        require("wandb", "--wandb-project")
        self.project, self.run_id, self.own_run = project, run_id or DEFAULT_RUN, run_id is None
        self.destination = f"wandb:{project}/{self.run_id}"
        self._run = None

    def _open(self):
        import wandb

        settings = wandb.Settings(
            # a resumed training run keeps its own console log, requirements, git and host metadata
            console="off",
            quiet=True,  # no history sparklines on finish: the command prints its own lines
            x_save_requirements=False,
            x_disable_meta=True,
            x_disable_stats=True,
            x_disable_machine_info=True,
            disable_git=True,
            save_code=False,
        )
        try:
            run = wandb.init(
                project=self.project,
                id=self.run_id,
                name=DEFAULT_RUN if self.own_run else None,  # never rename the training run
                resume="allow",
                reinit="create_new",
                settings=settings,
            )
        except wandb.errors.Error as error:
            raise UserError(f"W&B: {error} (WANDB_MODE=offline logs without a network)") from error
        run.define_metric(STEP_KEY)
        run.define_metric(f"{PREFIX}/*", step_metric=STEP_KEY)
        return run

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if self._run is None:
            self._run = self._open()
        self._run.log({**{tag: float(v) for tag, v in scalars.items()}, STEP_KEY: int(step)})

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


class MlflowLogger:
    """Metrics in an MLflow run with step = the training step ("/" is allowed in MLflow keys).

    With a run id, that run (e.g. the training run) is appended to and left as it was. Without
    one, the latest run named `specreplay` in `experiment` is reused, or created, and marked
    finished on close. Talks to the store through MlflowClient, so no global active run is set
    in the caller's process.
    """

    name = "mlflow"

    def __init__(self, uri: str, run_id: str | None = None, experiment: str = "specreplay"):
        require("mlflow", "--mlflow-uri")
        self.uri, self.run_id, self.experiment, self.own_run = uri, run_id, experiment, run_id is None
        named = f"experiment {experiment} run {DEFAULT_RUN}"
        self.destination = f"mlflow:{uri} " + (f"run {run_id}" if run_id else named)
        self._client = None

    def _open(self) -> None:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=self.uri)
        if not self.own_run:
            try:
                self._client.get_run(self.run_id)
            except MlflowException as error:
                raise UserError(f"--mlflow-run-id {self.run_id}: no such run at {self.uri} ({error})") from error
            return
        self.run_id = self._named_run(self._client)

    def _named_run(self, client) -> str:
        experiment = client.get_experiment_by_name(self.experiment)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(self.experiment)
        found = client.search_runs(
            [experiment_id],
            filter_string=f"attributes.run_name = '{DEFAULT_RUN}'",
            max_results=1,
            order_by=["attributes.start_time DESC"],
        )
        if found:
            return found[0].info.run_id
        return client.create_run(experiment_id, run_name=DEFAULT_RUN).info.run_id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        if self._client is None:
            self._open()
        now = int(time.time() * 1000)
        metrics = [Metric(tag, float(value), now, int(step)) for tag, value in scalars.items()]
        for start in range(0, len(metrics), 1000):  # MLflow's per-request limit on metrics
            self._client.log_batch(self.run_id, metrics=metrics[start : start + 1000], synchronous=True)

    def close(self) -> None:
        if self._client is not None and self.own_run:
            self._client.set_terminated(self.run_id)
        self._client = None
