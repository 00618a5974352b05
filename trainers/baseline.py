"""A logistic-regression CTR baseline (scikit-learn) on the ranker's own features.

Dense columns as they are plus one-hot ids (ad, advertiser, campaign, category, slot, position,
hour): the classic "LR on hashed ids" production baseline the ranker has to beat.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from sklearn.linear_model import LogisticRegression

from trainers.features import RankerBatch
from trainers.metrics import auc, logloss
from trainers.offline import EvalResult


def _design(batch: RankerBatch, offsets: np.ndarray, width: int) -> sp.csr_matrix:
    ids = batch.ids.numpy() + offsets[None, :]
    n, k = ids.shape
    onehot = sp.csr_matrix((np.ones(n * k), (np.repeat(np.arange(n), k), ids.ravel())), shape=(n, width))
    return sp.hstack([sp.csr_matrix(batch.dense.numpy()), onehot]).tocsr()


def logistic_baseline(train: RankerBatch, holdout: RankerBatch, c: float = 1.0, seed: int = 0) -> EvalResult:
    """Fit LR on `train`, report AUC/log loss on `holdout` (both labelled)."""
    if train.label is None or holdout.label is None:
        raise ValueError("logistic_baseline needs labelled batches")
    sizes = np.maximum(train.ids.max(0).values.numpy(), holdout.ids.max(0).values.numpy()) + 1
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    width = int(sizes.sum())
    model = LogisticRegression(C=c, max_iter=500, random_state=seed)
    model.fit(_design(train, offsets, width), train.label.numpy())
    probs = model.predict_proba(_design(holdout, offsets, width))[:, 1]
    y = holdout.label.numpy()
    return EvalResult(auc(probs, y), logloss(probs, y), len(y), int(y.sum()))
