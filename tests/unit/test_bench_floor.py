"""The framework floors of `benchmarks/serve.py` (`benchmarks.lib.floor`): the model floor ranks what the
ad server ranks for a request — `recall.k` candidates through the same `RankModel` — so its
capacity bounds the ad server's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks.lib.floor import ModelFloor
from schemas.events import SLOTS
from schemas.settings import Settings
from serving.ranking import RankModel
from trainers.models.ranker import Ranker, RankerConfig, save_checkpoint


def _settings(tmp_path: Path, k: int) -> Settings:
    torch.manual_seed(3)
    save_checkpoint(Ranker(RankerConfig()), tmp_path / "ranker")
    return Settings(model_dir=tmp_path, recall={"k": k}, device="cpu")


def test_the_model_floor_scores_recall_k_candidates_of_the_servers_ranker_for_each_slot(
    tmp_path: Path,
) -> None:
    s = _settings(tmp_path, 300)
    floor = ModelFloor(s)
    scores = {slot: floor.score(slot) for slot in SLOTS}
    for slot, p in scores.items():
        assert p.shape == (300,), slot
        assert np.isfinite(p).all() and ((p > 0) & (p < 1)).all()
        assert floor.inputs[slot].ids[:, 4].unique().tolist() == [SLOTS.index(slot)]
    # the slot is an input of the model: the scores differ between slots
    assert not np.allclose(scores["feed"], scores["splash"])
    # the checkpoint the ad server loads, not a fresh model: the same scores as a RankModel on it
    from serving.ranking import load_ranker

    model, version = load_ranker(s, torch.device("cpu"))
    assert version == floor.rank.version
    same = RankModel(model, version, s, torch.device("cpu")).score([floor.inputs["feed"]], True)[0]
    np.testing.assert_allclose(same, scores["feed"], rtol=1e-6)
    # the candidates span the id tables (not one embedding row read 300 times)
    assert len(np.unique(floor.inputs["feed"].ids[:, 0].numpy())) > 250


def _request(body: bytes) -> Any:
    from starlette.requests import Request

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/ads",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
    }
    return Request(scope, receive)


def test_both_floors_answer_the_fixed_response_and_the_model_floor_ranks_first(tmp_path: Path) -> None:
    """The deployment class itself (as Serve constructs it), not only its parts: a floor that
    failed to start would leave the benchmark without its bound."""
    import asyncio

    from benchmarks.lib.floor import MODEL_FLOOR_VERSION, FloorServer, fixed_response

    s = _settings(tmp_path, 200)
    user_class = next(c for c in FloorServer.__mro__ if "ads" in vars(c))  # under Serve's wrapper
    answers = {}
    for model in (False, True):
        server = object.__new__(user_class)
        user_class.__init__(server, s.model_dump_json(), model)
        calls: list[str] = []
        if model:
            assert server.version == MODEL_FLOOR_VERSION
            ranker = server.ranker

            def counted(slot: str, score: Any = ranker.score, seen: list[str] = calls) -> Any:
                seen.append(slot)
                return score(slot)

            ranker.score = counted
        resp = asyncio.run(server.ads(_request(b'{"user_id":"u1","slot":"search","k":10}')))
        answers[model] = (resp.status_code, resp.body)
        assert calls == (["search"] if model else [])
    body = fixed_response().model_dump_json().encode()
    assert answers == {False: (200, body), True: (200, body)}


_ROUND_TRIP = """
import dis, importlib, sys
from ray import cloudpickle
module_name, class_name = sys.argv[1], sys.argv[2]
module = importlib.import_module(module_name)
wrapper = cloudpickle.loads(cloudpickle.dumps(getattr(module, class_name)))
user = next(c for c in wrapper.__mro__[1:] if c.__name__ == class_name)

def globals_read(code):
    # the names a function (and the functions and comprehensions inside it) loads as globals:
    # `co_names` holds attribute names too (`self.path.serve` is no read of the module's `serve`)
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            yield ins.argval
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            yield from globals_read(const)

missing = []
for name, fn in vars(user).items():
    code = getattr(fn, "__code__", None)
    if code is None:
        continue
    for ref in set(globals_read(code)):  # a module-level name the method reads, missing from its copy
        if ref in vars(module) and ref not in fn.__globals__ and ref not in vars(__builtins__):
            missing.append(f"{name}: {ref}")
print(sorted(missing))
"""


@pytest.mark.parametrize(
    ("module", "name"), [("benchmarks.lib.floor", "FloorServer"), ("serving.app", "AdServer")]
)
def test_what_serve_ingress_freezes_sees_every_module_name_its_methods_read(module: str, name: str) -> None:
    """`@serve.ingress` freezes a cloudpickle copy of the class when it decorates it, at import:
    a method that reads a module name defined further down (the model floor's class, first
    written below `FloorServer`) raised NameError in the replica, never in-process. Checked
    the way the replica gets the class: a pickle round trip in a fresh interpreter."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _ROUND_TRIP, module, name], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
