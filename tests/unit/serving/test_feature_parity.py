"""Serving builds the ranker's inputs column for column as training does (trainers.models.features).

A candidate's features at serve time must be what the model was trained on for the same user,
ad and context; a column that differs is a train/serve skew the model was never fitted to.
"""

from __future__ import annotations

import numpy as np
import torch

from serving.ranking import build_input
from trainers.models.features import featurize
from trainers.models.ranker import RankerConfig

DIM = 8


class Example:
    """What a TrainingExample from the streams join carries for one impression."""

    user_vector = tuple(0.1 * i for i in range(DIM))
    intent_score = 1.25
    recall_score = None  # the join never has one: impressions do not record it
    query_match = 0.625  # the impression's, as served (`Impression.query_match`)
    ad_id, advertiser_id, campaign_id, category = "a1", "v1", "c1", "shoes"
    slot, position, hour, click = "search", 0, 13, True


def test_serving_features_equal_the_training_features_of_the_same_impression() -> None:
    cfg = RankerConfig(state_dim=DIM)
    trained = featurize([Example()], cfg)
    served = build_input(
        np.asarray(Example.user_vector, dtype=np.float32),
        np.asarray([Example.intent_score], dtype=np.float32),  # the user's intent per category code
        trained.ids[:, :4].numpy(),  # the catalog's bucketed ids of the ad
        np.asarray([0]),
        Example.slot,
        Example.hour,
        DIM,
        query_features=cfg.query_features,
        query_match=np.asarray([Example.query_match], dtype=np.float32),
    )
    torch.testing.assert_close(served.dense, trained.dense)
    torch.testing.assert_close(served.ids, trained.ids)
