"""``pof bench capacity --model``: a directory or a local preset, and a model too short for the
trace refused before any server starts (vLLM would refuse each one, minutes later)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pof_connector.bench import BenchError
from pof_connector.bench.capacity import check_context, model_dir
from pof_connector.bench.make_model import PRESETS


def config(tmp_path: Path, positions: int) -> Path:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 2000, "max_position_embeddings": positions}))
    return tmp_path


def test_a_model_directory_is_taken_as_given_and_anything_else_is_refused_naming_the_presets(tmp_path: Path) -> None:
    d = config(tmp_path / "m", 4096)
    assert model_dir(str(d)) == d
    with pytest.raises(BenchError, match=r"--model: .*nope.* neither a model directory .*tiny, tiny-long"):
        model_dir(str(tmp_path / "nope"))


def test_a_model_shorter_than_the_traces_longest_context_is_refused_with_the_preset_that_fits(tmp_path: Path) -> None:
    assert PRESETS["tiny-long"].max_position_embeddings >= 17280 > PRESETS["tiny"].max_position_embeddings
    short = config(tmp_path / "short", PRESETS["tiny"].max_position_embeddings)
    with pytest.raises(BenchError, match=r"holds 4096 positions.* needs 17280 \(17108 tokens.*tiny-long"):
        check_context(short, None, 17280, 17108)
    check_context(short, None, 4096, 3291)                    # the long-sessions trace fits tiny
    check_context(config(tmp_path / "long", 32768), "x", 17280, 17108)
