"""`specreplay log`: existing score results into TensorBoard, W&B or MLflow (scoring/track/loggers.py)."""

from __future__ import annotations

import click


@click.command(context_settings={"max_content_width": 100})
@click.option(
    "--results",
    required=True,
    metavar="DIR",
    type=click.Path(exists=True, file_okay=False),
    help="A results directory written by `specreplay score`, or a directory holding several (e.g. its --out).",
)
@click.option(
    "--tensorboard",
    default=None,
    metavar="DIR",
    help="Write TensorBoard events here; the training run's own log directory puts the curves beside its loss.",
)
@click.option("--wandb-project", default=None, metavar="P", help="Log to this Weights & Biases project.")
@click.option(
    "--wandb-run-id",
    default=None,
    metavar="ID",
    help="Append to this W&B run (e.g. the training run) instead of the project's run 'specreplay'.",
)
@click.option(
    "--mlflow-uri",
    default=None,
    metavar="URI",
    help="Log to this MLflow tracking store (sqlite:///mlflow.db, http://...).",
)
@click.option(
    "--mlflow-run-id",
    default=None,
    metavar="ID",
    help="Append to this MLflow run (e.g. the training run) instead of the run named 'specreplay'.",
)
@click.option(
    "--mlflow-experiment",
    default="specreplay",
    show_default=True,
    help="MLflow experiment of the run named 'specreplay' (without --mlflow-run-id).",
)
def log(results, tensorboard, wandb_project, wandb_run_id, mlflow_uri, mlflow_run_id, mlflow_experiment):
    """Log scored checkpoints to TensorBoard, Weights & Biases and/or MLflow, each at its
    checkpoint's training step, in step order, so acceptance curves sit in the dashboard you
    already watch.

    Point --tensorboard at the trainer's own log directory (the one TensorBoard's --logdir shows)
    and tau appears beside the training loss, at the same steps. Scalars, per dataset (`all` =
    every dataset pooled): specreplay/<dataset>/tau_chain, .../tau_ddtree_<N>, .../streak (chain
    all-anchor streak), .../accept_rate_pos_<k> (left out where too few anchors reached the
    position for its rate to be a reading, as the report greys it). In W&B their x-axis is
    specreplay/step.

    Idempotent: what went where is recorded in .specreplay-logged.json beside the results
    directories, and a checkpoint already logged at its step to a destination is not logged
    there again. Results without a training step (checkpoint_step null) are skipped.

    \b
    Example:
      specreplay log --results data/results --tensorboard runs/run7/tb
      WANDB_MODE=offline specreplay log --results data/results --wandb-project drafter --wandb-run-id 3kq9x1
      specreplay log --results data/results --mlflow-uri sqlite:///mlflow.db
    """
    from scoring.track.loggers import LoggerOptions, ledger_path_for, log_results, open_loggers, results_dirs_under

    options = LoggerOptions(
        tensorboard=tensorboard,
        wandb_project=wandb_project,
        wandb_run_id=wandb_run_id,
        mlflow_uri=mlflow_uri,
        mlflow_run_id=mlflow_run_id,
        mlflow_experiment=mlflow_experiment,
    )
    loggers = open_loggers(options)
    if not loggers:
        raise click.UsageError("nothing to log to: pass --tensorboard DIR, --wandb-project P and/or --mlflow-uri URI")
    dirs = results_dirs_under(results)
    try:
        for line in log_results(dirs, loggers, ledger_path_for(dirs)):
            click.echo(line)
    finally:
        for logger in loggers:
            logger.close()
