"""A job's TensorBoard files, read back with TensorBoard's own reader: the curves of two
attempts, where the second resumed from a checkpoint behind the first one's last point."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from elastic.train.tensorboard import TensorBoardLog, directory


def read(checkpoint_dir: Path) -> EventAccumulator:
    reader = EventAccumulator(directory(str(checkpoint_dir)), size_guidance={"scalars": 0})
    reader.Reload()
    return reader


def metrics(step: int, loss: float, world: int) -> dict[str, object]:
    return {
        "step": step,
        "loss": loss,
        "accuracy": 0.5,
        "learning_rate": 0.1,
        "samples_per_s": 100.0 * world,
        "world_size": world,
        "eval_loss": None,  # not evaluated at this step: no point
    }


def test_a_restored_attempt_replaces_the_points_past_its_checkpoint(tmp_path: Path) -> None:
    first = TensorBoardLog(str(tmp_path), attempt=1, world_size=3, step=0)
    for step, loss in ((10, 2.0), (20, 1.5), (30, 1.2)):
        first.record("metrics", metrics(step, loss, 3))
    first.record("checkpoint_saved", {"step": 20})
    first.close()
    # The node dies after step 30; the job resumes at 2 workers from step 20.
    second = TensorBoardLog(str(tmp_path), attempt=2, world_size=2, step=20)
    for step, loss in ((30, 1.25), (40, 1.0)):
        second.record("metrics", metrics(step, loss, 2))
    second.close()

    reader = read(tmp_path)
    loss = [(e.step, e.value) for e in reader.Scalars("train/loss")]
    assert loss == [(10, 2.0), (20, 1.5), (30, 1.25), (40, 1.0)]
    world = [(e.step, e.value) for e in reader.Scalars("train/world_size")]
    assert world == [(10, 3), (20, 3), (30, 2), (40, 2)]
    assert "eval/loss" not in reader.Tags()["scalars"]
    assert set(reader.Tags()["scalars"]) == {
        "train/loss",
        "train/accuracy",
        "train/learning_rate",
        "train/samples_per_s",
        "train/world_size",
    }


def test_attempts_and_checkpoints_leave_text_markers(tmp_path: Path) -> None:
    first = TensorBoardLog(str(tmp_path), attempt=1, world_size=3, step=0)
    first.record("checkpoint_saved", {"step": 20})
    first.close()
    second = TensorBoardLog(str(tmp_path), attempt=2, world_size=2, step=20)
    second.close()
    reader = EventAccumulator(directory(str(tmp_path)), size_guidance={"tensors": 0})
    reader.Reload()
    texts = [
        (e.step, e.tensor_proto.string_val[0].decode())
        for e in reader.Tensors("events/text_summary")
    ]
    assert texts == [
        (0, "attempt 1 began at world size 3, from the start"),
        (20, "checkpoint saved at step 20"),
        (20, "attempt 2 began at world size 2, from the checkpoint of step 20"),
    ]


def test_a_checkpoint_saved_after_the_attempt_closed_opens_no_second_file(tmp_path: Path) -> None:
    # The attempt failed and closed its log while its checkpoint writer was still saving:
    # the writer's late event must not reopen a second event file of the same attempt.
    log = TensorBoardLog(str(tmp_path), attempt=1, world_size=3, step=0)
    log.record("metrics", metrics(10, 2.0, 3))
    log.close()
    log.record("checkpoint_saved", {"step": 20})
    log.record("metrics", metrics(20, 1.5, 3))
    log.close()
    (only,) = Path(directory(str(tmp_path))).iterdir()
    assert only.name.endswith(".attempt1")
    assert [(e.step, e.value) for e in read(tmp_path).Scalars("train/loss")] == [(10, 2.0)]
