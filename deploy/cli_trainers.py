"""`adstream train` (offline models) and `adstream trainer` (online LoRA, live or `--replay`)."""

from __future__ import annotations

import asyncio
import json
import signal
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from deploy.training_data import events_from_clickhouse, examples_from_events, read_events
from schemas.settings import Settings

console = Console()


class ReplayOrder(StrEnum):
    """The order `adstream trainer --replay` learns a file's examples in."""

    impression = "impression"  # impression time: as a live trainer would have met them
    emission = "emission"  # the file's (join's) order


def _quality_table(title: str, rows: list[tuple[str, Any, Any]]) -> Table:
    t = Table(title=title)
    for col in ("model", "AUC", "log loss"):
        t.add_column(col)
    for name, a, ll in rows:
        t.add_row(name, "-" if a is None else f"{a:.4f}", "-" if ll is None else f"{ll:.4f}")
    return t


def register(app: typer.Typer) -> None:
    """Add the trainers commands to the `adstream` CLI."""

    @app.command()
    def train(
        events: Annotated[
            Path | None, typer.Option(help="JSON-lines file of contract events (or TrainingExamples)")
        ] = None,
        clickhouse: Annotated[bool, typer.Option(help="Read the events from ClickHouse instead")] = False,
        limit: Annotated[int | None, typer.Option(help="At most this many events from ClickHouse")] = None,
        out: Annotated[
            Path | None, typer.Option(help="Model directory (default: settings.model_dir)")
        ] = None,
        holdout: Annotated[float, typer.Option(help="Share of the latest examples held out")] = 0.2,
        epochs: Annotated[int, typer.Option(help="Ranker epochs (early stopping on a validation slice)")] = 8,
        two_tower: Annotated[
            bool, typer.Option(help="Also train the two-tower recall model + ad index")
        ] = True,
        threads: Annotated[int, typer.Option(help="Torch CPU threads")] = 2,
        json_out: Annotated[Path | None, typer.Option("--json", help="Also write the report here")] = None,
    ) -> None:
        """Train the ranker and the two-tower model offline; report holdout AUC/log loss."""
        from trainers.models.ranker import resolve_device, slot_buckets_for
        from trainers.offline import TrainSpec
        from trainers.train_all import set_threads, train_all

        settings = Settings()
        set_threads(threads)
        if events is None and not clickhouse:
            raise typer.BadParameter("give --events FILE or --clickhouse")
        msgs, bad = (
            read_events(events) if events is not None else (events_from_clickhouse(settings, limit), 0)
        )
        examples, catalog = examples_from_events(msgs, settings)
        console.print(f"{len(msgs)} events ({bad} invalid lines skipped) → {len(examples)} training examples")
        out_dir = out or settings.model_dir
        report = train_all(
            examples,
            catalog,
            out_dir,
            state_dim=settings.state_dim,
            spec=TrainSpec(epochs=epochs, holdout=holdout, device=str(resolve_device(settings.device))),
            two_tower=two_tower,
            slot_buckets=slot_buckets_for(settings.slots.names),
        )
        rows = [("ranker (DCN-v2)", report["ranker"]["auc"], report["ranker"]["logloss"])]
        if "logistic_baseline" in report:
            rows.append(
                (
                    "logistic regression",
                    report["logistic_baseline"]["auc"],
                    report["logistic_baseline"]["logloss"],
                )
            )
        if "two_tower" in report:
            rows.append(("two-tower (recall)", report["two_tower"]["auc"], None))
        console.print(_quality_table(f"time-ordered holdout: {report['holdout']} examples", rows))
        if "ranker_minus_lr_auc_ci95" in report:
            lo, hi = report["ranker_minus_lr_auc_ci95"]
            console.print(
                f"ranker − LR AUC, 95% paired-bootstrap interval: [{lo:+.4f}, {hi:+.4f}] "
                f"({report['holdout_positives']} clicks in the holdout)"
            )
        console.print(f"checkpoints under {out_dir} (ranker {report['ranker']['version']})")
        if json_out is not None:
            json_out.write_text(json.dumps(report, indent=2, default=str) + "\n")

    @app.command()
    def trainer(
        replay: Annotated[
            Path | None, typer.Option(help="Replay this JSON-lines file instead of Kafka")
        ] = None,
        json_out: Annotated[
            Path | None, typer.Option("--json", help="Replay: write the progressive report here")
        ] = None,
        checkpoint: Annotated[
            Path | None, typer.Option(help="Ranker checkpoint dir (default: model_dir/ranker)")
        ] = None,
        max_examples: Annotated[int | None, typer.Option(help="Live: stop after this many examples")] = None,
        order: Annotated[
            ReplayOrder,
            typer.Option(help="Replay order: impression (impression time) or emission (file/join order)"),
        ] = ReplayOrder.impression,
        threads: Annotated[
            int, typer.Option(help="Torch CPU threads (1 avoids OpenMP stalls on a busy CPU)")
        ] = 1,
        metrics_port: Annotated[
            int | None, typer.Option(help="Prometheus port (default metrics_port + 1; 0 = off)")
        ] = None,
        score_log: Annotated[
            Path | None,
            typer.Option(help="Live: on stop, write every example's online and frozen scores (JSON) here"),
        ] = None,
        wait_for_model: Annotated[
            float,
            typer.Option(
                min=0,
                help="Live: wait this many seconds for the base model (`adstream init` writes it) "
                "before giving up; 0 = fail at once without one",
            ),
        ] = 900.0,
    ) -> None:
        """Run the online LoRA trainer on `ad.training-examples` (or `--replay FILE --json OUT`)."""
        from trainers.models.lora import AdapterBank
        from trainers.models.ranker import load_checkpoint
        from trainers.online import OnlineTrainer
        from trainers.train_all import set_threads

        settings = Settings()
        if replay is None:
            from schemas.clients import require_kafka

            require_kafka(settings)  # before the model loads: a broker that is down is one clear line
        set_threads(threads)
        # no checkpoint yet (a deployment's first start): wait for `adstream init` rather than
        # crash-loop; the metrics port (readiness) opens only once the model is loaded
        from deploy.bootstrap import wait_for_model as wait

        say = lambda line: console.print(line, markup=False, highlight=False)  # noqa: E731
        found = wait(settings, wait_for_model if replay is None else 0.0, say, checkpoint=checkpoint)
        model, version = load_checkpoint(found)
        bank = AdapterBank(model, settings.lora, version)
        online = OnlineTrainer.from_settings(
            bank, settings, keep_log=replay is not None or score_log is not None
        )
        if replay is not None:
            _replay(replay, json_out, online, settings, order)
            return
        from deploy.stack import create_topics

        create_topics(settings)
        port = settings.metrics.port + 1 if metrics_port is None else metrics_port
        asyncio.run(_live(settings, online, max_examples, port, score_log))


