"""AdRequest.interests: optional, bounded declared interests (category names) of a user."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from schemas.api import MAX_INTERESTS, AdRequest
from schemas.codec import describe_validation_error


def parse(**over: object) -> AdRequest:
    return AdRequest.model_validate_json(json.dumps({"user_id": "u", "slot": "feed", **over}))


def test_old_requests_stay_valid_and_have_no_interests() -> None:
    assert parse().interests is None
    assert parse(interests=None).interests is None


def test_interests_parse_in_order() -> None:
    assert parse(interests=["shoes", "travel"]).interests == ["shoes", "travel"]
    assert parse(interests=[]).interests == []


@pytest.mark.parametrize(
    "bad",
    [
        [f"c{i}" for i in range(MAX_INTERESTS + 1)],  # too many
        ["shoes", "shoes"],  # twice
        [""],  # empty name
        ["c" * 65],  # longer than a category id
        ["shoes\n"],  # not printable
        [3],  # not a string
        "shoes",  # not a list
    ],
)
def test_bad_interests_are_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(ValidationError) as exc:
        parse(interests=bad)
    assert all(e["loc"][0] == "interests" for e in exc.value.errors())
    assert "interests" in describe_validation_error(exc.value)
