"""Bootstrap intervals for the losses along the path and for the barrier (docs/design.md §5).

The unit resampled is the document (windows that start in the same document go together: neighbouring windows
of one text are not independent draws), the window where the data has no document boundaries, the image for
classifiers.  Every resample draws as many units as there are, with replacement, and recomputes each point's
loss (summed loss over summed predicted tokens), the excess over the endpoints' line (plane) and the barrier
(its maximum); the interval is the percentile interval of those values.  Seeded: a rerun gives the same numbers."""
from __future__ import annotations

import numpy as np

RESAMPLES = 1000
SEED = 0
LEVEL = 0.95
DRAWS_AT_ONCE = 1 << 22  # resampled unit counts held at a time (resamples x units)


def units_of(inputs, eos: int | None) -> np.ndarray:
    """The resampling unit of each window: the document its first token belongs to (a document is ended by an
    `eos` token); each window its own unit when the windows hold no document boundary."""
    n = len(inputs)
    if eos is None or n == 0:
        return np.arange(n)
    ends = (np.asarray(inputs) == eos).sum(axis=1)
    before = np.concatenate([[0], np.cumsum(ends)[:-1]])
    return before if len(np.unique(before)) > 1 else np.arange(n)


def resampled_counts(n_units: int, resamples: int, seed: int):
    """Batches of [r, n_units] arrays: how many times each unit is drawn in each resample (r summing to
    `resamples`)."""
    rng = np.random.default_rng(seed)
    per_batch = max(1, DRAWS_AT_ONCE // max(1, n_units))
    for start in range(0, resamples, per_batch):
        r = min(per_batch, resamples - start)
        draws = rng.integers(0, n_units, (r, n_units)) + n_units * np.arange(r)[:, None]
        yield np.bincount(draws.reshape(-1), minlength=r * n_units).reshape(r, n_units)


def unit_sums(window_loss, window_count, units) -> tuple[np.ndarray, np.ndarray]:
    """(summed loss of each unit at every point [points, units], predicted tokens of each unit [units])."""
    window_loss = np.asarray(window_loss, dtype=np.float64)
    _, unit = np.unique(np.asarray(units), return_inverse=True)
    n_units = int(unit.max()) + 1
    unit_loss = np.zeros((len(window_loss), n_units))
    np.add.at(unit_loss.T, unit, window_loss.T)
    unit_count = np.bincount(unit, weights=np.asarray(window_count, dtype=np.float64), minlength=n_units)
    return unit_loss, unit_count


def resampled_path(counts, unit_loss, unit_count, weights, vertices) -> tuple[np.ndarray, np.ndarray]:
    """(every point's loss [r, points], the barrier [r]) of r resamples, `counts` [r, units] the draws of each."""
    weights = np.asarray(weights, dtype=np.float64)
    loss = (counts @ unit_loss.T) / (counts @ unit_count)[:, None]
    excess = loss - loss[:, list(vertices)] @ weights.T
    return loss, excess.max(axis=1)


def path_intervals(window_loss, window_count, units, weights, vertices, *, resamples: int = RESAMPLES,
                   seed: int = SEED, level: float = LEVEL) -> dict:
    """Intervals of every point's loss and of the barrier.
    window_loss: [points, windows] summed losses; window_count: [windows] predicted tokens (images: 1);
    units: [windows] unit ids (units_of); weights: [points, models] interpolation weights; vertices: the index of
    each model's own point."""
    unit_loss, unit_count = unit_sums(window_loss, window_count, units)
    losses, barriers = [], []
    for counts in resampled_counts(len(unit_count), resamples, seed):
        loss, barrier = resampled_path(counts, unit_loss, unit_count, weights, vertices)
        losses.append(loss)
        barriers.append(barrier)
    losses, barriers = np.concatenate(losses), np.concatenate(barriers)
    tails = [50 * (1 - level), 50 * (1 + level)]
    return {"loss_interval": np.percentile(losses, tails, axis=0).T.tolist(),
            "barrier_interval": np.percentile(barriers, tails).tolist(),
            "bootstrap": {"resamples": resamples, "seed": seed, "level": level, "units": len(unit_count)}}


def paired_difference(first: dict, second: dict, *, point: int | None = None, resamples: int = RESAMPLES,
                      seed: int = SEED, level: float = LEVEL) -> dict:
    """first's barrier minus second's (and, given `point`, first's loss there minus second's), with the percentile
    interval of a paired bootstrap: each resample draws the same units for both methods, so what the two share
    (a hard document is hard for both) cancels in the difference.  Each argument is one method's evaluation on the
    same windows: {"window_loss": [points, windows], "window_count": [windows], "units": [windows], "weights":
    [points, models], "vertices": [models]} (pipeline.MergeResult.evaluation)."""
    if (list(first["units"]) != list(second["units"])
            or list(first["window_count"]) != list(second["window_count"])):
        raise ValueError("a paired difference needs both methods evaluated on the same windows (same documents and "
                         "predicted tokens); these evaluations differ")
    sums = [unit_sums(e["window_loss"], e["window_count"], e["units"]) for e in (first, second)]

    def measured(counts):
        paths = [resampled_path(counts, loss, count, e["weights"], e["vertices"])
                 for (loss, count), e in zip(sums, (first, second))]
        barrier = paths[0][1] - paths[1][1]
        return barrier, None if point is None else paths[0][0][:, point] - paths[1][0][:, point]

    whole = measured(np.ones((1, len(sums[0][1]))))
    draws = [measured(counts) for counts in resampled_counts(len(sums[0][1]), resamples, seed)]
    tails = [50 * (1 - level), 50 * (1 + level)]
    out = {"barrier": float(whole[0][0]),
           "barrier_interval": np.percentile(np.concatenate([d[0] for d in draws]), tails).tolist(),
           "bootstrap": {"resamples": resamples, "seed": seed, "level": level, "units": len(sums[0][1]),
                         "paired": True}}
    if point is not None:
        out.update(loss=float(whole[1][0]),
                   loss_interval=np.percentile(np.concatenate([d[1] for d in draws]), tails).tolist())
    return out