def _replay(path: Path, json_out: Path | None, online: Any, settings: Settings, order: ReplayOrder) -> None:
    from trainers.replay import impression_order, progressive_report, replay

    msgs, bad = read_events(path)
    examples, _ = examples_from_events(msgs, settings)
    if order is ReplayOrder.impression:
        examples = impression_order(examples)
    n = replay(examples, online, settings.online.micro_batch)
    report = progressive_report(online) | {
        "order": order,
        "file": str(path),
        "invalid_lines": bad,
        "examples": n,
        "base_version": online.bank.base_version,
    }
    o = report["overall"]
    rows = [
        ("online LoRA", o["auc_online"], o["logloss_online"]),
        ("frozen base", o["auc_base"], o["logloss_base"]),
    ]
    console.print(_quality_table(f"progressive validation over {n} examples", rows))
    per = Table(title="per adapter")
    for col in ("adapter", "n", "AUC online", "AUC base", "deltas", "last seq"):
        per.add_column(col)
    for aid, r in report["adapters"].items():
        per.add_row(
            aid,
            str(r["n"]),
            str(r["auc_online"]),
            str(r["auc_base"]),
            str(r.get("deltas", 0)),
            str(r["last_seq"]),
        )
    console.print(per)
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=2) + "\n")


async def _live(
    settings: Settings, online: Any, max_examples: int | None, port: int, score_log: Path | None = None
) -> None:
    from trainers import telemetry
    from trainers.service import TrainerService

    telemetry.serve(port)
    service = TrainerService(settings, online)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await service.start()
    console.print(f"trainer consuming {service.in_topic} as group {service.group}; metrics on :{port}")
    try:
        await service.run(stop, max_examples=max_examples)
    finally:
        await service.stop()
        console.print(f"learned {service.learned} examples, published {service.published} deltas")
        if score_log is not None and online.log is not None:
            write_score_log(score_log, online)


def write_score_log(path: Path, online: Any) -> None:
    """The progressive log (each example's online and frozen score before learning, its label as
    scored, adapter, impression id) and the resets per adapter, for paired online-vs-frozen figures."""
    log = online.log
    body = {
        "online": log.online, "base": log.base, "labels": log.labels, "adapters": log.adapters,
        "impression_ids": log.impression_ids,
        "resets": {a: int(run.counts["resets"]) for a, run in online.runs.items()},
    }  # fmt: skip
    path.write_text(json.dumps(body))


# this room's commands (`register` adds them to it; `deploy.cli` wires the app in)
app = typer.Typer(help="The trainers room: offline training and the online LoRA trainer.")
register(app)
