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


def path_intervals(window_loss, window_count, units, weights, vertices, *, resamples: int = RESAMPLES,
                   seed: int = SEED, level: float = LEVEL) -> dict:
    """Intervals of every point's loss and of the barrier.
    window_loss: [points, windows] summed losses; window_count: [windows] predicted tokens (images: 1);
    units: [windows] unit ids (units_of); weights: [points, models] interpolation weights; vertices: the index of
    each model's own point."""
    window_loss = np.asarray(window_loss, dtype=np.float64)
    _, unit = np.unique(np.asarray(units), return_inverse=True)
    n_units = int(unit.max()) + 1
    unit_loss = np.zeros((len(window_loss), n_units))
    np.add.at(unit_loss.T, unit, window_loss.T)
    unit_count = np.bincount(unit, weights=np.asarray(window_count, dtype=np.float64), minlength=n_units)
    weights = np.asarray(weights, dtype=np.float64)
    losses, barriers = [], []
    for counts in resampled_counts(n_units, resamples, seed):
        loss = (counts @ unit_loss.T) / (counts @ unit_count)[:, None]  # [r, points]
        excess = loss - loss[:, list(vertices)] @ weights.T
        losses.append(loss)
        barriers.append(excess.max(axis=1))
    losses, barriers = np.concatenate(losses), np.concatenate(barriers)
    tails = [50 * (1 - level), 50 * (1 + level)]
    return {"loss_interval": np.percentile(losses, tails, axis=0).T.tolist(),
            "barrier_interval": np.percentile(barriers, tails).tolist(),
            "bootstrap": {"resamples": resamples, "seed": seed, "level": level, "units": n_units}}
