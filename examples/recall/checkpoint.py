"""Orbax checkpoints of a run: the model's and optimizer's state at a step, and the
run's description (configs and history) as JSON next to it."""

from pathlib import Path

import orbax.checkpoint as ocp

STATE, META = "state", "meta"


def manager(directory: Path, keep: int = 2) -> ocp.CheckpointManager:
    """Keeps the ``keep`` latest checkpoints in ``directory`` (created if missing)."""
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
    return ocp.CheckpointManager(Path(directory).absolute(), options=options)


def save(mngr: ocp.CheckpointManager, step: int, state: dict, meta: dict) -> None:
    """Saves ``state`` (a pytree of arrays, e.g. ``nnx.to_pure_dict(state)``) and
    ``meta`` (JSON) as checkpoint ``step``, replacing one already there."""
    if step in mngr.all_steps():
        mngr.delete(step)
    mngr.save(
        step,
        args=ocp.args.Composite(
            **{STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta)}
        ),
    )
    mngr.wait_until_finished()


def latest(directory: Path) -> int | None:
    """The step of the latest checkpoint in ``directory``, or None."""
    if not Path(directory).is_dir():
        return None
    mngr = manager(directory)
    try:
        return mngr.latest_step()
    finally:
        mngr.close()


def load_meta(directory: Path, step: int) -> dict:
    """The JSON description saved with checkpoint ``step``."""
    mngr = manager(directory)
    try:
        return mngr.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
    finally:
        mngr.close()


def load_state(directory: Path, step: int, abstract: dict) -> dict:
    """The state of checkpoint ``step``, shaped like ``abstract`` (arrays or
    ``jax.ShapeDtypeStruct``s with the same tree)."""
    mngr = manager(directory)
    try:
        restored = mngr.restore(
            step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(abstract)})
        )
        return restored[STATE]
    finally:
        mngr.close()
