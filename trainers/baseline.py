"""A logistic-regression CTR baseline (scikit-learn) on the ranker's own features.

Dense columns standardised with the training rows' mean and standard deviation, plus one-hot ids
(ad, advertiser, campaign, category, slot, position, hour): the classic "LR on hashed ids"
production baseline the ranker has to beat. (Raw user-state sums reach the hundreds for heavy
users; unscaled, lbfgs stopped at its iteration limit before converging.)
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from sklearn.linear_model import LogisticRegression

from trainers.models.features import RankerBatch
from trainers.offline import EvalResult
from trainers.quality import auc, logloss


def _design(
    batch: RankerBatch, offsets: np.ndarray, width: int, mean: np.ndarray, std: np.ndarray
) -> sp.csr_matrix:
    ids = batch.ids.numpy() + offsets[None, :]
    n, k = ids.shape
    onehot = sp.csr_matrix((np.ones(n * k), (np.repeat(np.arange(n), k), ids.ravel())), shape=(n, width))
    dense = (batch.dense.numpy().astype(np.float64) - mean) / std
    return sp.hstack([sp.csr_matrix(dense), onehot]).tocsr()


def logistic_baseline(train: RankerBatch, holdout: RankerBatch, c: float = 1.0, seed: int = 0) -> EvalResult:
    """Fit LR on `train`, report AUC/log loss on `holdout` (both labelled)."""
    probs = logistic_probs(train, holdout, c, seed)
    y = holdout.label.numpy() if holdout.label is not None else np.zeros(0)
    return EvalResult(auc(probs, y), logloss(probs, y), len(y), int(y.sum()))


def logistic_probs(train: RankerBatch, holdout: RankerBatch, c: float = 1.0, seed: int = 0) -> np.ndarray:
    """Holdout click probabilities of LR fitted on `train`."""
    if train.label is None or holdout.label is None:
        raise ValueError("logistic_baseline needs labelled batches")
    sizes = np.maximum(train.ids.max(0).values.numpy(), holdout.ids.max(0).values.numpy()) + 1
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    width = int(sizes.sum())
    dense = train.dense.numpy().astype(np.float64)
    mean = dense.mean(0) if len(dense) else np.zeros(dense.shape[1])
    std = dense.std(0) if len(dense) else np.ones(dense.shape[1])
    std = np.where(std > 1e-6, std, 1.0)  # constant columns (e.g. no recall score) stay as they are
    model = LogisticRegression(C=c, max_iter=2000, random_state=seed)
    model.fit(_design(train, offsets, width, mean, std), train.label.numpy())
    probs: np.ndarray = model.predict_proba(_design(holdout, offsets, width, mean, std))[:, 1]
    return probs


def auc_diff_ci(
    a: np.ndarray, b: np.ndarray, labels: np.ndarray, n_boot: int = 500, seed: int = 0
) -> tuple[float, float]:
    """95% paired-bootstrap interval of AUC(a) − AUC(b) over the rows (resampled together)."""
    rng = np.random.default_rng(seed)
    diffs = []
    n = len(labels)
    for _ in range(n_boot):
        idx = rng.integers(0, n, n)
        d = auc(a[idx], labels[idx]) - auc(b[idx], labels[idx])
        if not np.isnan(d):
            diffs.append(d)
    if not diffs:
        return (float("nan"), float("nan"))
    lo, hi = np.percentile(diffs, [2.5, 97.5])
    return float(lo), float(hi)
